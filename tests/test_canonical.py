"""Canonical JSON under fingerprint policies (flask_idem._canonical, through Fingerprint): two requests
count alike exactly when the parts that count are the same JSON value, for values drawn as near misses of
each other (x10^n, negated, -0 and 0, trailing zeros, 5 and "5", true and 1, null and absent), at any
depth, through array indices, and with an exclusion inside an inclusion (Hypothesis)."""

from __future__ import annotations

import json
import random
from decimal import Decimal
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_idem import Fingerprint
from flask_idem._canonical import ABSENT
from flask_idem._policy import RequestParts

from .support.json_values import DOCUMENTS, NESTED, paths, pointer, spelled

Path = tuple[str, ...]

#: A policy under which the whole body counts, but not as the default policy hashes it.
WHOLE = Fingerprint(headers=["X-Unused"])

PROPERTY = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one JSON value: numbers by value (``-0`` is ``0``), ``true`` is not
    ``1``, a string is not a number, ``null`` is not absent."""
    if a is ABSENT or b is ABSENT:
        return a is b
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if a is None or b is None:
        return a is b
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same(a[k], b[k]) for k in a)
        )
    return bool(Decimal(a) == Decimal(b))


def near_misses(value: Any) -> list[Any]:
    """Values a bug could take for ``value`` (:data:`ABSENT` for a part that is not there), the same one
    among them."""
    if value is ABSENT:
        return [ABSENT, None, False, Decimal(0), ""]
    if value is None:
        return [None, ABSENT, False, Decimal(0), "null", ""]
    if isinstance(value, bool):
        return [value, not value, Decimal(int(value)), json.dumps(value), None, ABSENT]
    if isinstance(value, str):
        found: list[Any] = [value, value + "0", value.upper(), ABSENT]
        try:
            found.append(Decimal(value))  # "5" and 5
        except ArithmeticError:
            pass
        return [v for v in found if not (isinstance(v, Decimal) and not v.is_finite())]
    number = Decimal(value)
    sign, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    found = [
        number,
        *(number.scaleb(n) for n in (-2, -1, 1, 2)),  # 5, 50, 0.5 (and 0, 00, 0.0 for zero)
        -number,
        Decimal((1 - sign, digits, exponent)),  # the sign flipped: -0 for 0
        Decimal((sign, (*digits, 0, 0), exponent - 2)),  # trailing zeros: the same number
        number + 1,
        str(number),
        ABSENT,
    ]
    if number in (0, 1):
        found.append(bool(number))
    return found


def at(document: Any, path: Path) -> Any:
    """The part of ``document`` at ``path``, or :data:`ABSENT`."""
    for token in path:
        if isinstance(document, dict) and token in document:
            document = document[token]
        elif isinstance(document, list) and token.isdigit() and int(token) < len(document):
            document = document[int(token)]
        else:
            return ABSENT
    return document


def put(document: Any, path: Path, value: Any) -> Any:
    """A copy of ``document`` with ``value`` at ``path`` (a member left out for :data:`ABSENT`)."""
    head, rest = path[0], path[1:]
    if isinstance(document, list):
        copy = list(document)
        copy[int(head)] = put(copy[int(head)], rest, value) if rest else value
        return copy
    changed = {**document}
    if rest:
        changed[head] = put(document[head], rest, value)
    elif value is ABSENT:
        changed.pop(head, None)
    else:
        changed[head] = value
    return changed


def places(document: dict[str, Any]) -> list[Path]:
    """Where a near miss may go: every scalar, and a member missing from each object."""
    found: list[Path] = [("fresh",)]
    for path in paths(document):
        value = at(document, path)
        if isinstance(value, dict):
            found.append((*path, "fresh"))
        elif not isinstance(value, list):
            found.append(path)
    return found


def changed(
    document: dict[str, Any], data: st.DataObject, within: Path | None = None
) -> tuple[dict[str, Any], Path]:
    """``document`` with one near miss put somewhere in it (often ``within`` a part), and where."""
    candidates = places(document)
    inner = [p for p in candidates if within is not None and inside(p, within)]
    if inner and data.draw(st.booleans(), label="within"):
        candidates = inner
    place = data.draw(st.sampled_from(candidates), label="place")
    within_array = isinstance(at(document, place[:-1]), list)
    misses = [v for v in near_misses(at(document, place)) if not (within_array and v is ABSENT)]
    return put(document, place, data.draw(st.sampled_from(misses), label="near miss")), place


def inside(inner: Path, outer: Path) -> bool:
    return inner[: len(outer)] == outer


def alike(policy: Fingerprint, one: dict[str, Any], other: dict[str, Any], seed: int) -> bool:
    """Whether ``policy`` gives ``one`` and ``other`` one fingerprint, each spelled in its own way."""
    texts = (spelled(one, random.Random(seed)), spelled(other, random.Random(seed + 1)))
    first, second = (
        policy.compute(RequestParts("POST", "/o", b"", "application/json", t.encode(), {}, None)).sha
        for t in texts
    )
    return first == second


@PROPERTY
@given(DOCUMENTS, st.data(), st.integers(0, 2**16))
def test_same_fingerprint_exactly_when_same_value(
    document: dict[str, Any], data: st.DataObject, seed: int
) -> None:
    """A body and its near miss have one fingerprint exactly when they are one JSON value."""
    other, _ = changed(document, data)
    assert alike(WHOLE, document, other, seed) == same(document, other)


@PROPERTY
@given(DOCUMENTS, st.data(), st.integers(0, 2**16))
def test_an_included_part_counts_at_any_depth(
    document: dict[str, Any], data: st.DataObject, seed: int
) -> None:
    """include= one part anywhere (an array element, a member the body lacks): a near miss inside it
    counts exactly when it is another value, one outside it never does."""
    parts = sorted(set(paths(document)) | set(places(document)))
    included = data.draw(st.sampled_from(parts), label="included")
    other, place = changed(document, data, included)
    expected = not inside(place, included) or same(at(document, place), at(other, place))
    assert alike(Fingerprint(include=[pointer(included)]), document, other, seed) == expected


@PROPERTY
@given(NESTED, st.data(), st.integers(0, 2**16))
def test_an_exclusion_inside_an_inclusion(document: dict[str, Any], data: st.DataObject, seed: int) -> None:
    """include= a part, exclude= a part of it: a near miss counts exactly when it is inside the first,
    outside the second and another value."""
    excluded = data.draw(st.sampled_from([p for p in paths(document) if len(p) > 1]), label="excluded")
    included = excluded[: data.draw(st.integers(1, len(excluded) - 1), label="depth")]
    policy = Fingerprint(include=[pointer(included)], exclude=[pointer(excluded)])
    other, place = changed(document, data, included)
    counts = inside(place, included) and not inside(place, excluded)
    expected = not counts or same(at(document, place), at(other, place))
    assert alike(policy, document, other, seed) == expected
