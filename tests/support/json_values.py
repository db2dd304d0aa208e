"""JSON documents for the property tests of fingerprint policies (Hypothesis strategies), and the helpers
that address, change and spell them."""

from __future__ import annotations

import json
import random
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

__all__ = ["DOCUMENTS", "KEYS", "NESTED", "VALUES", "paths", "pointer", "replaced", "spelled"]

KEYS = st.text(alphabet="abcxyz~/", min_size=1, max_size=3)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.decimals(allow_nan=False, allow_infinity=False, places=3, min_value=-(10**6), max_value=10**6),
    st.text(max_size=5),
    # Near misses of one another, often: a bug that drops a number's exponent or sign, or confuses a
    # number with its string, shows on these.
    st.sampled_from([0, 1, -1, 5, -5, 50, Decimal("0.5"), Decimal("-0"), Decimal("5.00"), "5", "0"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=20,
)
DOCUMENTS = st.dictionaries(KEYS, VALUES, min_size=1, max_size=5)
#: Documents with at least one part two levels down (an object in an object, or an element of an array).
NESTED = st.dictionaries(
    KEYS,
    st.one_of(
        st.lists(VALUES, min_size=1, max_size=4), st.dictionaries(KEYS, VALUES, min_size=1, max_size=4)
    ),
    min_size=1,
    max_size=4,
)


def paths(value: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every path to a part of ``value`` (not the root)."""
    found: list[tuple[str, ...]] = []
    if isinstance(value, dict):
        children: list[tuple[str, Any]] = list(value.items())
    elif isinstance(value, list):
        children = [(str(i), v) for i, v in enumerate(value)]
    else:
        return found
    for token, child in children:
        path = (*prefix, token)
        found.append(path)
        found.extend(paths(child, path))
    return found


def pointer(path: tuple[str, ...]) -> str:
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in path)


def replaced(value: Any, path: tuple[str, ...], new: Any) -> Any:
    """``value`` with the part at ``path`` replaced by ``new`` (a copy)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    copy = list(value)
    copy[int(head)] = replaced(copy[int(head)], rest, new)
    return copy


def spelled(value: Any, rng: random.Random) -> str:
    """``value`` as JSON text with members shuffled, random whitespace and numbers spelled at random."""
    space = rng.choice(["", " ", "\n  "])
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        inner = f",{space}".join(f"{json.dumps(k)}:{space}{spelled(v, rng)}" for k, v in items)
        return "{" + space + inner + "}"
    if isinstance(value, list):
        return "[" + f",{space}".join(spelled(v, rng) for v in value) + "]"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    number = Decimal(value)
    sign, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    mantissa = "".join(map(str, digits)).lstrip("0")
    if not mantissa:
        return rng.choice(["0", "-0", "0.0", "0e7", "-0.000E-2"])
    shift = rng.randint(0, 3)
    choices = [
        f"{mantissa}{'0' * shift}e{exponent - shift}",
        f"{mantissa}E{exponent:+d}",
        str(number),
        f"{number:f}" + (".0" if "." not in f"{number:f}" else "0"),
    ]
    return ("-" if sign else "") + rng.choice(choices).lstrip("-")
