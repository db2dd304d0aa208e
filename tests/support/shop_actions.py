"""What the shop's tests do to the shop: place an order, pay it, queue a gateway fault, wait for a condition.

Plain functions, imported by the test modules (fixtures live in ``conftest.py``).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import requests
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from .helpers import headers, wait_for

__all__ = [
    "ORDER",
    "add_fault",
    "charges",
    "lease_expired",
    "pay",
    "paying_in_background",
    "payment_statuses",
    "place_order",
    "queued_faults",
    "stranded_payment",
    "wait_for",
]

#: The body of an ordinary order.
ORDER = {"amount": 1250, "currency": "EUR"}


def place_order(client: FlaskClient, api_key: str, amount: int = 1250) -> int:
    """Create an order of ``amount`` euro cents with a fresh key; return its id."""
    response = client.post(
        "/orders", json={"amount": amount, "currency": "EUR"}, headers=headers(api_key, uuid.uuid4())
    )
    assert response.status_code == 201
    order_id: int = response.json["id"]  # type: ignore[index]
    return order_id


def pay(
    client: FlaskClient, api_key: str, order_id: int, key: uuid.UUID, source: str = "tok_visa"
) -> TestResponse:
    """``POST /payments`` of ``order_id`` under ``key``."""
    return client.post(
        "/payments", json={"order_id": order_id, "source": source}, headers=headers(api_key, key)
    )


def paying_in_background(
    client: FlaskClient, api_key: str, order_id: int, key: uuid.UUID, gateway_url: str
) -> tuple[threading.Thread, dict[str, TestResponse]]:
    """Start paying in a thread; return once the gateway has made the charge, while the payment is still
    under way. Returns the thread, and the dict where its answer will be, under ``"first"``."""
    results: dict[str, TestResponse] = {}
    thread = threading.Thread(target=lambda: results.setdefault("first", pay(client, api_key, order_id, key)))
    thread.start()
    wait_for(lambda: len(charges(gateway_url)) == 1)
    return thread, results


def charges(gateway_url: str) -> list[dict[str, Any]]:
    """Every charge the gateway made, oldest first."""
    result: list[dict[str, Any]] = requests.get(gateway_url + "/charges", timeout=5).json()["charges"]
    return result


def add_fault(gateway_url: str, mode: str, count: int = 1, delay: float = 0.0) -> None:
    """Queue a gateway fault for the next ``count`` charge requests (over HTTP)."""
    requests.post(
        gateway_url + "/_faults", json={"mode": mode, "count": count, "delay": delay}, timeout=5
    ).raise_for_status()


def queued_faults(gateway_url: str) -> list[dict[str, Any]]:
    """The gateway faults not used up yet."""
    result: list[dict[str, Any]] = requests.get(gateway_url + "/_faults", timeout=5).json()["faults"]
    return result


def payment_statuses(db: psycopg.Connection[Any]) -> list[str]:
    """The status of every payment, oldest first."""
    return [row[0] for row in db.execute("SELECT status FROM payments ORDER BY id").fetchall()]


def fulfilments_enqueued(db: psycopg.Connection[Any]) -> list[tuple[int, str, list[int]]]:
    """The outbox's messages, oldest first: organisation, task, and arguments (order id, payment id)."""
    rows = db.execute("SELECT org_id, task, args FROM idempotency_keys_outbox ORDER BY created_at")
    return [(row[0], row[1], row[2]) for row in rows.fetchall()]


def paid(db: psycopg.Connection[Any]) -> list[list[int]]:
    """The order and payment ids of every succeeded payment: the arguments of its fulfilment."""
    rows = db.execute("SELECT order_id, id FROM payments WHERE status = 'succeeded' ORDER BY id")
    return [[row[0], row[1]] for row in rows.fetchall()]


def stranded_payment(client: FlaskClient, api_key: str, gateway_url: str, mode: str) -> tuple[int, uuid.UUID]:
    """Place an order and pay it through the gateway fault ``mode``: the payment is left stranded (503).

    Returns the order's id and the payment's key.
    """
    order_id = place_order(client, api_key)
    add_fault(gateway_url, mode)
    key = uuid.uuid4()
    assert pay(client, api_key, order_id, key).status_code == 503
    return order_id, key


def lease_expired(db: psycopg.Connection[Any]) -> bool:
    """Whether the lease on the payment request has run out."""
    row = db.execute(
        "SELECT lease_expires_at < now() FROM idempotency_keys WHERE path = '/payments'"
    ).fetchone()
    return row == (True,)
