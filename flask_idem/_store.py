"""The key table: every SQL statement of the extension. Nothing else talks to PostgreSQL about keys.

Races are decided by PostgreSQL, never by reading first and writing after. Every reservation first takes
a transaction-scoped advisory lock of its key with ``pg_try_advisory_xact_lock``, which never waits: the
request that holds the lock is the one in flight (409 at once), and whoever fails to take it knows so
immediately. Under the lock, a statement whose snapshot is taken once the lock is held looks for the key in
every partition of the key table and among its compact tombstones, and inserts the row only if there is
none (``INSERT ... ON CONFLICT DO NOTHING``): of any number of concurrent requests with one key exactly one
inserts it. The lock is released by the same COMMIT or ROLLBACK that ends the reservation, and it needs no
session state (so it works behind PgBouncer in transaction mode); the lock and the statement after it are
sent in one round trip.

The store *has* a :class:`~flask_idem._pool.ConnectionSource` (its pool, or a SQLAlchemy engine's) for the
statements it runs on its own (``stuck`` and the observing ones); the others run on the caller's connection,
inside the caller's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import DictRow, class_row, dict_row
from psycopg.types.json import Jsonb

from . import _wire
from ._connection import Batched
from ._pool import ConnectionSource, PooledConnection, batched
from ._records import (
    RECORD_FIELDS,
    KeyedRequest,
    KeyRecord,
    KeyRef,
    Lease,
    RangeRows,
    Reservation,
    Stranded,
    StuckRow,
    TableState,
    TableStats,
    lock_id,
)
from ._settings import table_parts
from ._sqlfile import SqlFile
from .errors import ConfigurationError
from .signals import timed

__all__ = ["Store"]


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[DictRow]:
    """The cursor (of dictionaries) the store's statements run on: the connection's own when it comes
    from a pool here."""
    if not isinstance(conn, PooledConnection):
        return conn.cursor(row_factory=dict_row)
    cursor = conn._idem_store_cursor
    if cursor is None or cursor.closed:
        cursor = conn._idem_store_cursor = conn.cursor(row_factory=dict_row)
    return cursor


_RESERVED = Reservation(reserved=True)
_IN_FLIGHT = Reservation(reserved=False)


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"org_id": lease.org_id, "key": lease.key, "token": lease.token, "lease": lease.seconds}


class Store:
    """The key table's statements, and the pool they run on when they need a connection of their own.

    :param source: where :meth:`stuck` and the observing methods borrow connections.
    :param table: the key table's name, optionally schema-qualified (``"idem.keys"``).
    :param tombstone_ttl: seconds a key is remembered, as a tombstone, after its stored response
        expired; 0 forgets it at once.
    :param distributed: the table is a Citus distributed table, and reservations go through its
        delegated function (:mod:`flask_idem.migrations`).
    """

    def __init__(
        self,
        source: ConnectionSource,
        *,
        table: str = "idempotency_keys",
        tombstone_ttl: float = 0.0,
        distributed: bool = False,
    ) -> None:
        self._sql = _Statements(table, distributed=distributed)
        self.table = table
        self.distributed = distributed
        self.source = source
        self.tombstone_ttl = tombstone_ttl
        #: Whether an atomic request in a batched transaction writes its row once, with COMMIT
        #: (:meth:`_reserve_once`); on Citus it reserves first, through the reserve function, and
        #: ``bench/breakdown.py`` turns it off to measure what it saves.
        self.write_once = not distributed

    # -- both modes ------------------------------------------------------------------------------------

    @timed("reserve")
    def reserve(
        self,
        conn: psycopg.Connection[Any],
        request: KeyedRequest,
        *,
        ttl: float,
        flow: str | None = None,
        lease: Lease | None = None,
    ) -> Reservation:
        """Reserve the key of ``request`` inside the transaction open on ``conn``, or report who has it.

        An expired finished row is deleted and the key reserved anew. The reservation lasts until the
        transaction ends; a multi-step request's ``flow`` name and ``lease`` outlive it.
        """
        params: dict[str, Any] = {
            "org_id": request.org_id,
            "key": request.key,
            "sha": request.request_sha,
            "method": request.method,
            "path": request.path,
            "ttl": ttl,
            "tomb": self.tombstone_ttl,
            "lock": lock_id(request.org_id, request.key),
            "task": request.task,
        }
        q = self._sql
        statement = q.reserve
        if flow is not None:
            if lease is None:
                raise TypeError("A multi-step reservation needs a lease.")
            params.update(flow=flow, token=lease.token, lease=lease.seconds)
            statement = q.reserve_leased
        cursor = _cursor(conn)
        opening = batched(conn)
        if flow is None and opening is not None and not opening.begun and self.write_once:
            return self._reserve_once(conn, opening, params, q)
        # On Citus, the key table's lock on the coordinator first (the guard statement, _store.sql).
        guard = [(q.batches[q.guard], params)] if q.distributed else []
        for _ in range(2):
            if not q.distributed:
                row: dict[str, Any] | None = self._lock_then(conn, opening, statement, params, q)
            elif opening is not None and not opening.begun:  # BEGIN goes with it, in one round trip
                row = opening.begin_all([*guard, (q.batches[statement], params)])[-1].rows[0]
            else:
                if guard:
                    cursor.execute(q.guard)
                row = cursor.execute(statement, params).fetchone()
            guard = []  # the table is locked here for the rest of the transaction
            assert row is not None  # the statement always answers one row
            if q.distributed:  # the reserve function
                _check_snapshots(row)
            if row["fresh"]:
                return _RESERVED
            if row["request_sha"] is None:  # no committed row for the key in this statement's snapshot
                if not row["taken"]:  # and another transaction holds the key: it is in flight
                    return _IN_FLIGHT
                # The INSERT met a row committed after the snapshot was taken; a new statement sees it.
                row = cursor.execute(q.lookup, params).fetchone()
                if row is None:
                    return _IN_FLIGHT
            record = KeyRecord(**{name: row[name] for name in RECORD_FIELDS})
            if not record.expired:
                return Reservation(reserved=False, record=record)
            if not row["taken"]:  # another request is renewing the expired key right now
                return _IN_FLIGHT
            cursor.execute(q.delete_expired, params)
        return _IN_FLIGHT

    def lost_race(self, error: psycopg.Error) -> bool:
        """Whether ``error``, raised by a transaction that reserved a key, is the key table's unique
        index refusing the key's row because another transaction committed the same key meanwhile (as
        an atomic row written once with ``COMMIT`` may meet under REPEATABLE READ): nothing of that
        transaction was kept, and the next attempt finds the other's row.

        The index that refuses the row is the table's or a partition's (``<table>_p<stamp>``).
        """
        if not isinstance(error, psycopg.errors.UniqueViolation):
            return False
        name = error.diag.table_name
        base = self.table.rpartition(".")[2]
        if name is None or not name.startswith(base):
            return False
        rest = name[len(base) :]
        return rest == "" or (rest.startswith("_p") and rest[2:].isdigit())

    def _lock_then(
        self,
        conn: psycopg.Connection[Any],
        opening: Batched | None,
        statement: bytes,
        params: dict[str, Any],
        q: _Statements,
    ) -> dict[str, Any] | None:
        """The key's lock in a statement of its own, then ``statement``, whose snapshot is taken once the
        lock is held (sent with BEGIN, in one round trip, when the transaction is not begun yet)."""
        if opening is not None and not opening.begun:
            batches = q.batches
            lock, found = opening.begin_all([(batches[q.lock], params), (batches[statement], params)])
            _check_snapshots(lock.rows[0])
            return found.rows[0]
        cursor = _cursor(conn)
        lock_row = cursor.execute(q.lock, params).fetchone()
        assert lock_row is not None
        _check_snapshots(lock_row)
        return cursor.execute(statement, params).fetchone()

    def _reserve_once(
        self, conn: psycopg.Connection[Any], opening: Batched, params: dict[str, Any], q: _Statements
    ) -> Reservation:
        """An atomic reservation in a batched transaction: the key's lock and its row, read with BEGIN.

        Nothing is written yet: the row is written once, completed, with ``COMMIT``
        (:meth:`complete`), while the lock keeps every other attempt out (409). It saves the row's
        second version (the completion's ``UPDATE``) that the reservation's ``INSERT`` otherwise needs.
        """
        batches = q.batches
        lock, found = opening.begin_all([(batches[q.lock], params), (batches[q.lookup], params)])
        taken = lock.rows[0]["taken"]
        _check_snapshots(lock.rows[0])
        if found.rows:
            row = found.rows[0]
            record = KeyRecord(**{name: row[name] for name in RECORD_FIELDS})
            if not record.expired:
                return Reservation(reserved=False, record=record)
            if not taken:  # another request is renewing the expired key right now
                return _IN_FLIGHT
            _cursor(conn).execute(q.delete_expired, params)
        elif not taken:
            return _IN_FLIGHT
        opening.pending = params
        return _RESERVED

    @timed("complete")
    def complete(
        self,
        conn: psycopg.Connection[Any],
        owner: KeyRef,
        response: dict[str, Any],
        *,
        failed: str | None = None,
    ) -> bool:
        """Store the final response of a key and mark it finished, in the caller's transaction.

        ``owner`` is the key itself for an atomic request, whose reservation is the caller's own
        uncommitted row. For a multi-step request it is the worker's :class:`Lease`: nothing is written
        (and the answer is false) when the lease was lost, and the lease ends. ``failed`` gives the
        reason when the recovery job gives up: the row is marked ``failed`` and flagged for a person.
        """
        if not isinstance(owner, Lease):
            if failed is not None:
                raise TypeError("Only a leased (multi-step) request can be marked failed.")
            closing = batched(conn)
            pending = None if closing is None else closing.pending
            if pending is not None and pending["key"] == owner.key and pending["org_id"] == owner.org_id:
                closing.pending = None  # type: ignore[union-attr]
                # Written once, completed, with COMMIT, in one round trip (see _reserve_once).
                q = self._sql
                statement = q.batches[q.insert_completed]
                closing.defer(statement, {**pending, "response": Jsonb(response)})  # type: ignore[union-attr]
                return True
            params = {"org_id": owner.org_id, "key": owner.key, "response": Jsonb(response)}
            if closing is not None and closing.begun:
                # Sent with COMMIT, in one round trip. It updates the transaction's own row, which
                # nothing else can see, let alone change: it always matches that one row.
                q = self._sql
                closing.defer(q.batches[q.complete], params)
                return True
            return _cursor(conn).execute(self._sql.complete, params).rowcount == 1
        params = {
            **_lease_params(owner),
            "response": Jsonb(response),
            "status": "completed" if failed is None else "failed",
            "error": failed,
        }
        return _cursor(conn).execute(self._sql.complete_leased, params).rowcount == 1

    # -- multi-step mode: every write is guarded by the lease token -----------------------------------

    @timed("take_over")
    def take_over(self, conn: psycopg.Connection[Any], lease: Lease) -> bool:
        """Take a processing request whose lease expired, under ``lease``; of concurrent callers one wins."""
        return _cursor(conn).execute(self._sql.take_over, _lease_params(lease)).rowcount == 1

    @timed("hold")
    def hold(self, conn: psycopg.Connection[Any], lease: Lease) -> bool:
        """Renew ``lease`` and lock the row for the caller's transaction; false if the lease is lost."""
        return _cursor(conn).execute(self._sql.hold, _lease_params(lease)).rowcount == 1

    @timed("record_step")
    def record_step(self, conn: psycopg.Connection[Any], lease: Lease, step: str, result: Any) -> bool:
        """Record that ``step`` finished with ``result`` and renew the lease; false if the lease is lost."""
        params = {**_lease_params(lease), "step": step, "result": Jsonb(result)}
        return _cursor(conn).execute(self._sql.record_step, params).rowcount == 1

    @timed("release")
    def release(self, conn: psycopg.Connection[Any], lease: Lease, *, error: str, retry_in: float) -> bool:
        """Give ``lease`` up after a failure so that a retry may take over at once.

        The recovery job waits ``retry_in`` seconds before it tries the request itself.
        """
        params = {**_lease_params(lease), "error": error, "retry_in": retry_in}
        return _cursor(conn).execute(self._sql.release, params).rowcount == 1

    @timed("claim_stranded")
    def claim_stranded(
        self,
        conn: psycopg.Connection[Any],
        *,
        token: uuid.UUID,
        lease: float,
        limit: int,
        deadline: float,
        flows: list[str],
    ) -> list[Stranded]:
        """Claim up to ``limit`` processing requests whose lease expired and whose next attempt is due.

        Rows locked by another claimer are skipped (``FOR UPDATE SKIP LOCKED``), and each claimed row
        gets the lease ``token`` for ``lease`` seconds, so two recovery processes never work on one row
        under one lease. ``overdue`` tells whether the request is older than ``deadline`` seconds. Only
        requests of ``flows`` are claimed.
        """
        params: dict[str, Any] = {
            "token": token,
            "lease": lease,
            "limit": limit,
            "deadline": deadline,
            "flows": flows,
        }
        if not self._sql.distributed:
            with conn.cursor(row_factory=class_row(Stranded)) as stranded:
                return stranded.execute(self._sql.claim, params).fetchall()
        # On Citus a LIMIT with FOR UPDATE cannot span shards: due rows are read without locks, then
        # claimed organisation by organisation (one shard each) by a statement that locks them with SKIP
        # LOCKED and checks again that each is due. Rows skipped or taken meanwhile are left out of the
        # next read.
        cursor = _cursor(conn)
        tried: list[DictRow] = []
        while True:
            candidates = cursor.execute(self._sql.claim_candidates, {**params, **_pairs(tried, "tried")})
            rows = candidates.fetchall()
            if not rows:
                return []
            overdue = {(row["org_id"], row["key"]): row["overdue"] for row in rows}
            claimed = [
                Stranded(**row, overdue=overdue[row["org_id"], row["key"]])
                for group in _by_org(rows)
                for row in cursor.execute(self._sql.claim, {**params, **_pairs(group)}).fetchall()
            ]
            if claimed:
                return claimed
            tried += rows

    def stuck(self, *, older_than: float) -> list[StuckRow]:
        """Rows flagged for a person, and processing rows older than ``older_than`` seconds."""
        with self.source.connection() as conn, conn.cursor(row_factory=class_row(StuckRow)) as cursor:
            return cursor.execute(self._sql.stuck, {"older_than": older_than}).fetchall()

    # -- observing -------------------------------------------------------------------------------------

    def state(self) -> TableState:
        """Processing, stranded and flagged rows and the oldest processing age: one cheap statement.

        It reads only the partial indexes of leased and flagged rows, so it stays cheap however many keys
        are kept.
        """
        with self.source.connection() as conn, conn.cursor(row_factory=class_row(TableState)) as cursor:
            found = cursor.execute(self._sql.state).fetchone()
        assert found is not None  # aggregates always answer one row
        return found

    def stats(
        self,
        *,
        key_bounds: Sequence[datetime] | None = None,
        tombstone_bounds: Sequence[datetime] | None = None,
    ) -> TableStats:
        """The key table at a glance, for ``flask idem stats``, from one snapshot of it.

        :param key_bounds: the upper bounds of the key table's partitions,
            oldest first: its rows are counted by partition too (:attr:`TableStats.keys_by_range`).
        :param tombstone_bounds: the same for the partitions of its compact tombstones.
        """
        with self.source.connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            by_status = [(r[0], r[1]) for r in conn.execute(self._sql.stats_by_status)]
            by_flow = [(r[0], r[1], r[2], r[3]) for r in conn.execute(self._sql.stats_by_flow)]
            with conn.cursor(row_factory=class_row(StuckRow)) as cursor:
                oldest = cursor.execute(self._sql.stats_oldest).fetchone()
            params = {"table": self._sql.qualified, "tomb": self.tombstone_ttl}
            with conn.cursor(row_factory=dict_row) as cursor:
                totals = cursor.execute(self._sql.stats_totals, params).fetchone()
                keys = _by_range(cursor, self._sql.stats_by_range, key_bounds)
                tombstones = _by_range(cursor, self._sql.stats_tombstones_by_range, tombstone_bounds)
        assert totals is not None
        return TableStats(
            by_status=by_status,
            by_flow=by_flow,
            oldest_processing=oldest,
            keys_by_range=keys,
            tombstones_by_range=tombstones,
            **totals,
        )


def _by_range(
    cursor: psycopg.Cursor[DictRow], statement: bytes, bounds: Sequence[datetime] | None
) -> list[RangeRows]:
    """Rows by range of ``expires_at``, one range per bound and one past them; none without bounds."""
    if bounds is None:
        return []
    found = {
        row.pop("range"): RangeRows(**row) for row in cursor.execute(statement, {"bounds": list(bounds)})
    }
    return [found.get(i, RangeRows(0)) for i in range(len(bounds) + 1)]


def _check_snapshots(lock: dict[str, Any]) -> None:
    """Refuse a reservation in a transaction that keeps one snapshot (REPEATABLE READ or SERIALIZABLE):
    its lookup, after the key's lock, must see every committed row in every partition."""
    if not lock["fresh_snapshots"]:
        raise ConfigurationError(
            "flask-idem reserves keys in READ COMMITTED transactions: on the partitioned key table the"
            " lookup after the key's lock needs a snapshot of its own. This transaction runs"
            " at a higher isolation level; run the idempotent route's transaction at READ COMMITTED."
        )


def _pairs(rows: list[DictRow], name: str = "") -> dict[str, Any]:
    """The keys of ``rows`` (of one organisation, unless named) as the statements on candidates take them."""
    return {f"{name}org": rows[0]["org_id"] if rows else None, f"{name}keys": [row["key"] for row in rows]}


def _by_org(rows: list[DictRow]) -> list[list[DictRow]]:
    """``rows`` grouped by organisation: on Citus, one shard per group."""
    groups: dict[int, list[DictRow]] = {}
    for row in rows:
        groups.setdefault(row["org_id"], []).append(row)
    return list(groups.values())


class _Statements:
    """Every statement of the store (``_store.sql``), composed once for one table name."""

    def __init__(self, table: str, *, distributed: bool = False) -> None:
        parts = table_parts(table)
        self.distributed = distributed
        name = sql.Identifier(*parts)
        #: The table's name as ``regclass`` input (quoted, schema-qualified if given).
        self.qualified = name.as_string(None)
        names: dict[str, sql.Composable] = {
            "table": name,
            "tombstones": sql.Identifier(*parts[:-1], parts[-1] + "_tombstones"),
            "reserve_function": sql.Identifier(*parts[:-1], parts[-1] + "_reserve"),
        }
        q = SqlFile("_store.sql", names, distributed=distributed)
        names = q.names

        self.reserve = q("reserve", lease=names["atomic"])
        self.reserve_leased = q("reserve", lease=names["leased"])
        #: The key's row in any partition, else its live compact tombstone (the reserve function of the
        #: layout's distributed_sql looks the same way; a test compares them).
        self.found = names["found"].as_bytes(None)
        self.lookup = q("lookup")
        self.lock = q("lock")
        self.insert_completed = q("insert_completed")
        self.delete_expired = q("delete_expired")
        self.complete = q("complete")
        # The statements a batched transaction sends with BEGIN or COMMIT (flask_idem._pool.Batched).
        batched = (self.reserve, self.reserve_leased, self.complete, self.lock, self.lookup)
        self.batches = {text: _wire.Statement.from_query(text) for text in (*batched, self.insert_completed)}
        self.take_over = q("take_over")
        self.hold = q("hold")
        self.record_step = q("record_step")
        self.complete_leased = q("complete_leased")
        self.release = q("release")
        self.claim = q("claim")
        self.stuck = q("stuck")
        self.state = q("state")
        self.stats_by_status = q("stats_by_status")
        self.stats_by_flow = q("stats_by_flow")
        self.stats_oldest = q("stats_oldest")
        self.stats_totals = q("stats_totals")
        self.stats_by_range = q("stats_by_range")
        self.stats_tombstones_by_range = q("stats_tombstones_by_range")
        self.claim_candidates = self.guard = b""
        if distributed:
            self.guard = q("guard")
            self.batches[self.guard] = _wire.Statement.from_query(self.guard)
            self.claim_candidates = q("claim_candidates")
