"""The request fingerprint: a SHA-256 over the method, the path, the query and a canonical body.

The same JSON object serialised with other key order or whitespace is the same request: JSON bodies,
form bodies and query strings (pairs sorted) are written again in one canonical form before hashing;
other bodies are hashed as they are. Pure functions of plain values: no Flask, no database.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from decimal import Decimal
from itertools import accumulate
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlencode

from .errors import InvalidBody

__all__ = ["canonical_body", "canonical_json", "canonical_query", "decode_json", "fingerprint", "is_json"]

#: Nesting deeper than this is refused (400) rather than parsed: no real API body needs it, and Python's
#: parser would otherwise recurse until it fails.
MAX_JSON_DEPTH = 64


def is_json(mimetype: str) -> bool:
    """Whether ``mimetype`` (without parameters) is JSON: ``application/json`` or ``*/*+json``."""
    mimetype = mimetype.strip().lower()
    return mimetype == "application/json" or mimetype.endswith("+json")


def _invalid(detail: str) -> NoReturn:
    raise InvalidBody(detail)


def _reject_constant(name: str) -> NoReturn:
    _invalid(f"The JSON body contains {name}, which is not valid JSON.")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400 reads as infinity, which JSON cannot express
        _invalid("The JSON body holds a number too large to represent.")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        _invalid("The JSON body has an object with the same member name twice.")
    return result


#: A JSON string: a quote, then characters or escapes up to the closing quote (or, unterminated, the end).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)', re.DOTALL)
#: Every byte but the four brackets, for ``bytes.translate`` to delete.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
#: What each byte does to the nesting depth: +1 for ``[`` and ``{``, -1 for ``]`` and ``}``.
_STEP = [(b in b"[{") - (b in b"]}") for b in range(256)]


def _depth(data: bytes) -> int:
    """The deepest bracket nesting of a JSON text, counted without parsing it (strings skipped).

    Strings are cut out, every byte but the brackets is deleted and the running depth summed, all at C
    speed: no Python code runs per byte.
    """
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))


# Built once: json.loads and json.dumps with options build a new decoder or encoder on every call.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_pairs, parse_constant=_reject_constant, parse_float=_finite
)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


#: Numbers as exact decimals, for the fingerprints of route policies (flask_idem._policy): 1, 1.0 and
#: 10e-1 are one number there, and no digit is lost to a float.
_EXACT_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_pairs, parse_constant=_reject_constant, parse_float=Decimal, parse_int=Decimal
)


def _decode(data: bytes, decoder: json.JSONDecoder) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        _invalid("The JSON body is not valid UTF-8.")
    # Counting brackets is cheap, and most bodies have too few of them to nest too deep.
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and _depth(data) > MAX_JSON_DEPTH:
        _invalid(f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as e:
        _invalid(f"The request body is not valid JSON (line {e.lineno}, column {e.colno}).")
    except ValueError:  # e.g. an integer longer than Python's int_max_str_digits
        _invalid("The JSON body holds a value that cannot be read.")


def decode_json(data: bytes) -> Any:
    """Parse a JSON body with the checks of :func:`canonical_json`, numbers as exact ``Decimal`` values.

    :raises InvalidBody: as :func:`canonical_json` does (a lone surrogate is found when the value is
        written out again, not here).
    """
    return _decode(data, _EXACT_DECODER)


def canonical_json(data: bytes) -> bytes:
    """Parse a JSON body and serialise it canonically: sorted member names, no insignificant whitespace.

    :raises InvalidBody: when the body is not UTF-8 JSON, nests deeper than :data:`MAX_JSON_DEPTH`,
        contains ``NaN``, ``Infinity`` or an escaped lone surrogate, or repeats a member name within one
        object (parsers disagree on which value wins, so such a body has no single meaning to fingerprint).
    """
    text = _ENCODER.encode(_decode(data, _DECODER))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800": an escaped lone surrogate is no character at all
        _invalid("The JSON body contains an escaped lone surrogate, which is not text.")


def canonical_query(query: bytes) -> bytes:
    """A query string (or form body) with its pairs sorted, so parameter order does not matter.

    The bytes are read as latin-1, which maps every byte to one character and back, so raw non-ASCII
    bytes and percent-escapes are compared exactly, whatever their encoding.
    """
    if not query:
        return b""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True, encoding="latin-1")
    return urlencode(sorted(pairs), encoding="latin-1").encode("ascii")


def canonical_body(mimetype: str, body: bytes) -> bytes:
    """The canonical form of a request body, by its media type.

    JSON is re-serialised (:func:`canonical_json`), ``application/x-www-form-urlencoded`` has its pairs
    sorted, an empty body stays empty, and anything else is taken byte for byte with its media type
    in front, so the same bytes sent as two different types do not look alike.
    """
    if not body:
        return b""
    if is_json(mimetype):
        return b"json:" + canonical_json(body)
    if mimetype.strip().lower() == "application/x-www-form-urlencoded":
        return b"form:" + canonical_query(body)
    return mimetype.strip().lower().encode("latin-1", "replace") + b":" + body


def fingerprint(*, method: str, path: str, query: bytes, mimetype: str, body: bytes) -> bytes:
    """The 32-byte SHA-256 fingerprint of a request.

    Each part is length-prefixed before hashing, so no two different requests can produce the same
    input by moving bytes from one part into the next.

    :param method: the HTTP method, e.g. ``"POST"``.
    :param path: the request path as routed, e.g. ``"/orders/7/refunds"``.
    :param query: the raw query string.
    :param mimetype: the body's media type without parameters (``""`` when none).
    :param body: the raw body.
    :raises InvalidBody: when a JSON body is malformed (see :func:`canonical_json`).
    """
    digest = hashlib.sha256()
    for part in (
        method.upper().encode("ascii"),
        path.encode("utf-8", "surrogateescape"),
        canonical_query(query),
        canonical_body(mimetype, body),
    ):
        digest.update(b"%d:" % len(part))
        digest.update(part)
    return digest.digest()
