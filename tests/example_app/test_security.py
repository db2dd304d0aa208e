"""Security of keys: organisations never see each other's keys, credentials come first, no card data kept."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient

from example_app.auth import new_api_key
from example_app.cli import create_org
from flask_idem._fingerprint import fingerprint

from ..support.helpers import count, headers
from ..support.notes_app import post
from ..support.shop_actions import ORDER, add_fault, charges, pay, place_order, queued_faults, wait_for

#: Twelve or more digits, maybe grouped by spaces or dashes: what a card number looks like.
CARD_NUMBER = re.compile(r"\d(?:[ -]?\d){11}")
#: Values that are digits by chance, not card data: gateway charge ids and UUIDs.
NOT_CARD_DATA = re.compile(r"ch_[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

Org = tuple[int, str]


@pytest.fixture
def shop_client(shop: Flask) -> FlaskClient:
    """A test client of the paying shop."""
    return shop.test_client()


@pytest.fixture
def orgs(shop: Flask) -> tuple[Org, Org]:
    """Two organisations of the shop, A and B: their ids and API keys."""
    with shop.app_context():
        return create_org("a"), create_org("b")


def strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string inside a JSON value, with where it is (``intent.source``)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from strings(item, f"{path}.{name}".lstrip("."))
    elif isinstance(value, list):
        for at, item in enumerate(value):
            yield from strings(item, f"{path}[{at}]")


def card_numbers(value: Any) -> list[str]:
    """What looks like a card number in a JSON value, once charge ids and UUIDs are set aside."""
    return CARD_NUMBER.findall(NOT_CARD_DATA.sub("", json.dumps(value)))


@pytest.mark.parametrize("body", [ORDER, {"amount": 99, "currency": "USD"}], ids=["same-body", "other-body"])
def test_same_key_in_another_org_is_a_new_request(
    shop_client: FlaskClient, orgs: tuple[Org, Org], db: psycopg.Connection[Any], body: dict[str, Any]
) -> None:
    """Org B's request with org A's key is carried out for B: no replay, no 409, no 422 mismatch."""
    (a_id, a_key), (b_id, b_key) = orgs
    key = uuid.uuid4()
    first = shop_client.post("/orders", json=ORDER, headers=headers(a_key, key))
    other = shop_client.post("/orders", json=body, headers=headers(b_key, key))
    assert (first.status_code, other.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in other.headers
    assert other.json is not None and first.json is not None
    assert other.json["id"] != first.json["id"]
    assert (other.json["amount"], other.json["currency"]) == (body["amount"], body["currency"])
    for api_key, sent, original in ((a_key, ORDER, first), (b_key, body, other)):
        again = shop_client.post("/orders", json=sent, headers=headers(api_key, key))
        assert again.status_code == 200 and again.get_data() == original.get_data()
    rows = db.execute(
        "SELECT org_id FROM idempotency_keys WHERE idem_key = %s ORDER BY org_id", (key,)
    ).fetchall()
    assert rows == [(a_id,), (b_id,)]
    assert db.execute("SELECT org_id FROM orders ORDER BY id").fetchall() == [(a_id,), (b_id,)]


def test_answer_to_another_org_does_not_depend_on_the_key(
    shop_client: FlaskClient, orgs: tuple[Org, Org], db: psycopg.Connection[Any]
) -> None:
    """Org B gets the same bytes for org A's finished key as for a key nobody used: it learns nothing."""
    (_, a_key), (_, b_key) = orgs
    order_id = place_order(shop_client, a_key)
    key = uuid.uuid4()
    assert pay(shop_client, a_key, order_id, key).status_code == 201
    used = pay(shop_client, b_key, order_id, key)
    fresh = pay(shop_client, b_key, order_id, uuid.uuid4())
    assert used.status_code == fresh.status_code == 404
    assert used.get_data() == fresh.get_data()
    assert sorted(used.headers.items()) == sorted(fresh.headers.items())
    assert count(db, "payments") == 1


def test_in_flight_key_of_another_org_is_invisible(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """While org 1's request holds its key, org 2's request with the same key runs at once, for org 2."""
    entered, release = threading.Event(), threading.Event()
    app = make_app(ENTERED=entered, RELEASE=release)
    key = uuid.uuid4()
    results: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: results.setdefault("first", post(app, "/notes/block", key)))
    thread.start()
    try:
        assert entered.wait(10)
        other = post(app, "/notes/optional", key, **{"X-Org": "2"})
        still_running = thread.is_alive()
    finally:
        release.set()
        thread.join(15)
    assert still_running
    assert other.status_code == 201
    assert "Idempotent-Replayed" not in other.headers
    assert results["first"].status_code == 201
    again = post(app, "/notes/optional", key, **{"X-Org": "2"})
    assert again.status_code == 200 and again.get_data() == other.get_data()
    assert db.execute("SELECT org_id FROM notes ORDER BY org_id").fetchall() == [(1,), (2,)]


def test_in_flight_payment_of_another_org_is_invisible(
    make_shop: Callable[..., Flask],
    orgs: tuple[Org, Org],
    gateway_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """While org A's payment waits on a slow gateway, other orgs' requests with its key run for them alone."""
    shop = make_shop(GATEWAY_TIMEOUT=5.0)  # the gateway answers A 1.5 s late
    shop_client = shop.test_client()
    (a_id, a_key), (_, b_key) = orgs
    with shop.app_context():
        c_key = create_org("c")[1]
    a_order, b_order = place_order(shop_client, a_key), place_order(shop_client, b_key)
    add_fault(gateway_url, "delay", delay=1.5)
    key = uuid.uuid4()
    results: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: results.setdefault("a", pay(shop_client, a_key, a_order, key)))
    thread.start()
    try:
        wait_for(lambda: not queued_faults(gateway_url), timeout=5, interval=0.02)  # A is at the gateway
        row = db.execute(
            "SELECT status, step FROM idempotency_keys WHERE org_id = %s AND idem_key = %s", (a_id, key)
        ).fetchone()
        probe = pay(shop_client, c_key, a_order, key)  # A's very request, from C
        own = pay(shop_client, b_key, b_order, key)
        still_running = thread.is_alive()
    finally:
        thread.join(15)
    assert row == ("processing", "intent")
    assert still_running, "org B's requests waited for org A's"
    assert probe.status_code == 404
    assert own.status_code == 201 and "Idempotent-Replayed" not in own.headers
    assert results["a"].status_code == 201
    assert results["a"].json["id"] != own.json["id"]  # type: ignore[index]
    assert pay(shop_client, a_key, a_order, key).get_data() == results["a"].get_data()
    made = charges(gateway_url)
    assert len(made) == 2 and len({c["idempotency_key"] for c in made}) == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/orders", {**ORDER, "org_id": "B"}),
        ("/payments", {"order_id": "A's order", "source": "tok_visa", "org_id": "B"}),
    ],
    ids=["orders", "payments"],
)
def test_org_in_body_is_refused(
    shop_client: FlaskClient,
    orgs: tuple[Org, Org],
    gateway_url: str,
    db: psycopg.Connection[Any],
    path: str,
    body: dict[str, Any],
) -> None:
    """An org_id in a body is an unknown field (422), and nothing is written for either organisation."""
    (a_id, a_key), (b_id, b_key) = orgs
    a_order = place_order(shop_client, a_key)
    filled = {name: {"B": b_id, "A's order": a_order}.get(value, value) for name, value in body.items()}
    before = count(db, "orders")
    response = shop_client.post(path, json=filled, headers=headers(a_key, uuid.uuid4()))
    assert response.status_code == 422
    assert response.json is not None and response.json["errors"] == {"org_id": ["Unknown field."]}
    assert (count(db, "orders"), count(db, "payments")) == (before, 0)
    assert requests.get(gateway_url + "/charges", timeout=5).json()["charges"] == []
    assert db.execute("SELECT count(*) FROM idempotency_keys WHERE org_id = %s", (b_id,)).fetchone() == (0,)
    listing = shop_client.get("/orders", headers=headers(b_key))
    assert listing.json == {"orders": []}


@pytest.mark.parametrize(
    ("path", "body"),
    [("/orders", ORDER), ("/payments", {"order_id": 1, "source": "tok_visa"})],
    ids=["orders", "payments"],
)
def test_revoked_api_key_is_401_before_any_key_lookup(
    client: FlaskClient, app: Flask, db: psycopg.Connection[Any], path: str, body: dict[str, Any]
) -> None:
    """A revoked key gets one and the same 401 whether its key is unused, finished or in flight."""
    key = uuid.uuid4()
    with app.app_context():
        unused, finished, in_flight = (create_org(name) for name in ("unused", "finished", "in-flight"))
    stored = json.dumps({"status": 201, "headers": [], "body": "{}"})
    sha = fingerprint(
        method="POST", path=path, query=b"", mimetype="application/json", body=json.dumps(body).encode()
    )
    for (org_id, _), status, response in ((finished, "completed", stored), (in_flight, "processing", None)):
        db.execute(
            "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response,"
            " expires_at) VALUES (%s, %s, %s, 'POST', %s, %s, %s, now() + interval '1 hour')",
            (org_id, key, sha, path, status, response),
        )
    db.execute("UPDATE orgs SET revoked_at = now()")
    before = db.execute("SELECT * FROM idempotency_keys ORDER BY org_id").fetchall()
    answers = [
        client.post(path, json=body, headers=headers(api_key, key))
        for api_key in (unused[1], finished[1], in_flight[1], new_api_key())
    ]
    assert {a.status_code for a in answers} == {401}
    assert len({(a.get_data(), tuple(sorted(a.headers.items()))) for a in answers}) == 1
    assert answers[0].headers["WWW-Authenticate"].lower().startswith("bearer")
    assert db.execute("SELECT * FROM idempotency_keys ORDER BY org_id").fetchall() == before
    assert count(db, "orders") == count(db, "payments") == 0
    db.execute("UPDATE orgs SET revoked_at = NULL")  # a lookup would have found a replay and a 409
    replay, busy = (client.post(path, json=body, headers=headers(o[1], key)) for o in (finished, in_flight))
    assert (replay.status_code, replay.get_data(), busy.status_code) == (200, b"{}", 409)


@pytest.mark.parametrize(
    ("source", "status"), [("tok_visa", 201), ("tok_decline", 402)], ids=["succeeded", "declined"]
)
def test_stored_payment_holds_no_card_data(
    shop_client: FlaskClient, orgs: tuple[Org, Org], db: psycopg.Connection[Any], source: str, status: int
) -> None:
    """What the key table keeps of a payment holds the tok_ token once, in the intent, and nothing else."""
    (a_id, a_key), _ = orgs
    order_id = place_order(shop_client, a_key)
    key = uuid.uuid4()
    response = pay(shop_client, a_key, order_id, key, source)
    assert response.status_code == status
    assert response.json is not None and "source" not in response.json
    stored, state = db.execute(
        "SELECT response, state FROM idempotency_keys WHERE org_id = %s AND idem_key = %s", (a_id, key)
    ).fetchone() or (None, None)
    assert stored["status"] == status
    assert "source" not in json.loads(stored["body"])
    assert source not in json.dumps(stored)
    assert [(where, s) for where, s in strings(state) if s.startswith("tok_")] == [("intent.source", source)]
    assert card_numbers(stored) == card_numbers(state) == []


def test_card_number_as_source_is_never_stored(
    shop_client: FlaskClient, orgs: tuple[Org, Org], db: psycopg.Connection[Any]
) -> None:
    """A card number dressed as a token is refused (422) and leaves no trace in the key table."""
    (_, a_key), _ = orgs
    order_id = place_order(shop_client, a_key)
    response = pay(shop_client, a_key, order_id, uuid.uuid4(), "tok_4242424242424242")
    assert response.status_code == 422
    rows = db.execute("SELECT response, state FROM idempotency_keys").fetchall()
    assert [card_numbers(value) for row in rows for value in row] == [[]] * (2 * len(rows))
