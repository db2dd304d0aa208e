"""Clients that place and pay orders through the retry helper (and refund some at the gateway), and a
nemesis that injects faults: worker kills, PostgreSQL restarts, gateway faults (of charges and of its
webhook deliveries), and faults of the network between the shop and PostgreSQL.

Every operation is recorded with its key, its body and how it ended: ``ok`` (a 2xx, with the body the
client received), ``failed`` (a definite refusal, e.g. a 402 decline) or ``unknown`` (the helper gave up
while the outcome was open: timeouts, dropped connections, 409s, 503s).
"""

from __future__ import annotations

import functools
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from flask_idem.client import IdempotentClient, Rejected, RequestsTransport, RetriesExhausted, RetryPolicy

from .cluster import Cluster

#: Statuses a client may see on the way; any other (a 500, say) is an anomaly.
EXPECTED = {200, 201, 402, 409, 503}

#: The helper's policy during the run: patient, but bounded, so some operations end "unknown".
RUN_POLICY = RetryPolicy(attempts=4, deadline=3.0, base=0.1, cap=1.0, attempt_timeout=2.5)


@dataclass
class Op:
    """One logical operation and what its client learnt."""

    kind: str  # "order" or "payment"
    api_key: str
    key: uuid.UUID
    body: dict[str, Any]
    outcome: str = "pending"  # ok, failed, unknown
    status: int | None = None
    response: bytes | None = None
    statuses: list[int | None] = field(default_factory=list)

    @property
    def path(self) -> str:
        return "/orders" if self.kind == "order" else "/payments"


def perform(client: IdempotentClient[requests.Response], base: str, op: Op) -> None:
    """Run ``op`` through the retry helper and record how it ended."""
    headers = {"Authorization": f"Bearer {op.api_key}"}
    try:
        response = client.post(base + op.path, json=op.body, headers=headers, key=op.key)
    except Rejected as e:
        op.outcome, op.status = "failed", e.status
        op.response = e.response.content if e.response is not None else None  # type: ignore[attr-defined]
    except RetriesExhausted as e:
        op.outcome, op.status = "unknown", e.status
    else:
        op.outcome, op.status, op.response = "ok", response.status_code, response.content


def client_loop(cluster: Cluster, seed: int, stop_at: float, history: list[Op], lock: threading.Lock) -> None:
    """Place orders and pay them until ``stop_at``; append every operation to ``history``."""
    rng = random.Random(seed)
    with requests.Session() as session:
        recorded: list[int | None] = []
        client = IdempotentClient(
            RequestsTransport(session),
            policy=RUN_POLICY,
            on_attempt=lambda info: recorded.append(info.status),
            rng=random.Random(seed),
        )
        while time.monotonic() < stop_at:
            api_key = rng.choice(cluster.api_keys)
            order = Op("order", api_key, uuid.uuid4(), {"amount": rng.randint(1, 10**6), "currency": "EUR"})
            _run(client, cluster, order, recorded, history, lock)
            if order.outcome != "ok":
                continue
            source = "tok_chargedecline" if rng.random() < 0.1 else "tok_visa"
            order_id = _json(order.response)["id"]
            payment = Op("payment", api_key, uuid.uuid4(), {"order_id": order_id, "source": source})
            _run(client, cluster, payment, recorded, history, lock)
            if payment.outcome == "ok" and rng.random() < REFUND_RATE:
                refund(session, cluster, _json(payment.response)["gateway_charge_id"])


#: The share of paid orders refunded at the gateway (its payment.refunded event races the success's).
REFUND_RATE = 0.2


def refund(session: requests.Session, cluster: Cluster, charge_id: str) -> None:
    """Refund a charge at the gateway (as from its dashboard); a failure is only noted, the checker compares
    the gateway's refunds with the shop's."""
    try:
        session.post(f"{cluster.gateway_url}/charges/{charge_id}/refund", timeout=5).raise_for_status()
    except requests.RequestException:
        pass


def _run(
    client: IdempotentClient[requests.Response],
    cluster: Cluster,
    op: Op,
    recorded: list[int | None],
    history: list[Op],
    lock: threading.Lock,
) -> None:
    recorded.clear()
    perform(client, cluster.shop_url, op)
    op.statuses = list(recorded)
    with lock:
        history.append(op)


def _json(body: bytes | None) -> Any:
    import json

    assert body is not None
    return json.loads(body)


#: The faults of the path between the shop and PostgreSQL (:meth:`.Cluster.network_fault`).
NETWORK_FAULTS = ("reset", "commit", "hold", "hung", "dead")

#: The faults of the gateway's webhook deliveries (:meth:`.Cluster.webhook_fault`): each is queued for a
#: few events when the nemesis starts, so that even a short run has them all, and chosen at random later.
WEBHOOK_FAULTS = ("webhook_duplicate", "webhook_reorder", "webhook_fail_first")


def nemesis(cluster: Cluster, stop_at: float, interval: float, max_faults: int) -> None:
    """Inject a fault every ``interval`` seconds, at most ``max_faults`` times, until ``stop_at``: first
    each of the :data:`NETWORK_FAULTS` once, in random order (when the shop is behind the fault proxy), so
    that even a short run has them all, then faults chosen at random (``interval`` apart on average)."""
    rng = cluster.rng
    for mode in WEBHOOK_FAULTS:
        cluster.webhook_fault(mode, count=3)
    first = rng.sample(NETWORK_FAULTS, len(NETWORK_FAULTS)) if cluster.proxy is not None else []
    actions = [
        lambda: cluster.kill_worker(),
        lambda: cluster.restart_postgres("fast"),
        lambda: cluster.restart_postgres("immediate"),
        lambda: cluster.gateway_fault("delay", delay=2.0),  # charged, answered after the shop gave up
        lambda: cluster.gateway_fault("fail_before"),
        lambda: cluster.gateway_fault("fail_after"),
        lambda: cluster.gateway_fault("drop_after"),
        lambda: cluster.webhook_fault(rng.choice(WEBHOOK_FAULTS), count=rng.randint(1, 5)),
        lambda: cluster.network_fault("reset"),
        lambda: cluster.network_fault("commit"),
        lambda: cluster.network_fault("hold"),
        lambda: cluster.network_fault("hung"),
        lambda: cluster.network_fault("dead"),
    ]
    injected = 0
    while injected < max_faults and time.monotonic() + interval < stop_at:
        action: Callable[[], None]
        if injected < len(first):
            time.sleep(interval)
            action = functools.partial(cluster.network_fault, first[injected])
        else:
            time.sleep(rng.uniform(0.5, 1.5) * interval)
            action = rng.choice(actions)
        try:
            action()
        except Exception as e:  # e.g. queueing a gateway fault while PostgreSQL restarts
            name = f"injection failed ({type(e).__name__})"
            cluster.faults[name] = cluster.faults.get(name, 0) + 1
        injected += 1
