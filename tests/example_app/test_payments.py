"""Payments: a multi-step flow through a real gateway process, with every fault the gateway can inject."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask

from example_app.cli import create_org
from flask_idem.errors import PROBLEM_JSON

from ..support.helpers import count, headers
from ..support.shop_actions import (
    add_fault,
    charges,
    lease_expired,
    pay,
    paying_in_background,
    payment_statuses,
    place_order,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_pay_an_order(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """A payment charges the order's amount once: 201, and a retry replays it as 200."""
    client = shop.test_client()
    order_id = place_order(client, org[1], 4321)
    key = uuid.uuid4()
    first = pay(client, org[1], order_id, key)
    assert first.status_code == 201, first.json
    body = first.json
    assert set(body) == {"id", "order_id", "amount", "currency", "status", "gateway_charge_id"}
    assert (body["order_id"], body["amount"], body["currency"], body["status"]) == (
        order_id,
        4321,
        "EUR",
        "succeeded",
    )
    assert first.headers["Location"] == f"/payments/{body['id']}"
    assert client.get(first.headers["Location"], headers=headers(org[1])).json == body
    retry = pay(client, org[1], order_id, key)
    assert retry.status_code == 200
    assert retry.data == first.data
    made = charges(gateway_url)
    assert [(c["id"], c["amount"]) for c in made] == [(body["gateway_charge_id"], 4321)]
    assert "tok_visa" not in first.get_data(as_text=True)
    row = db.execute(
        "SELECT status, step, lease_token FROM idempotency_keys WHERE path = '/payments'"
    ).fetchone()
    assert row == ("completed", "charge", None)


def test_decline_is_402_and_replayed(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """A declined charge answers 402, stored and replayed; the order can then be paid with a new key."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    key = uuid.uuid4()
    first = pay(client, org[1], order_id, key, source="tok_chargedecline")
    assert first.status_code == 402
    assert first.mimetype == PROBLEM_JSON
    assert first.json["payment_id"] > 0
    again = pay(client, org[1], order_id, key, source="tok_chargedecline")
    assert (again.status_code, again.data) == (402, first.data)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert pay(client, org[1], order_id, uuid.uuid4()).status_code == 201
    assert payment_statuses(db) == ["declined", "succeeded"]
    assert len(charges(gateway_url)) == 2


def test_other_orgs_order_is_404(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """Paying another organisation's order is 404 and charges nothing."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    with shop.app_context():
        _, other = create_org("other")
    response = pay(client, other, order_id, uuid.uuid4())
    assert response.status_code == 404
    assert response.mimetype == PROBLEM_JSON
    assert (count(db, "payments"), len(charges(gateway_url))) == (0, 0)


def test_order_is_paid_at_most_once(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """A second payment of a paid order, with a new key, is refused without a charge."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    assert pay(client, org[1], order_id, uuid.uuid4()).status_code == 201
    second = pay(client, org[1], order_id, uuid.uuid4())
    assert second.status_code == 422
    assert second.mimetype == PROBLEM_JSON
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]


def test_changed_request_with_same_key_is_422(shop: Flask, org: tuple[int, str], gateway_url: str) -> None:
    """The same key for another order is a mismatch, not a second payment."""
    client = shop.test_client()
    first_order, second_order = place_order(client, org[1]), place_order(client, org[1])
    key = uuid.uuid4()
    assert pay(client, org[1], first_order, key).status_code == 201
    assert pay(client, org[1], second_order, key).status_code == 422
    assert len(charges(gateway_url)) == 1


@pytest.mark.parametrize(
    "body",
    [{"order_id": 1}, {"order_id": "1", "source": "tok_visa"}, {"order_id": 1, "source": "4242424242424242"}],
    ids=["no-source", "string-id", "card-number"],
)
def test_invalid_payment_is_422(
    shop: Flask, org: tuple[int, str], gateway_url: str, body: dict[str, Any]
) -> None:
    """An invalid payment request is a 422 problem and charges nothing; a card number is never echoed."""
    response = shop.test_client().post("/payments", json=body, headers=headers(org[1], uuid.uuid4()))
    assert response.status_code == 422
    assert response.mimetype == PROBLEM_JSON
    assert "4242424242424242" not in response.get_data(as_text=True)
    assert charges(gateway_url) == []


def test_slow_gateway_in_time(shop: Flask, org: tuple[int, str], gateway_url: str) -> None:
    """A gateway answering late but within the timeout: 201, one charge."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    add_fault(gateway_url, "delay", delay=0.3)
    assert pay(client, org[1], order_id, uuid.uuid4()).status_code == 201
    assert len(charges(gateway_url)) == 1


@pytest.mark.parametrize(
    ("mode", "delay", "charged"),
    [("delay", 2.0, 1), ("fail_before", 0.0, 0), ("fail_after", 0.0, 1), ("drop_after", 0.0, 1)],
    ids=["timeout", "fail-before", "fail-after", "drop-after"],
)
def test_unknown_outcome_then_retry(
    shop: Flask,
    org: tuple[int, str],
    gateway_url: str,
    db: psycopg.Connection[Any],
    mode: str,
    delay: float,
    charged: int,
) -> None:
    """An unknown outcome answers 503 and keeps the key processing; the retry finishes with one charge."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    add_fault(gateway_url, mode, delay=delay)
    key = uuid.uuid4()
    first = pay(client, org[1], order_id, key)
    assert first.status_code == 503
    assert first.headers["Retry-After"] == "1"
    assert first.json["type"] == "urn:flask-idem:problem:outcome-pending"
    assert len(charges(gateway_url)) == charged
    row = db.execute(
        "SELECT status, step, last_error FROM idempotency_keys WHERE path = '/payments'"
    ).fetchone()
    assert row == ("processing", "intent", "OutcomeUnknown")
    assert payment_statuses(db) == ["pending"]
    if mode == "delay":
        time.sleep(delay)  # let the gateway's late answer go nowhere before counting again
    retry = pay(client, org[1], order_id, key)
    assert retry.status_code == 201, retry.json
    made = charges(gateway_url)
    assert len(made) == 1
    assert retry.json["gateway_charge_id"] == made[0]["id"]
    assert payment_statuses(db) == ["succeeded"]
    assert pay(client, org[1], order_id, key).status_code == 200


def test_duplicate_while_processing_gets_409(
    make_shop: Callable[..., Flask], org: tuple[int, str], gateway_url: str
) -> None:
    """While the first attempt waits on the gateway under its lease, a duplicate gets 409 at once."""
    shop = make_shop(GATEWAY_TIMEOUT=5.0)
    client = shop.test_client()
    order_id = place_order(client, org[1])
    add_fault(gateway_url, "delay", delay=1.5)
    key = uuid.uuid4()
    thread, results = paying_in_background(client, org[1], order_id, key, gateway_url)
    duplicate = pay(client, org[1], order_id, key)
    first_running = thread.is_alive()
    thread.join(10)
    assert first_running
    assert duplicate.status_code == 409
    assert duplicate.headers["Retry-After"] == "1"
    assert results["first"].status_code == 201
    assert len(charges(gateway_url)) == 1


def test_lease_takeover_by_a_retry(
    make_shop: Callable[..., Flask], org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """A retry after the lease expired takes the request over; the slow first worker then changes nothing."""
    shop = make_shop(GATEWAY_TIMEOUT=5.0, IDEM_LEASE_TIMEOUT=1.0)
    client = shop.test_client()
    order_id = place_order(client, org[1])
    add_fault(gateway_url, "delay", delay=2.5)
    key = uuid.uuid4()
    thread, results = paying_in_background(client, org[1], order_id, key, gateway_url)
    wait_for(lambda: lease_expired(db))
    retry = pay(client, org[1], order_id, key)
    thread.join(10)
    assert retry.status_code == 201, retry.json
    assert results["first"].status_code == 409  # its lease was gone when its answer came back
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]
    assert db.execute("SELECT attempts FROM idempotency_keys WHERE path = '/payments'").fetchone() == (1,)


def test_slow_gateway_does_not_exhaust_the_pool(
    make_shop: Callable[..., Flask], org: tuple[int, str], gateway_url: str
) -> None:
    """Four payments waiting on a slow gateway hold no connection: orders are served meanwhile."""
    shop = make_shop(GATEWAY_TIMEOUT=5.0, IDEM_POOL_MAX_SIZE=2, IDEM_POOL_TIMEOUT=1.0)
    client = shop.test_client()
    order_ids = [place_order(client, org[1]) for _ in range(4)]
    add_fault(gateway_url, "delay", count=4, delay=2.0)
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda o=o: statuses.append(pay(client, org[1], o, uuid.uuid4()).status_code))
        for o in order_ids
    ]
    for t in threads:
        t.start()
    wait_for(lambda: len(charges(gateway_url)) == 4)
    during = [place_order(client, org[1]) for _ in range(5)]
    still_waiting = sum(t.is_alive() for t in threads)
    for t in threads:
        t.join(15)
    assert len(during) == 5
    assert still_waiting == 4
    assert statuses == [201] * 4


def test_key_reused_after_retention_is_422(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """After its key row is purged, a payment key used again is refused by the payments table, not a 500."""
    client = shop.test_client()
    order_id = place_order(client, org[1])
    key = uuid.uuid4()
    assert pay(client, org[1], order_id, key, source="tok_chargedecline").status_code == 402
    db.execute("DELETE FROM idempotency_keys WHERE path = '/payments'")
    again = pay(client, org[1], order_id, key)
    assert again.status_code == 422
    assert again.mimetype == PROBLEM_JSON
    assert "Idempotency-Key" in again.json["detail"]
    assert len(charges(gateway_url)) == 1
