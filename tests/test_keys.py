"""The Idempotency-Key header parser."""

from __future__ import annotations

import uuid

import pytest

from flask_idem._keys import MAX_LENGTH, parse_key
from flask_idem.errors import InvalidKey

KEY = "5f1e6a3c-2b7d-4c8e-9a01-3d4f5e6a7b8c"


@pytest.mark.parametrize(
    "value",
    [KEY, KEY.upper(), f'"{KEY}"', f" {KEY} ", "5F1E6A3C-2b7d-4C8E-9a01-3D4F5E6A7B8C"],
    ids=["lower", "upper", "sf-string", "padded", "mixed-case"],
)
def test_accepted_forms(value: str) -> None:
    """A UUID in any letter case, bare or as a quoted structured-field string, is accepted."""
    assert parse_key([value]) == uuid.UUID(KEY)


def test_absent() -> None:
    """No header at all is reported as None, for the caller to decide whether that is allowed."""
    assert parse_key([]) is None


MALFORMED = {
    "empty": [""],
    "blank": ["   "],
    "empty-quoted": ['""'],
    "several-headers": [KEY, KEY],
    "comma": [f"{KEY}, {KEY}"],
    "comma-short": ["a,b"],
    "over-long": ["a" * (MAX_LENGTH + 1)],
    "huge": ["8" * 100_000],
    "not-uuid": ["order-42"],
    "no-hyphens": [KEY.replace("-", "")],
    "braces": ["{" + KEY + "}"],
    "urn": [f"urn:uuid:{KEY}"],
    "unbalanced-quote": [f'"{KEY}'],
    "single-quotes": [f"'{KEY}'"],
    "newline": [KEY + "\n"],
    "carriage-return": [KEY[:8] + "\r\n" + KEY[8:]],
    "tab": [KEY + "\t"],
    "nul": [KEY + "\x00"],
    "del": [KEY + "\x7f"],
    "non-ascii": [KEY[:-1] + "é"],
    "latin1-bytes": [KEY[:-2] + "\xc3\xa9"],
    "fullwidth-digit": ["８" + KEY[1:]],
}


@pytest.mark.parametrize("values", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed(values: list[str]) -> None:
    """Anything but exactly one UUID is refused with a 400 whose detail never echoes the value."""
    with pytest.raises(InvalidKey) as info:
        parse_key(values)
    assert info.value.code == 400
    for value in values:
        if value.strip():
            assert value not in info.value.to_dict()["detail"]


@pytest.mark.parametrize(
    "values",
    [
        [f"{KEY}, {KEY}"],
        [f"{KEY},{KEY}"],
        [f'"{KEY}", "{KEY}"'],
        [f"{KEY}, {uuid.uuid4()}, {uuid.uuid4()}"],
        [KEY, KEY],
    ],
    ids=["joined-by-a-server", "joined-without-space", "joined-sf-strings", "three-joined", "several"],
)
def test_more_than_one_key(values: list[str]) -> None:
    """Two keys, whether as two header lines or as the one value a WSGI server joins them into with
    ", " (longer than MAX_LENGTH), are reported as more than one key, not as too long."""
    with pytest.raises(InvalidKey) as info:
        parse_key(values)
    detail = info.value.to_dict()["detail"]
    assert "more than one Idempotency-Key" in detail
    assert "too long" not in detail
