"""The gateway's connection pool and every SQL statement it runs. No other module runs SQL."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any

from flask import current_app
from psycopg.rows import class_row

from flask_idem import ForkSafeConnectionPool

__all__ = ["Charge", "Fault", "Store", "current_store"]

_SELECT_CHARGE = (
    "SELECT id, idem_key AS idempotency_key, amount, currency, source, status, created_at"
    " FROM gateway_charges"
)


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
        }


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

    def __init__(self, pool: ForkSafeConnectionPool) -> None:
        self.pool = pool

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
        self, *, key: str, amount: int, currency: str, source: str, status: str
    ) -> tuple[Charge, bool]:
        """Create the charge of ``key``, or find the one it already has.

        Returns the charge and whether this call created it. Of concurrent calls with one key
        exactly one creates it: the others wait on the unique index, then read the committed row.
        """
        with self.pool.connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=class_row(Charge))
            row = cursor.execute(
                "INSERT INTO gateway_charges (idem_key, amount, currency, source, status)"
                " VALUES (%s, %s, %s, %s, %s)"
                " ON CONFLICT (idem_key) DO NOTHING"
                " RETURNING id, idem_key AS idempotency_key, amount, currency, source, status, created_at",
                (key, amount, currency, source, status),
            ).fetchone()
            if row is not None:
                return row, True
            row = cursor.execute(_SELECT_CHARGE + " WHERE idem_key = %s", (key,)).fetchone()
        assert row is not None, "a conflicting charge is never deleted"
        return row, False

    def charge_by_key(self, key: str) -> Charge | None:
        """The charge made with ``key``, if any."""
        with self.pool.connection() as conn, conn.cursor(row_factory=class_row(Charge)) as cursor:
            return cursor.execute(_SELECT_CHARGE + " WHERE idem_key = %s", (key,)).fetchone()

    def charges(self) -> list[Charge]:
        """Every charge, oldest first."""
        with self.pool.connection() as conn, conn.cursor(row_factory=class_row(Charge)) as cursor:
            return cursor.execute(_SELECT_CHARGE + " ORDER BY created_at, id").fetchall()

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
        """Consume one use of the oldest queued entry; ``None`` when the queue is empty.

        Consumers take turns on an advisory lock, so concurrent requests in any number of processes
        consume exactly one use each, in queue order. The lock lasts for two short statements. The
        returned entry's ``remaining`` counts the uses left after this one.
        """
        with self.pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('example_app.gateway.faults'))")
            fault = (
                conn.cursor(row_factory=class_row(Fault))
                .execute("SELECT id, mode, remaining, delay FROM gateway_faults ORDER BY id LIMIT 1")
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
