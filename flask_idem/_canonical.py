"""Canonical forms of JSON values for fingerprint policies (:mod:`._policy`): one spelling per value.

Member order and the spelling of numbers never count (``1``, ``1.0`` and ``10e-1`` are one number, kept
exactly); a missing part (:data:`ABSENT`) differs from every value, ``null`` included. Pure functions of
plain values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, Final
from urllib.parse import parse_qsl

from .errors import ConfigurationError, InvalidBody

__all__ = ["ABSENT", "at", "encode", "form", "jsonlike", "without"]

#: Marks a part that is not in the request (a member the body lacks, a header not sent). Distinct from
#: every JSON value, ``null`` included.
ABSENT: Final = object()

_INDEX = re.compile(r"0|[1-9][0-9]*")


def form(body: bytes) -> dict[str, list[str]]:
    """A form body as ``{"field": ["value", ...]}``; bytes read as latin-1 (every byte kept exactly)."""
    document: dict[str, list[str]] = {}
    for name, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True, encoding="latin-1"):
        document.setdefault(name, []).append(value)
    return document


def at(value: Any, tokens: tuple[str, ...]) -> Any:
    """The part of ``value`` at ``tokens``, or :data:`ABSENT`."""
    for token in tokens:
        if isinstance(value, dict):
            value = value.get(token, ABSENT)
        elif isinstance(value, list) and _INDEX.fullmatch(token) and int(token) < len(value):
            value = value[int(token)]
        else:
            return ABSENT
    return value


def without(value: Any, paths: Sequence[tuple[str, ...]]) -> Any:
    """``value`` without the parts at ``paths`` (a new value where something is left out; never mutated)."""
    if not paths or not isinstance(value, (dict, list)):
        return value
    dropped = {p[0] for p in paths if len(p) == 1}
    deeper: dict[str, list[tuple[str, ...]]] = {}
    for p in paths:
        if len(p) > 1:
            deeper.setdefault(p[0], []).append(p[1:])
    if isinstance(value, dict):
        return {k: without(v, deeper.get(k, ())) for k, v in value.items() if k not in dropped}
    return [without(v, deeper.get(str(i), ())) for i, v in enumerate(value) if str(i) not in dropped]


def _number(value: Decimal) -> bytes:
    """A number's one spelling: sign, significant digits, exponent (``1.50`` and ``15e-1`` -> ``15e-1``)."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # JSON has no NaN or infinity, and a function's are refused
    text = "".join(map(str, digits)).lstrip("0")
    if not text:
        return b"0"
    stripped = text.rstrip("0")
    exponent += len(text) - len(stripped)
    return b"%s%se%d" % (b"-" if sign else b"", stripped.encode("ascii"), exponent)


def encode(value: Any) -> bytes:
    """A canonical, one-to-one encoding of a JSON value (or :data:`ABSENT`): members sorted, numbers
    spelled one way, strings as JSON writes them."""
    if value is ABSENT:
        return b"~"
    if value is None:
        return b"null"
    if value is True:
        return b"true"
    if value is False:
        return b"false"
    if isinstance(value, str):
        try:
            return json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidBody(
                "The JSON body contains an escaped lone surrogate, which is not text."
            ) from None
    if isinstance(value, Decimal):
        return _number(value)
    if isinstance(value, list):
        return b"[" + b",".join(encode(v) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b",".join(encode(k) + b":" + encode(value[k]) for k in sorted(value)) + b"}"
    raise AssertionError(f"not a decoded JSON value: {type(value).__name__}")


def jsonlike(value: Any) -> Any:
    """What a ``custom`` function returned, as decoded JSON is (numbers as ``Decimal``)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigurationError("A Fingerprint's custom function returned a float that is not finite.")
        return Decimal(repr(value))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ConfigurationError("A Fingerprint's custom function returned a Decimal that is not finite.")
        return value
    if isinstance(value, (list, tuple)):
        return [jsonlike(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: jsonlike(v) for k, v in value.items()}
    raise ConfigurationError(
        "A Fingerprint's custom function must return JSON-like values (dict with str keys, list, tuple,"
        f" str, int, float, bool, None), not {type(value).__name__}."
    )
