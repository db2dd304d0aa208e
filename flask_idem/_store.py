"""The key table: every SQL statement of the extension. Nothing else talks to PostgreSQL about keys.

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

The store *has* a :class:`~flask_idem._pool.ConnectionSource` (its pool, or a SQLAlchemy engine's) for the
statements it runs on its own (schema, ``stuck``, ``purge``); the others run on the caller's connection,
inside the caller's transaction.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, LiteralString

import psycopg
from psycopg import sql
from psycopg.rows import DictRow, class_row, dict_row
from psycopg.types.json import Jsonb

from . import _wire
from ._pool import ConnectionSource, PooledConnection, batched
from .signals import timed

__all__ = [
    "KeyRecord",
    "KeyRef",
    "KeyedRequest",
    "Lease",
    "Reservation",
    "Store",
    "Stranded",
    "StuckRow",
    "TableState",
    "TableStats",
    "lock_id",
]

#: Advisory locks share one namespace with the application's own. Mixing this constant into the lock id
#: keeps ours apart from ids an application derives from small integers.
_LOCK_SALT = b"flask-idem/v1"


@dataclass(frozen=True, slots=True)
class KeyRef:
    """One key of one organisation: the primary key of a row of the key table."""

    org_id: int
    key: uuid.UUID


@dataclass(frozen=True, slots=True)
class KeyedRequest(KeyRef):
    """A write request that carries a key: what a reservation records about it."""

    #: The request's fingerprint (:func:`flask_idem._fingerprint.fingerprint`).
    request_sha: bytes
    method: str
    path: str


@dataclass(frozen=True, slots=True)
class Lease(KeyRef):
    """A worker's hold on a multi-step request: every write it makes is guarded by ``token``."""

    token: uuid.UUID
    #: How long the lease lasts from each write that renews it.
    seconds: float


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A committed row of the key table, as a later request with the same key sees it."""

    request_sha: bytes
    status: str
    response: dict[str, Any] | None
    #: Past its retention period and its tombstone's, finished, and not flagged for a person: the key
    #: may be used anew.
    expired: bool
    #: Past its retention period but not its tombstone's: the stored response is gone (or about to be),
    #: and a retry is told where the result is, or that it expired.
    stale: bool
    #: Multi-step rows: whether a worker holds the request now, the flow, and what it recorded.
    lease_live: bool = False
    flow: str | None = None
    step: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


_RECORD_FIELDS = tuple(f.name for f in fields(KeyRecord))


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
    #: What the row is for: a request's method and path, or ``TASK`` and the task's path for a
    #: background job (:mod:`flask_idem.jobs`).
    method: str = ""
    path: str = ""


@dataclass(frozen=True, slots=True)
class TableState:
    """The key table's state at a glance, read with one query over small partial indexes (for metrics).

    Only committed rows count: an atomic request's row is never seen ``processing`` by others, so
    ``processing`` rows are multi-step requests.
    """

    #: Multi-step requests not finished yet.
    processing: int
    #: Of those, the ones whose lease has expired: stranded, waiting for a retry or the recovery job.
    stranded: int
    #: Rows flagged for a person (``flask idem stuck``).
    flagged: int
    #: Age in seconds of the oldest processing request; 0 when there is none.
    oldest_processing_seconds: float


@dataclass(frozen=True, slots=True)
class TableStats:
    """What ``flask idem stats`` prints. Reads the whole table: meant for a person, not for a scraper."""

    #: Rows by status, sorted by status.
    by_status: list[tuple[str, int]]
    #: Multi-step rows by flow, status and last finished step (``None`` before any step after the intent).
    by_flow: list[tuple[str, str, str | None, int]]
    flagged: int
    #: Rows kept as tombstones (:data:`IDEM_TOMBSTONE_TTL`): their stored response has expired.
    tombstones: int
    #: What ``flask idem purge`` would do now: rows it would turn into tombstones, and rows it would
    #: delete (tombstones past their own period, or expired rows when tombstones are off).
    to_tombstone: int
    to_delete: int
    #: The oldest processing request, or ``None``.
    oldest_processing: StuckRow | None
    #: ``pg_total_relation_size`` of the table (with its indexes and TOAST), and the indexes alone.
    total_bytes: int
    index_bytes: int


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


def _cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[DictRow]:
    """The cursor the store's statements run on: the connection's own when it comes from a pool here.

    Rows come back as dictionaries, so they are bound to the dataclasses above by column name.
    """
    if not isinstance(conn, PooledConnection):
        return conn.cursor(row_factory=dict_row)
    cursor = conn._idem_store_cursor
    if cursor is None or cursor.closed:
        cursor = conn._idem_store_cursor = conn.cursor(row_factory=dict_row)
    return cursor


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"org_id": lease.org_id, "key": lease.key, "token": lease.token, "lease": lease.seconds}


class Store:
    """The key table's statements, and the pool they run on when they need a connection of their own.

    :param source: where :meth:`stuck`, :meth:`purge` and the observing methods borrow connections.
    :param table: the key table's name, optionally schema-qualified (``"idem.keys"``).
    :param tombstone_ttl: seconds a key is remembered, as a tombstone, after its stored response
        expired; 0 forgets it at once.
    :param distributed: the table is a Citus distributed table (``flask idem migrate`` with
        ``IDEM_DISTRIBUTED``), and reservations go through its delegated function (layout 1's
        ``distributed_sql``, :mod:`flask_idem.migrations`).
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
        self.source = source
        self.tombstone_ttl = tombstone_ttl

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

        An expired finished row is deleted and the key reserved anew: past its retention period a key
        is treated as never seen. The caller must run this in a transaction; the reservation lasts until
        that transaction ends. A multi-step request passes its ``flow`` name and its ``lease``, which
        outlive the transaction.
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
        }
        statement = self._sql.reserve
        if flow is not None:
            if lease is None:
                raise TypeError("A multi-step reservation needs a lease.")
            params.update(flow=flow, token=lease.token, lease=lease.seconds)
            statement = self._sql.reserve_leased
        cursor = _cursor(conn)
        opening = batched(conn)
        for _ in range(2):
            if opening is not None and not opening.begun:  # BEGIN goes with it, in one round trip
                row: dict[str, Any] | None = opening.begin(self._sql.batches[statement], params).rows[0]
            else:
                row = cursor.execute(statement, params).fetchone()
            assert row is not None  # the statement always answers one row
            if row["fresh"]:
                return Reservation(reserved=True)
            if row["request_sha"] is None:  # no committed row for the key in this statement's snapshot
                if not row["taken"]:  # and another transaction holds the key: it is in flight
                    return Reservation(reserved=False)
                # The INSERT met a row committed after the snapshot was taken; a new statement sees it.
                row = cursor.execute(self._sql.lookup, params).fetchone()
                if row is None:
                    return Reservation(reserved=False)
            record = KeyRecord(**{name: row[name] for name in _RECORD_FIELDS})
            if not record.expired:
                return Reservation(reserved=False, record=record)
            if not row["taken"]:  # another request is renewing the expired key right now
                return Reservation(reserved=False)
            cursor.execute(self._sql.delete_expired, params)
        return Reservation(reserved=False)

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
            params = {"org_id": owner.org_id, "key": owner.key, "response": Jsonb(response)}
            closing = batched(conn)
            if closing is not None and closing.begun:
                # Sent with COMMIT, in one round trip. It updates the transaction's own row, which
                # nothing else can see, let alone change: it always matches that one row.
                closing.defer(self._sql.batches[self._sql.complete], params)
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

    # -- retention -------------------------------------------------------------------------------------

    def purge(self, *, batch_size: int = 1000) -> tuple[int, int]:
        """Turn finished rows past retention into tombstones, and delete rows past their tombstone's.

        Both steps work in batches of ``batch_size`` rows, each batch its own short transaction that
        skips rows another transaction has locked (``FOR UPDATE SKIP LOCKED``), so writers never wait.
        ``processing`` rows and rows flagged for a person are never touched, whatever their age. With a
        tombstone period of 0 no tombstone is kept: expired rows are deleted.

        :returns: how many rows were deleted and how many were turned into tombstones.
        """
        params = {"limit": batch_size, "tomb": self.tombstone_ttl}
        done = {"deleted": 0, "tombstoned": 0}
        steps = [("deleted", self._sql.purge_candidates, self._sql.purge)]
        if self.tombstone_ttl > 0:
            steps.append(("tombstoned", self._sql.tombstone_candidates, self._sql.tombstone))
        for name, candidates, statement in steps:
            while True:
                with self.source.connection() as conn, conn.transaction():
                    cursor = _cursor(conn)
                    if not self._sql.distributed:
                        seen = count = cursor.execute(statement, params).rowcount
                    else:  # on Citus: rows read without locks, then acted on one organisation at a time
                        rows = cursor.execute(candidates, params).fetchall()
                        seen, count = len(rows), 0
                        for group in _by_org(rows):
                            count += cursor.execute(statement, {**params, **_pairs(group)}).rowcount
                done[name] += count
                if seen < batch_size or count == 0:
                    break
        return done["deleted"], done["tombstoned"]

    # -- observing -------------------------------------------------------------------------------------

    def state(self) -> TableState:
        """Processing, stranded and flagged rows and the oldest processing age: one cheap statement.

        It reads only the partial indexes of leased and flagged rows (rows in flight or needing a
        person), never the table's finished rows, so it stays cheap however many keys are kept.
        """
        with self.source.connection() as conn, conn.cursor(row_factory=class_row(TableState)) as cursor:
            found = cursor.execute(self._sql.state).fetchone()
        assert found is not None  # aggregates always answer one row
        return found

    def stats(self) -> TableStats:
        """The key table at a glance, for ``flask idem stats``, from one snapshot of it."""
        with self.source.connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            by_status = [(r[0], r[1]) for r in conn.execute(self._sql.stats_by_status)]
            by_flow = [(r[0], r[1], r[2], r[3]) for r in conn.execute(self._sql.stats_by_flow)]
            with conn.cursor(row_factory=class_row(StuckRow)) as cursor:
                oldest = cursor.execute(self._sql.stats_oldest).fetchone()
            params = {"table": self._sql.qualified, "tomb": self.tombstone_ttl}
            with conn.cursor(row_factory=dict_row) as cursor:
                totals = cursor.execute(self._sql.stats_totals, params).fetchone()
        assert totals is not None
        return TableStats(by_status=by_status, by_flow=by_flow, oldest_processing=oldest, **totals)


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
    """Every statement of the store, composed once for one table name."""

    def __init__(self, table: str, *, distributed: bool = False) -> None:
        parts = table.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}")
        self.distributed = distributed
        name = sql.Identifier(*parts)
        names = {
            "table": name,
            "expires_index": sql.Identifier(parts[-1] + "_expires_at_idx"),
            "lease_index": sql.Identifier(parts[-1] + "_lease_idx"),
            "attention_index": sql.Identifier(parts[-1] + "_attention_idx"),
        }
        #: The table's name as ``regclass`` input (quoted, schema-qualified if given).
        self.qualified = name.as_string(None)

        # The columns a later request reads (named as KeyRecord's fields), and the guard of every write
        # under a lease.
        # A finished row is "stale" once its response passed retention, and "expired" (the key may be
        # used anew) once its tombstone's period passed too. A row the purge turned into a tombstone
        # has had its expires_at moved to the tombstone's end (see `tombstone` below).
        finished = sql.SQL("k.status <> 'processing' AND NOT k.needs_attention")
        # Written so that no STABLE function (timestamptz arithmetic) takes a column, and none sits in a
        # CASE: Citus refuses both in UPDATE and DELETE.
        gone = sql.SQL(
            "(k.response ? 'tombstone' IS TRUE AND k.expires_at <= now()"
            " OR k.response ? 'tombstone' IS NOT TRUE"
            "    AND k.expires_at <= now() - make_interval(secs => %(tomb)s))"
        )
        record = sql.SQL(
            "k.request_sha, k.status, k.response,"
            " {finished} AND {gone} AS expired,"
            " {finished} AND (k.response ? 'tombstone' OR k.expires_at <= now()) AS stale,"
            " coalesce(k.lease_expires_at > now(), false) AS lease_live, k.flow, k.step, k.state"
        ).format(finished=finished, gone=gone)
        mine = sql.SQL(
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
            " AND status = 'processing' AND lease_token = %(token)s"
        )

        def q(text: LiteralString, **more: sql.Composable) -> bytes:
            # Rendered once: executing a Composed would compose it again on every call.
            return (
                sql.SQL(text)
                .format(**names, record=record, mine=mine, finished=finished, gone=gone, **more)
                .as_bytes(None)
            )

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
            " SELECT EXISTS (SELECT FROM reserved) AS fresh, lock.taken, {record}"
            " FROM lock LEFT JOIN {table} AS k ON k.org_id = %(org_id)s AND k.idem_key = %(key)s"
        )
        self.reserve = q(reserve, lease=sql.SQL("NULL, NULL, NULL"))
        self.reserve_leased = q(
            reserve, lease=sql.SQL("%(flow)s, %(token)s, now() + make_interval(secs => %(lease)s)")
        )
        # On Citus: the same answer from the reserve function of layout 1 (distributed_sql), run on the
        # key's node.
        function = sql.Identifier(*parts[:-1], parts[-1] + "_reserve")
        call = (
            "SELECT * FROM {function}(%(org_id)s::bigint, %(key)s, %(sha)s, %(method)s, %(path)s,"
            " %(ttl)s, %(lock)s, {lease}, %(tomb)s)"
        )
        #: The columns of a key's row as a later request reads them; the reserve function of layout 1's
        #: distributed_sql answers the same (a test compares them).
        self.record = record.as_bytes(None)
        if distributed:
            self.reserve = q(call, function=function, lease=sql.SQL("NULL, NULL, NULL"))
            self.reserve_leased = q(call, function=function, lease=sql.SQL("%(flow)s, %(token)s, %(lease)s"))
        self.lookup = q(
            "SELECT false AS fresh, true AS taken, {record} FROM {table} AS k"
            " WHERE k.org_id = %(org_id)s AND k.idem_key = %(key)s"
        )
        self.delete_expired = q(
            "DELETE FROM {table} AS k"
            " WHERE k.org_id = %(org_id)s AND k.idem_key = %(key)s AND {finished} AND {gone}"
        )
        self.complete = q(
            "UPDATE {table} SET status = 'completed', response = %(response)s"
            " WHERE org_id = %(org_id)s AND idem_key = %(key)s"
        )
        # The statements a batched transaction sends with BEGIN or COMMIT (flask_idem._pool.Batched).
        self.batches = {
            text: _wire.Statement.from_query(text)
            for text in (self.reserve, self.reserve_leased, self.complete)
        }
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
        self.complete_leased = q(
            "UPDATE {table} SET status = %(status)s, response = %(response)s,"
            " lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,"
            " last_error = coalesce(%(error)s, last_error),"
            " needs_attention = (%(status)s = 'failed'){mine}"
        )
        self.release = q(
            "UPDATE {table} SET lease_expires_at = now(), last_error = %(error)s,"
            " next_attempt_at = now() + make_interval(secs => %(retry_in)s){mine}"
        )
        due = sql.SQL(
            "k.lease_expires_at IS NOT NULL AND greatest(k.lease_expires_at, k.next_attempt_at) <= now()"
        )
        # A stranded request is due once its lease has expired and its next attempt is due: at
        # greatest(lease_expires_at, next_attempt_at), which ignores a NULL next_attempt_at. Layout 2
        # indexes that moment (flask_idem.migrations.v2_due_index), so a claim reads due rows only, not
        # every row still backing off; on layout 1 the same statement reads them all, as before.
        self.claim = q(
            "WITH due AS ("
            " SELECT org_id, idem_key FROM {table} AS k"
            " WHERE {due} AND k.status = 'processing' AND k.flow = ANY(%(flows)s)"
            " ORDER BY greatest(k.lease_expires_at, k.next_attempt_at) LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED"
            ")"
            " UPDATE {table} AS k SET lease_token = %(token)s,"
            " lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = k.attempts + 1"
            " FROM due WHERE k.org_id = due.org_id AND k.idem_key = due.idem_key"
            " RETURNING k.org_id, k.idem_key AS key, k.flow, k.step, k.state, k.method, k.path, k.attempts,"
            " k.created_at <= now() - make_interval(secs => %(deadline)s) AS overdue",
            due=due,
        )
        self.stuck = q(
            "SELECT org_id, idem_key AS key, status, flow, step, attempts,"
            " extract(epoch FROM now() - created_at)::float8 AS age_seconds, needs_attention, last_error,"
            " method, path"
            " FROM {table}"
            " WHERE needs_attention"
            " OR (status = 'processing' AND created_at <= now() - make_interval(secs => %(older_than)s))"
            " ORDER BY created_at"
        )
        self.purge = q(
            "DELETE FROM {table} WHERE (org_id, idem_key) IN ("
            " SELECT org_id, idem_key FROM {table} AS k"
            " WHERE k.expires_at <= now() AND {finished} AND {gone}"
            " ORDER BY k.expires_at LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED)"
        )
        # What a tombstone keeps of the response: its status and Location, no body and no other header
        # (they may carry personal data). Its expires_at moves to the end of the tombstone's period, out
        # of the range the next purge walks.
        self.tombstone = q(
            "UPDATE {table} AS k SET expires_at = k.expires_at + make_interval(secs => %(tomb)s),"
            " response = jsonb_build_object("
            "  'tombstone', true, 'status', k.response->'status',"
            "  'headers', coalesce((SELECT jsonb_agg(h) FROM jsonb_array_elements(k.response->'headers') AS h"
            "                       WHERE lower(h->>0) = 'location'), '[]'::jsonb))"
            " FROM (SELECT org_id, idem_key FROM {table} AS k"
            "       WHERE k.expires_at <= now() AND {finished} AND NOT k.response ? 'tombstone'"
            "       ORDER BY k.expires_at LIMIT %(limit)s"
            "       FOR UPDATE SKIP LOCKED) AS due"
            " WHERE k.org_id = due.org_id AND k.idem_key = due.idem_key"
        )

        # Observing. Committed processing rows always have a lease (atomic rows are never committed
        # processing), so `lease_expires_at IS NOT NULL` lets the planner use the lease index.
        processing = sql.SQL(
            " FROM {table} WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
        ).format(**names)
        self.state = q(
            "SELECT p.processing, p.stranded,"
            " (SELECT count(*) FROM {table} WHERE needs_attention) AS flagged,"
            " p.oldest_processing_seconds"
            " FROM (SELECT count(*) AS processing,"
            " count(*) FILTER (WHERE lease_expires_at <= now()) AS stranded,"
            " coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_processing_seconds"
            " {processing}) AS p",
            processing=processing,
        )
        self.stats_by_status = q("SELECT status, count(*) FROM {table} GROUP BY status ORDER BY status")
        self.stats_by_flow = q(
            "SELECT flow, status, step, count(*) FROM {table} WHERE flow IS NOT NULL"
            " GROUP BY flow, status, step ORDER BY flow, status, step NULLS FIRST"
        )
        self.stats_oldest = q(
            "SELECT org_id, idem_key AS key, status, flow, step, attempts,"
            " extract(epoch FROM now() - created_at)::float8 AS age_seconds, needs_attention, last_error"
            " {processing} ORDER BY created_at LIMIT 1",
            processing=processing,
        )
        # What the next purge would do: delete rows past their tombstone's period (or past retention,
        # without tombstones), and turn the other rows past retention into tombstones.
        self.stats_totals = q(
            "SELECT count(*) FILTER (WHERE k.needs_attention) AS flagged,"
            " count(*) FILTER (WHERE k.response ? 'tombstone') AS tombstones,"
            " count(*) FILTER (WHERE k.expires_at <= now() AND {finished} AND {gone}) AS to_delete,"
            " count(*) FILTER (WHERE k.expires_at <= now() AND {finished} AND NOT k.response ? 'tombstone'"
            "  AND NOT ({gone})) AS to_tombstone,"
            " pg_total_relation_size(%(table)s::regclass) AS total_bytes,"
            " pg_indexes_size(%(table)s::regclass) AS index_bytes"
            " FROM {table} AS k"
        )

        # On Citus (the rest of this method): FOR UPDATE cannot span shards, nor can a LIMIT under it. Rows
        # are read without locks across shards (*_candidates), then acted on one organisation at a time
        # (one shard, a router query) by a statement that locks them with SKIP LOCKED and checks again.
        # Only IMMUTABLE functions may take a column in its UPDATE and DELETE, and no STABLE one may sit
        # in a CASE or COALESCE, so expires_at + tomb is computed in epoch seconds and the tombstone is
        # built with jsonb_set (jsonb_build_object is STABLE).
        self.claim_candidates = self.purge_candidates = self.tombstone_candidates = b""
        if not distributed:
            return
        claimable = sql.SQL("{due} AND k.status = 'processing' AND k.flow = ANY(%(flows)s)").format(due=due)
        one_org = sql.SQL("k.org_id = %(org)s AND k.idem_key = ANY(%(keys)s::uuid[])")
        self.claim_candidates = q(
            "SELECT org_id, idem_key AS key,"
            " created_at <= now() - make_interval(secs => %(deadline)s) AS overdue"
            " FROM {table} AS k WHERE {due} AND NOT k.idem_key = ANY(%(triedkeys)s::uuid[])"
            " ORDER BY greatest(k.lease_expires_at, k.next_attempt_at) LIMIT %(limit)s",
            due=claimable,
        )
        self.claim = q(
            "UPDATE {table} AS t SET lease_token = %(token)s,"
            " lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = t.attempts + 1"
            " FROM (SELECT org_id, idem_key FROM {table} AS k WHERE {one_org} AND {due}"
            "       FOR UPDATE SKIP LOCKED) AS due"
            " WHERE t.org_id = %(org)s AND t.org_id = due.org_id AND t.idem_key = due.idem_key"
            " RETURNING t.org_id, t.idem_key AS key, t.flow, t.step, t.state, t.method, t.path, t.attempts",
            due=claimable,
            one_org=one_org,
        )
        self.purge_candidates = q(
            "SELECT org_id, idem_key AS key FROM {table} AS k"
            " WHERE k.expires_at <= now() AND {finished} AND {gone}"
            " ORDER BY k.expires_at LIMIT %(limit)s"
        )
        self.purge = q(
            "DELETE FROM {table} AS t WHERE t.org_id = %(org)s AND (t.org_id, t.idem_key) IN ("
            " SELECT org_id, idem_key FROM {table} AS k"
            " WHERE {one_org} AND k.expires_at <= now() AND {finished} AND {gone}"
            " FOR UPDATE SKIP LOCKED)",
            one_org=one_org,
        )
        tombstoning = sql.SQL("k.expires_at <= now() AND {finished} AND NOT k.response ? 'tombstone'").format(
            finished=finished
        )
        self.tombstone_candidates = q(
            "SELECT org_id, idem_key AS key FROM {table} AS k"
            " WHERE {tombstoning} ORDER BY k.expires_at LIMIT %(limit)s",
            tombstoning=tombstoning,
        )
        self.tombstone = q(
            "UPDATE {table} AS t"
            " SET expires_at = to_timestamp(extract(epoch FROM t.expires_at - 'epoch'::timestamptz)"
            "                               + %(tomb)s),"
            " response = jsonb_set(jsonb_set('{{\"tombstone\": true}}'::jsonb,"
            "  '{{status}}', coalesce(t.response->'status', 'null'::jsonb)),"
            "  '{{headers}}', coalesce((SELECT jsonb_agg(h)"
            "                          FROM jsonb_array_elements(t.response->'headers') AS h"
            "                          WHERE lower(h->>0) = 'location'), '[]'::jsonb))"
            " FROM (SELECT org_id, idem_key FROM {table} AS k WHERE {one_org} AND {tombstoning}"
            "       FOR UPDATE SKIP LOCKED) AS due"
            " WHERE t.org_id = %(org)s AND t.org_id = due.org_id AND t.idem_key = due.idem_key",
            one_org=one_org,
            tombstoning=tombstoning,
        )
