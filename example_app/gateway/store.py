"""The gateway's connection pool and every SQL statement it runs. No other module runs SQL."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any

from flask import current_app
from psycopg.rows import class_row

from flask_idem import ForkSafeConnectionPool

__all__ = ["Charge", "Event", "Fault", "Store", "current_store"]

_SELECT_CHARGE = (
    "SELECT id, idem_key AS idempotency_key, amount, currency, source, status, created_at, reference,"
    " refunded_at FROM gateway_charges"
)

_WEBHOOK_MODES = ["webhook_duplicate", "webhook_reorder", "webhook_fail_first"]
_CHARGE_MODES = ["delay", "fail_before", "fail_after", "drop_after"]


@dataclass(frozen=True, slots=True)
class Charge:
    """One row of ``gateway_charges``."""

    id: str
    idempotency_key: str
    amount: int
    currency: str
    source: str
    status: str
    created_at: datetime
    reference: str | None = None
    refunded_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """The charge as the API shows it."""
        return {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "amount": self.amount,
            "currency": self.currency,
            "source": self.source,
            "status": self.status,
            "created_at": self.created_at.isoformat(),
            "reference": self.reference,
            "refunded_at": None if self.refunded_at is None else self.refunded_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Event:
    """One row of ``gateway_events`` (the webhook outbox), as a sender claimed it."""

    id: int
    event_id: str
    type: str
    body: str
    fault: str | None
    attempts: int


@dataclass(frozen=True, slots=True)
class Fault:
    """One entry of the fault queue: ``mode`` for the next ``remaining`` charge requests."""

    id: int
    mode: str
    remaining: int
    delay: float

    def to_dict(self) -> dict[str, Any]:
        """The entry as the API shows it."""
        return {"id": self.id, "mode": self.mode, "remaining": self.remaining, "delay": self.delay}


class Store:
    """The gateway's tables, and the per-process pool their connections come from.

    :param pool: flask-idem's :class:`~flask_idem.ForkSafeConnectionPool`, one pool per worker process.
    """

    def __init__(self, pool: ForkSafeConnectionPool, *, events: bool = False) -> None:
        self.pool = pool
        #: Whether charges and refunds write webhook events (the gateway has a webhook URL).
        self.events = events

    def close(self) -> None:
        """Close this process's pool (a later use opens a new one)."""
        self.pool.close()

    def init_schema(self) -> None:
        """Create the gateway's tables if missing; safe when several workers start at once."""
        ddl = files(__package__).joinpath("schema.sql").read_bytes()
        with self.pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('example_app.gateway.schema'))")
            conn.execute(ddl)

    # -- charges -----------------------------------------------------------------------------------

    def charge(
        self,
        *,
        key: str,
        amount: int,
        currency: str,
        source: str,
        status: str,
        reference: str | None = None,
    ) -> tuple[Charge, bool]:
        """Create the charge of ``key``, or find the one it already has.

        Returns the charge and whether this call created it. Of concurrent calls with one key
        exactly one creates it: the others wait on the unique index, then read the committed row.
        A charge that succeeds writes its ``payment.succeeded`` event in the same transaction.
        """
        with self.pool.connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=class_row(Charge))
            row = cursor.execute(
                "INSERT INTO gateway_charges (idem_key, amount, currency, source, status, reference)"
                " VALUES (%s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (idem_key) DO NOTHING"
                " RETURNING id, idem_key AS idempotency_key, amount, currency, source, status, created_at,"
                " reference, refunded_at",
                (key, amount, currency, source, status, reference),
            ).fetchone()
            if row is not None:
                if row.status == "succeeded":
                    self._add_event(conn, "payment.succeeded", row)
                return row, True
            row = cursor.execute(_SELECT_CHARGE + " WHERE idem_key = %s", (key,)).fetchone()
        assert row is not None, "a conflicting charge is never deleted"
        return row, False

    def refund(self, charge_id: str) -> tuple[Charge | None, bool]:
        """Refund a succeeded charge in full, once; return it (``None``: no such charge) and whether
        this call refunded it. A refund writes its ``payment.refunded`` event in the same transaction."""
        with self.pool.connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=class_row(Charge))
            row = cursor.execute(
                "UPDATE gateway_charges SET refunded_at = now()"
                " WHERE id = %s AND status = 'succeeded' AND refunded_at IS NULL"
                " RETURNING id, idem_key AS idempotency_key, amount, currency, source, status, created_at,"
                " reference, refunded_at",
                (charge_id,),
            ).fetchone()
            if row is not None:
                self._add_event(conn, "payment.refunded", row)
                return row, True
            return cursor.execute(_SELECT_CHARGE + " WHERE id = %s", (charge_id,)).fetchone(), False

    def charge_by_key(self, key: str) -> Charge | None:
        """The charge made with ``key``, if any."""
        with self.pool.connection() as conn, conn.cursor(row_factory=class_row(Charge)) as cursor:
            return cursor.execute(_SELECT_CHARGE + " WHERE idem_key = %s", (key,)).fetchone()

    def charges(self) -> list[Charge]:
        """Every charge, oldest first."""
        with self.pool.connection() as conn, conn.cursor(row_factory=class_row(Charge)) as cursor:
            return cursor.execute(_SELECT_CHARGE + " ORDER BY created_at, id").fetchall()

    # -- webhook events ------------------------------------------------------------------------------

    def _add_event(self, conn: Any, type_: str, charge: Charge) -> None:
        """Write the event of ``charge`` to the outbox on ``conn``, with the next webhook fault if any."""
        if not self.events:
            return
        fault = self._take(conn, _WEBHOOK_MODES)
        body = {"type": type_, "data": {"charge": charge.to_dict()}}
        conn.execute(
            "INSERT INTO gateway_events (type, body, fault) VALUES (%s, %s, %s)",
            (type_, json.dumps(body, separators=(",", ":")), None if fault is None else fault.mode),
        )

    def claim_events(self, limit: int) -> list[Event]:
        """Claim up to ``limit`` events due for delivery, oldest first, for this sender alone.

        A claimed event is not due again for 30 seconds, longer than a delivery attempt, so that two
        senders never deliver it at once unless a fault says so; a sender that dies while delivering
        leaves it to be claimed again then. An event held back by ``webhook_reorder`` waits until a
        later event was delivered (at most 5 seconds).
        """
        with self.pool.connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=class_row(Event))
            return cursor.execute(
                "UPDATE gateway_events SET next_attempt_at = now() + interval '30 seconds'"
                " WHERE id IN ("
                "  SELECT e.id FROM gateway_events e"
                "  WHERE e.delivered_at IS NULL AND e.abandoned_at IS NULL AND e.next_attempt_at <= now()"
                "  AND (e.fault IS DISTINCT FROM 'webhook_reorder' OR e.attempts > 0"
                "       OR e.created_at < now() - interval '5 seconds'"
                "       OR EXISTS (SELECT 1 FROM gateway_events later"
                "                  WHERE later.id > e.id AND later.delivered_at IS NOT NULL))"
                "  ORDER BY e.id LIMIT %s FOR UPDATE SKIP LOCKED)"
                " RETURNING id, event_id, type, body, fault, attempts",
                (limit,),
            ).fetchall()

    def event_delivered(self, event: Event) -> None:
        """Record the delivery of ``event`` (one more attempt)."""
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(
                "UPDATE gateway_events SET attempts = attempts + 1, delivered_at = now() WHERE id = %s",
                (event.id,),
            )

    def event_failed(self, event: Event, *, retry_in: float | None) -> None:
        """Record a failed attempt of ``event``: due again in ``retry_in`` seconds, or abandoned (None)."""
        with self.pool.connection() as conn, conn.transaction():
            if retry_in is None:
                conn.execute(
                    "UPDATE gateway_events SET attempts = attempts + 1, abandoned_at = now() WHERE id = %s",
                    (event.id,),
                )
            else:
                conn.execute(
                    "UPDATE gateway_events SET attempts = attempts + 1,"
                    " next_attempt_at = now() + make_interval(secs => %s) WHERE id = %s",
                    (retry_in, event.id),
                )

    def events_summary(self) -> dict[str, int]:
        """How many events are delivered, abandoned and still to deliver, and the attempts made."""
        with self.pool.connection() as conn:
            row = conn.execute(
                "SELECT count(delivered_at), count(abandoned_at),"
                " count(*) FILTER (WHERE delivered_at IS NULL AND abandoned_at IS NULL),"
                " coalesce(sum(attempts), 0) FROM gateway_events"
            ).fetchone()
        assert row is not None
        return dict(zip(("delivered", "abandoned", "pending", "attempts"), map(int, row), strict=True))

    # -- faults ------------------------------------------------------------------------------------

    def add_fault(self, *, mode: str, count: int, delay: float) -> Fault:
        """Queue ``mode`` for the next ``count`` charge requests, behind the earlier entries."""
        with self.pool.connection() as conn, conn.transaction():
            row = (
                conn.cursor(row_factory=class_row(Fault))
                .execute(
                    "INSERT INTO gateway_faults (mode, remaining, delay) VALUES (%s, %s, %s)"
                    " RETURNING id, mode, remaining, delay",
                    (mode, count, delay),
                )
                .fetchone()
            )
        assert row is not None
        return row

    def take_fault(self) -> Fault | None:
        """Consume one use of the oldest queued entry for charge requests; ``None`` when there is none.

        Consumers take turns on an advisory lock, so concurrent requests in any number of processes
        consume exactly one use each, in queue order. The lock lasts for two short statements. The
        returned entry's ``remaining`` counts the uses left after this one. Webhook faults are left
        to the events (:meth:`charge`, :meth:`refund`).
        """
        with self.pool.connection() as conn, conn.transaction():
            return self._take(conn, _CHARGE_MODES)

    @staticmethod
    def _take(conn: Any, modes: Sequence[str]) -> Fault | None:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('example_app.gateway.faults'))")
        fault: Fault | None = (
            conn.cursor(row_factory=class_row(Fault))
            .execute(
                "SELECT id, mode, remaining, delay FROM gateway_faults WHERE mode = ANY(%s)"
                " ORDER BY id LIMIT 1",
                (list(modes),),
            )
            .fetchone()
        )
        if fault is None:
            return None
        if fault.remaining == 1:
            conn.execute("DELETE FROM gateway_faults WHERE id = %s", (fault.id,))
        else:
            conn.execute("UPDATE gateway_faults SET remaining = remaining - 1 WHERE id = %s", (fault.id,))
        return Fault(fault.id, fault.mode, fault.remaining - 1, fault.delay)

    def faults(self) -> list[Fault]:
        """The queued entries, next first."""
        with self.pool.connection() as conn, conn.cursor(row_factory=class_row(Fault)) as cursor:
            return cursor.execute(
                "SELECT id, mode, remaining, delay FROM gateway_faults ORDER BY id"
            ).fetchall()

    def clear_faults(self) -> int:
        """Remove every queued entry; return how many there were."""
        with self.pool.connection() as conn, conn.transaction():
            return conn.execute("DELETE FROM gateway_faults").rowcount


def current_store() -> Store:
    """The :class:`Store` of the gateway handling the current request."""
    store: Store = current_app.extensions["gateway"]
    return store
