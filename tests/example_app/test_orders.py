"""The shop's orders API over flask-idem: authentication, validation, idempotent creation."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient

from flask_idem.errors import PROBLEM_JSON

from ..support.helpers import close_pool, count, headers

ORDER = {"amount": 1250, "currency": "EUR"}


def test_create_order(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """POST /orders answers 201 with the order and its Location."""
    response = client.post("/orders", json=ORDER, headers=headers(api_key, uuid.uuid4()))
    assert response.status_code == 201
    body = response.json
    assert body is not None
    assert set(body) == {"id", "amount", "currency", "created_at"}
    assert (body["amount"], body["currency"]) == (1250, "EUR")
    assert response.headers["Location"] == f"/orders/{body['id']}"
    assert client.get(response.headers["Location"], headers=headers(api_key)).json == body


def test_same_key_same_body_is_one_order(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any]
) -> None:
    """A retry gets 200 and the same order; only one order exists."""
    key = uuid.uuid4()
    first = client.post("/orders", json=ORDER, headers=headers(api_key, key))
    second = client.post(
        "/orders",
        data='{ "currency": "EUR",  "amount": 1250 }',
        content_type="application/json",
        headers=headers(api_key, key),
    )
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json == first.json
    assert second.headers["Location"] == first.headers["Location"]
    assert count(db, "orders") == 1


def test_changed_amount_is_rejected(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """The same key with another amount is a 422 and the first order is untouched."""
    key = uuid.uuid4()
    first = client.post("/orders", json=ORDER, headers=headers(api_key, key))
    second = client.post("/orders", json={**ORDER, "amount": 99999}, headers=headers(api_key, key))
    assert (first.status_code, second.status_code) == (201, 422)
    assert second.mimetype == PROBLEM_JSON
    assert db.execute("SELECT amount FROM orders").fetchall() == [(1250,)]


def test_changed_amount_with_replay_policy(
    database_url: str, db: psycopg.Connection[Any], make_org: Any
) -> None:
    """With IDEM_ON_MISMATCH="replay" the changed request gets the original order, 200."""
    from example_app import create_app

    app = create_app({"TESTING": True, "DATABASE_URL": database_url, "IDEM_ON_MISMATCH": "replay"})
    try:
        with app.app_context():
            from example_app.cli import create_org

            _, api_key = create_org("replay")
        client = app.test_client()
        key = uuid.uuid4()
        first = client.post("/orders", json=ORDER, headers=headers(api_key, key))
        second = client.post("/orders", json={**ORDER, "amount": 5}, headers=headers(api_key, key))
    finally:
        close_pool(app)
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json == first.json
    assert second.json["amount"] == 1250
    assert db.execute("SELECT amount FROM orders").fetchall() == [(1250,)]


def test_orgs_are_independent(
    client: FlaskClient, make_org: Callable[[str], tuple[int, str]], db: psycopg.Connection[Any]
) -> None:
    """Two organisations with one key get two orders; neither can read the other's."""
    _, alice = make_org("alice")
    _, bob = make_org("bob")
    key = uuid.uuid4()
    a = client.post("/orders", json=ORDER, headers=headers(alice, key))
    b = client.post("/orders", json={**ORDER, "amount": 7}, headers=headers(bob, key))
    assert (a.status_code, b.status_code) == (201, 201)
    assert count(db, "orders") == 2
    assert client.get(a.headers["Location"], headers=headers(bob)).status_code == 404
    assert [o["id"] for o in client.get("/orders", headers=headers(bob)).json["orders"]] == [b.json["id"]]


def test_org_in_body_is_ignored(
    client: FlaskClient, make_org: Callable[[str], tuple[int, str]], db: psycopg.Connection[Any]
) -> None:
    """An org_id in the body is an unknown field (422), never a way to act for another org."""
    victim_id, _ = make_org("victim")
    _, attacker = make_org("attacker")
    response = client.post(
        "/orders", json={**ORDER, "org_id": victim_id}, headers=headers(attacker, uuid.uuid4())
    )
    assert response.status_code == 422
    assert "org_id" in response.json["errors"]
    assert count(db, "orders") == 0


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer", "Bearer not-a-real-key-0123456789", "Basic dXNlcjpwYXNz", "bearer x"],
    ids=["missing", "empty", "unknown", "basic", "malformed"],
)
def test_authentication_required(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], auth: str | None
) -> None:
    """A missing, malformed or unknown API key is 401 and touches no key row."""
    hdrs = {"Idempotency-Key": str(uuid.uuid4())}
    if auth is not None:
        hdrs["Authorization"] = auth
    response = client.post("/orders", json=ORDER, headers=hdrs)
    assert response.status_code == 401
    assert response.mimetype == PROBLEM_JSON
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert count(db, "idempotency_keys") == 0


def test_revoked_key_is_a_401(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """A revoked API key is refused before any idempotency work."""
    db.execute("UPDATE orgs SET revoked_at = now()")
    response = client.post("/orders", json=ORDER, headers=headers(api_key, uuid.uuid4()))
    assert response.status_code == 401
    assert count(db, "idempotency_keys") == 0


INVALID = {
    "missing-amount": ({"currency": "EUR"}, "amount"),
    "zero": ({"amount": 0, "currency": "EUR"}, "amount"),
    "negative": ({"amount": -5, "currency": "EUR"}, "amount"),
    "float": ({"amount": 12.5, "currency": "EUR"}, "amount"),
    "string-amount": ({"amount": "100", "currency": "EUR"}, "amount"),
    "bool-amount": ({"amount": True, "currency": "EUR"}, "amount"),
    "too-big": ({"amount": 2**63, "currency": "EUR"}, "amount"),
    "lowercase-currency": ({"amount": 1, "currency": "eur"}, "currency"),
    "long-currency": ({"amount": 1, "currency": "EURO"}, "currency"),
    "newline-currency": ({"amount": 1, "currency": "EUR\n"}, "currency"),
    "number-currency": ({"amount": 1, "currency": 978}, "currency"),
    "unknown-field": ({"amount": 1, "currency": "EUR", "note": "x"}, "note"),
    "not-an-object": ([1, 2], "_schema"),
}


@pytest.mark.parametrize(("body", "field"), INVALID.values(), ids=INVALID.keys())
def test_validation_errors(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], body: Any, field: str
) -> None:
    """An invalid body is a 422 problem naming the field, and creates no order."""
    response = client.post("/orders", json=body, headers=headers(api_key, uuid.uuid4()))
    assert response.status_code == 422
    assert response.mimetype == PROBLEM_JSON
    assert field in response.json["errors"]
    assert count(db, "orders") == 0


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b'{"amount": 1', "application/json", 400),
        (b"amount=1&currency=EUR", "application/x-www-form-urlencoded", 415),
        (b"", "application/json", 400),
    ],
    ids=["broken-json", "form", "empty"],
)
def test_unreadable_bodies(
    client: FlaskClient, api_key: str, data: bytes, content_type: str, status: int
) -> None:
    """Bodies that are not a JSON document are 4xx problems, never 500."""
    response = client.post(
        "/orders", data=data, content_type=content_type, headers=headers(api_key, uuid.uuid4())
    )
    assert response.status_code == status
    assert response.mimetype == PROBLEM_JSON


def test_oversized_body_is_a_413(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """A body over MAX_CONTENT_LENGTH is refused before any key row is written."""
    body = b'{"amount": 1, "currency": "EUR", "pad": "' + b"x" * 70_000 + b'"}'
    response = client.post(
        "/orders",
        data=body,
        content_type="application/json",
        headers=headers(api_key, uuid.uuid4()),
    )
    assert response.status_code == 413
    assert response.mimetype == PROBLEM_JSON
    assert count(db, "idempotency_keys") == 0


def test_missing_idempotency_key(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """POST /orders without Idempotency-Key is a 400 problem."""
    response = client.post("/orders", json=ORDER, headers=headers(api_key))
    assert response.status_code == 400
    assert response.json["type"] == "urn:flask-idem:problem:missing-key"
    assert count(db, "orders") == 0


def test_unknown_routes_and_methods_are_problems(client: FlaskClient, api_key: str) -> None:
    """404 and 405 from routing are problem documents too."""
    assert client.get("/nope", headers=headers(api_key)).mimetype == PROBLEM_JSON
    response = client.delete("/orders", headers=headers(api_key))
    assert response.status_code == 405
    assert response.mimetype == PROBLEM_JSON


def test_order_lookup(client: FlaskClient, api_key: str) -> None:
    """GET /orders/<id> of a missing order is 404; GET /orders lists oldest first."""
    assert client.get("/orders/999999", headers=headers(api_key)).status_code == 404
    assert client.get(f"/orders/{2**70}", headers=headers(api_key)).status_code == 404
    ids = [
        client.post("/orders", json=ORDER, headers=headers(api_key, uuid.uuid4())).json["id"]
        for _ in range(3)
    ]
    listed = client.get("/orders", headers=headers(api_key)).json["orders"]
    assert [o["id"] for o in listed] == ids


def test_key_reused_after_retention_does_not_make_a_second_order(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any]
) -> None:
    """After the key row is purged, the orders table's unique key still refuses a second order."""
    key = uuid.uuid4()
    assert client.post("/orders", json=ORDER, headers=headers(api_key, key)).status_code == 201
    db.execute("DELETE FROM idempotency_keys")
    response = client.post("/orders", json=ORDER, headers=headers(api_key, key))
    assert response.status_code == 422
    assert response.mimetype == PROBLEM_JSON
    assert count(db, "orders") == 1


def test_app_factory_is_independent(app: Flask) -> None:
    """Each create_app() has its own extension state and the idem CLI group."""
    assert "idem" in app.extensions
    assert "idem" in app.cli.commands and "shop" in app.cli.commands


def test_validation_error_is_answered_under_the_key(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any]
) -> None:
    """@idem.idempotent() wraps flask-smorest's argument parsing: a 422 validation problem is the view's
    answer, stored under the key and replayed, and it writes no order."""
    key = uuid.uuid4()
    first = client.post("/orders", json={"amount": 0, "currency": "EUR"}, headers=headers(api_key, key))
    again = client.post("/orders", json={"amount": 0, "currency": "EUR"}, headers=headers(api_key, key))
    assert (first.status_code, first.mimetype, "amount" in first.json["errors"]) == (422, PROBLEM_JSON, True)
    assert (again.status_code, again.data, again.headers["Idempotent-Replayed"]) == (422, first.data, "true")
    assert "Idempotent-Replayed" not in first.headers
    assert count(db, "orders") == 0
    assert db.execute("SELECT status FROM idempotency_keys").fetchall() == [("completed",)]
