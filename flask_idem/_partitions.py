"""Retention on the partitioned key table of layout 4: partitions made ahead, and dropped whole.

The key table and its compact tombstones (``<table>_tombstones``) are partitioned by range of
``expires_at`` (:mod:`flask_idem.migrations.v4_partitions`). A partition whose range has passed holds
only keys past their retention, and :func:`maintain` (``flask idem purge``) retires it:

1. a moment's transaction locks it in ``SHARE`` mode, which waits for every transaction still writing
   to it, and lets go at once (an ``UPDATE`` of the key table locks every partition: holding the lock
   longer would hold up every multi-step request). A partition that holds a multi-step request still
   in progress is kept, untouched, and retired by a later run once they finish (a worker holding a
   lease keeps writing its row where it is). Otherwise no row can enter it any more, nor start
   processing there, and a second transaction, which blocks no one:

   - writes the compact tombstone of each finished key (its fingerprint, final status and
     ``Location``, until the end of ``IDEM_TOMBSTONE_TTL``) into the tombstones' table, and marks the
     partition done, so that a run stopped before the drop writes none twice;
   - moves rows flagged for a person into a live partition (deleted here and inserted there in the
     same transaction, so that no statement sees the key missing);

2. ``ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY``, which waits for the transactions that may still
   read it, without blocking anyone (a plain ``DETACH`` or ``DROP`` would wait on every open
   transaction on the key table, and hold up every request behind it);
3. ``DROP TABLE``: the partition's files are unlinked; no row is deleted, no WAL is written per row.

Tombstone partitions whose range has passed are detached and dropped the same way. Partitions are made
ahead (``CREATE TABLE`` and ``ATTACH PARTITION``, which takes no lock writers wait on) to cover the
application's longest retention and ``IDEM_PARTITION_AHEAD``; a key whose expiry has no partition
cannot be written, so ``flask idem stats``, the metrics and the health check warn long before.

Nothing is written into a partition once its range has passed: rows expire from the moment their
statement runs (``statement_timestamp()``), and every retention is positive. Retiring waits one more
``grace`` (the partition interval, at most a minute) after the range passed, for statements that began
before.

Every step runs as the owner of the tables (the role of ``flask idem migrate``), under the migration's
advisory lock, so that two runs, or a run and a migration, never work at once; all but the concurrent
detach, which cannot run in a transaction. Two runs at once both succeed: a partition is made after
the last one found under the lock, and a partition another run is retiring is left to it (a detach it
left pending, as when it was interrupted, is finished by the next run with ``DETACH ... FINALIZE``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from . import _layout, _migrate

__all__ = ["Overview", "Partition", "RetentionReport", "duration", "maintain", "overview", "partitions"]

logger = logging.getLogger("flask_idem")

#: The longest wait after a partition's range passed before it is retired.
MAX_GRACE = 60.0

#: How often ``flask idem purge`` is expected to run at least (the docs say daily).
_DAY = 86_400.0

#: A partition: its name, its range (``None``: unbounded), and whether a detach was begun and not
#: finished (an interrupted ``DETACH ... CONCURRENTLY``).
_LIST = """
SELECT c.relname::text AS name, b.lower, b.upper, i.inhdetachpending AS detaching,
       coalesce(c.reltuples, 0)::bigint AS rows, pg_total_relation_size(c.oid) AS bytes
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid,
LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) AS e,
LATERAL (SELECT (regexp_match(e.bound, 'FROM \\(''([^'']+)''\\)'))[1]::timestamptz AS lower,
                (regexp_match(e.bound, 'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS upper) AS b
WHERE i.inhparent = to_regclass(%s)
ORDER BY b.upper NULLS LAST
"""


#: Whether Citus is installed in the database (then :meth:`_migrate._Runner.is_distributed` may ask).
_CITUS = "SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the key table or of its tombstones."""

    name: str
    #: Its range of ``expires_at``: ``[lower, upper)``; ``lower`` is ``None`` for the first partition
    #: of an upgraded table (``MINVALUE``).
    lower: datetime | None
    upper: datetime | None
    #: Whether a ``DETACH ... CONCURRENTLY`` of it was interrupted (it is finished by the next run).
    detaching: bool
    #: Rows as the statistics estimate them, and bytes on disk with indexes and TOAST.
    rows: int
    bytes: int


@dataclass
class RetentionReport:
    """What :func:`maintain` did."""

    #: Partitions dropped, of the key table and of the tombstones.
    dropped: list[str] = field(default_factory=list)
    #: Partitions made ahead.
    created: list[str] = field(default_factory=list)
    #: Partitions past their range kept, with why.
    kept: list[tuple[str, str]] = field(default_factory=list)
    #: Compact tombstones written, and rows flagged for a person moved to a live partition.
    tombstoned: int = 0
    moved: int = 0


def partitions(conn: psycopg.Connection[Any], parent: str) -> list[Partition]:
    """The partitions of ``parent`` (a name as ``to_regclass`` reads it), oldest range first."""
    with conn.cursor() as cursor:
        return [Partition(*row) for row in cursor.execute(_LIST, (parent,))]


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y%m%d%H%M%S")


def _aligned_after(moment: datetime, interval: float) -> datetime:
    """The first multiple of ``interval`` seconds since the epoch after ``moment``."""
    seconds = moment.timestamp()
    return datetime.fromtimestamp((math.floor(seconds / interval) + 1) * interval, UTC)


def _aligned_at(moment: datetime, interval: float) -> datetime:
    """The last multiple of ``interval`` seconds since the epoch at or before ``moment``."""
    return datetime.fromtimestamp(math.floor(moment.timestamp() / interval) * interval, UTC)


class _Tables:
    """The names of one key table's partitioned tables and the statements on their partitions."""

    def __init__(self, table: str) -> None:
        self.names = _layout.names(table)
        parts = table.split(".")
        self.schema, self.base = parts[:-1], parts[-1]
        self.keys = self.names["table"].as_string(None)
        self.tombstones = self.names["tombstones_qualified"].as_string(None)

    def partition(self, prefix: str, lower: datetime) -> sql.Identifier:
        return sql.Identifier(*self.schema, f"{self.base}{prefix}{_stamp(lower)}")

    def qualified(self, name: str) -> sql.Identifier:
        return sql.Identifier(*self.schema, name)


def maintain(
    url: str,
    *,
    table: str,
    interval: float,
    horizon: float,
    tombstone_ttl: float,
    ahead: float = 0.0,
    lock_timeout: float = 2.0,
    connect_options: Any = None,
    now: Callable[[], datetime] | None = None,
    echo: Callable[[str], None] = logger.info,
) -> RetentionReport:
    """Retire the partitions whose range has passed and make partitions ahead, on a connection of its own
    to ``url`` (a role that owns the tables).

    :param interval: seconds of ``expires_at`` one new partition of the key table covers
        (``IDEM_PARTITION_INTERVAL``); tombstones' partitions cover more, a quarter of ``tombstone_ttl``
        when that is longer, so that few are live at once.
    :param horizon: seconds from now that partitions are made ahead of: the application's longest
        retention and ``IDEM_PARTITION_AHEAD``.
    :param tombstone_ttl: seconds a key is remembered after its response expired (``IDEM_TOMBSTONE_TTL``);
        0 keeps no tombstone.
    :param ahead: of ``horizon``, the seconds made ahead only in case runs stop (``IDEM_PARTITION_AHEAD``):
        partitions of ``interval`` are made until a day (or an interval, when longer) past the longest
        retention, and one spare partition covers the rest, until it is needed (it is replaced while
        empty, and kept as it is once a row is in it). Every lookup of a key reads every partition: a
        spare instead of a week of empty ones keeps that cost down. 0 makes partitions of ``interval``
        all the way.
    :param now: the clock, the database's ``now()`` by default. Every comparison with the present is
        with its reading, the statements' included (they take it as a parameter), so that a fake clock
        ahead of the database's (a test's) retires partitions consistently.
    """
    tables = _Tables(table)
    report = RetentionReport()
    with _migrate.connect(url, connect_options) as conn:
        runner = _migrate._Runner(conn, table, tables.names, lock_timeout, echo)
        runner.distributed = conn.execute(_CITUS).fetchone() == (True,) and runner.is_distributed()
        clock = now or (lambda: conn.execute("SELECT now()").fetchone()[0])  # type: ignore[index]
        grace = timedelta(seconds=min(interval, MAX_GRACE))
        tomb_interval = max(interval, tombstone_ttl / 4)
        moment = clock()
        # Until the next run (daily, or at half of ahead when that is sooner): keys written meanwhile
        # expire up to the longest retention after.
        before_next = timedelta(seconds=max(interval, min(ahead / 2, _DAY)))
        start = _aligned_at(moment, interval)
        until = moment + timedelta(seconds=horizon)
        near = moment + timedelta(seconds=horizon - ahead) + before_next if ahead > 0 else until
        reach = timedelta(seconds=horizon - ahead)  # a key written now expires within the retention
        ranges = _Ranges(start=start, near=near, until=until, reach=reach)
        _ahead(runner, tables, tables.keys, interval, ranges, report, clock)
        if tombstone_ttl > 0:
            # Tombstones of every partition retired now, and of the keys written until the horizon
            # (those retired by the runs until the next one end before near); one written now (of a
            # partition retired now) ends within the tombstones' period.
            until = moment + timedelta(seconds=horizon + tombstone_ttl)
            near = moment + timedelta(seconds=tombstone_ttl) + before_next if ahead > 0 else until
            start = _aligned_at(moment, tomb_interval)
            ranges = _Ranges(start=start, near=near, until=until, reach=timedelta(seconds=tombstone_ttl))
            _ahead(runner, tables, tables.tombstones, tomb_interval, ranges, report, clock)
        for part in partitions(conn, tables.keys):
            at = clock()
            if part.upper is None or part.upper > at - grace:
                continue
            try:
                if part.detaching or _retire(runner, tables, part, tombstone_ttl, interval, at, report):
                    _drop(runner, tables, tables.keys, part, report)
            except psycopg.errors.UndefinedTable:  # another run retired it meanwhile
                continue
        for part in partitions(conn, tables.tombstones):
            if part.upper is not None and part.upper <= clock():
                try:
                    _drop(runner, tables, tables.tombstones, part, report)
                except psycopg.errors.UndefinedTable:
                    continue
    return report


@dataclass(frozen=True, slots=True)
class _Ranges:
    """Where :func:`_ahead` makes partitions of a table: from ``start`` (or the end of the last one)
    until ``until``, of the interval until ``near`` and one spare after it; ``reach`` is how far past
    the present a row written now may expire at most (the longest retention)."""

    start: datetime
    near: datetime
    until: datetime
    reach: timedelta


def _ahead(
    runner: _migrate._Runner,
    tables: _Tables,
    parent: str,
    interval: float,
    ranges: _Ranges,
    report: RetentionReport,
    clock: Callable[[], datetime],
) -> None:
    """Make partitions of ``parent`` until ``ranges.until``, after the last one, or from
    ``ranges.start`` (the interval that holds now) when there is none or the last one ended before it:
    no row can expire in the past, and a run after a long pause makes no partition only to drop it.

    Partitions of ``interval`` are made until ``ranges.near``, and one spare partition from there to
    ``ranges.until`` (none when ``near`` is ``until``). A spare that ``near`` has reached since, or that
    ends before ``until`` (a partition after it would leave it wide, in the middle), is replaced while
    it is empty (detached without blocking anyone, found empty, and dropped; attached again if a row
    came in meanwhile), but only while no row can be written into it before its detach is through: it
    begins more than ``ranges.reach``, and the detach's two waits (each under the lock timeout), after
    the present. A row written into it as the detach begins would be missed, until it
    is attached again, by every statement after (the same transaction's as well). One that holds a row,
    or that the present has come too near (runs came late), stays as it is: a wider partition, retired
    once its range has passed. A replacement's detach left pending (interrupted, or past its lock
    timeout) is finished by the next run, and the range it leaves is filled.

    Each is created on its own and then attached: ``ATTACH PARTITION`` takes a lock on the parent that
    writers do not wait on (``CREATE TABLE ... PARTITION OF`` would take one they do), and finds the new
    table empty at once. The partitions are read in the same transaction, under the migration's lock,
    so that two runs at once make each partition once.
    """
    prefix = "_p" if parent == tables.keys else "_t"
    # Seconds a detach may take: its two waits, each under the lock timeout, and one more.
    detach = timedelta(seconds=2 * runner.lock_timeout_ms / 1000 + 1)

    def spare(conn: psycopg.Connection[Any]) -> Partition | None:
        found = partitions(conn, parent)
        now = clock()
        for part in found:  # a replacement left pending: finished, and dropped or attached again
            if part.detaching and part.lower is not None and part.upper is not None and part.upper > now:
                return part
        last = found[-1] if found else None
        if last is None or last.lower is None or last.upper is None or last.detaching:
            return None
        if last.upper - last.lower <= timedelta(seconds=interval):
            return None
        if last.lower >= ranges.near and last.upper >= ranges.until:  # as this run would make it
            return None
        if last.lower <= now + ranges.reach + detach:
            return None
        return None if _holds_rows(conn, tables.qualified(last.name)) else last

    def create(conn: psycopg.Connection[Any]) -> sql.Identifier | None:
        lower, before = ranges.start, None
        for part in partitions(conn, parent):  # after the last one, or in a range a replacement left
            if part.upper is None:  # an unbounded last partition: nothing to add after it
                return None
            if part.lower is not None and part.lower > lower and lower < ranges.until:
                before = part.lower
                break
            lower = max(lower, part.upper)
        if lower >= ranges.until:
            return None
        upper = _aligned_after(lower if lower < ranges.near else ranges.until, interval)
        if before is not None:
            upper = min(upper, before)
        name = tables.partition(prefix, lower)
        if runner.distributed:
            # On Citus the attach distributes the new table: its shards are made, and attached to the
            # key table's, over one connection per node, or the transaction's own connections may wait
            # on one another (Citus then cancels it as a distributed deadlock).
            conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        _make(conn, parent, name, lower, upper, fillfactor=80 if parent == tables.keys else 100)
        return name

    if (empty := runner.transaction(spare)) is not None:
        _replace(runner, tables, parent, empty, report)
    while (made := runner.transaction(create)) is not None:
        report.created.append(made.as_string(None))


def _holds_rows(conn: psycopg.Connection[Any], name: sql.Identifier) -> bool:
    # Not EXISTS (SELECT FROM ...): Citus plans a distributed table's empty target list as a function.
    return conn.execute(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(name)).fetchone() is not None


def _make(
    conn: psycopg.Connection[Any],
    parent: str,
    name: sql.Identifier,
    lower: datetime,
    upper: datetime,
    *,
    fillfactor: int,
) -> None:
    """Create partition ``name`` of ``parent`` as a table of its own, then attach it for ``[lower,
    upper)`` (see :func:`_ahead`)."""
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
            " WITH (fillfactor = {})"
        ).format(name, sql.SQL(parent), sql.Literal(fillfactor))
    )
    _attach(conn, parent, name, lower, upper)


def _attach(
    conn: psycopg.Connection[Any], parent: str, name: sql.Identifier, lower: datetime, upper: datetime
) -> None:
    conn.execute(
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
            sql.SQL(parent), name, sql.Literal(lower), sql.Literal(upper)
        )
    )


def _replace(
    runner: _migrate._Runner, tables: _Tables, parent: str, part: Partition, report: RetentionReport
) -> None:
    """Detach the spare partition ``part``, found empty, without blocking anyone; drop it if it is still
    empty, or attach it again as it was. Meanwhile a row whose expiry falls in its range cannot be
    written (the request is answered 503, to be retried): only a key kept longer than the longest
    retention the application had when the last run made partitions.

    The detach waits for older transactions under the lock timeout (not for as long as they last, as a
    retired partition's does): one left pending is finished by the next run, and must be before the
    present reaches its range, where no row can be written until then.

    On Citus the detach is a plain one (see :func:`_drop`), and a plain detach is transactional: the
    detach, the check and the drop are one transaction, so a spare found holding a row was never
    detached for any statement to miss, however long the detach's tries took."""
    name = tables.qualified(part.name)
    assert part.lower is not None and part.upper is not None
    lower, upper = part.lower, part.upper
    runner.echo(f"Replacing the spare partition {part.name} (empty) by partitions of the interval.")
    if runner.distributed:
        _replace_in_one(runner, parent, name, part, report)
        return
    try:
        _detach(runner, parent, name, part, bounded=True)
    except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.UndefinedTable):  # another run's
        return
    except psycopg.errors.LockNotAvailable:
        runner.echo(f"The detach of {part.name} waits for older transactions: the next run finishes it.")
        return

    def drop_if_empty(conn: psycopg.Connection[Any]) -> bool:
        if _holds_rows(conn, name):
            _attach(conn, parent, name, lower, upper)
            return False
        conn.execute(sql.SQL("DROP TABLE {}").format(name))
        return True

    try:
        if runner.transaction(drop_if_empty):
            report.dropped.append(part.name)
        else:
            runner.echo(f"A row came into {part.name} meanwhile: attached again, and kept.")
    except psycopg.errors.UndefinedTable:  # dropped by another run
        return


class _Kept(Exception):
    """A spare partition found holding a row in the transaction that detached it: rolled back."""


def _replace_in_one(
    runner: _migrate._Runner, parent: str, name: sql.Identifier, part: Partition, report: RetentionReport
) -> None:
    """On Citus: detach the spare ``part``, check that it is empty and drop it, in one transaction (under
    the lock timeout, tried again), rolled back when a row is found in it."""
    runner.echo(f"Detaching {part.name} (Citus: a moment's lock on the key table, under the lock timeout).")

    def replace(conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(sql.SQL(parent), name))
        if _holds_rows(conn, name):
            raise _Kept
        conn.execute(sql.SQL("DROP TABLE {}").format(name))

    try:
        runner.transaction(replace)
    except _Kept:
        runner.echo(f"A row came into {part.name}: left attached, and kept.")
        return
    except psycopg.errors.UndefinedTable:  # detached or dropped by another run
        return
    report.dropped.append(part.name)


#: The compact tombstones of a retired partition's finished keys. A row without a stored status is a
#: task's of layout 4 (``{"result": ...}``, or ``{"error": ...}`` given up): 200, or 500 for a failed
#: one, as a task's row of layout 3 stores them. Neither form of a task's row has a ``Location``. A
#: failed operation's status is kept negative (no column of its own: a tombstone is kept narrow).
#: The end of each tombstone is computed in a subquery over the partition, not in a LATERAL one without
#: FROM: Citus pushes the INSERT ... SELECT down to the shards only so.
_TOMBSTONES = """
INSERT INTO {tombstones} (expires_at, org_id, idem_key, status, request_sha, location)
SELECT k.until, k.org_id, k.idem_key,
       (CASE WHEN k.status = 'failed' THEN -1 ELSE 1 END)
       * coalesce((k.response->>'status')::smallint,
                  CASE WHEN k.status = 'failed' THEN 500 ELSE 200 END::smallint),
       k.request_sha,
       (SELECT h->>1 FROM jsonb_array_elements(
            CASE WHEN jsonb_typeof(k.response->'headers') = 'array' THEN k.response->'headers'
                 ELSE '[]'::jsonb END) AS h
        WHERE lower(h->>0) = 'location' LIMIT 1)
FROM (SELECT p.*, CASE WHEN p.response ? 'tombstone' THEN p.expires_at
                       ELSE p.expires_at + make_interval(secs => %(tomb)s) END AS until
      FROM {partition} AS p) AS k
WHERE k.status <> 'processing' AND NOT k.needs_attention AND k.until > %(now)s
"""

#: What marks a partition whose tombstones are written (a run that stopped before dropping it leaves it
#: so, and the next run writes none twice).
_RETIRED = "flask-idem: tombstones written"

_MOVE = """
WITH moved AS (DELETE FROM {partition} WHERE needs_attention RETURNING *)
INSERT INTO {table} (org_id, idem_key, request_sha, method, path, task, status, response, created_at,
                     expires_at, flow, step, state, lease_token, lease_expires_at, attempts,
                     next_attempt_at, last_error, needs_attention)
SELECT org_id, idem_key, request_sha, method, path, task, status, response, created_at,
       greatest(expires_at, %(now)s + make_interval(secs => %(keep)s), %(after)s), flow, step, state,
       lease_token,
       lease_expires_at, attempts, next_attempt_at, last_error, needs_attention
FROM moved
"""


def _retire(
    runner: _migrate._Runner,
    tables: _Tables,
    part: Partition,
    tombstone_ttl: float,
    interval: float,
    now: datetime,
    report: RetentionReport,
) -> bool:
    """Step 1 of retiring ``part``; whether it may be detached and dropped now.

    ``now`` is :func:`maintain`'s clock, not the statements' ``now()``: which tombstones are still
    live, and how far ahead a flagged row moves, are measured against the moment that retires the
    partition (under a fake clock as well, whose partitions are the ones made ahead).
    """
    name = tables.qualified(part.name)

    def settled(conn: psycopg.Connection[Any]) -> int:
        # SHARE waits for every transaction still writing to the partition, and is let go at once: an
        # UPDATE of the key table locks every partition, so holding it would hold up every multi-step
        # request while the tombstones are written. Once it was had, no row can enter the partition
        # (rows expire from the moment they are written, after its range) nor start processing there.
        if runner.distributed:
            _wait_for_writers(conn, name, runner.lock_timeout_ms)
        else:
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(name))
        busy = conn.execute(
            # Committed processing rows always have a lease: the lease index answers, not a scan.
            sql.SQL(
                "SELECT count(*) FROM {} WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
            ).format(name)
        ).fetchone()
        return busy[0] if busy is not None else 0

    def work(conn: psycopg.Connection[Any]) -> tuple[int, int]:
        written = 0
        marked = conn.execute("SELECT obj_description(%s::regclass, 'pg_class')", (name.as_string(None),))
        retired = marked.fetchone() == (_RETIRED,)
        if tombstone_ttl > 0 and not retired:
            written = conn.execute(
                sql.SQL(_TOMBSTONES).format(tombstones=sql.SQL(tables.tombstones), partition=name),
                {"tomb": tombstone_ttl, "now": now},
            ).rowcount
        conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(name, sql.Literal(_RETIRED)))
        moved = conn.execute(
            sql.SQL(_MOVE).format(partition=name, table=tables.names["table"]),
            {"keep": 2 * interval, "after": part.upper, "now": now},
        ).rowcount
        return written, moved

    try:
        busy = runner.transaction(settled)
        if busy:
            report.kept.append((part.name, f"{busy} multi-step request(s) still in progress"))
            return False
        done = runner.transaction(work)
    except psycopg.errors.UndefinedTable:  # another run retired and dropped it meanwhile
        return False
    report.tombstoned += done[0]
    report.moved += done[1]
    return True


#: On Citus, a transaction of its own on the node of each shard of a partition, which waits for every
#: transaction still writing to the shard (its ``SHARE`` lock, let go at once) but no longer than the
#: lock timeout (``%s`` is the shard, filled in by Citus; ``{timeout}`` in milliseconds). Citus refuses
#: a command on a shard unless told, as its error says, with citus.enable_manual_changes_to_shards.
_BARRIER = (
    "DO $barrier$ BEGIN PERFORM set_config('lock_timeout', '{timeout}ms', true);"
    " PERFORM set_config('citus.enable_manual_changes_to_shards', 'on', true);"
    " LOCK TABLE %s IN SHARE MODE; END $barrier$"
)
_PLACEMENTS = "SELECT shardid, success, result FROM run_command_on_placements(%s::regclass, %s)"


def _wait_for_writers(conn: psycopg.Connection[Any], name: sql.Identifier, timeout_ms: int) -> None:
    """On Citus: wait for every transaction still writing to partition ``name``.

    ``LOCK TABLE`` on a distributed table locks its table on each node (the coordinator's, and the
    workers' copies of its metadata), not its shards, where the rows are written: it would not wait for
    a request that inserted a row there through its delegated reserve function. Each shard is locked in
    ``SHARE`` mode instead, in a transaction of its own on its node (Citus's manual propagation,
    ``run_command_on_placements``), and let go at once: the same moment's lock as on PostgreSQL.

    :raises psycopg.errors.LockNotAvailable: when a shard's lock was not had within ``timeout_ms``
        (the caller's transaction is tried again).
    """
    command = _BARRIER.format(timeout=timeout_ms)
    failed = [
        (shard, result)
        for shard, success, result in conn.execute(_PLACEMENTS, (name.as_string(None), command))
        if not success
    ]
    if any("lock timeout" in (result or "") for _, result in failed):
        raise psycopg.errors.LockNotAvailable(f"a shard of {name.as_string(None)} is busy: {failed}")
    if failed:
        raise RuntimeError(f"Locking the shards of {name.as_string(None)} failed: {failed}")


def _detach(
    runner: _migrate._Runner, parent: str, name: sql.Identifier, part: Partition, *, bounded: bool = False
) -> None:
    """Detach ``part`` from ``parent``, concurrently but on Citus (see :func:`_drop`), or finish its
    interrupted detach.

    :param bounded: the concurrent detach waits for older transactions no longer than the lock timeout
        (then it is left pending, and :class:`psycopg.errors.LockNotAvailable` raised); by default as
        long as they last, as nothing waits behind it.
    """
    if runner.distributed:
        runner.echo(
            f"Detaching {part.name} (Citus: a moment's lock on the key table, under the lock timeout)."
        )
        runner.transaction(
            lambda c: c.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(sql.SQL(parent), name))
        )
    elif part.detaching:
        runner.transaction(
            lambda c: c.execute(
                sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(sql.SQL(parent), name)
            )
        )
    else:
        runner.echo(f"Detaching {part.name} (concurrently: requests go on meanwhile).")
        if bounded:  # outside a transaction: for the session, until the detach is through
            runner.conn.execute(sql.SQL("SET lock_timeout = {}").format(runner.lock_timeout))
        try:
            runner.conn.execute(
                sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(sql.SQL(parent), name)
            )
        finally:
            if bounded:
                runner.conn.execute("RESET lock_timeout")


def _drop(
    runner: _migrate._Runner, tables: _Tables, parent: str, part: Partition, report: RetentionReport
) -> None:
    """Detach ``part`` from ``parent`` without blocking anyone, then drop it.

    Another run may be at it too: a partition that is no partition any more (detached, or dropped) is
    dropped if it is still there, and one whose detach another run has begun is left to that run.

    On Citus, ``DETACH PARTITION ... CONCURRENTLY`` is refused on a distributed table ("currently
    unsupported", Citus 13; citusdata/citus#5264), and so is ``FINALIZE``. The nearest safe thing is a
    plain ``DETACH PARTITION`` in a transaction of its own under the migration's short lock timeout,
    which the nodes apply too (``citus.propagate_set_commands``), tried again after a pause when it runs
    out: it changes the catalog only (no scan, no row), but takes the key table's ``ACCESS EXCLUSIVE``
    lock on every shard for that moment, so it waits for the transactions using the key table and
    holds up the requests behind it, for at most the lock timeout per try.
    """
    name = tables.qualified(part.name)
    try:
        _detach(runner, parent, name, part)
    except psycopg.errors.ObjectNotInPrerequisiteState:  # "already pending detach": another run's
        runner.echo(f"{part.name} is being detached by another run; left to it.")
        return
    except psycopg.errors.UndefinedTable:  # "is not a partition", "does not exist": detached already
        pass

    try:  # without IF EXISTS: the table is looked up again once its lock is had
        runner.transaction(lambda c: c.execute(sql.SQL("DROP TABLE {}").format(name)))
    except psycopg.errors.UndefinedTable:  # dropped by another run
        return
    report.dropped.append(part.name)


@dataclass(frozen=True, slots=True)
class Overview:
    """The partitions of a partitioned key table and of its tombstones, as the catalog has them, and
    the database's clock: what ``flask idem stats``, the metrics and :meth:`Idempotency.partition_warning
    <flask_idem.Idempotency.partition_warning>` read."""

    #: The key table's name, as configured (``IDEM_TABLE``).
    table: str
    #: Oldest range first.
    keys: list[Partition]
    tombstones: list[Partition]
    #: ``now()`` of the database: partitions are ranges of its clock.
    now: datetime

    @property
    def newest_end(self) -> datetime | None:
        """The upper bound of the key table's newest partition: no key can expire at or after it.
        ``None`` when the newest is unbounded (or there is none)."""
        return self.keys[-1].upper if self.keys else None

    def passed(self, partitions: list[Partition]) -> list[Partition]:
        """Those of ``partitions`` whose range has passed: ``flask idem purge`` retires them."""
        return [p for p in partitions if p.upper is not None and p.upper <= self.now]

    def warning(self, *, horizon: float, ahead: float) -> str | None:
        """A sentence when the key table's partitions run out soon, else ``None``.

        Keys expire up to the longest retention (``horizon - ahead``) after they are written, and
        ``flask idem purge`` makes partitions ``ahead`` seconds further: the warning starts when the
        newest partition ends less than half of ``ahead`` past that, that is, when purge has not run
        for about half of ``IDEM_PARTITION_AHEAD``.

        :param horizon: the application's :meth:`~flask_idem._state.IdemState.horizon`.
        :param ahead: ``IDEM_PARTITION_AHEAD``.
        """
        retention = horizon - ahead
        if not self.keys:
            return (
                f"The key table {self.table} has no partition: no key can be written. Run"
                " 'flask idem purge' as the tables' owner now (it makes partitions ahead), and daily."
            )
        end = self.newest_end
        if end is None or end >= self.now + timedelta(seconds=horizon - ahead / 2):
            return None
        left = (end - self.now).total_seconds()
        if left < retention:
            what = (
                f"less than the longest retention ({duration(retention)}): requests whose key would"
                " expire after it fail now"
            )
        else:
            what = (
                f"less than the longest retention ({duration(retention)}) and half of"
                f" IDEM_PARTITION_AHEAD ({duration(ahead / 2)})"
            )
        when = "passed" if left <= 0 else f"is {duration(left)} from now"
        stamp = end.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"The newest partition of the key table {self.table} ends at {stamp} UTC, which {when}:"
            f" {what}. Run 'flask idem purge' as the tables' owner (it makes partitions ahead), and run"
            " it daily."
        )


def overview(conn: psycopg.Connection[Any], table: str) -> Overview:
    """The partitions of ``table`` (``IDEM_TABLE``) and of its tombstones. Catalog queries only, whatever
    the number of keys: cheap enough for every scrape of the metrics."""
    tables = _Tables(table)
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None  # one row, always
    (now,) = row
    return Overview(table, partitions(conn, tables.keys), partitions(conn, tables.tombstones), now)


def duration(seconds: float) -> str:
    """``seconds`` for a person: "40 s", "12 min", "5.0 h", "3.2 days"."""
    seconds = abs(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
