"""The connection pool and every SQL statement of the extension. Nothing else talks to PostgreSQL.

Races are decided by PostgreSQL, never by reading first and writing after: a key is reserved with
``INSERT ... ON CONFLICT (org_id, idem_key) DO NOTHING RETURNING``, so of any number of concurrent
requests with one key exactly one inserts the row.

An atomic-mode reservation stays uncommitted while the view runs, and a second ``INSERT`` of the same key
would wait for it on the unique index. The server must answer 409 at once instead, so every reservation
first takes a transaction-scoped advisory lock with ``pg_try_advisory_xact_lock``, which never waits: the
request that holds the lock is the one in flight, and whoever fails to take it knows so immediately. The
lock is released by the same COMMIT or ROLLBACK that ends the reservation, it needs no session state (so it
works behind PgBouncer in transaction mode), and it costs nothing extra because it is evaluated inside the
``INSERT`` statement itself.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, LiteralString

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

__all__ = ["KeyRecord", "Reservation", "Store"]

Connection = psycopg.Connection[TupleRow]

#: Advisory locks share one namespace with the application's own. Mixing this constant into the lock id
#: keeps ours apart from ids an application derives from small integers.
_LOCK_SALT = b"flask-idem/v1"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A committed row of the key table, as a later request with the same key sees it."""

    request_sha: bytes
    status: str
    response: dict[str, Any] | None
    expired: bool


@dataclass(frozen=True, slots=True)
class Reservation:
    """What :meth:`Store.reserve` found.

    ``reserved`` is true when this transaction inserted the row and now owns the key. Otherwise
    ``record`` is the committed row, or ``None`` when another transaction holds the key and has not
    committed yet (the request is in flight).
    """

    reserved: bool
    record: KeyRecord | None = None


def lock_id(org_id: int, key: uuid.UUID) -> int:
    """The signed 64-bit advisory lock id of one (org, key) pair."""
    digest = hashlib.blake2b(
        org_id.to_bytes(8, "big", signed=True) + key.bytes, digest_size=8, key=_LOCK_SALT
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


class Store:
    """The key table and the pool its connections come from.

    One pool per process: it is created on first use and created again when the process id changes, so a
    pre-fork server (gunicorn) that imports the application in its master still gives every worker its own
    connections. Connections run in autocommit mode; every transaction is an explicit
    ``with conn.transaction():`` block.

    :param conninfo: a libpq connection string or URL.
    :param table: the key table's name, optionally schema-qualified (``"idem.keys"``).
    :param min_size: connections the pool keeps open.
    :param max_size: most connections the pool opens.
    :param timeout: seconds a request waits for a free connection before the pool gives up.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table: str = "idempotency_keys",
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 5.0,
    ) -> None:
        self._conninfo = conninfo
        self._pool_args: dict[str, Any] = {
            "min_size": min_size,
            "max_size": max_size,
            "timeout": timeout,
        }
        self._pool: ConnectionPool[Connection] | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._sql = _Statements(table)
        atexit.register(self.close)

    @property
    def pool(self) -> ConnectionPool[Connection]:
        """This process's connection pool, opened on first use."""
        pool = self._pool
        if pool is not None and self._pid == os.getpid():
            return pool
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # A pool inherited through fork() is dropped, not closed: its sockets are shared with
                # the parent, and closing them here would cut the parent's connections.
                self._pool = ConnectionPool(
                    self._conninfo,
                    kwargs={"autocommit": True},
                    open=False,
                    name="flask-idem",
                    **self._pool_args,
                )
                self._pool.open(wait=False)
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Close this process's pool, if it has one. A later use opens a new one."""
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """Borrow a connection from the pool for the duration of a ``with`` block."""
        with self.pool.connection() as conn:
            yield conn

    # -- schema ----------------------------------------------------------------------------------------

    def init_schema(self) -> None:
        """Create the key table and its index when they do not exist (safe to run twice, or at once)."""
        with self.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(0, uuid.UUID(int=0)),))
            conn.execute(self._sql.schema)

    # -- atomic mode -----------------------------------------------------------------------------------

    def reserve(
        self,
        conn: Connection,
        *,
        org_id: int,
        key: uuid.UUID,
        request_sha: bytes,
        method: str,
        path: str,
        ttl: float,
    ) -> Reservation:
        """Reserve ``key`` for ``org_id`` inside the transaction open on ``conn``, or report who has it.

        An expired finished row is deleted and the key reserved anew: past its retention period a key
        is treated as never seen. The caller must run this in a transaction; the reservation lasts until
        that transaction ends.
        """
        params = {
            "org_id": org_id,
            "key": key,
            "sha": request_sha,
            "method": method,
            "path": path,
            "ttl": ttl,
            "lock": lock_id(org_id, key),
        }
        for _ in range(2):
            row = conn.execute(self._sql.reserve, params).fetchone()
            if row is None:
                # The INSERT found a conflicting row this statement's snapshot could not see (committed
                # a moment ago), or did not get the lock. A new statement sees whatever has committed.
                row = conn.execute(self._sql.lookup, params).fetchone()
                if row is None:
                    return Reservation(reserved=False)
            if row[0]:
                return Reservation(reserved=True)
            record = KeyRecord(request_sha=row[1], status=row[2], response=row[3], expired=row[4])
            if not (record.expired and record.status != "processing"):
                return Reservation(reserved=False, record=record)
            conn.execute(self._sql.delete_expired, params)
        return Reservation(reserved=False)

    def complete(self, conn: Connection, *, org_id: int, key: uuid.UUID, response: dict[str, Any]) -> None:
        """Store the response of a reserved key and mark it ``completed``, in the caller's transaction."""
        conn.execute(self._sql.complete, {"org_id": org_id, "key": key, "response": Jsonb(response)})

    # -- retention -------------------------------------------------------------------------------------

    def purge(self, *, batch_size: int = 1000) -> int:
        """Delete expired finished rows in batches of ``batch_size``, each its own short transaction.

        ``processing`` rows are never deleted, whatever their age. Returns how many rows were removed.
        """
        removed = 0
        while True:
            with self.connection() as conn, conn.transaction():
                count = conn.execute(self._sql.purge, {"limit": batch_size}).rowcount
            removed += count
            if count < batch_size:
                return removed


class _Statements:
    """Every statement of the store, composed once for one table name."""

    def __init__(self, table: str) -> None:
        parts = table.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}")
        name = sql.Identifier(*parts)
        fields = {"table": name, "expires_index": sql.Identifier(parts[-1] + "_expires_at_idx")}

        def q(text: LiteralString) -> sql.Composed:
            return sql.SQL(text).format(**fields)

        ddl = files(__package__).joinpath("schema.sql").read_text("utf-8")
        self.schema = sql.SQL(ddl).format(**fields)

        self.reserve = q(
            "WITH reserved AS ("
            " INSERT INTO {table} (org_id, idem_key, request_sha, method, path, status, expires_at)"
            " SELECT %(org_id)s, %(key)s, %(sha)s, %(method)s, %(path)s, 'processing',"
            "        now() + make_interval(secs => %(ttl)s)"
            " WHERE pg_try_advisory_xact_lock(%(lock)s)"
            " ON CONFLICT (org_id, idem_key) DO NOTHING"
            " RETURNING 1"
            ")"
            " SELECT true, NULL::bytea, NULL::text, NULL::jsonb, NULL::boolean FROM reserved"
            " UNION ALL"
            " SELECT false, request_sha, status, response, expires_at <= now() FROM {table}"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s AND NOT EXISTS (SELECT FROM reserved)"
        )
        self.lookup = q(
            "SELECT false, request_sha, status, response, expires_at <= now() FROM {table}"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
        )
        self.delete_expired = q(
            "DELETE FROM {table}"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
            " AND expires_at <= now() AND status <> 'processing'"
        )
        self.complete = q(
            "UPDATE {table} SET status = 'completed', response = %(response)s"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
        )
        self.purge = q(
            "DELETE FROM {table} WHERE (org_id, idem_key) IN ("
            " SELECT org_id, idem_key FROM {table}"
            " WHERE expires_at <= now() AND status <> 'processing'"
            " ORDER BY expires_at LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED)"
        )
