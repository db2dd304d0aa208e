"""The gateway's webhook events, through a real gateway (its outbox and sender thread) and the shop served
over HTTP: each event is applied once, whatever is delivered twice, out of order, or after a failure."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import requests
from flask import Flask

from example_app import gateway_events
from example_app.cli import create_org
from example_app.gateway import create_app as gateway_create_app
from example_app.gateway.events import Sender, sign
from flask_idem.errors import PROBLEM_JSON

from ..support.servers import in_thread
from ..support.shop_actions import add_fault, pay, place_order, stranded_payment, wait_for

pytestmark = pytest.mark.slow

SECRET = "whsec_" + base64.b64encode(b"the gateway's webhook secret!!").decode()


@dataclass
class Linked:
    """The shop and the gateway, each knowing the other: the shop pays through the gateway, whose events
    go to the shop's ``POST /webhooks/gateway``."""

    shop: Flask
    shop_url: str
    gateway_url: str
    org: tuple[int, str]

    @property
    def webhook_url(self) -> str:
        return self.shop_url + "/webhooks/gateway"


@pytest.fixture
def linked(database_url: str, make_shop: Callable[..., Flask]) -> Iterator[Linked]:
    """The gateway (webhooks on, a fast backoff) and the shop, both served on loopback."""
    gateway = gateway_create_app(
        {
            "TESTING": True,
            "DATABASE_URL": database_url,
            "FAULTS_ENABLED": True,
            "GATEWAY_WEBHOOK_URL": "http://127.0.0.1:9/not-yet",  # the shop's port is not known yet
            "GATEWAY_WEBHOOK_SECRET": SECRET,
            "GATEWAY_WEBHOOK_BACKOFF": 0.05,
            "GATEWAY_WEBHOOK_BACKOFF_CAP": 0.2,
            "GATEWAY_WEBHOOK_TIMEOUT": 5.0,
        }
    )
    sender: Sender = gateway.extensions["gateway_events"]
    try:
        with in_thread(gateway) as gateway_port:
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            shop = make_shop(GATEWAY_URL=gateway_url, GATEWAY_WEBHOOK_SECRET=SECRET)
            with in_thread(shop) as shop_port:
                sender.url = f"http://127.0.0.1:{shop_port}/webhooks/gateway"
                with shop.app_context():
                    org = create_org("payer")
                yield Linked(shop, f"http://127.0.0.1:{shop_port}", gateway_url, org)
    finally:
        sender.stop()
        gateway.extensions["gateway"].close()


def paid_order(linked: Linked) -> tuple[int, dict[str, Any]]:
    """Place and pay an order through the shop; its order id and the payment's answer (201)."""
    client = linked.shop.test_client()
    order_id = place_order(client, linked.org[1])
    response = pay(client, linked.org[1], order_id, uuid.uuid4())
    assert response.status_code == 201, response.json
    return order_id, response.json  # type: ignore[return-value]


def outbox(db: psycopg.Connection[Any]) -> list[tuple[str, str, int, bool]]:
    """The gateway's events, oldest first: id, type, attempts made, delivered."""
    rows = db.execute(
        "SELECT event_id, type, attempts, delivered_at IS NOT NULL FROM gateway_events ORDER BY id"
    ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def all_delivered(db: psycopg.Connection[Any], n: int) -> bool:
    found = outbox(db)
    return len(found) == n and all(delivered for *_, delivered in found)


def applied(db: psycopg.Connection[Any]) -> list[tuple[str, str, bool]]:
    """The events the shop applied, in the order it applied them: id, type, whether it moved the payment."""
    rows = db.execute("SELECT event_id, type, moved FROM payment_events ORDER BY id").fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def payment_state(db: psycopg.Connection[Any]) -> tuple[str, str | None, bool]:
    """The one payment's status, gateway charge id, and whether it is refunded."""
    row = db.execute("SELECT status, gateway_charge_id, refunded_at IS NOT NULL FROM payments").fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def deliver(
    linked: Linked, event_id: str, body: dict[str, Any] | bytes, *, secret: str = SECRET
) -> requests.Response:
    """Post one delivery to the shop by hand, signed as the gateway signs."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(SECRET, event_id, timestamp, raw),
    }
    return requests.post(linked.webhook_url, data=raw, headers=headers, timeout=10)


def event_body(db: psycopg.Connection[Any], event_id: str) -> bytes:
    row = db.execute("SELECT body FROM gateway_events WHERE event_id = %s", (event_id,)).fetchone()
    assert row is not None
    return str(row[0]).encode()


def test_event_of_a_payment_is_applied_once(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """A payment's success reaches the shop twice (the flow's answer and the event): it moves once, and the
    event delivered again by hand is answered with the first answer and applies nothing."""
    _, payment = paid_order(linked)
    wait_for(lambda: all_delivered(db, 1))
    [(event_id, kind, attempts, _)] = outbox(db)
    assert (kind, attempts) == ("payment.succeeded", 1)
    assert payment_state(db) == ("succeeded", payment["gateway_charge_id"], False)
    # The flow's last step and the event race to record the success; whichever is second moves nothing.
    [(applied_id, kind, moved)] = applied(db)
    assert (applied_id, kind) == (event_id, "payment.succeeded")
    again = deliver(linked, event_id, event_body(db, event_id))
    assert again.status_code == 200
    assert again.json() == {"applied": True, "payment_id": payment["id"], "moved": moved}
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert len(applied(db)) == 1


def test_duplicate_at_the_same_moment_applies_once(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """The gateway sends an event twice at once: the shop applies it once (the other delivery is replayed
    or told 409 and retried)."""
    add_fault(linked.gateway_url, "webhook_duplicate")
    paid_order(linked)
    wait_for(lambda: all_delivered(db, 1))
    [(event_id, *_)] = outbox(db)
    assert [e for e, *_ in applied(db)] == [event_id]


def test_stranded_payment_is_settled_by_the_event(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """A charge made while the flow failed to hear it (fail_after): the event moves the pending payment to
    succeeded, once, before any recovery."""
    client = linked.shop.test_client()
    stranded_payment(client, linked.org[1], linked.gateway_url, "fail_after")
    wait_for(lambda: all_delivered(db, 1))
    [(event_id, *_)] = outbox(db)
    charge_id = json.loads(event_body(db, event_id))["data"]["charge"]["id"]
    assert payment_state(db) == ("succeeded", charge_id, False)
    assert applied(db) == [(event_id, "payment.succeeded", True)]


def test_reordered_refund_before_success(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """The success is held back until the refund was delivered: the refund is recorded, and the success
    arriving later does not undo it."""
    add_fault(linked.gateway_url, "webhook_reorder")
    _, payment = paid_order(linked)
    refund = requests.post(f"{linked.gateway_url}/charges/{payment['gateway_charge_id']}/refund", timeout=5)
    assert refund.status_code == 200
    wait_for(lambda: all_delivered(db, 2))
    assert [kind for _, kind, _ in applied(db)] == ["payment.refunded", "payment.succeeded"]
    assert [moved for *_, moved in applied(db)] == [True, False]
    assert payment_state(db) == ("succeeded", payment["gateway_charge_id"], True)
    # A second refund request refunds nothing more and sends no event.
    assert requests.post(f"{linked.gateway_url}/charges/{payment['gateway_charge_id']}/refund", timeout=5).ok
    assert len(outbox(db)) == 2


def test_refund_before_success_of_a_pending_payment(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """Out of order on a payment still pending: the refund is recorded, then the success moves it to
    succeeded and keeps the refund; each event once."""
    client = linked.shop.test_client()
    stranded_payment(client, linked.org[1], linked.gateway_url, "fail_before")  # no charge, no event
    row = db.execute("SELECT org_id, id FROM payments").fetchone()
    assert row is not None
    charge = {"id": "ch_by_hand", "reference": f"{row[0]}:{row[1]}"}
    refunded = {"type": "payment.refunded", "data": {"charge": charge}}
    succeeded = {"type": "payment.succeeded", "data": {"charge": charge}}
    assert deliver(linked, "evt_refund", refunded).status_code == 200
    assert payment_state(db) == ("pending", None, True)
    assert deliver(linked, "evt_success", succeeded).status_code == 200
    assert deliver(linked, "evt_refund", refunded).status_code == 200
    assert payment_state(db) == ("succeeded", "ch_by_hand", True)
    assert applied(db) == [
        ("evt_refund", "payment.refunded", True),
        ("evt_success", "payment.succeeded", True),
    ]


def test_failed_delivery_is_retried_and_applied_once(
    linked: Linked, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shop's handler fails on the first delivery (500, its writes rolled back): the gateway delivers
    the event again after a backoff, and it is applied once."""
    real = gateway_events.apply
    calls: list[str] = []

    def failing_once(event_id: str, event: dict[str, Any]) -> dict[str, Any]:
        calls.append(event_id)
        result = real(event_id, event)
        if len(calls) == 1:
            raise RuntimeError("the handler fails after its writes")
        return result

    monkeypatch.setattr(gateway_events, "apply", failing_once)
    paid_order(linked)
    wait_for(lambda: all_delivered(db, 1))
    [(event_id, _, attempts, _)] = outbox(db)
    assert (attempts, calls) == (2, [event_id, event_id])
    assert [e for e, *_ in applied(db)] == [event_id]


def test_wrong_signature_on_first_attempt_is_retried(linked: Linked, db: psycopg.Connection[Any]) -> None:
    """webhook_fail_first: the first attempt is refused (400), the retry is applied, once."""
    add_fault(linked.gateway_url, "webhook_fail_first")
    paid_order(linked)
    wait_for(lambda: all_delivered(db, 1))
    [(event_id, _, attempts, _)] = outbox(db)
    assert attempts == 2
    assert [e for e, *_ in applied(db)] == [event_id]


@pytest.mark.parametrize("secret", ["whsec_" + base64.b64encode(b"another secret").decode(), SECRET])
def test_bad_signature_is_400_and_changes_nothing(
    linked: Linked, db: psycopg.Connection[Any], secret: str
) -> None:
    """A delivery signed with another secret, or whose body changed after signing, is 400 problem+json
    naming the signature check, and writes nothing."""
    client = linked.shop.test_client()
    stranded_payment(client, linked.org[1], linked.gateway_url, "fail_before")
    row = db.execute("SELECT org_id, id FROM payments").fetchone()
    assert row is not None
    body = {
        "type": "payment.succeeded",
        "data": {"charge": {"id": "ch_x", "reference": f"{row[0]}:{row[1]}"}},
    }
    raw = json.dumps(body).encode()
    timestamp = int(time.time())
    signed = raw if secret != SECRET else raw.replace(b"ch_x", b"ch_y")  # the right secret, another body
    response = requests.post(
        linked.webhook_url,
        data=raw,
        headers={
            "webhook-id": "evt_forged",
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, "evt_forged", timestamp, signed),
        },
        timeout=10,
    )
    assert response.status_code == 400
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.json()["check"] == "signature"
    assert payment_state(db) == ("pending", None, False)
    assert applied(db) == []
    key_rows = db.execute("SELECT count(*) FROM idempotency_keys WHERE org_id < 0").fetchone()
    assert key_rows == (0,)
