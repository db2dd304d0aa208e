"""Hypothesis strategies of the hostile-input suite: key values, bodies, content types, raw header bytes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ..support.shop_actions import ORDER

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: The shop refuses bodies larger than this (its MAX_CONTENT_LENGTH).
SHOP_MAX_BODY = 64 * 1024

PAYMENT = {"order_id": 1, "source": "tok_visa"}
ROUTES = {"/orders": ORDER, "/payments": PAYMENT}

UUIDS = st.uuids().map(str)


def _latin1(text: str) -> str:
    """``text`` as a WSGI server hands a header over: its UTF-8 bytes, each byte one latin-1 character."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


def _spliced(parts: tuple[str, str, int]) -> str:
    value, odd, at = parts
    return value[:at] + odd + value[at:]


#: One header value as the test client can carry it: anything but CR and LF.
HEADER_TEXT = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=80)
_ODD_CHARS = st.text(st.sampled_from('\x00\x01\t\x0b\x1b\x7f\x85\xa0\xff,;"\\ {}é'), min_size=1, max_size=3)

KEY_VALUES = st.one_of(
    UUIDS,
    UUIDS.map(str.upper),
    UUIDS.map(lambda u: f'"{u}"'),
    UUIDS.map(lambda u: f"  {u} "),
    UUIDS.map(lambda u: f"{{{u}}}"),
    UUIDS.map(lambda u: f"urn:uuid:{u}"),
    UUIDS.map(lambda u: u.replace("-", "")),
    UUIDS.map(lambda u: f"'{u}'"),
    st.tuples(UUIDS, UUIDS).map(", ".join),
    st.tuples(UUIDS, _ODD_CHARS, st.integers(0, 36)).map(_spliced),
    HEADER_TEXT,
    st.text(st.characters(exclude_characters="\r\n"), max_size=20).map(_latin1),
    st.integers(65, 20_000).map(lambda n: "a" * n),
    st.sampled_from(["", '""', '"', ",", "null", "0", "-1"]),
)

_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_NAMES = st.sampled_from(["amount", "currency", "order_id", "source", "org_id", ""]) | st.text(max_size=6)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_NAMES, inner, max_size=4),
    max_leaves=12,
)


def _dump(value: Any, ascii_only: bool) -> bytes:
    # "surrogatepass": a lone surrogate in a string becomes bytes that are not UTF-8, which is hostile too.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


#: Bodies no JSON encoder writes.
SPECIAL_BODIES = [
    b'{"amount": 1e400, "currency": "EUR"}',
    b'{"amount": NaN, "currency": "EUR"}',
    b'{"amount": Infinity, "currency": "EUR"}',
    b'{"amount": -Infinity, "currency": "EUR"}',
    b"NaN",
    b'{"amount": 1, "amount": 2, "currency": "EUR"}',
    b'{"order_id": 1, "source": "tok_visa", "order_id": 2}',
    b'\xef\xbb\xbf{"amount": 1250, "currency": "EUR"}',
    json.dumps(ORDER).encode("utf-16"),
    json.dumps(ORDER).encode("utf-32-le"),
    b'{"amount": 1250, "currency": "EUR"}\x00',
    b"\x00",
    b'{"amount": 1' + b"0" * 5000 + b', "currency": "EUR"}',
    b'{"amount": 9223372036854775808, "currency": "EUR"}',
    b'{"amount": 1250, "currency": "E\\u0000R"}',
    b'{"amount": 1250, "currency": "\\ud800"}',
    b'{"amount": 1250, "currency": "EUR\\n"}',
    b'{"amount": 1.0, "currency": "EUR"}',
    b'{"amount": 125e1, "currency": "EUR"}',
    b'{"amount": true, "currency": "EUR"}',
    b'{"amount": "1250", "currency": "EUR"}',
    b'{"amount": 1250, "currency": "EUR", "org_id": 2}',
    b'{"order_id": 1, "source": "tok_visa", "org_id": 2}',
    b'{"order_id": 1, "source": "tok_4242424242424242"}',
    b"[" * 65 + b"]" * 65,
    b"[" * 64 + b"]" * 64,
    b"[" * 60_000,
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b'"\\\\\\"',
    b'{"amount": 1250, "currency": "EUR"',
    b"",
    b" ",
    b"null",
    b"[]",
    b"{}",
    b'"x"',
    b"amount=1250&currency=EUR&amount=1",
    b'--b\r\nContent-Disposition: form-data; name="amount"\r\n\r\n1\r\n--b--\r\n',
]

#: Orders and payments that are valid, or nearly: a bound, a duplicate-looking member, an extra member.
_NEAR_VALID = st.fixed_dictionaries(
    {
        "amount": st.integers(1, 2**63 - 1) | st.sampled_from([0, -1, 2**63, 2**64]),
        "currency": st.from_regex(r"[A-Z]{3}", fullmatch=True) | st.sampled_from(["eur", "EURO", "EU"]),
    },
    optional={"order_id": st.integers(0, 2**63), "source": st.from_regex(r"tok_\w{1,62}", fullmatch=True)},
)

BODIES = st.one_of(
    st.builds(_dump, _NEAR_VALID, st.booleans()),
    st.builds(_dump, JSON_VALUES, st.booleans()),
    st.builds(
        _dump,
        st.fixed_dictionaries(
            {"amount": _JSON_SCALARS, "currency": _JSON_SCALARS},
            optional={"order_id": _JSON_SCALARS, "source": _JSON_SCALARS, "org_id": st.integers()},
        ),
        st.booleans(),
    ),
    st.binary(max_size=64),
    st.sampled_from(SPECIAL_BODIES),
    st.tuples(st.builds(_dump, JSON_VALUES, st.booleans()), st.integers(0, 40)).map(lambda t: t[0][: t[1]]),
)

_JSON_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
        "APPLICATION/JSON",
        "application/problem+json",
        "application/vnd.api+json",
    ]
)
_OTHER_TYPES = st.sampled_from(
    [
        "text/json",
        "text/x+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=b",
        "multipart/form-data",
        "application/octet-stream",
        "",
        "*/*",
        "application/json;;;",
        "application/json; charset",
    ]
)
#: Half JSON, so that most bodies get as far as the parser; the rest anything.
CONTENT_TYPES = st.sampled_from(
    [_JSON_TYPES, _JSON_TYPES, _OTHER_TYPES, HEADER_TEXT.map(lambda s: s[:40])]
).flatmap(lambda types: types)


#: Raw header values: the test client refuses CR and LF, NUL and non-latin-1 text; a server may not.
RAW_VALUES = st.one_of(
    st.binary(max_size=48),
    st.tuples(
        UUIDS.map(str.encode), st.sampled_from([b"\r", b"\n", b"\r\n", b"\x00", b"\r\n ", b"\n\t"])
    ).map(lambda t: t[0] + t[1] + t[0]),
    UUIDS.map(lambda u: u.encode() + b"\r\nIdempotency-Key: " + u.encode()),
    UUIDS.map(lambda u: u.encode() + b"\r\nContent-Length: 0"),
    UUIDS.map(lambda u: u.encode() + b"\nTransfer-Encoding: chunked"),
    UUIDS.map(lambda u: u.encode() + b"\r\n\r\n" + json.dumps(ORDER).encode()),
    UUIDS.map(lambda u: b"\xef\xbb\xbf" + u.encode()),
    UUIDS.map(lambda u: u.encode("utf-16-le")),
)
