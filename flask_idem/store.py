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
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, LiteralString

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

__all__ = ["Connection", "KeyRecord", "ProcessPool", "Reservation", "Store", "Stranded", "StuckRow"]


class Connection(psycopg.Connection[TupleRow]):
    """The connections of a :class:`ProcessPool`: psycopg connections that keep one cursor for the store.

    psycopg gives every new cursor an empty cache of parameter adapters, so the first statement on a new
    cursor looks up how to send each parameter again. The store's statements run on every write request,
    so they share one cursor per connection (:func:`_cursor`), which keeps that cache warm.
    """

    _store_cursor: psycopg.Cursor[TupleRow] | None = None


def _cursor(conn: psycopg.Connection[TupleRow]) -> psycopg.Cursor[TupleRow]:
    """The cursor the store's statements run on: the connection's own when it comes from a pool here."""
    if not isinstance(conn, Connection):
        return conn.cursor()
    cursor = conn._store_cursor
    if cursor is None or cursor.closed:
        cursor = conn._store_cursor = conn.cursor()
    return cursor


#: Advisory locks share one namespace with the application's own. Mixing this constant into the lock id
#: keeps ours apart from ids an application derives from small integers.
_LOCK_SALT = b"flask-idem/v1"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A committed row of the key table, as a later request with the same key sees it."""

    request_sha: bytes
    status: str
    response: dict[str, Any] | None
    #: Past its retention period, finished, and not flagged for a person: the key may be used anew.
    expired: bool
    #: Multi-step rows: whether a worker holds the request now, the flow, and what it recorded.
    lease_live: bool = False
    flow: str | None = None
    step: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stranded:
    """A multi-step request the recovery job claimed: its lease had expired."""

    org_id: int
    key: uuid.UUID
    flow: str
    step: str | None
    state: dict[str, Any]
    method: str
    path: str
    attempts: int
    overdue: bool


@dataclass(frozen=True, slots=True)
class StuckRow:
    """A row ``flask idem stuck`` reports."""

    org_id: int
    key: uuid.UUID
    status: str
    flow: str | None
    step: str | None
    attempts: int
    age_seconds: float
    needs_attention: bool
    last_error: str | None


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


class ProcessPool:
    """A psycopg :class:`~psycopg_pool.ConnectionPool` per process, opened on first use.

    The pool is created on first use and created again when the process id changes, so a pre-fork server
    (gunicorn) that imports the application in its master still gives every worker its own connections.
    Its connections are :class:`Connection` objects in autocommit mode; every transaction is an explicit
    ``with conn.transaction():`` block.

    :param conninfo: a libpq connection string or URL.
    :param name: the pool's name in psycopg's logs.
    :param min_size: connections the pool keeps open.
    :param max_size: most connections the pool opens.
    :param timeout: seconds a request waits for a free connection before the pool gives up.
    :param prepare_threshold: psycopg's server-side prepared statements after this many runs of a
        statement; ``None`` turns them off (PgBouncer in transaction mode before 1.21).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        name: str = "flask-idem",
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 5.0,
        prepare_threshold: int | None = 5,
    ) -> None:
        self._conninfo = conninfo
        self._pool_args: dict[str, Any] = {
            "name": name,
            "min_size": min_size,
            "max_size": max_size,
            "timeout": timeout,
            "kwargs": {"autocommit": True, "prepare_threshold": prepare_threshold},
        }
        self._pool: ConnectionPool[Connection] | None = None
        self._pid = 0
        self._lock = threading.Lock()
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
                    self._conninfo, connection_class=Connection, open=False, **self._pool_args
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


class Store(ProcessPool):
    """The key table, and the per-process pool its connections come from (:class:`ProcessPool`).

    :param conninfo: a libpq connection string or URL.
    :param table: the key table's name, optionally schema-qualified (``"idem.keys"``).
    :param pool_args: the other arguments of :class:`ProcessPool`.
    """

    def __init__(self, conninfo: str, *, table: str = "idempotency_keys", **pool_args: Any) -> None:
        self._sql = _Statements(table)
        super().__init__(conninfo, **pool_args)

    # -- schema ----------------------------------------------------------------------------------------

    def init_schema(self) -> None:
        """Create the key table and its index when they do not exist (safe to run twice, or at once)."""
        with self.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(0, uuid.UUID(int=0)),))
            conn.execute(self._sql.schema)

    # -- atomic mode -----------------------------------------------------------------------------------

    def reserve(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        request_sha: bytes,
        method: str,
        path: str,
        ttl: float,
        flow: str | None = None,
        lease_token: uuid.UUID | None = None,
        lease: float | None = None,
    ) -> Reservation:
        """Reserve ``key`` for ``org_id`` inside the transaction open on ``conn``, or report who has it.

        An expired finished row is deleted and the key reserved anew: past its retention period a key
        is treated as never seen. The caller must run this in a transaction; the reservation lasts until
        that transaction ends. A multi-step request passes its ``flow`` name and a lease (a token and
        its length in seconds), which outlive the transaction.
        """
        params: dict[str, Any] = {
            "org_id": org_id,
            "key": key,
            "sha": request_sha,
            "method": method,
            "path": path,
            "ttl": ttl,
            "lock": lock_id(org_id, key),
        }
        statement = self._sql.reserve
        if flow is not None:
            params.update(flow=flow, token=lease_token, lease=lease)
            statement = self._sql.reserve_leased
        for _ in range(2):
            row = _cursor(conn).execute(statement, params).fetchone()
            assert row is not None  # the statement always answers one row
            fresh, taken, *columns = row
            if fresh:
                return Reservation(reserved=True)
            if columns[0] is None:  # no committed row for the key in this statement's snapshot
                if not taken:  # and another transaction holds the key: it is in flight
                    return Reservation(reserved=False)
                # The INSERT met a row committed after the snapshot was taken; a new statement sees it.
                row = _cursor(conn).execute(self._sql.lookup, params).fetchone()
                if row is None:
                    return Reservation(reserved=False)
                columns = list(row[2:])
            record = KeyRecord(*columns)
            if not record.expired:
                return Reservation(reserved=False, record=record)
            if not taken:  # another request is renewing the expired key right now
                return Reservation(reserved=False)
            _cursor(conn).execute(self._sql.delete_expired, params)
        return Reservation(reserved=False)

    def complete(
        self, conn: psycopg.Connection[TupleRow], *, org_id: int, key: uuid.UUID, response: dict[str, Any]
    ) -> None:
        """Store the response of a reserved key and mark it ``completed``, in the caller's transaction."""
        _cursor(conn).execute(self._sql.complete, {"org_id": org_id, "key": key, "response": Jsonb(response)})

    # -- multi-step mode: every write is guarded by the lease token -----------------------------------

    def take_over(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        token: uuid.UUID,
        lease: float,
    ) -> bool:
        """Take a processing request whose lease has expired; of concurrent callers one wins."""
        params = {"org_id": org_id, "key": key, "token": token, "lease": lease}
        return _cursor(conn).execute(self._sql.take_over, params).rowcount == 1

    def hold(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        token: uuid.UUID,
        lease: float,
    ) -> bool:
        """Renew our lease and lock the row for the caller's transaction; false if the lease is lost."""
        params = {"org_id": org_id, "key": key, "token": token, "lease": lease}
        return _cursor(conn).execute(self._sql.hold, params).rowcount == 1

    def record_step(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        token: uuid.UUID,
        step: str,
        result: Any,
        lease: float,
    ) -> bool:
        """Record that ``step`` finished with ``result`` and renew the lease; false if the lease is lost."""
        params = {
            "org_id": org_id,
            "key": key,
            "token": token,
            "lease": lease,
            "step": step,
            "result": Jsonb(result),
        }
        return _cursor(conn).execute(self._sql.record_step, params).rowcount == 1

    def finish(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        token: uuid.UUID,
        response: dict[str, Any],
        status: str = "completed",
        error: str | None = None,
    ) -> bool:
        """Store the final response and end the lease; false (and nothing written) if the lease is lost.

        ``status`` is ``"failed"`` when the recovery job gives up; such rows are flagged for a person.
        """
        params = {
            "org_id": org_id,
            "key": key,
            "token": token,
            "response": Jsonb(response),
            "status": status,
            "error": error,
        }
        return _cursor(conn).execute(self._sql.finish, params).rowcount == 1

    def release(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        org_id: int,
        key: uuid.UUID,
        token: uuid.UUID,
        error: str,
        retry_in: float,
    ) -> bool:
        """Give the lease up after a failure so that a retry may take over at once.

        The recovery job waits ``retry_in`` seconds before it tries the request itself.
        """
        params = {"org_id": org_id, "key": key, "token": token, "error": error, "retry_in": retry_in}
        return _cursor(conn).execute(self._sql.release, params).rowcount == 1

    def claim_stranded(
        self,
        conn: psycopg.Connection[TupleRow],
        *,
        token: uuid.UUID,
        lease: float,
        limit: int,
        deadline: float,
        flows: list[str],
    ) -> list[Stranded]:
        """Claim up to ``limit`` processing requests whose lease expired and whose next attempt is due.

        Rows locked by another claimer are skipped (``FOR UPDATE SKIP LOCKED``), and each claimed row
        gets the lease ``token``, so two recovery processes never work on one row under one lease.
        ``overdue`` tells whether the request is older than ``deadline`` seconds. Only requests of
        ``flows`` are claimed.
        """
        params = {"token": token, "lease": lease, "limit": limit, "deadline": deadline, "flows": flows}
        return [Stranded(*row) for row in _cursor(conn).execute(self._sql.claim, params).fetchall()]

    def stuck(self, *, older_than: float) -> list[StuckRow]:
        """Rows flagged for a person, and processing rows older than ``older_than`` seconds."""
        with self.connection() as conn:
            rows = _cursor(conn).execute(self._sql.stuck, {"older_than": older_than}).fetchall()
        return [StuckRow(*row) for row in rows]

    # -- retention -------------------------------------------------------------------------------------

    def purge(self, *, batch_size: int = 1000) -> int:
        """Delete expired finished rows in batches of ``batch_size``, each its own short transaction.

        ``processing`` rows and rows flagged for a person are never deleted, whatever their age.
        Returns how many rows were removed.
        """
        removed = 0
        while True:
            with self.connection() as conn, conn.transaction():
                count = _cursor(conn).execute(self._sql.purge, {"limit": batch_size}).rowcount
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
        fields = {
            "table": name,
            "expires_index": sql.Identifier(parts[-1] + "_expires_at_idx"),
            "lease_index": sql.Identifier(parts[-1] + "_lease_idx"),
        }

        # The columns a later request reads, and the guard of every write under a lease.
        record = sql.SQL(
            "k.request_sha, k.status, k.response,"
            " k.expires_at <= now() AND k.status <> 'processing' AND NOT k.needs_attention,"
            " coalesce(k.lease_expires_at > now(), false), k.flow, k.step, k.state"
        )
        mine = sql.SQL(
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
            " AND status = 'processing' AND lease_token = %(token)s"
        )

        def q(text: LiteralString, **more: sql.Composable) -> bytes:
            # Rendered once: executing a Composed would compose it again on every call.
            return sql.SQL(text).format(**fields, record=record, mine=mine, **more).as_bytes(None)

        ddl = files(__package__).joinpath("schema.sql").read_text("utf-8")
        self.schema = sql.SQL(ddl).format(**fields).as_bytes(None)

        # Always one row: whether this transaction inserted the row, whether it holds the key's lock,
        # and the committed row of the key, if its snapshot has one (it never sees its own insert).
        # Atomic requests have no flow and no lease; multi-step ones name both.
        reserve = (
            "WITH lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(%(lock)s) AS taken),"
            " reserved AS ("
            " INSERT INTO {table} (org_id, idem_key, request_sha, method, path, status, expires_at,"
            "                      flow, lease_token, lease_expires_at)"
            " SELECT %(org_id)s, %(key)s, %(sha)s, %(method)s, %(path)s, 'processing',"
            "        now() + make_interval(secs => %(ttl)s), {lease} FROM lock WHERE lock.taken"
            " ON CONFLICT (org_id, idem_key) DO NOTHING"
            " RETURNING 1"
            ")"
            " SELECT EXISTS (SELECT FROM reserved), lock.taken, {record}"
            " FROM lock LEFT JOIN {table} AS k ON k.org_id = %(org_id)s AND k.idem_key = %(key)s"
        )
        self.reserve = q(reserve, lease=sql.SQL("NULL, NULL, NULL"))
        self.reserve_leased = q(
            reserve, lease=sql.SQL("%(flow)s, %(token)s, now() + make_interval(secs => %(lease)s)")
        )
        self.lookup = q(
            "SELECT false, true, {record} FROM {table} AS k"
            " WHERE k.org_id = %(org_id)s AND k.idem_key = %(key)s"
        )
        self.delete_expired = q(
            "DELETE FROM {table}"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
            " AND expires_at <= now() AND status <> 'processing' AND NOT needs_attention"
        )
        self.complete = q(
            "UPDATE {table} SET status = 'completed', response = %(response)s"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
        )
        self.take_over = q(
            "UPDATE {table} SET lease_token = %(token)s,"
            " lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = attempts + 1"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
            " AND status = 'processing' AND lease_expires_at <= now()"
        )
        self.hold = q("UPDATE {table} SET lease_expires_at = now() + make_interval(secs => %(lease)s){mine}")
        self.record_step = q(
            "UPDATE {table} SET step = %(step)s,"
            " state = state || jsonb_build_object(%(step)s::text, %(result)s::jsonb),"
            " lease_expires_at = now() + make_interval(secs => %(lease)s){mine}"
        )
        self.finish = q(
            "UPDATE {table} SET status = %(status)s, response = %(response)s,"
            " lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,"
            " last_error = coalesce(%(error)s, last_error),"
            " needs_attention = (%(status)s = 'failed'){mine}"
        )
        self.release = q(
            "UPDATE {table} SET lease_expires_at = now(), last_error = %(error)s,"
            " next_attempt_at = now() + make_interval(secs => %(retry_in)s){mine}"
        )
        self.claim = q(
            "WITH due AS ("
            " SELECT org_id, idem_key FROM {table}"
            " WHERE status = 'processing' AND flow = ANY(%(flows)s) AND lease_expires_at <= now()"
            " AND (next_attempt_at IS NULL OR next_attempt_at <= now())"
            " ORDER BY lease_expires_at LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED"
            ")"
            " UPDATE {table} AS k SET lease_token = %(token)s,"
            " lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = k.attempts + 1"
            " FROM due WHERE k.org_id = due.org_id AND k.idem_key = due.idem_key"
            " RETURNING k.org_id, k.idem_key, k.flow, k.step, k.state, k.method, k.path, k.attempts,"
            " k.created_at <= now() - make_interval(secs => %(deadline)s)"
        )
        self.stuck = q(
            "SELECT org_id, idem_key, status, flow, step, attempts,"
            " extract(epoch FROM now() - created_at)::float8, needs_attention, last_error"
            " FROM {table}"
            " WHERE needs_attention"
            " OR (status = 'processing' AND created_at <= now() - make_interval(secs => %(older_than)s))"
            " ORDER BY created_at"
        )
        self.purge = q(
            "DELETE FROM {table} WHERE (org_id, idem_key) IN ("
            " SELECT org_id, idem_key FROM {table}"
            " WHERE expires_at <= now() AND status <> 'processing' AND NOT needs_attention"
            " ORDER BY expires_at LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED)"
        )
