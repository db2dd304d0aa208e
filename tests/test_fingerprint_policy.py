"""Fingerprint policies (flask_idem.Fingerprint) on their own: what counts, what does not, and properties
over random JSON documents (Hypothesis)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flask_idem import Fingerprint
from flask_idem._fingerprint import fingerprint
from flask_idem._policy import RequestParts, describe_mismatch
from flask_idem.errors import ConfigurationError, InvalidBody

from .support.json_values import DOCUMENTS, VALUES, paths, pointer, replaced, spelled

JSON = "application/json"


def parts(
    body: bytes | Any = b"{}",
    *,
    mimetype: str = JSON,
    headers: Mapping[str, Sequence[str]] | None = None,
    custom: Any = None,
    query: bytes = b"",
) -> RequestParts:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return RequestParts("POST", "/orders", query, mimetype, body, headers or {}, custom)


def sha(policy: Fingerprint, request: RequestParts) -> bytes:
    return policy.compute(request).sha


# -- the default policy is today's fingerprint ------------------------------------------------------------


def test_the_default_policy_is_the_fingerprint_keys_were_stored_with() -> None:
    """Fingerprint() hashes exactly as flask_idem._fingerprint does, so stored keys keep matching."""
    body = b'{"amount": 1.0, "b": [1, 2]}'
    expected = fingerprint(method="POST", path="/orders", query=b"a=1", mimetype=JSON, body=body)
    result = Fingerprint().compute(parts(body, query=b"a=1"))
    assert result.sha == expected
    assert result.parts is None  # nothing more is stored for the default policy
    assert Fingerprint().default and not Fingerprint(exclude=["/a"]).default


def test_a_policy_digest_never_equals_another_policys() -> None:
    """Two policies that count the same bytes still give different digests: each hashes its identity."""
    request = parts({"a": 1})
    assert sha(Fingerprint(include=["/a"]), request) != sha(Fingerprint(include=["/a"], version=2), request)
    assert sha(Fingerprint(exclude=["/zz"]), request) != sha(Fingerprint(), request)


# -- what counts ---------------------------------------------------------------------------------------------


def test_excluded_members_do_not_count() -> None:
    """A client timestamp left out: two attempts differing only there have one fingerprint."""
    policy = Fingerprint(exclude=["/client_ts", "/meta/trace"])
    one = parts({"amount": 5, "client_ts": 1, "meta": {"trace": "a", "x": 1}})
    two = parts({"amount": 5, "client_ts": 2, "meta": {"trace": "b", "x": 1}})
    three = parts({"amount": 5, "meta": {"x": 1}})
    assert sha(policy, one) == sha(policy, two) == sha(policy, three)
    assert sha(policy, one) != sha(
        policy, parts({"amount": 6, "client_ts": 1, "meta": {"trace": "a", "x": 1}})
    )


def test_included_members_only_count() -> None:
    """Only /amount and /currency count; a missing member differs from null and from any value."""
    policy = Fingerprint(include=["/amount", "/currency"])
    base = sha(policy, parts({"amount": 5, "currency": "EUR", "note": "x"}))
    assert base == sha(policy, parts({"currency": "EUR", "amount": 5, "note": "y", "more": [1]}))
    assert base != sha(policy, parts({"amount": 5, "currency": "USD"}))
    assert base != sha(policy, parts({"amount": 5}))
    assert sha(policy, parts({"amount": 5})) != sha(policy, parts({"amount": 5, "currency": None}))


def test_array_elements_by_index() -> None:
    """/items/0/ts names the first item's ts; an excluded element is left out, the others keep counting."""
    policy = Fingerprint(exclude=["/items/0/ts", "/tags/1"])
    assert sha(policy, parts({"items": [{"ts": 1, "sku": "a"}], "tags": ["x", "y"]})) == sha(
        policy, parts({"items": [{"ts": 2, "sku": "a"}], "tags": ["x", "z"]})
    )
    assert sha(policy, parts({"items": [{"ts": 1, "sku": "a"}, {"ts": 1}]})) != sha(
        policy, parts({"items": [{"ts": 1, "sku": "a"}, {"ts": 2}]})
    )


def test_exclude_inside_include() -> None:
    """include /order with exclude /order/nonce: the nonce and anything outside /order do not count."""
    policy = Fingerprint(include=["/order"], exclude=["/order/nonce"])
    assert sha(policy, parts({"order": {"n": 1, "nonce": "a"}, "x": 1})) == sha(
        policy, parts({"order": {"n": 1, "nonce": "b"}, "x": 2})
    )
    assert sha(policy, parts({"order": {"n": 1}})) != sha(policy, parts({"order": {"n": 2}}))


def test_escaped_pointer_tokens() -> None:
    """'~1' is '/', '~0' is '~' (RFC 6901)."""
    policy = Fingerprint(include=["/a~1b", "/c~0d"])
    assert sha(policy, parts({"a/b": 1, "c~d": 2, "e": 3})) == sha(policy, parts({"a/b": 1, "c~d": 2}))
    assert sha(policy, parts({"a/b": 1, "c~d": 2})) != sha(policy, parts({"a/b": 9, "c~d": 2}))


def test_headers_count_by_value_and_absence() -> None:
    """A named header counts in any letter case; its absence differs from an empty value."""
    policy = Fingerprint(headers=["X-Currency"])
    eur = sha(policy, parts(headers={"x-currency": ["EUR"]}))
    assert eur != sha(policy, parts(headers={"x-currency": ["USD"]}))
    assert sha(policy, parts(headers={})) != sha(policy, parts(headers={"x-currency": [""]}))
    assert Fingerprint(headers=["x-currency"]).id == Fingerprint(headers=["X-Currency"]).id


def test_a_header_names_letter_case_never_counts() -> None:
    """Fingerprint(headers=["X-Currency"]) and ["x-currency"] are one policy: same id, digest and parts."""
    request = parts({"a": 1}, headers={"x-currency": ["EUR"]})
    upper = Fingerprint(headers=["X-Currency"]).compute(request)
    lower = Fingerprint(headers=["x-currency"]).compute(request)
    assert upper.sha == lower.sha and upper.parts == lower.parts


def test_custom_values_count_canonically() -> None:
    """A custom function's value counts: key order and int/float spelling do not; the value does."""
    policy = Fingerprint(include=[], custom=lambda: None)
    assert sha(policy, parts(custom={"a": 1, "b": [1.5, True]})) == sha(
        policy, parts(custom={"b": (Decimal("1.50"), True), "a": 1.0})
    )
    assert sha(policy, parts(custom={"a": 1})) != sha(policy, parts(custom={"a": "1"}))
    assert sha(policy, parts({"body": 1}, custom=1)) == sha(policy, parts({"body": 2}, custom=1))
    with pytest.raises(ConfigurationError, match="JSON-like"):
        policy.compute(parts(custom={"a": object()}))
    with pytest.raises(ConfigurationError, match="not finite"):
        policy.compute(parts(custom=float("nan")))


def test_form_bodies_are_addressed_by_field() -> None:
    """A form body reads as {"field": [values]}: /csrf_token leaves the CSRF token out."""
    policy = Fingerprint(exclude=["/csrf_token"])
    form = "application/x-www-form-urlencoded"
    assert sha(policy, parts(b"amount=5&csrf_token=a", mimetype=form)) == sha(
        policy, parts(b"csrf_token=b&amount=5", mimetype=form)
    )
    assert sha(policy, parts(b"amount=5&csrf_token=a", mimetype=form)) != sha(
        policy, parts(b"amount=6&csrf_token=a", mimetype=form)
    )


def test_other_bodies_count_whole() -> None:
    """A body neither JSON nor a form has no parts to point at: all of it counts."""
    policy = Fingerprint(exclude=["/ts"])
    assert sha(policy, parts(b"abc", mimetype="text/plain")) != sha(
        policy, parts(b"abd", mimetype="text/plain")
    )


def test_malformed_json_is_refused_as_by_the_default() -> None:
    """Invalid JSON, duplicate members and lone surrogates are 400s under a policy too."""
    policy = Fingerprint(exclude=["/ts"])
    for body in (b"{", b'{"a": 1, "a": 2}', b'{"a": "\\ud800"}', b"[NaN]"):
        with pytest.raises(InvalidBody):
            policy.compute(parts(body))


# -- what is refused when the policy is made -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"exclude": ["amount"]}, "starts with '/'"),
        ({"exclude": [""]}, "starts with '/'"),
        ({"include": ["/a~2"]}, "'~' must be written"),
        ({"include": ["/items/-"]}, "after the end of an array"),
        ({"exclude": ["/a", "/a/b"]}, "one inside the other"),
        ({"include": ["/a"], "exclude": ["/b"]}, "not inside any included part"),
        ({"include": ["/a"], "exclude": ["/a"]}, "not inside any included part"),
        ({"headers": ["Authorization"]}, "credentials"),
        ({"headers": ["Idempotency-Key"]}, "the key itself"),
        ({"headers": ["X Bad"]}, "header names"),
        ({"headers": ["X-A", "x-a"]}, "twice"),
        ({"exclude": "/a"}, "takes a list"),
        ({"custom": 5}, "takes a function"),
        ({"previous": [None]}, "Fingerprint objects"),
    ],
    ids=[
        "no-slash",
        "whole-body",
        "bad-escape",
        "dash",
        "overlap",
        "outside-include",
        "same-as-include",
        "authorization",
        "idempotency-key",
        "bad-header",
        "header-twice",
        "string-not-list",
        "custom-not-callable",
        "previous-not-policy",
    ],
)
def test_mistakes_are_refused_when_the_policy_is_made(kwargs: dict[str, Any], message: str) -> None:
    """Each malformed policy fails with a ConfigurationError saying what is wrong."""
    with pytest.raises(ConfigurationError, match=message):
        Fingerprint(**kwargs)


# -- what a 422 can say ---------------------------------------------------------------------------------


def test_a_mismatch_names_the_parts_that_differ_and_no_value() -> None:
    """The stored part digests tell 'header X-Currency' and 'body /amount' apart; no value is shown."""
    policy = Fingerprint(include=["/amount"], headers=["X-Currency"])
    first = policy.compute(parts({"amount": 5}, headers={"x-currency": ["EUR"]}))
    stored = {"status": 201, "request": {"policy": policy.id, "parts": first.parts}}
    now = policy.compute(parts({"amount": 5}, headers={"x-currency": ["USD"]}))
    told = describe_mismatch(policy, stored, now)
    assert told is not None
    detail, differs = told
    assert differs == ["header X-Currency"]
    assert "USD" not in detail and "EUR" not in detail
    now = policy.compute(parts({"amount": 6}, headers={"x-currency": ["EUR"]}))
    assert describe_mismatch(policy, stored, now) == (
        "This Idempotency-Key was already used for a request that differs in: body /amount. A retry must"
        " repeat the original request; a new operation needs a new key.",
        ["body /amount"],
    )


def test_a_mismatch_after_a_policy_change_says_so() -> None:
    """A response stored under a policy the route no longer names says the policy changed; under one in
    previous=, it names the parts that differ under that one."""
    old, new = Fingerprint(exclude=["/ts"]), Fingerprint(exclude=["/ts", "/nonce"])
    stored = {"status": 201, "request": {"policy": old.id, "parts": old.compute(parts({"a": 1})).parts}}
    told = describe_mismatch(new, stored, new.compute(parts({"a": 1})))
    assert told is not None and told[1] == ["fingerprint policy"]
    # With the old policy in previous=, the request is compared under it and the parts are named.
    kept = Fingerprint(exclude=["/ts", "/nonce"], previous=[old])
    request = parts({"a": 2, "nonce": "x"})
    told = describe_mismatch(kept, stored, kept.compute(request), lambda p: p.compute(request))
    assert told is not None and told[1] == ["body except /ts"]
    assert "earlier fingerprint policy" in told[0]
    # Without part digests (the default policy, a tombstone, a flow in progress) nothing more is said.
    assert describe_mismatch(new, {"status": 201}, new.compute(parts({"a": 1}))) is None
    assert describe_mismatch(new, None, new.compute(parts({"a": 1}))) is None


def test_what_counts_in_words() -> None:
    """counted() lists the parts as published and as named in a 422."""
    policy = Fingerprint(include=["/order", "/amount"], exclude=["/order/nonce"], headers=["X-Currency"])
    assert policy.counted() == [
        "method",
        "path",
        "query",
        "media type",
        "body /amount",
        "body /order except /order/nonce",
        "header X-Currency",
    ]


# -- properties over random JSON --------------------------------------------------------------------------


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS, st.data())
def test_excluded_parts_never_change_the_fingerprint(document: dict[str, Any], data: st.DataObject) -> None:
    """Whatever replaces an excluded part (or removes it), the fingerprint stays."""
    path = data.draw(st.sampled_from(paths(document)))
    policy = Fingerprint(exclude=[pointer(path)])
    before = sha(policy, parts(spelled(document, random.Random(1)).encode()))
    after = replaced(document, path, data.draw(VALUES))
    assert sha(policy, parts(spelled(after, random.Random(2)).encode())) == before


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS, st.data())
def test_included_parts_always_change_the_fingerprint(document: dict[str, Any], data: st.DataObject) -> None:
    """Any change of an included part (as a JSON value, not a spelling) changes the fingerprint, and so
    does any change outside an excluded one."""
    path = data.draw(st.sampled_from(paths(document)))
    new = data.draw(VALUES)
    old_text = spelled(document, random.Random(1)).encode()
    new_text = spelled(replaced(document, path, new), random.Random(1)).encode()
    # Python's equality is JSON's but for True == 1, which it only makes look alike: skipped, not wrong.
    assume(json.loads(old_text, parse_float=Decimal) != json.loads(new_text, parse_float=Decimal))
    including = Fingerprint(include=[pointer(path[:1])])
    assert sha(including, parts(old_text)) != sha(including, parts(new_text))
    others = [p for p in paths(document) if not (p[: len(path)] == path or path[: len(p)] == p)]
    if others:
        excluding = Fingerprint(exclude=[pointer(data.draw(st.sampled_from(others)))])
        assert sha(excluding, parts(old_text)) != sha(excluding, parts(new_text))


@settings(max_examples=60)
@given(DOCUMENTS, st.integers(0, 2**32))
def test_member_order_whitespace_and_number_spelling_never_count(document: dict[str, Any], seed: int) -> None:
    """The same document written another way (members shuffled, 1.0 as 10e-1) has one fingerprint."""
    rng = random.Random(seed)
    policy = Fingerprint(exclude=[pointer(rng.choice(paths(document)))])
    first = sha(policy, parts(spelled(document, rng).encode()))
    assert sha(policy, parts(spelled(document, rng).encode())) == first
    whole = Fingerprint(include=["/" + next(iter(document)).replace("~", "~0").replace("/", "~1")])
    assert sha(whole, parts(spelled(document, rng).encode())) == sha(
        whole, parts(spelled(document, rng).encode())
    )
