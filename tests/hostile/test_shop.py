"""Hostile input to the shop through the Werkzeug test client: its routes, authentication and problems."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from hypothesis import given
from hypothesis import strategies as st

from ..support.helpers import count, headers
from ..support.shop_actions import ORDER
from .checks import (
    EXTENSION_PROBLEM,
    assert_not_echoed,
    assert_sound,
    clean,
    problem_document,
)
from .strategies import (
    BODIES,
    CONTENT_TYPES,
    HEADER_TEXT,
    KEY_VALUES,
    ROUTES,
    SETTINGS,
    SHOP_MAX_BODY,
)


@pytest.mark.parametrize("path", list(ROUTES), ids=["orders", "payments"])
@SETTINGS
@given(values=st.lists(KEY_VALUES, min_size=1, max_size=3))
def test_odd_idempotency_keys(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    path: str,
    values: list[str],
) -> None:
    """Any Idempotency-Key header is a 400 invalid-key, or a request stored under the one UUID it names."""
    clean(db)
    logs.clear()
    sent = [("Authorization", f"Bearer {api_key}"), *(("Idempotency-Key", v) for v in values)]
    response = client.post(path, json=ROUTES[path], headers=sent)
    assert_sound(db, response.status_code, response.content_type, response.get_data(), table=path[1:])
    if response.status_code == 400:
        assert response.json is not None
        assert response.json["type"] in {
            EXTENSION_PROBLEM + "invalid-key",
            EXTENSION_PROBLEM + "missing-key",
        }
        assert all(v not in response.get_data(as_text=True) for v in values if len(v) >= 16)
    else:
        assert len(values) == 1
        (stored,) = db.execute("SELECT idem_key FROM idempotency_keys").fetchone() or (None,)
        assert str(stored) in values[0].lower()
    assert_not_echoed(logs, *values)


@pytest.mark.parametrize("path", list(ROUTES), ids=["orders", "payments"])
@SETTINGS
@given(body=BODIES, content_type=CONTENT_TYPES, query=st.text(st.characters(max_codepoint=0xFF), max_size=24))
def test_hostile_bodies(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    path: str,
    body: bytes,
    content_type: str,
    query: str,
) -> None:
    """Whatever the body, content type and query string, the answer is sound and nothing partial is left."""
    clean(db)
    logs.clear()
    response = client.post(
        path,
        data=body,
        content_type=content_type,
        query_string=query,
        headers=headers(api_key, uuid.uuid4()),
    )
    assert_sound(db, response.status_code, response.content_type, response.get_data(), table=path[1:])
    assert_not_echoed(logs, body, content_type, query)


@SETTINGS
@given(body=BODIES, content_type=CONTENT_TYPES)
def test_hostile_retry_of_a_finished_key(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], body: bytes, content_type: str
) -> None:
    """A hostile retry of a finished key is a replay, a 422 mismatch or a 400/413, and changes no row."""
    clean(db)
    key = uuid.uuid4()
    first = client.post("/orders", json=ORDER, headers=headers(api_key, key))
    assert first.status_code == 201
    before = db.execute("SELECT * FROM idempotency_keys").fetchall()
    again = client.post("/orders", data=body, content_type=content_type, headers=headers(api_key, key))
    assert again.status_code < 500
    if again.status_code == 200:
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_data() == first.get_data()
    else:
        problem = problem_document(again.status_code, again.content_type, again.get_data())
        assert problem["type"].startswith(EXTENSION_PROBLEM) or again.status_code == 413, problem
    assert db.execute("SELECT * FROM idempotency_keys").fetchall() == before
    assert count(db, "orders") == 1


@SETTINGS
@given(
    values=st.lists(
        st.one_of(
            HEADER_TEXT,
            HEADER_TEXT.map(lambda s: "Bearer " + s),
            st.sampled_from(["Bearer", "Bearer ", "bearer", "Basic dXNlcjpwYXNz", "Token", "Bearer null"]),
            st.sampled_from(
                ["{k} ", " {k}", "bearer {k}", "Bearer  {k}", "Bearer {k},", "{k}", "Bearer {k}x"]
            ),
            st.sampled_from(
                ["Bearer {k}\x00", "Bearer {k}\t", "Bearer {k}\x85", 'Bearer "{k}"', "Bearer {k}é"]
            ),
            st.integers(129, 20_000).map(lambda n: "Bearer " + "a" * n),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_odd_authorization_headers(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    values: list[str],
) -> None:
    """Any Authorization header but the exact bearer key is a 401 problem and a challenge; nothing written."""
    clean(db)
    logs.clear()
    sent = [v.replace("{k}", api_key) for v in values]
    response = client.post(
        "/orders",
        json=ORDER,
        headers=[*(("Authorization", v) for v in sent), ("Idempotency-Key", str(uuid.uuid4()))],
    )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].lower().startswith("bearer")
    assert_sound(db, response.status_code, response.content_type, response.get_data(), table="orders")
    assert api_key not in response.get_data(as_text=True)
    assert_not_echoed(logs, *sent)


@pytest.mark.parametrize(
    "body",
    [b'{"amount": 1e400, "currency": "EUR"}', b"-1e999", b"[1E+309]"],
    ids=["amount", "negative", "in-array"],
)
def test_overflowing_number_is_a_400(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], body: bytes
) -> None:
    """A JSON number too large for a float is a 400 invalid-body before any key row, not a 500."""
    response = client.post(
        "/orders", data=body, content_type="application/json", headers=headers(api_key, uuid.uuid4())
    )
    assert response.status_code == 400
    assert response.json is not None and response.json["type"] == EXTENSION_PROBLEM + "invalid-body"
    assert count(db, "idempotency_keys") == 0


@pytest.mark.parametrize(
    ("query", "content_type", "body", "status"),
    [
        ("\xc3\xa9=1", "application/json", json.dumps(ORDER).encode(), 201),
        ("", "application/x-www-form-urlencoded", "caf\u00e9=1".encode(), 415),
    ],
    ids=["query", "form-body"],
)
def test_non_ascii_query_or_form_is_not_a_5xx(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    query: str,
    content_type: str,
    body: bytes,
    status: int,
) -> None:
    """Raw UTF-8 in the query string or a form body is fingerprinted like any bytes, not a 500."""
    response = client.post(
        "/orders",
        data=body,
        content_type=content_type,
        query_string=query,
        headers=headers(api_key, uuid.uuid4()),
    )
    assert response.status_code == status
    assert_sound(db, response.status_code, response.content_type, response.get_data(), table="orders")


@pytest.mark.parametrize(
    ("size", "reused"),
    [(SHOP_MAX_BODY + 1, False), (4 * SHOP_MAX_BODY, False), (SHOP_MAX_BODY + 1, True)],
    ids=["just-over", "four-times", "over-on-a-finished-key"],
)
def test_oversized_body_is_413_before_any_key_row(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], size: int, reused: bool
) -> None:
    """A body over the limit is a 413 problem, and no key row is read or written for it."""
    key = uuid.uuid4()
    if reused:
        assert client.post("/orders", json=ORDER, headers=headers(api_key, key)).status_code == 201
    before = db.execute("SELECT * FROM idempotency_keys").fetchall()
    padding = "x" * (size - len('{"amount": 1250, "currency": "EUR", "pad": ""}'))
    body = json.dumps({**ORDER, "pad": padding}).encode()
    assert len(body) == size
    response = client.post(
        "/orders", data=body, content_type="application/json", headers=headers(api_key, key)
    )
    assert response.status_code == 413
    problem_document(413, response.content_type, response.get_data())
    assert db.execute("SELECT * FROM idempotency_keys").fetchall() == before
    assert count(db, "idempotency_keys") == (1 if reused else 0)
