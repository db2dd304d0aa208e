"""After the run: heal, recover, resolve the unknown, then check the history against the database.

The promises checked:

- no (org, key) produced two orders or two charges, and no order was charged twice;
- every acknowledged order and payment exists exactly once, with the amount of its first request;
- every operation left unknown has at most one effect once retried with its key and recovered;
- no key row is left ``processing`` and no payment ``pending``;
- a replay of every acknowledged operation is byte for byte the answer first received;
- no client ever saw a status outside the expected ones (a 500, say);
- every webhook event of the gateway was delivered and applied by the shop exactly once (duplicates,
  reordering and failed deliveries notwithstanding): no event id applied twice, no payment moved twice
  by events of one type, every charge that succeeded is a succeeded payment and every refund a refunded
  one.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
import requests

from example_app import create_app
from example_app.payments import pay
from flask_idem.client import IdempotentClient, RequestsTransport, RetryPolicy
from flask_idem.flow import Run
from flask_idem.recovery import recover

from ..support.helpers import close_pool
from .cluster import LEASE_TIMEOUT, Cluster, wait_until_postgres_answers
from .workload import EXPECTED, Op, perform

#: The helper's policy when resolving unknown operations after the faults stopped.
RESOLVE_POLICY = RetryPolicy(attempts=20, deadline=60.0, base=0.2, cap=2.0, attempt_timeout=10.0)


@dataclass
class Report:
    """What the checker found."""

    operations: Counter[str] = field(default_factory=Counter)
    faults: dict[str, int] = field(default_factory=dict)
    recovered: int = 0
    anomalies: dict[str, list[str]] = field(default_factory=dict)
    #: What the run could not check, and why (e.g. no broker for the background jobs).
    notes: list[str] = field(default_factory=list)

    def anomaly(self, kind: str, detail: str) -> None:
        self.anomalies.setdefault(kind, []).append(detail)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def summary(self) -> str:
        lines = ["history check"]
        lines.append("  operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.operations.items())))
        lines.append(
            "  faults injected: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.faults.items())) or "none")
        )
        lines.append(f"  requests finished by the recovery job: {self.recovered}")
        for kind in ("duplicates", "lost", "unexpected"):
            found = self.anomalies.get(kind, [])
            lines.append(f"  {kind}: {len(found)}")
            lines.extend(f"    - {detail}" for detail in found[:20])
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def settle(cluster: Cluster, history: list[Op], report: Report) -> None:
    """Stop the faults, let leases lapse, run recovery until nothing is processing, resolve unknowns."""
    wait_until_postgres_answers(cluster.database_url)
    cluster.heal()
    time.sleep(LEASE_TIMEOUT + 0.5)
    app = create_app(cluster.app_config())
    try:
        with psycopg.connect(cluster.database_url, autocommit=True) as db:
            for _ in range(10):
                db.execute("UPDATE idempotency_keys SET next_attempt_at = now() WHERE status = 'processing'")
                report.recovered += len(recover(app).completed)
                if _one(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'processing'") == 0:
                    break
                time.sleep(LEASE_TIMEOUT + 0.2)
    finally:
        close_pool(app)
    with requests.Session() as session:
        client = IdempotentClient(RequestsTransport(session), policy=RESOLVE_POLICY, rng=random.Random(0))
        for op in history:
            if op.outcome == "unknown":
                perform(client, cluster.shop_url, op)
                op.outcome = "resolved " + op.outcome
    _settle_events(cluster.database_url)


#: Seconds the gateway's webhook outbox may take to drain once the faults stopped: a claim lapses after
#: 30 s when its sender could not record the attempt (a PostgreSQL restart at that moment).
EVENTS_SETTLE = 75.0


def _settle_events(url: str) -> None:
    """Wait until the gateway has delivered (or abandoned) every webhook event; the check says which."""
    deadline = time.monotonic() + EVENTS_SETTLE
    with psycopg.connect(url, autocommit=True) as db:
        query = "SELECT count(*) FROM gateway_events WHERE delivered_at IS NULL AND abandoned_at IS NULL"
        while _one(db, query) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)


def check(cluster: Cluster, history: list[Op], report: Report) -> None:
    """Compare the history with the database, the gateway, and fresh replays."""
    report.faults = dict(cluster.faults)
    if cluster.proxy is not None and (lost := cluster.proxy.counts["commit answer lost"]):
        report.faults["network commit answer lost (at the proxy)"] = lost
    for op in history:
        report.operations[f"{op.kind} {op.outcome}"] += 1
        for status in op.statuses:
            if status is not None and status not in EXPECTED:
                report.anomaly("unexpected", f"{op.kind} {op.key} saw HTTP {status}")
        if op.outcome.endswith("failed") and not (op.kind == "payment" and op.status == 402):
            report.anomaly("unexpected", f"{op.kind} {op.key} was refused with HTTP {op.status}")
    with psycopg.connect(cluster.database_url, autocommit=True) as db:
        _check_tables(db, history, report)
        _check_events(db, report)
    _check_replays(cluster, history, report)


def _check_tables(db: psycopg.Connection[Any], history: list[Op], report: Report) -> None:
    orgs = {r[1]: r[0] for r in db.execute("SELECT id, api_key_sha FROM orgs").fetchall()}
    orders = db.execute("SELECT org_id, idempotency_key, id, amount FROM orders").fetchall()
    payments = db.execute(
        "SELECT org_id, idempotency_key, id, order_id, amount, status, gateway_charge_id FROM payments"
    ).fetchall()
    charges = {
        r[0]: r for r in db.execute("SELECT idem_key, id, amount, status FROM gateway_charges").fetchall()
    }

    for (org, key), n in Counter((o[0], o[1]) for o in orders).items():
        if n > 1:
            report.anomaly("duplicates", f"{n} orders for org {org} key {key}")
    live = Counter(p[3] for p in payments if p[5] in ("succeeded", "pending"))
    for order_id, n in live.items():
        if n > 1:
            report.anomaly("duplicates", f"order {order_id} has {n} live payments")
    expected_charge_keys = {
        Run(flow=pay.name, org_id=p[0], key=p[1]).derived_key("charge"): p for p in payments
    }
    for charge_key, charge in charges.items():
        if charge_key not in expected_charge_keys:
            report.anomaly("duplicates", f"charge {charge[1]} matches no payment")
    for payment in payments:
        charge = charges.get(Run(flow=pay.name, org_id=payment[0], key=payment[1]).derived_key("charge"))
        if payment[5] == "pending":
            key_row = db.execute(
                "SELECT status, step, attempts, response -> 'status', last_error FROM idempotency_keys"
                " WHERE org_id = %s AND idem_key = %s",
                (payment[0], payment[1]),
            ).fetchone()
            report.anomaly("lost", f"payment {payment[2]} is still pending (its key row: {key_row})")
        elif payment[5] in ("succeeded", "declined") and (charge is None or charge[1] != payment[6]):
            report.anomaly("lost", f"payment {payment[2]} ({payment[5]}) has no matching charge")
        elif charge is not None and charge[2] != payment[4]:
            report.anomaly("unexpected", f"payment {payment[2]} charged {charge[2]}, not {payment[4]}")
    if (n := _one(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'processing'")) > 0:
        report.anomaly("lost", f"{n} key rows still processing after recovery")

    from example_app.auth import hash_api_key

    by_key = {(o[0], o[1]): o for o in orders}
    pays_by_key = {(p[0], p[1]): p for p in payments}
    for op in history:
        org = orgs[hash_api_key(op.api_key)]
        if op.kind == "order":
            row = by_key.get((org, op.key))
            if op.outcome.endswith("ok"):
                body = json.loads(op.response or b"{}")
                if row is None:
                    report.anomaly("lost", f"acknowledged order {op.key} does not exist")
                elif (row[2], row[3]) != (body["id"], op.body["amount"]):
                    report.anomaly(
                        "unexpected", f"order {op.key} is {row[2:]} not {body['id']}/{op.body['amount']}"
                    )
            elif op.outcome.endswith("failed") and row is not None:
                report.anomaly("unexpected", f"refused order {op.key} exists")
        else:
            row = pays_by_key.get((org, op.key))
            if op.outcome.endswith("ok"):
                body = json.loads(op.response or b"{}")
                if row is None or row[5] != "succeeded" or row[6] != body.get("gateway_charge_id"):
                    report.anomaly("lost", f"acknowledged payment {op.key} is {row and row[5]}")
            elif op.outcome.endswith("failed") and op.status == 402 and (row is None or row[5] != "declined"):
                report.anomaly("unexpected", f"declined payment {op.key} is recorded as {row and row[5]}")


def _check_events(db: psycopg.Connection[Any], report: Report) -> None:
    """The gateway's webhook events against what the shop applied and the payments' states."""
    events = db.execute(
        "SELECT event_id, type, attempts, delivered_at IS NOT NULL, abandoned_at IS NOT NULL"
        " FROM gateway_events"
    ).fetchall()
    applied = db.execute("SELECT event_id, org_id, payment_id, type, moved FROM payment_events").fetchall()
    report.operations["webhook event"] += len(events)
    report.operations["webhook delivery attempt"] += sum(e[2] for e in events)
    times_applied = Counter(a[0] for a in applied)
    for event_id, kind, attempts, delivered, abandoned in events:
        if not delivered:
            state = "abandoned" if abandoned else "still undelivered"
            report.anomaly("lost", f"webhook event {event_id} ({kind}) {state} after {attempts} attempts")
        elif times_applied[event_id] == 0:
            report.anomaly("lost", f"webhook event {event_id} ({kind}) was delivered but never applied")
    for event_id, n in times_applied.items():
        if n > 1:
            report.anomaly("duplicates", f"webhook event {event_id} was applied {n} times")
    moves = Counter((a[1], a[2], a[3]) for a in applied if a[4])
    for (org, payment_id, kind), n in moves.items():
        if n > 1:
            report.anomaly("duplicates", f"payment {payment_id} of org {org} was moved {n} times by {kind}")
    # The gateway's charges against the shop's payments: a success is a succeeded payment, a refund a
    # refunded one, whichever of the flow and the events recorded them first and in whatever order.
    rows = db.execute(
        "SELECT c.id, c.refunded_at IS NOT NULL, p.id, p.status, p.refunded_at IS NOT NULL"
        " FROM gateway_charges c JOIN payments p ON c.reference = p.org_id || ':' || p.id"
        " WHERE c.status = 'succeeded'"
    ).fetchall()
    for charge_id, charge_refunded, payment_id, status, payment_refunded in rows:
        if status != "succeeded":
            report.anomaly("lost", f"charge {charge_id} succeeded, its payment {payment_id} is {status}")
        if charge_refunded != payment_refunded:
            report.anomaly(
                "lost" if charge_refunded else "unexpected",
                f"charge {charge_id} refunded: {charge_refunded}, payment {payment_id}: {payment_refunded}",
            )


def _check_replays(cluster: Cluster, history: list[Op], report: Report) -> None:
    with requests.Session() as session:
        for op in history:
            if not (op.outcome.endswith("ok") or op.status == 402):
                continue
            again = session.post(
                cluster.shop_url + op.path,
                json=op.body,
                headers={"Authorization": f"Bearer {op.api_key}", "Idempotency-Key": str(op.key)},
                timeout=10,
            )
            if again.content != op.response or again.headers.get("Idempotent-Replayed") != "true":
                report.anomaly("unexpected", f"replay of {op.kind} {op.key} differs ({again.status_code})")


def _one(db: psycopg.Connection[Any], query: str) -> int:
    row = db.execute(query).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return int(row[0])
