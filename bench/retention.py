"""Retention of the key table: layout 3's purge against layout 4's partition retirement, and bytes per key.

Issue 32, section 4: what retention costs on layout 3 (one UPDATE or DELETE per row) and on layout 4
(whole partitions detached and dropped), side by side, on tables created by flask-idem's own migration::

    uv run python bench/retention.py                       # 100,000 and 1,000,000 rows, 40 days
    uv run python bench/retention.py --rows 1000000 10000000
    uv run python bench/retention.py --quick               # 20,000 rows, 10 days (about a minute)

For each row count it fills a scratch database fast (one ``INSERT ... SELECT FROM generate_series`` per
million rows) with expired keys shaped like the shop's, then measures:

- layout 3: flask-idem's own ``Store.purge`` (what ``flask idem purge`` runs there) in its three cases:
  full rows past ``IDEM_KEY_TTL`` turned into tombstones (an UPDATE per row), tombstones past
  ``IDEM_TOMBSTONE_TTL`` deleted, and full rows deleted when ``IDEM_TOMBSTONE_TTL`` is 0; then the
  ``VACUUM`` that follows;
- layout 4: ``flask_idem._partitions.maintain`` (what ``flask idem purge`` runs there) on a table made by
  ``flask_idem._migrate.upgrade``, the same rows in one daily partition whose range has passed, under a
  clock given to it (``now=``): its steps timed apart (the first step of retiring: ``LOCK ... SHARE``, the
  check for requests in progress, the compact tombstones written; then ``DETACH PARTITION ...
  CONCURRENTLY`` + ``DROP TABLE``; and making partitions ahead), with 30 days of tombstones and with
  ``IDEM_TOMBSTONE_TTL=0`` (no tombstone: a pure drop);
- bytes per key: a full row of either layout, layout 3's tombstone, layout 4's compact tombstone;
- WAL per fresh key written through the extension (Flask's test client, one request per key), on both
  layouts.

Then it simulates ``--days`` days of traffic at ``--day-keys`` keys a day on both layouts in a second
scratch database whose ``now()`` is a clock the script sets (``bench_clock.now()``, first on the
database's ``search_path``): each day's keys are written with the times they would have had, then the
daily purge (layout 3, and the VACUUM autovacuum would run) or maintain (layout 4) runs at 01:00, and the
tables' sizes are read.

WAL is counted twice: the records of the scratch database alone (read back with ``pg_walinspect``), with
their full-page images apart, and the whole server's ``pg_current_wal_insert_lsn()`` difference, which
includes whatever other sessions wrote meanwhile. To read a phase's records, a temporary replication slot
keeps them from its start until they are read, and is dropped right after; should a phase write more than
``--wal-cap-gb`` a watcher lets the slot go (the disk is shared), and that phase has the server's figure
only. Nothing here asserts; it prints tables.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import psycopg
from flask import Flask
from psycopg import sql

from bench.harness import DEFAULT_SERVER_URL, scratch_database, server_version
from bench.report import machine
from flask_idem import Idempotency, _layout, _partitions
from flask_idem._migrate import upgrade
from flask_idem._partitions import maintain, partitions
from flask_idem._partitions import run as maintain_run
from flask_idem._partitions.clock import aligned_after
from flask_idem._state import get_state

DATABASE = "flask_idem_bench_retention"
DAYS_DATABASE = "flask_idem_bench_retention_days"
ORG = 1
BATCH = 1_000_000
DAY = 86_400.0
TOMBSTONE_TTL = 30 * DAY
#: Layout 4's partitions: one a day, made two days ahead here (the application's default is
#: IDEM_KEY_TTL + IDEM_PARTITION_AHEAD, 8 days, which the simulation of days uses).
INTERVAL = DAY
#: The wait after a partition's range passed before maintain retires it (``_partitions.MAX_GRACE``).
AFTER = timedelta(seconds=2 * _partitions.MAX_GRACE)
#: A response document of the shop's shape, about 260 bytes as JSON text: status, the two headers, and a
#: body of an order (its id and Location vary per row).
RESPONSE = """jsonb_build_object(
    'status', 201,
    'headers', jsonb_build_array(jsonb_build_array('Content-Type', 'application/json'),
                                 jsonb_build_array('Location', '/orders/' || i)),
    'body', format('{"id": %%s, "amount": 1250, "currency": "EUR", "status": "created", '
                   '"created_at": "2025-01-01T12:00:00Z", "reference": "%%s"}', i, left(md5(i::text), 8)))"""
#: What layout 3's purge leaves of that response (flask_idem/_store.sql, block "tombstone").
TOMBSTONE = """jsonb_build_object(
    'tombstone', true, 'status', 201,
    'headers', jsonb_build_array(jsonb_build_array('Location', '/orders/' || i)))"""
#: ``rows`` completed keys in the order they would have arrived: random keys, expiring one after the
#: other from ``first`` over ``span`` seconds, each created ``ttl`` seconds before it expires.
FILL = """
INSERT INTO {table} (org_id, idem_key, request_sha, method, path, status, response, created_at, expires_at)
SELECT %(org)s, k, sha256(uuid_send(k)), 'POST', '/orders', 'completed', {response},
       e - make_interval(secs => %(ttl)s), e
FROM (SELECT gen_random_uuid() AS k, i,
             %(first)s::timestamptz + make_interval(secs => %(span)s * (i - 1) / %(rows)s) AS e
      FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i) AS keys
"""
#: Records of this database: their blocks are in it, or their transaction wrote some (its commit); per
#: step of the phase (NULL: between steps), with the bytes of full-page images apart.
WAL_OF_DATABASE = """
WITH r AS (SELECT start_lsn, xid, record_length, fpi_length, block_ref LIKE %(pattern)s AS mine
           FROM pg_get_wal_records_info(%(start)s, %(end)s)),
     ours AS (SELECT DISTINCT xid FROM r WHERE mine AND xid <> '0'),
     steps AS (SELECT * FROM unnest(%(names)s::text[], %(starts)s::pg_lsn[], %(ends)s::pg_lsn[])
                             AS s(name, first, last))
SELECT s.name, coalesce(sum(r.record_length), 0)::bigint, coalesce(sum(r.fpi_length), 0)::bigint
FROM r LEFT JOIN steps AS s ON r.start_lsn >= s.first AND r.start_lsn < s.last
WHERE r.mine OR r.xid IN (SELECT xid FROM ours)
GROUP BY s.name
"""
#: The check of maintain's first step for requests in progress on a partition (_partitions.retire).
CHECK = "SELECT count(*) FROM {} WHERE status = 'processing'"
#: The partitions of a partitioned table: bytes with indexes and TOAST, and without indexes.
TREE_SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint, coalesce(sum(pg_table_size(relid)), 0)::bigint
FROM pg_partition_tree(%s::regclass) WHERE isleaf
"""


def quiet(_: str) -> None:
    pass


@dataclass
class Wal:
    #: This database's records (None: not read, the slot was let go), of which full-page images.
    database: int | None = None
    fpi: int | None = None
    server: int = 0


@dataclass
class Step:
    """One step of a measured phase: its time and its range of WAL."""

    name: str
    seconds: float
    start: str
    end: str
    wal: Wal = field(default_factory=Wal)


class Meter:
    """WAL written between two moments: this database's records, and the whole server's."""

    def __init__(self, conn: psycopg.Connection[Any], cap: float) -> None:
        self.conn = conn
        self.cap = cap
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
        assert oid is not None
        self.pattern = f"% rel %/{oid[0]}/%"
        self.serial = itertools.count()
        self.steps: list[Step] = []

    def lsn(self) -> str:
        row = self.conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    def diff(self, end: str, start: str) -> int:
        row = self.conn.execute("SELECT pg_wal_lsn_diff(%s, %s)::bigint", (end, start)).fetchone()
        assert row is not None
        return int(row[0])

    @contextmanager
    def measure(self, into: Wal, *, checkpoint: bool = True) -> Iterator[list[Step]]:
        """Measure the WAL of the block into ``into``, and of the steps it appends to the list it gets."""
        if checkpoint:
            self.conn.execute("CHECKPOINT")  # full-page images start afresh, as after any checkpoint
        slot = f"{DATABASE}_{os.getpid()}_{next(self.serial)}"
        # Keeps the segments from now on until the records are read: a slot of this session only.
        self.conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (slot,))
        watcher = _Watcher(self, slot)
        steps: list[Step] = []
        try:
            start = self.lsn()
            watcher.start()
            try:
                yield steps
            finally:
                watcher.stop()
            end = self.lsn()
            into.server = self.diff(end, start)
            for step in steps:
                step.wal.server = self.diff(step.end, step.start)
            if not watcher.released:
                self.conn.execute("SELECT pg_switch_wal()")  # the records up to end are flushed, readable
                params = {
                    "start": start, "end": end, "pattern": self.pattern,
                    "names": [str(i) for i in range(len(steps))],
                    "starts": [s.start for s in steps], "ends": [s.end for s in steps],
                }  # fmt: skip
                into.database = into.fpi = 0
                for name, total, fpi in self.conn.execute(WAL_OF_DATABASE, params).fetchall():
                    into.database += int(total)
                    into.fpi += int(fpi)
                    if name is not None:
                        steps[int(name)].wal.database, steps[int(name)].wal.fpi = int(total), int(fpi)
                for step in steps:
                    if step.wal.database is None:
                        step.wal.database = step.wal.fpi = 0
        finally:
            self.conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


class _Watcher(threading.Thread):
    """Lets a measuring slot go once it holds more than the cap of WAL: the disk is shared."""

    def __init__(self, meter: Meter, slot: str) -> None:
        super().__init__(daemon=True)
        self.meter, self.slot = meter, slot
        self.stopping = threading.Event()
        self.released = False

    def run(self) -> None:
        held = (
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), restart_lsn) FROM pg_replication_slots"
            " WHERE slot_name = %s"
        )
        while not self.stopping.wait(1.0):
            row = self.meter.conn.execute(held, (self.slot,)).fetchone()  # the session's lock: one at a time
            if row is not None and row[0] is not None and row[0] > self.meter.cap:
                self.meter.conn.execute(
                    "SELECT pg_replication_slot_advance(%s, pg_current_wal_flush_lsn())", (self.slot,)
                )
                self.released = True

    def stop(self) -> None:
        self.stopping.set()
        self.join()


@dataclass
class PerKey:
    """Bytes per key of one kind of row: the row itself, and table plus indexes over the rows."""

    row: float
    total: float
    #: The heap alone (with TOAST), over the rows: ``total`` less the indexes.
    heap: float = 0.0


def added(one: Wal, other: Wal) -> Wal:
    """The WAL of two phases together."""
    if one.database is None or other.database is None:
        return Wal(None, None, one.server + other.server)
    return Wal(one.database + other.database, (one.fpi or 0) + (other.fpi or 0), one.server + other.server)


def fill(conn: psycopg.Connection[Any], table: str, rows: int, response: str, *, first: datetime,
         span: float = DAY) -> None:  # fmt: skip
    """``rows`` completed keys expiring over ``span`` seconds from ``first``, one statement per million."""
    text = sql.SQL(FILL).format(table=sql.Identifier(table), response=sql.SQL(response))
    for low in range(1, rows + 1, BATCH):
        high = min(rows, low + BATCH - 1)
        params = {
            "org": ORG,
            "low": low,
            "high": high,
            "rows": rows,
            "first": first,
            "span": span,
            "ttl": DAY,
        }
        conn.execute(text, params)


def size(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (table,)).fetchone()
    assert row is not None
    return int(row[0])


def tree_size(conn: psycopg.Connection[Any], table: str, *, heap: bool = False) -> int:
    """Bytes of every partition of ``table`` with their indexes (``heap``: without)."""
    row = conn.execute(TREE_SIZE, (table,)).fetchone()
    assert row is not None
    return int(row[1] if heap else row[0])


def per_key(conn: psycopg.Connection[Any], table: str, rows: int, *, tree: bool = False) -> PerKey:
    """A row's bytes, and the table's (or its partitions') with and without indexes, over ``rows``."""
    if tree:
        return PerKey(
            row_bytes(conn, table), tree_size(conn, table) / rows, tree_size(conn, table, heap=True) / rows
        )
    heap = conn.execute("SELECT pg_table_size(%s::regclass)", (table,)).fetchone()
    assert heap is not None
    return PerKey(row_bytes(conn, table), size(conn, table) / rows, int(heap[0]) / rows)


def row_bytes(conn: psycopg.Connection[Any], table: str) -> float:
    query = sql.SQL("SELECT avg(pg_column_size(k.*))::float8 FROM {} AS k").format(sql.Identifier(table))
    row = conn.execute(query).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def now_of(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def execute(conn: psycopg.Connection[Any], template: str, *names: str) -> None:
    conn.execute(sql.SQL(template).format(*(sql.Identifier(name) for name in names)))


# -- the two layouts ---------------------------------------------------------------------------------------


def layout3_table(url: str, name: str) -> None:
    """Layout 3's key table, by flask-idem's own migration stopped there, autovacuum off."""
    every = _layout.revisions()
    with mock.patch.object(_layout, "revisions", lambda: tuple(r for r in every if r.layout <= 3)):
        upgrade(url, table=name, echo=quiet)
    with psycopg.connect(url, autocommit=True) as conn:
        execute(conn, "ALTER TABLE {} SET (autovacuum_enabled = false)", name)


def layout4_table(url: str, conn: psycopg.Connection[Any], name: str, tombstone_ttl: float) -> datetime:
    """Layout 4's key table with daily partitions; the start of the first whole day, whose partition
    is empty and whose range has not passed under maintain's clock.

    ``upgrade`` attaches its first partition up to a minute from now (``horizon``); one ``maintain``
    under a clock just past the next midnight makes the daily partitions and retires the first ones,
    empty. The key partitions have autovacuum off (the VACUUM ANALYZE after filling is the only one).
    """
    upgrade(url, table=name, horizon=60.0, echo=quiet)
    [first] = partitions(conn, name)
    assert first.upper is not None
    day = aligned_after(first.upper, INTERVAL)
    maintain(url, table=name, interval=INTERVAL, horizon=2 * DAY, tombstone_ttl=tombstone_ttl,
             now=lambda: day + AFTER, echo=quiet)  # fmt: skip
    for part in partitions(conn, name):
        execute(conn, "ALTER TABLE {} SET (autovacuum_enabled = false)", part.name)
    return day


def partition_of(conn: psycopg.Connection[Any], table: str, lower: datetime) -> str:
    return next(part.name for part in partitions(conn, table) if part.lower == lower)


def store_app(url: str, table: str, tombstone_ttl: float) -> tuple[Flask, Idempotency]:
    app = Flask("bench-retention")
    app.config.update(
        MAX_CONTENT_LENGTH=65536, IDEM_DATABASE_URL=url, IDEM_TABLE=table, IDEM_TOMBSTONE_TTL=tombstone_ttl
    )
    idem = Idempotency(app, scope=lambda: ORG)
    get_state(app).check_layout()  # the store runs the statements of the table's layout
    return app, idem


@dataclass
class Measured:
    """One operation at one row count."""

    seconds: float = 0.0
    wal: Wal = field(default_factory=Wal)
    size_before: int = 0
    size_after: int = 0
    vacuum_seconds: float | None = None
    vacuum_wal: Wal = field(default_factory=Wal)
    size_vacuumed: int | None = None
    done: str = ""


def purge3(url: str, meter: Meter, table: str, tombstone_ttl: float, *, vacuum: bool = True) -> Measured:
    """Layout 3: flask-idem's own purge until it finds nothing left, then VACUUM, each measured."""
    conn = meter.conn
    app, _ = store_app(url, table, tombstone_ttl)
    store = get_state(app).store
    found = Measured(size_before=size(conn, table))
    totals = [0, 0]

    def purge() -> None:
        while True:
            deleted, tombstoned = store.purge()  # flask idem purge's default batch of 1000
            totals[0] += deleted
            totals[1] += tombstoned
            if not deleted and not tombstoned:
                return

    try:
        with meter.measure(found.wal):
            found.seconds = timed(purge)
    finally:
        get_state(app).source.close()
    found.done = f"{totals[0]:,} deleted, {totals[1]:,} tombstoned"
    found.size_after = size(conn, table)
    if vacuum:
        with meter.measure(found.vacuum_wal):
            found.vacuum_seconds = timed(lambda: execute(conn, "VACUUM {}", table))
        found.size_vacuumed = size(conn, table)
    return found


#: maintain's steps, as _partitions.run names them; ``drop`` is timed in two: the detach, and the last
#: transaction, the DROP TABLE.
STEPS = {"retire": "retire", "drop": "drop", "make_ahead": "ahead"}


@contextmanager
def steps_timed(meter: Meter, steps: list[Step]) -> Iterator[None]:
    """Time maintain's steps (``_partitions.run``'s ``retire``, ``drop``, ``make_ahead``) and note their WAL
    ranges."""

    def wrap(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed_step(run: Any, *args: Any, **kwargs: Any) -> Any:
            runner = run.runner
            transactions: list[tuple[str, float]] = []  # where each of the step's transactions began
            if name == "drop":
                original = runner.transaction

                def transaction(work: Callable[..., Any]) -> Any:
                    transactions.append((meter.lsn(), time.perf_counter()))
                    return original(work)

                runner.transaction = transaction
            start, began = meter.lsn(), time.perf_counter()
            try:
                return step(run, *args, **kwargs)
            finally:
                ended = time.perf_counter()
                end = meter.lsn()
                if name == "drop":
                    del runner.transaction  # the class's method again
                    middle, split = transactions[-1] if transactions else (end, ended)
                    steps.append(Step("detach", split - began, start, middle))
                    steps.append(Step("drop table", ended - split, middle, end))
                else:
                    steps.append(Step(STEPS[name], ended - began, start, end))

        return timed_step

    with ExitStack() as stack:
        for name in STEPS:
            stack.enter_context(
                mock.patch.object(maintain_run, name, wrap(name, getattr(maintain_run, name)))
            )
        yield


def maintain4(
    url: str, meter: Meter, table: str, tombstone_ttl: float, now: datetime, **options: Any
) -> tuple[Measured, dict[str, Measured], _partitions.RetentionReport]:
    """Layout 4: flask-idem's own maintain at ``now``, the whole call and each kind of step measured."""
    conn = meter.conn
    found = Measured(size_before=tree_size(conn, table))
    reports: list[_partitions.RetentionReport] = []
    interval, horizon = options.get("interval", INTERVAL), options.get("horizon", 2 * DAY)

    def run() -> None:
        reports.append(maintain(url, table=table, interval=interval, horizon=horizon,
                                tombstone_ttl=tombstone_ttl, now=lambda: now, echo=quiet))  # fmt: skip

    with meter.measure(found.wal) as steps, steps_timed(meter, steps):
        found.seconds = timed(run)
    [report] = reports
    found.size_after = found.size_vacuumed = tree_size(conn, table)
    found.done = (
        f"{len(report.dropped)} partition(s) dropped, {report.tombstoned:,} compact tombstones written,"
        f" {len(report.created)} made ahead"
    )
    parts: dict[str, Measured] = {}
    for step in steps:
        for name in {step.name, "drop" if step.name in ("detach", "drop table") else step.name}:
            part = parts.setdefault(name, Measured(wal=Wal(0, 0, 0)))
            part.seconds += step.seconds
            part.wal = added(part.wal, step.wal)
    for part in parts.values():
        part.size_before, part.size_after = found.size_before, found.size_after
    return found, parts, report


# -- one row count -----------------------------------------------------------------------------------------


@dataclass
class Run:
    rows: int
    ops: dict[str, Measured] = field(default_factory=dict)
    keys: dict[str, PerKey] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


OPS = {
    "l3 tombstone": "layout 3: purge turns expired full rows into tombstones (UPDATE)",
    "l3 delete tombstones": "layout 3: purge deletes tombstones past IDEM_TOMBSTONE_TTL (DELETE)",
    "l3 delete rows": "layout 3: purge deletes expired full rows, IDEM_TOMBSTONE_TTL=0 (DELETE)",
    "l4 retire": "layout 4, 30-day tombstones: maintain's first step (LOCK SHARE, the check for requests"
    " in progress, compact tombstones INSERT ... SELECT, flagged rows moved)",
    "l4 drop": "layout 4, 30-day tombstones: DETACH PARTITION CONCURRENTLY + DROP TABLE",
    "l4 detach": "layout 4, 30-day tombstones: of which DETACH PARTITION CONCURRENTLY",
    "l4 drop table": "layout 4, 30-day tombstones: of which DROP TABLE",
    "l4 ahead": "layout 4, 30-day tombstones: partitions made ahead (keys and tombstones)",
    "l4 maintain": "layout 4, 30-day tombstones: the whole maintain() call",
    "l4/0 retire": "layout 4, IDEM_TOMBSTONE_TTL=0: maintain's first step (LOCK SHARE, the check for"
    " requests in progress, flagged rows moved; no tombstone)",
    "l4/0 drop": "layout 4, IDEM_TOMBSTONE_TTL=0: DETACH PARTITION CONCURRENTLY + DROP TABLE",
    "l4/0 detach": "layout 4, IDEM_TOMBSTONE_TTL=0: of which DETACH PARTITION CONCURRENTLY",
    "l4/0 drop table": "layout 4, IDEM_TOMBSTONE_TTL=0: of which DROP TABLE",
    "l4/0 maintain": "layout 4, IDEM_TOMBSTONE_TTL=0: the whole maintain() call (a pure drop)",
    "l4 check": "layout 4: the first step's check for requests in progress (SELECT count(*) ... WHERE"
    " status = 'processing' on the partition), timed alone before maintain",
    "l4 check, lease index": "layout 4: the same count with AND lease_expires_at IS NOT NULL (a committed"
    " processing row has a lease), which the partial lease index answers, timed alone",
}
KEYS = {
    "full3": "full row, layout 3",
    "full4": "full row, layout 4 (a daily partition)",
    "tombstone": "layout 3's tombstone (the row after purge's UPDATE)",
    "compact": "layout 4's compact tombstone (<table>_tombstones)",
}


def measure(url: str, rows: int, cap: float) -> Run:
    run = Run(rows)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET work_mem = '256MB'")
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        meter = Meter(conn, cap)
        expired = now_of(conn) - timedelta(hours=1) - timedelta(seconds=DAY)  # over a day until an hour ago

        # Layout 3. Full rows past their retention, tombstones kept 30 days: purge turns them into
        # tombstones. Each table is dropped once measured, so that one at a time takes the disk.
        layout3_table(url, "l3_rows")
        fill(conn, "l3_rows", rows, RESPONSE, first=expired)
        execute(conn, "VACUUM ANALYZE {}", "l3_rows")
        run.keys["full3"] = per_key(conn, "l3_rows", rows)
        length = conn.execute("SELECT avg(octet_length(response::text))::int FROM l3_rows").fetchone()
        assert length is not None
        run.notes.append(f"response document: {length[0]} bytes of JSON text on average")
        run.ops["l3 tombstone"] = purge3(url, meter, "l3_rows", TOMBSTONE_TTL)
        run.keys["tombstone"] = PerKey(row_bytes(conn, "l3_rows"), 0.0)
        execute(conn, "DROP TABLE {}", "l3_rows")

        # Tombstones past their period (filled as purge leaves them, packed): purge deletes them.
        layout3_table(url, "l3_tombstones")
        fill(conn, "l3_tombstones", rows, TOMBSTONE, first=expired)
        execute(conn, "VACUUM ANALYZE {}", "l3_tombstones")
        packed = per_key(conn, "l3_tombstones", rows)
        run.keys["tombstone"].total, run.keys["tombstone"].heap = packed.total, packed.heap
        run.ops["l3 delete tombstones"] = purge3(url, meter, "l3_tombstones", TOMBSTONE_TTL)
        execute(conn, "DROP TABLE {}", "l3_tombstones")

        # No tombstones kept: expired full rows deleted.
        layout3_table(url, "l3_forget")
        fill(conn, "l3_forget", rows, RESPONSE, first=expired)
        execute(conn, "VACUUM ANALYZE {}", "l3_forget")
        run.ops["l3 delete rows"] = purge3(url, meter, "l3_forget", 0.0)
        execute(conn, "DROP TABLE {}", "l3_forget")

        # Layout 4: the same rows in the partition of one day, a thousand live ones in the next; maintain
        # runs two minutes after that day ended (its clock; the database's own is not moved).
        for prefix, ttl in (("l4", TOMBSTONE_TTL), ("l4/0", 0.0)):
            table = "l4_keys" if ttl else "l4_forget"
            day = layout4_table(url, conn, table, ttl)
            fill(conn, table, rows, RESPONSE, first=day)
            fill(conn, table, min(rows, 1000), RESPONSE, first=day + timedelta(seconds=DAY))
            part = partition_of(conn, table, day)
            execute(conn, "VACUUM ANALYZE {}", part)
            if ttl:
                run.keys["full4"] = per_key(conn, part, rows)
                for name, check in (
                    ("l4 check", CHECK),
                    ("l4 check, lease index", CHECK + " AND lease_expires_at IS NOT NULL"),
                ):
                    query = sql.SQL(check).format(sql.Identifier(part))
                    seconds = timed(lambda query=query: conn.execute(query))  # type: ignore[misc]
                    run.ops[name] = Measured(seconds=seconds, wal=Wal(0, 0, 0))
            whole, steps, report = maintain4(url, meter, table, ttl, day + timedelta(seconds=DAY) + AFTER)
            run.ops[f"{prefix} maintain"] = whole
            for name, found in steps.items():
                if f"{prefix} {name}" in OPS:
                    run.ops[f"{prefix} {name}"] = found
            if ttl:
                tombstones = f"{table}_tombstones"
                run.keys["compact"] = per_key(conn, tombstones, max(1, report.tombstoned), tree=True)
                run.ops["l4 ahead"].done = f"{len(report.created)} partition(s) made"
            execute(conn, "DROP TABLE {}, {}", table, f"{table}_tombstones")
    return run


# -- WAL per fresh key through the extension --------------------------------------------------------------


@dataclass
class Written:
    layout: int
    requests: int
    seconds: float
    wal: Wal
    statuses: dict[int, int]
    #: Keys in the table before (0: empty, and no CHECKPOINT before).
    prefill: int = 0


def write_path(url: str, requests: int, cap: float, prefill: int) -> list[Written]:
    """Fresh keys through a decorated route (Flask's test client, one request per key), both layouts:
    the WAL of the key table's writes. The route writes nothing else; its 201 carries a body of the
    shop's shape and a Location.

    Twice per layout: into an empty table (no CHECKPOINT before: its few index pages are rarely written
    whole), and, with ``prefill``, into a table of ``prefill`` keys expiring with the new ones (in the
    same partition) right after a CHECKPOINT: the first change to each page of the unique index after a
    checkpoint writes the whole page, and random keys find a different page almost every time, as in a
    table of millions of keys between two checkpoints.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        meter = Meter(conn, cap)
        return [
            written(url, meter, layout, requests, rows)
            for rows in ((0, prefill) if prefill else (0,))
            for layout in (3, 4)
        ]


def written(url: str, meter: Meter, layout: int, requests: int, prefill: int) -> Written:
    table = f"w{layout}_keys"
    if layout == 3:
        layout3_table(url, table)
    else:  # daily partitions from a minute from now on, as after the first purge
        upgrade(url, table=table, horizon=60.0, echo=quiet)
        maintain(
            url, table=table, interval=INTERVAL, horizon=2 * DAY, tombstone_ttl=TOMBSTONE_TTL, echo=quiet
        )
    if prefill:  # expiring in the minute before the new keys do: their partition
        fill(
            meter.conn,
            table,
            prefill,
            RESPONSE,
            first=now_of(meter.conn) + timedelta(seconds=DAY - 60),
            span=60,
        )
        execute(meter.conn, "VACUUM ANALYZE {}", table)
    app, extension = store_app(url, table, TOMBSTONE_TTL)
    numbers = itertools.count(1)

    @app.post("/orders")
    @extension.idempotent()
    def create_order() -> tuple[dict[str, Any], int, dict[str, str]]:
        n = next(numbers)
        body = {"id": n, "amount": 1250, "currency": "EUR", "status": "created",
                "created_at": "2025-01-01T12:00:00Z", "reference": uuid.uuid4().hex[:8]}  # fmt: skip
        return body, 201, {"Location": f"/orders/{n}"}

    client = app.test_client()
    statuses: dict[int, int] = {}

    def send(count: int) -> None:
        for _ in range(count):
            response = client.post("/orders", json={"amount": 1250, "currency": "EUR"},
                                   headers={"Idempotency-Key": str(uuid.uuid4())})  # fmt: skip
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    wal = Wal()
    try:
        send(max(100, requests // 10))  # warm-up: connections, prepared statements
        statuses.clear()
        with meter.measure(wal, checkpoint=bool(prefill)):
            seconds = timed(lambda: send(requests))
    finally:
        get_state(app).source.close()
    execute(meter.conn, "DROP TABLE {}", table)
    if layout == 4:
        execute(meter.conn, "DROP TABLE {}", f"{table}_tombstones")
    return Written(layout, requests, seconds, wal, dict(statuses), prefill)


# -- days of traffic, simulated -----------------------------------------------------------------------------


CLOCK = (
    "CREATE SCHEMA bench_clock",
    "CREATE TABLE bench_clock.clock (t timestamptz NOT NULL)",
    "CREATE FUNCTION bench_clock.now() RETURNS timestamptz LANGUAGE sql STABLE"
    " AS 'SELECT t FROM bench_clock.clock'",
)


@dataclass
class Day:
    day: int
    l3_rows: int
    l3_tombstones: int
    l3_bytes: int
    l3_seconds: float
    l3_wal: Wal
    l4_keys: int
    l4_tombstones: int
    l4_key_bytes: int
    l4_tombstone_bytes: int
    l4_seconds: float
    l4_wal: Wal
    l4_partitions: int


def simulate(server: str, days: int, per_day: int, cap: float) -> list[Day]:
    """``days`` days of ``per_day`` keys on both layouts, under a clock the script moves; the daily
    retention at 01:00 (layout 3: purge and VACUUM; layout 4: maintain with the defaults)."""
    start = datetime(2030, 1, 1, tzinfo=UTC)
    found: list[Day] = []
    with scratch_database(server, DAYS_DATABASE) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in CLOCK:
                conn.execute(statement)
            conn.execute("INSERT INTO bench_clock.clock VALUES (%s)", (start,))
            execute(
                conn, "ALTER DATABASE {} SET search_path = bench_clock, pg_catalog, public", DAYS_DATABASE
            )
        with psycopg.connect(url, autocommit=True) as conn:  # a session under the clock
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            meter = Meter(conn, cap)

            def clock(moment: datetime) -> None:
                conn.execute("UPDATE bench_clock.clock SET t = %s", (moment,))

            assert now_of(conn) == start
            layout3_table(url, "l3")
            upgrade(url, table="l4", horizon=60.0, echo=quiet)
            options = {"interval": DAY, "horizon": 8 * DAY}  # IDEM_KEY_TTL + IDEM_PARTITION_AHEAD
            maintain(url, table="l4", tombstone_ttl=TOMBSTONE_TTL, now=lambda: start, echo=quiet, **options)
            for day in range(days):
                clock(start + timedelta(days=day))
                for table in ("l3", "l4"):
                    fill(conn, table, per_day, RESPONSE, first=start + timedelta(days=day + 1))
                at = start + timedelta(days=day + 1, hours=1)
                clock(at)
                l3 = purge3(url, meter, "l3", TOMBSTONE_TTL)
                l4, _, _ = maintain4(url, meter, "l4", TOMBSTONE_TTL, at, **options)
                counts = conn.execute(
                    "SELECT (SELECT count(*) FILTER (WHERE NOT response ? 'tombstone') FROM l3),"
                    " (SELECT count(*) FILTER (WHERE response ? 'tombstone') FROM l3),"
                    " (SELECT count(*) FROM l4), (SELECT count(*) FROM l4_tombstones),"
                    " (SELECT count(*) FROM pg_partition_tree('l4') WHERE isleaf)"
                ).fetchone()
                assert counts is not None
                l3_wal = added(l3.wal, l3.vacuum_wal)
                found.append(Day(
                    day + 1, counts[0], counts[1], size(conn, "l3"), l3.seconds + (l3.vacuum_seconds or 0.0),
                    l3_wal, counts[2], counts[3], tree_size(conn, "l4"), tree_size(conn, "l4_tombstones"),
                    l4.seconds, l4.wal, counts[4],
                ))  # fmt: skip
                print(f"# day {day + 1}/{days}", flush=True)
    return found


# -- the report ----------------------------------------------------------------------------------------------


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def ratio(values: Sequence[float | None]) -> str:
    first, last = values[0], values[-1]
    return f"{last / first:.2f}" if len(values) > 1 and first and last is not None else "-"


def table(title: str, runs: Sequence[Run], lines: dict[str, list[float | None]],
          show: Callable[[float | None], str], with_ratio: bool = True) -> None:  # fmt: skip
    """One measure: a line per operation, a column per row count, and the last count's ratio to the first."""
    header = ["", *(f"{run.rows:,} rows" for run in runs)]
    if with_ratio and len(runs) > 1:
        header.append(f"ratio {runs[-1].rows:,} / {runs[0].rows:,}")
    print(f"\n### {title}\n\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for name, values in lines.items():
        cells = [name, *(show(v) for v in values)]
        if with_ratio and len(runs) > 1:
            cells.append(ratio(values))
        print("| " + " | ".join(cells) + " |")


def report_runs(runs: list[Run]) -> None:
    ops = {name: [run.ops[name] for run in runs] for name in OPS}
    print(
        "Retention of the key table (issue 32, section 4): layout 3's Store.purge (batches of 1000) against"
    )
    print("layout 4's _partitions.maintain, both on tables made by flask-idem's own migration.")
    print()
    for name, text in OPS.items():
        done = "; ".join(m.done for m in ops[name] if m.done)
        print(f"- {name}: {text}" + (f" ({done})" if done else ""))

    def line(value: Callable[[Measured], float | None]) -> dict[str, list[float | None]]:
        return {name: [value(m) for m in found] for name, found in ops.items()}

    def per_key(value: Callable[[Measured], float | None]) -> dict[str, list[float | None]]:
        return {
            name: [
                None if (v := value(m)) is None else v / run.rows for m, run in zip(found, runs, strict=True)
            ]
            for name, found in ops.items()
        }

    def n(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    table("Retention time, seconds", runs, line(lambda m: m.seconds), lambda v: f"{v or 0:.3f}")
    table("WAL of the retention, MB (this database's records; - : not read, over the cap)", runs,
          line(lambda m: m.wal.database), mb)  # fmt: skip
    table("of which full-page images, MB", runs, line(lambda m: m.wal.fpi), mb)
    table("WAL of the retention, MB (whole server: includes other sessions)", runs,
          line(lambda m: m.wal.server), mb)  # fmt: skip
    table("WAL per expired key, bytes (this database)", runs, per_key(lambda m: m.wal.database), n)
    table("WAL per expired key, bytes (whole server)", runs, per_key(lambda m: m.wal.server), n)
    whole = {k: v for k, v in ops.items() if k.startswith("l3") or k.endswith("maintain")}

    def sized(value: Callable[[Measured], float | None]) -> dict[str, list[float | None]]:
        return {name: [value(m) for m in found] for name, found in whole.items()}

    table("Key table (+ indexes, all partitions) before, MB", runs, sized(lambda m: m.size_before), mb)
    table("after the retention, MB (layout 4: the key table's partitions)", runs,
          sized(lambda m: m.size_after), mb)  # fmt: skip
    vacuumed = {name: found for name, found in ops.items() if name.startswith("l3")}
    table("VACUUM after layout 3's retention, seconds (none after a drop)", runs,
          {n_: [m.vacuum_seconds for m in f] for n_, f in vacuumed.items()},
          lambda v: f"{v or 0:.3f}")  # fmt: skip
    table("WAL of that VACUUM, MB (this database)", runs,
          {n_: [m.vacuum_wal.database for m in f] for n_, f in vacuumed.items()}, mb)  # fmt: skip
    table("Layout 3's table after VACUUM, MB", runs,
          {n_: [m.size_vacuumed for m in f] for n_, f in vacuumed.items()}, mb)  # fmt: skip
    keys: dict[str, list[float | None]] = {
        **{f"{text}: row": [run.keys[name].row for run in runs] for name, text in KEYS.items()},
        **{f"{text}: table + indexes / rows": [run.keys[name].total for run in runs]
           for name, text in KEYS.items()},
        **{f"{text}: of which the heap (with TOAST)": [run.keys[name].heap for run in runs]
           for name, text in KEYS.items()},
        "compact tombstone / full row of layout 3, table + indexes (goal ≤ 0.33)":
            [run.keys["compact"].total / run.keys["full3"].total for run in runs],
        "compact tombstone / layout 3's tombstone, table + indexes":
            [run.keys["compact"].total / run.keys["tombstone"].total for run in runs],
    }  # fmt: skip
    table("Bytes per key", runs, keys, lambda v: "-" if v is None else f"{v:,.2f}" if v < 10 else f"{v:,.0f}",
          with_ratio=False)  # fmt: skip
    print()
    for run in runs:
        for note in run.notes:
            print(f"- {run.rows:,} rows: {note}")
    print("- rows are inserted in the order they would have arrived (random keys, expiring one after the")
    print("  other over one day), so the heap is in expiry order and the unique index as random arrival")
    print("  leaves it; autovacuum is off on every measured table; a CHECKPOINT precedes each measured phase")


def report_writes(writes: list[Written]) -> None:
    print("\n### WAL per fresh key through the extension (Flask's test client, one request per key)\n")
    print("| layout | keys before | CHECKPOINT before | requests | statuses | s | µs / request |"
          " WAL / key, bytes (this database) | of which full-page images | records without them |"
          " whole server / key |")  # fmt: skip
    print("|" + " --- |" * 11)

    def per(value: int | None, requests: int) -> str:
        return "-" if value is None else f"{value / requests:,.0f}"

    for w in writes:
        db, fpi, n = w.wal.database, w.wal.fpi, w.requests
        print(f"| {w.layout} | {w.prefill:,} | {'yes' if w.prefill else 'no'} | {w.requests:,} |"
              f" {w.statuses} | {w.seconds:.2f} |"
              f" {w.seconds / n * 1e6:,.0f} | {per(db, n)} | {per(fpi, n)} |"
              f" {per(None if db is None or fpi is None else db - fpi, n)} |"
              f" {per(w.wal.server, n)} |")  # fmt: skip
    print("\n- into an empty table, full-page images are those of the checkpoints that happened to run; into")
    print("  a table of keys right after a CHECKPOINT, nearly every insert is the first change to its index")
    print("  page since the checkpoint (random keys), as in a table of millions of keys between checkpoints")


def report_days(days: list[Day], per_day: int) -> None:
    if not days:
        return
    last = days[-1].day
    shown = [d for d in days if d.day in {1, 2, 3, last} or d.day % 5 == 0 or d.day in (31, 32, 38, 39)]
    print(f"\n### {last} simulated days at {per_day:,} keys a day (IDEM_KEY_TTL 1 day, IDEM_TOMBSTONE_TTL"
          " 30 days), retention daily at 01:00\n")  # fmt: skip
    print("| day | L3 full rows | L3 tombstones | L3 table MB | L3 purge + VACUUM s | L3 WAL MB |"
          " L4 rows | L4 compact tombstones | L4 keys MB | L4 tombstones MB | L4 total MB | L4 maintain s |"
          " L4 WAL MB | L4 partitions |")  # fmt: skip
    print("|" + " --- |" * 14)
    for d in shown:
        print(f"| {d.day} | {d.l3_rows:,} | {d.l3_tombstones:,} | {mb(d.l3_bytes)} | {d.l3_seconds:.2f} |"
              f" {mb(d.l3_wal.database)} | {d.l4_keys:,} | {d.l4_tombstones:,} | {mb(d.l4_key_bytes)} |"
              f" {mb(d.l4_tombstone_bytes)} | {mb(d.l4_key_bytes + d.l4_tombstone_bytes)} |"
              f" {d.l4_seconds:.2f} | {mb(d.l4_wal.database)} | {d.l4_partitions} |")  # fmt: skip
    l3 = sum(d.l3_wal.database or 0 for d in days)
    l4 = sum(d.l4_wal.database or 0 for d in days)
    print(f"\n- WAL of retention over the {last} days, this database: layout 3 {mb(l3)} MB, layout 4"
          f" {mb(l4)} MB; retention time: layout 3 {sum(d.l3_seconds for d in days):.1f} s, layout 4"
          f" {sum(d.l4_seconds for d in days):.1f} s")  # fmt: skip
    print("- the clock is bench_clock.now(), ahead of pg_catalog on the database's search_path; layout 3's")
    print(
        "  VACUUM stands for autovacuum (off on its table); layout 4's partitions: 1 day, made 8 days ahead;"
    )
    print("  its tombstones' partitions cover 7.5 days (a quarter of IDEM_TOMBSTONE_TTL) and go whole")


def projection(run: Run, writes: list[Written], rates: Sequence[int]) -> None:
    """Per day and per 30-day month at each rate, from the bytes and WAL per key measured (not run)."""
    k = run.keys
    ops = run.ops
    write = {w.layout: (w.wal.database or w.wal.server) / w.requests for w in writes if not w.prefill}
    full = {w.layout: (w.wal.database or w.wal.server) / w.requests for w in writes if w.prefill}

    def wal(name: str) -> float:
        m = ops[name]
        return (m.wal.database if m.wal.database is not None else m.wal.server) / run.rows

    def vacuum_wal(name: str) -> float:
        return (ops[name].vacuum_wal.database or ops[name].vacuum_wal.server) / run.rows

    l3_wal = (
        wal("l3 tombstone")
        + vacuum_wal("l3 tombstone")
        + wal("l3 delete tombstones")
        + vacuum_wal("l3 delete tombstones")
    )
    l3_work = sum(
        ops[n].seconds + (ops[n].vacuum_seconds or 0.0) for n in ("l3 tombstone", "l3 delete tombstones")
    )
    l3_work /= run.rows
    l4_wal = wal("l4 retire")
    l4_work = ops["l4 retire"].seconds / run.rows
    drop = ops["l4 drop"].seconds + ops["l4 ahead"].seconds
    print(f"\n### Per day and per 30-day month, computed from the {run.rows:,}-row figures (not run; the"
          " largest run whose retention WAL was read for this database alone)\n")  # fmt: skip
    print("| fresh keys a second | layout | keys a day | live storage, steady state, GB | WAL a day: writes,"
          " records, GB | writes, with full-page images, GB | WAL a day: retention, GB | retention work a"
          " day, s | WAL a month, TB | retention work a month, h |")  # fmt: skip
    print("|" + " --- |" * 10)
    for rate in rates:
        day = rate * DAY
        l3_store = day * (k["full3"].total + 30 * k["tombstone"].total)
        l4_store = day * (2 * k["full4"].total + 37.5 * k["compact"].total)
        for layout, store, ret_wal, work in (
            (3, l3_store, l3_wal * day, l3_work * day),
            (4, l4_store, l4_wal * day, l4_work * day + drop),
        ):
            records, paged = write.get(layout, 0.0) * day, full.get(layout, 0.0) * day
            most = max(records, paged)
            print(f"| {rate:,} | {layout} | {day:,.0f} | {store / 1e9:,.0f} | {records / 1e9:,.1f} |"
                  f" {paged / 1e9 if paged else float('nan'):,.1f} | {ret_wal / 1e9:,.1f} | {work:,.0f} |"
                  f" {(most + ret_wal) * 30 / 1e12:,.2f} | {work * 30 / 3600:,.1f} |")  # fmt: skip
    print(
        "\n- live storage: layout 3 keeps 1 day of full rows and 30 days of tombstones in one table; layout 4"
    )
    print("  at most 2 days of full rows (the current day's partition and the one past until it is dropped)")
    print("  and at most 37.5 days of compact tombstones (30 days, and a 7.5-day partition until it passes)")
    print("- retention of layout 3: tombstoning + deleting tombstones + the VACUUM after each, per key; of")
    print("  layout 4: writing compact tombstones per key + one detach, drop and partitions made ahead a day")
    print("- WAL of writes: the write path's figures, into an empty table (records) and into a table of keys")
    print("  after a CHECKPOINT (a full-page image at nearly every insert); the month counts the larger")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000], help="row counts")
    parser.add_argument("--quick", action="store_true", help="20,000 rows, 10 days of 5,000 keys")
    parser.add_argument("--server-url", default=DEFAULT_SERVER_URL, help="a server to create a database on")
    parser.add_argument("--rate", type=int, nargs="+", default=[1000, 10000],
                        help="fresh keys a second, for the projection")  # fmt: skip
    parser.add_argument("--days", type=int, help="days to simulate (default 40, 0: none)")
    parser.add_argument("--day-keys", type=int, help="keys a simulated day (default 20,000)")
    parser.add_argument("--requests", type=int, help="fresh keys through the extension (default 3,000)")
    parser.add_argument(
        "--prefill", type=int, help="keys in the table of the second write path (default 1,000,000; 0: none)"
    )
    parser.add_argument("--wal-cap-gb", type=float, default=4.0,
                        help="WAL a measuring slot may hold before it is let go (default 4 GB)")  # fmt: skip
    args = parser.parse_args()
    counts = [20_000] if args.quick else args.rows
    days = args.days if args.days is not None else 10 if args.quick else 40
    per_day = args.day_keys or (5_000 if args.quick else 20_000)
    requests = args.requests or (500 if args.quick else 3_000)
    prefill = args.prefill if args.prefill is not None else 50_000 if args.quick else 1_000_000
    cap = args.wal_cap_gb * 2**30
    # Layout 3's tables are kept on purpose: not the warning that says they could be upgraded.
    logging.getLogger("flask_idem").setLevel(logging.ERROR)
    print(f"# {machine('', 0, 0).split('; gunicorn')[0].split(', PostgreSQL')[0]}", flush=True)
    with scratch_database(args.server_url, DATABASE) as url:
        version = server_version(url)
        runs = []
        for rows in counts:
            print(f"# {rows:,} rows, load average {os.getloadavg()[0]:.2f}", flush=True)
            runs.append(measure(url, rows, cap))
        print(f"# write path, load average {os.getloadavg()[0]:.2f}", flush=True)
        writes = write_path(url, requests, cap, prefill)
    print(f"# {days} days, load average {os.getloadavg()[0]:.2f}", flush=True)
    simulated = simulate(args.server_url, days, per_day, cap) if days else []
    report_runs(runs)
    report_writes(writes)
    report_days(simulated, per_day)
    needed = ("l3 tombstone", "l3 delete tombstones", "l4 retire")
    read = [run for run in runs if all(run.ops[name].wal.database is not None for name in needed)]
    projection((read or runs)[-1], writes, args.rate)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"\n{machine(version, 0, 0).split('; gunicorn')[0]}; load average at the end {load}; no load"
          " generator: one connection at a time")  # fmt: skip


if __name__ == "__main__":
    main()
