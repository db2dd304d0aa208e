"""The request fingerprint."""

from __future__ import annotations

import pytest

from flask_idem._fingerprint import MAX_JSON_DEPTH, canonical_json, fingerprint, is_json
from flask_idem.errors import InvalidBody


def fp(
    body: bytes,
    *,
    mimetype: str = "application/json",
    method: str = "POST",
    path: str = "/orders",
    query: bytes = b"",
) -> bytes:
    return fingerprint(method=method, path=path, query=query, mimetype=mimetype, body=body)


def test_json_key_order_and_whitespace_do_not_matter() -> None:
    """The same JSON object serialised differently has one fingerprint."""
    a = fp(b'{"amount": 100, "currency": "EUR", "meta": {"b": 1, "a": [1, 2]}}')
    b = fp(b'{\n  "meta": {"a": [1,2], "b": 1},\n  "currency":"EUR","amount":100\n}')
    assert a == b
    assert len(a) == 32


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"body": b'{"amount": 100}'}, {"body": b'{"amount": 101}'}),
        ({"body": b'{"amount": 100}'}, {"body": b'{"amount": "100"}'}),
        ({"body": b"[1, 2]"}, {"body": b"[2, 1]"}),
        ({"method": "POST"}, {"method": "PUT"}),
        ({"path": "/orders"}, {"path": "/orders/1"}),
        ({"query": b"a=1"}, {"query": b"a=2"}),
        (
            {"body": b"x=1", "mimetype": "text/plain"},
            {"body": b"x=1", "mimetype": "application/octet-stream"},
        ),
        ({"path": "/a", "query": b"b=1"}, {"path": "/ab", "query": b"=1"}),
    ],
    ids=[
        "amount",
        "type",
        "array-order",
        "method",
        "path",
        "query",
        "media-type",
        "boundary-shift",
    ],
)
def test_differences_change_the_fingerprint(one: dict, other: dict) -> None:
    """A changed amount, method, route, query or media type is a different request."""
    base = {"body": b"{}", "mimetype": "application/json"}
    assert fp(**{**base, **one}) != fp(**{**base, **other})


def test_query_and_form_order_do_not_matter() -> None:
    """Query strings and form bodies are compared as sorted pairs."""
    assert fp(b"", query=b"a=1&b=2") == fp(b"", query=b"b=2&a=1")
    form = "application/x-www-form-urlencoded"
    assert fp(b"x=1&y=2", mimetype=form) == fp(b"y=2&x=1", mimetype=form)


@pytest.mark.parametrize("mimetype", ["application/json", "application/problem+json", " Application/JSON "])
def test_is_json(mimetype: str) -> None:
    """JSON and every +json type are parsed as JSON."""
    assert is_json(mimetype)


def test_empty_body_is_not_parsed() -> None:
    """An empty body has a fingerprint even when it claims to be JSON."""
    assert fp(b"") == fp(b"", mimetype="")


MALFORMED = {
    "truncated": b'{"amount": 1',
    "trailing-garbage": b'{"amount": 1} x',
    "nan": b'{"amount": NaN}',
    "infinity": b'{"amount": -Infinity}',
    "duplicate-member": b'{"amount": 1, "amount": 100}',
    "nested-duplicate": b'{"a": {"b": 1, "b": 2}}',
    "not-utf8": b'{"a": "\xff"}',
    "deep": b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    "very-deep": b"[" * 100_000,
    "huge-int": b"1" * 5000,
    "lone-surrogate": b'"\\ud800"',
    "float-overflow": b'{"amount": 1e400}',
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_json_is_a_400(body: bytes) -> None:
    """A body that is not one well-defined JSON value is refused with 400, not fingerprinted."""
    with pytest.raises(InvalidBody) as info:
        fp(body)
    assert info.value.code == 400


def test_depth_limit_counts_brackets_outside_strings() -> None:
    """Brackets inside strings do not count toward the nesting limit."""
    body = b'{"a": "' + b"[" * 1000 + b'"}'
    assert canonical_json(body) == b'{"a":"' + b"[" * 1000 + b'"}'
    # An escaped quote does not end the string; an escaped backslash before a quote does.
    escaped = b'{"a": "\\"' + b"[" * 100 + b'", "b": "\\\\"}'
    assert canonical_json(escaped) == b'{"a":"\\"' + b"[" * 100 + b'","b":"\\\\"}'
    too_deep = b'{"a": "\\\\", "b": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"
    with pytest.raises(InvalidBody, match="nests deeper"):
        canonical_json(too_deep)


def test_unicode_is_kept() -> None:
    """Non-ASCII text is canonicalised as UTF-8, so escaped and literal forms match."""
    assert canonical_json('{"n": "Zoë"}'.encode()) == canonical_json(b'{"n": "Zo\\u00eb"}')


def test_non_ascii_query_and_form_bytes() -> None:
    """Raw non-ASCII bytes in a query or form body are compared exactly, not refused."""
    form = "application/x-www-form-urlencoded"
    assert fp(b"", query="é=1&a=2".encode()) == fp(b"", query="a=2&é=1".encode())
    assert fp(b"", query="é=1".encode()) != fp(b"", query=b"e=1")
    assert fp("café=1".encode(), mimetype=form) != fp(b"cafe=1", mimetype=form)
    assert fp(b"\xff=1", mimetype=form) == fp(b"%FF=1", mimetype=form)
