"""Retention of the key table: today's purge against dropping a time partition, and bytes per key.

Issue 32, section 4, before layout 4 exists: what retention costs today, side by side with a hand-made
stand-in of the target, so that the session building layout 4 can print one against the other::

    uv run python bench/retention.py                       # 100,000 and 1,000,000 rows
    uv run python bench/retention.py --rows 1000000 10000000
    uv run python bench/retention.py --quick               # 20,000 rows, a few seconds

For each row count it fills a scratch database fast (one ``INSERT ... SELECT FROM generate_series`` per
million rows) with expired keys shaped like the shop's, then measures:

- today: flask-idem's own ``Store.purge`` (what ``flask idem purge`` runs) on the key table created by
  flask-idem's own migration, in its three cases: full rows past ``IDEM_KEY_TTL`` turned into tombstones
  (an UPDATE per row), tombstones past ``IDEM_TOMBSTONE_TTL`` deleted, and full rows deleted when
  ``IDEM_TOMBSTONE_TTL`` is 0; then the ``VACUUM`` that follows;
- the target, on a stand-in that is *not* flask-idem code: the same rows in a table partitioned by range
  of ``expires_at``, one partition holding every expired row, dropped with ``DETACH PARTITION ...
  CONCURRENTLY`` and ``DROP TABLE``;
- bytes per key: a full row, today's tombstone, and a stand-in compact tombstone (a narrow table).

WAL is counted twice: the records of the scratch database alone (read back with ``pg_walinspect``,
under a temporary replication slot that keeps the segments until they are read), and the whole server's
``pg_current_wal_lsn()`` difference, which includes whatever other sessions wrote meanwhile. Nothing here
asserts; it prints tables.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from flask import Flask
from psycopg import sql

from bench.harness import DEFAULT_SERVER_URL, scratch_database, server_version
from bench.report import machine
from flask_idem import Idempotency
from flask_idem._migrate import upgrade
from flask_idem._state import get_state

DATABASE = "flask_idem_bench_retention"
ORG = 1
BATCH = 1_000_000
DAY = 86_400.0
#: A response document of the shop's shape, about 260 bytes as JSON text: status, the two headers, and a
#: body of an order (its id and Location vary per row).
RESPONSE = """jsonb_build_object(
    'status', 201,
    'headers', jsonb_build_array(jsonb_build_array('Content-Type', 'application/json'),
                                 jsonb_build_array('Location', '/orders/' || i)),
    'body', format('{"id": %%s, "amount": 1250, "currency": "EUR", "status": "created", '
                   '"created_at": "2025-01-01T12:00:00Z", "reference": "%%s"}', i, left(md5(i::text), 8)))"""
#: What today's purge leaves of that response (flask_idem/_store.sql, block "tombstone").
TOMBSTONE = """jsonb_build_object(
    'tombstone', true, 'status', 201,
    'headers', jsonb_build_array(jsonb_build_array('Location', '/orders/' || i)))"""
FILL = """
INSERT INTO {table} (org_id, idem_key, request_sha, method, path, status, response, created_at, expires_at)
SELECT %(org)s, k, sha256(uuid_send(k)), 'POST', '/orders', 'completed', {response},
       e - interval '1 day', e
FROM (SELECT gen_random_uuid() AS k, i,
             now() - make_interval(secs => %(expired)s + 86400.0 * (%(rows)s - i) / %(rows)s) AS e
      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i) AS keys
"""
#: The stand-in of a compact tombstone: what a late retry needs (issue 32, section 2), with its key.
COMPACT = """
CREATE TABLE compact_tombstones (
    org_id bigint NOT NULL, idem_key uuid NOT NULL, request_sha bytea NOT NULL, status smallint NOT NULL,
    location text, expires_at timestamptz NOT NULL, PRIMARY KEY (org_id, idem_key))
WITH (autovacuum_enabled = false)
"""
FILL_COMPACT = """
INSERT INTO compact_tombstones
SELECT %(org)s, k, sha256(uuid_send(k)), 201, '/orders/' || i, now() + interval '29 days'
FROM (SELECT gen_random_uuid() AS k, i FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i) AS keys
"""
#: The stand-in of layout 4's key table: today's columns, partitioned by range of expires_at. The
#: primary key must hold the partition column (which is why deduplication across partitions is layout
#: 4's real problem, not measured here).
PARTITIONED = """
CREATE TABLE parted (LIKE today_layout INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (expires_at);
ALTER TABLE parted ADD PRIMARY KEY (org_id, idem_key, expires_at);
CREATE INDEX ON parted (expires_at);
CREATE TABLE parted_expired PARTITION OF parted FOR VALUES FROM (MINVALUE) TO ({boundary})
    WITH (autovacuum_enabled = false, fillfactor = 80);
CREATE TABLE parted_live PARTITION OF parted FOR VALUES FROM ({boundary}) TO (MAXVALUE)
    WITH (autovacuum_enabled = false, fillfactor = 80);
"""
#: Records of this database: their blocks are in it, or their transaction wrote some (its commit).
WAL_OF_DATABASE = """
WITH r AS (SELECT xid, record_length, block_ref FROM pg_get_wal_records_info(%(start)s, %(end)s)),
     ours AS (SELECT DISTINCT xid FROM r WHERE block_ref LIKE %(pattern)s AND xid <> '0')
SELECT coalesce(sum(record_length), 0)::bigint FROM r
WHERE block_ref LIKE %(pattern)s OR xid IN (SELECT xid FROM ours)
"""


@dataclass
class Wal:
    database: int = 0
    server: int = 0


@dataclass
class Measured:
    """One operation at one row count."""

    seconds: float = 0.0
    wal: Wal = field(default_factory=Wal)
    size_before: int = 0
    size_after: int = 0
    vacuum_seconds: float = 0.0
    vacuum_wal: Wal = field(default_factory=Wal)
    size_vacuumed: int = 0
    done: str = ""


@dataclass
class PerKey:
    """Bytes per key of one kind of row: the row itself, and table plus indexes over the rows."""

    row: float
    total: float


class Meter:
    """WAL written between two moments: this database's records, and the whole server's."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
        assert oid is not None
        self.pattern = f"% rel %/{oid[0]}/%"

    def lsn(self) -> str:
        row = self.conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    @contextmanager
    def measure(self, into: Wal) -> Iterator[None]:
        self.conn.execute("CHECKPOINT")  # full-page images start afresh, as after any checkpoint
        start = self.lsn()
        yield
        end = self.lsn()
        self.conn.execute("SELECT pg_switch_wal()")  # the records up to end are flushed, readable
        params = {"start": start, "end": end, "pattern": self.pattern}
        row = self.conn.execute(WAL_OF_DATABASE, params).fetchone()
        server = self.conn.execute("SELECT pg_wal_lsn_diff(%s, %s)::bigint", (end, start)).fetchone()
        assert row is not None and server is not None
        into.database, into.server = int(row[0]), int(server[0])


def fill(conn: psycopg.Connection[Any], table: str, rows: int, response: str, expired: float,
         statement: str = FILL) -> None:  # fmt: skip
    """``rows`` completed keys, one statement per million rows, in the order they would have arrived:
    random keys, expiring one after the other over one day up to ``expired`` seconds ago."""
    text = sql.SQL(statement).format(table=sql.Identifier(table), response=sql.SQL(response))
    for first in range(1, rows + 1, BATCH):
        last = min(rows, first + BATCH - 1)
        params = {"org": ORG, "first": first, "last": last, "rows": rows, "expired": expired}
        conn.execute(text, params)


def size(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (table,)).fetchone()
    assert row is not None
    return int(row[0])


def per_key(conn: psycopg.Connection[Any], table: str, rows: int) -> PerKey:
    query = sql.SQL("SELECT avg(pg_column_size(k.*))::float8 FROM {} AS k").format(sql.Identifier(table))
    row = conn.execute(query).fetchone()
    assert row is not None
    return PerKey(row=float(row[0]), total=size(conn, table) / rows)


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def key_table(url: str, name: str) -> None:
    """Today's key table, created by flask-idem's own migration, autovacuum off (VACUUM is measured)."""
    upgrade(url, table=name, echo=lambda _: None)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(sql.Identifier(name)))


def purge_today(url: str, meter: Meter, table: str, tombstone_ttl: float) -> Measured:
    """flask-idem's own purge until it finds nothing left, then VACUUM, each measured."""
    conn = meter.conn
    app = Flask("bench-retention")
    app.config.update(
        MAX_CONTENT_LENGTH=65536, IDEM_DATABASE_URL=url, IDEM_TABLE=table, IDEM_TOMBSTONE_TTL=tombstone_ttl
    )
    Idempotency(app, scope=lambda: ORG)
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
        store.source.close()
    found.done = f"{totals[0]:,} deleted, {totals[1]:,} tombstoned"
    found.size_after = size(conn, table)
    vacuum = sql.SQL("VACUUM {}").format(sql.Identifier(table))
    with meter.measure(found.vacuum_wal):
        found.vacuum_seconds = timed(lambda: conn.execute(vacuum))
    found.size_vacuumed = size(conn, table)
    return found


def drop_partition(meter: Meter) -> Measured:
    """The stand-in's retention: detach the expired partition without blocking, then drop it."""
    conn = meter.conn
    found = Measured(size_before=size(conn, "parted_expired") + size(conn, "parted_live"))

    def retire() -> None:
        conn.execute("ALTER TABLE parted DETACH PARTITION parted_expired CONCURRENTLY")
        conn.execute("DROP TABLE parted_expired")

    with meter.measure(found.wal):
        found.seconds = timed(retire)
    found.size_after = found.size_vacuumed = size(conn, "parted_live")
    found.done = "1 partition detached and dropped"
    return found


@dataclass
class Run:
    rows: int
    ops: dict[str, Measured] = field(default_factory=dict)
    keys: dict[str, PerKey] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


OPS = {
    "tombstone": "today: purge turns expired full rows into tombstones (UPDATE)",
    "delete tombstones": "today: purge deletes tombstones past IDEM_TOMBSTONE_TTL (DELETE)",
    "delete rows": "today: purge deletes expired full rows, IDEM_TOMBSTONE_TTL=0 (DELETE)",
    "partition": "stand-in: DETACH PARTITION CONCURRENTLY + DROP TABLE",
}
KEYS = {
    "full": "full row (today, and the stand-in's partitions)",
    "tombstone": "tombstone of today (the row after purge's UPDATE)",
    "compact": "compact tombstone (stand-in: narrow table + primary key)",
}


def measure(url: str, rows: int) -> Run:
    run = Run(rows)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET work_mem = '256MB'")
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        # Keeps every WAL segment from now on until this connection closes, so that the records of a
        # measured range are still there to be read: a slot of this session only, dropped with it.
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (f"{DATABASE}_{rows}",))
        meter = Meter(conn)

        # Full rows past their retention, tombstones kept 30 days: purge turns them into tombstones.
        key_table(url, "today_layout")
        fill(conn, "today_layout", rows, RESPONSE, expired=3600)
        conn.execute("VACUUM ANALYZE today_layout")
        run.keys["full"] = per_key(conn, "today_layout", rows)
        length = conn.execute("SELECT avg(octet_length(response::text))::int FROM today_layout").fetchone()
        assert length is not None
        run.notes.append(f"response document: {length[0]} bytes of JSON text on average")
        run.ops["tombstone"] = purge_today(url, meter, "today_layout", 30 * DAY)
        run.keys["tombstone"] = PerKey(per_key(conn, "today_layout", rows).row, 0.0)

        # Tombstones past their period (filled as purge leaves them, packed): purge deletes them.
        key_table(url, "today_tombstones")
        fill(conn, "today_tombstones", rows, TOMBSTONE, expired=3600)
        conn.execute("VACUUM ANALYZE today_tombstones")
        run.keys["tombstone"].total = size(conn, "today_tombstones") / rows
        run.ops["delete tombstones"] = purge_today(url, meter, "today_tombstones", 30 * DAY)

        # No tombstones kept: expired full rows deleted.
        key_table(url, "today_no_tombstones")
        fill(conn, "today_no_tombstones", rows, RESPONSE, expired=3600)
        conn.execute("VACUUM ANALYZE today_no_tombstones")
        run.ops["delete rows"] = purge_today(url, meter, "today_no_tombstones", 0.0)
        for table in ("today_layout", "today_tombstones", "today_no_tombstones"):
            conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))

        # The target's stand-in: the same full rows in the expired partition, a few live ones beside.
        key_table(url, "today_layout")  # only as the template of the columns
        boundary = sql.Literal(time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime()))
        for statement in PARTITIONED.split(";\n"):
            if statement.strip():
                conn.execute(sql.SQL(statement).format(boundary=boundary))
        fill(conn, "parted", rows, RESPONSE, expired=3600)
        fill(conn, "parted", min(rows, 1000), RESPONSE, expired=-DAY)
        conn.execute("VACUUM ANALYZE parted_expired")
        conn.execute("VACUUM ANALYZE parted_live")
        run.ops["partition"] = drop_partition(meter)
        conn.execute("DROP TABLE parted, today_layout")

        conn.execute(COMPACT)
        fill(conn, "compact_tombstones", rows, "", expired=0, statement=FILL_COMPACT)
        conn.execute("VACUUM ANALYZE compact_tombstones")
        run.keys["compact"] = per_key(conn, "compact_tombstones", rows)
        conn.execute("DROP TABLE compact_tombstones")
    return run


def mb(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def ratio(values: Sequence[float]) -> str:
    return f"{values[-1] / values[0]:.2f}" if len(values) > 1 and values[0] else "-"


def table(title: str, runs: Sequence[Run], lines: dict[str, list[float]], show: Callable[[float], str],
          with_ratio: bool = True) -> None:  # fmt: skip
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


def projection(run: Run, rate: int, key_ttl_days: float, tombstone_days: float) -> None:
    """What the live table holds at a steady ``rate`` of fresh keys, from the bytes per key measured."""
    per_day = rate * DAY
    full, tomb, compact = run.keys["full"].total, run.keys["tombstone"].total, run.keys["compact"].total
    today = per_day * (key_ttl_days * full + tombstone_days * tomb)
    # Daily partitions: a row stays until its whole partition is dropped, up to one partition more.
    target = per_day * ((key_ttl_days + 1) * full + tombstone_days * compact)
    print(
        f"\n### Live table at {rate:,} fresh keys a second, steady state after 30 days (computed, not run)\n"
    )
    print("| layout | full rows | tombstones | GB |\n| --- | --- | --- | --- |")
    print(f"| today | {per_day * key_ttl_days:,.0f} | {per_day * tombstone_days:,.0f} | {today / 1e9:,.1f} |")
    print(f"| stand-in of layout 4, daily partitions | {per_day * (key_ttl_days + 1):,.0f} |"
          f" {per_day * tombstone_days:,.0f} | {target / 1e9:,.1f} |")  # fmt: skip
    print(f"\nFrom the table+indexes bytes per key at {run.rows:,} rows, IDEM_KEY_TTL {key_ttl_days:g} day,"
          f" IDEM_TOMBSTONE_TTL {tombstone_days:g} days; no bloat, no VACUUM lag counted.")  # fmt: skip


def report(runs: list[Run], version: str, rate: int) -> None:
    ops = {name: [run.ops[name] for run in runs] for name in OPS}
    print("Retention of the key table (issue 32, section 4). The partitioned table and the compact tombstone")
    print("are hand-made stand-ins of layout 4, NOT flask-idem code; 'today' is flask-idem's own migration")
    print("and Store.purge (flask idem purge, batches of 1000).")
    print()
    for name, text in OPS.items():
        print(f"- {name}: {text} ({'; '.join(m.done for m in ops[name])})")

    def line(value: Callable[[Measured], float]) -> dict[str, list[float]]:
        return {name: [value(m) for m in found] for name, found in ops.items()}

    table("Retention time, seconds", runs, line(lambda m: m.seconds), lambda v: f"{v:.3f}")
    table("WAL of the retention, MB (this database's records)", runs, line(lambda m: m.wal.database), mb)
    table("WAL of the retention, MB (whole server: includes other sessions)", runs,
          line(lambda m: m.wal.server), mb)  # fmt: skip
    table("WAL per expired key, bytes (this database)", runs,
          {name: [m.wal.database / run.rows for m, run in zip(found, runs, strict=True)]
           for name, found in ops.items()}, lambda v: f"{v:,.1f}")  # fmt: skip
    table("Table + indexes before, MB", runs, line(lambda m: m.size_before), mb)
    table("Table + indexes after the retention, MB", runs, line(lambda m: m.size_after), mb)
    table("VACUUM after the retention, seconds (none after a drop)", runs,
          line(lambda m: m.vacuum_seconds), lambda v: f"{v:.3f}")  # fmt: skip
    table("WAL of that VACUUM, MB (this database)", runs, line(lambda m: m.vacuum_wal.database), mb)
    table("Table + indexes after VACUUM, MB", runs, line(lambda m: m.size_vacuumed), mb)
    keys = {
        **{f"{text}: row" : [run.keys[name].row for run in runs] for name, text in KEYS.items()},
        **{f"{text}: table + indexes / rows": [run.keys[name].total for run in runs]
           for name, text in KEYS.items()},
        "compact tombstone / full row, table + indexes (goal ≤ 0.33)":
            [run.keys["compact"].total / run.keys["full"].total for run in runs],
    }  # fmt: skip
    table("Bytes per key", runs, keys, lambda v: f"{v:,.2f}" if v < 10 else f"{v:,.0f}", with_ratio=False)
    projection(runs[-1], rate, 1.0, 30.0)
    print()
    for run in runs:
        for note in run.notes:
            print(f"- {run.rows:,} rows: {note}")
    print("- rows are inserted in the order they would have arrived (random keys, expiring one after the")
    print(
        "  other over one day), so the heap is in expiry order and the primary key as random arrival leaves"
    )
    print("  it; autovacuum is off on every measured table")
    print(f"\n{machine(version, 0, 0).split('; gunicorn')[0]}; no load generator: one connection at a time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000], help="row counts")
    parser.add_argument("--quick", action="store_true", help="20,000 rows only (a few seconds)")
    parser.add_argument("--server-url", default=DEFAULT_SERVER_URL, help="a server to create a database on")
    parser.add_argument("--rate", type=int, default=1000, help="fresh keys a second, for the projection")
    args = parser.parse_args()
    counts = [20_000] if args.quick else args.rows
    with scratch_database(args.server_url, DATABASE) as url:
        version = server_version(url)
        runs = [measure(url, rows) for rows in counts]
    report(runs, version, args.rate)


if __name__ == "__main__":
    main()
