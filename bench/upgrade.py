"""How long the upgrade from layout 3 to layout 4 takes, per million keys, and how long it holds writers up.

    uv run python bench/upgrade.py                     # 100,000 and 1,000,000 keys (~3 min, ~1 GB of disk)
    uv run python bench/upgrade.py --rows 200000       # any row counts
    uv run python bench/upgrade.py --quick             # 20,000 keys, a few seconds

For each row count it makes a scratch database whose key table is in layout 3 (flask-idem's own
revisions 1 to 3), fills it fast with finished keys shaped like the shop's (a response of about 260
bytes, expiring over the next 24 hours), and runs flask-idem's own upgrade to layout 4
(``flask_idem._migrate.upgrade``, what ``flask idem migrate`` runs) while one thread inserts keys and
another reads them, each statement on its own and timed. It prints, for each step of the revision: how
long it took, and the longest a write and a read waited while it ran:

1. DDL: the transaction that adds the ``task`` column, the two ``NOT VALID`` checks and the tombstones'
   table (``ACCESS EXCLUSIVE`` for an instant);
2. the unique index ``(org_id, idem_key, expires_at)``, built with ``CREATE UNIQUE INDEX CONCURRENTLY``
   (writers go on);
3. the validation of the two checks (a scan under ``SHARE UPDATE EXCLUSIVE``: writers go on);
4. the swap: the rename, the partitioned table, the attach of the old one as its first partition, and
   the layout recorded (``ACCESS EXCLUSIVE``, no scan, no build).

Steps are timed by wrapping the migration's own two methods that run them (``_Runner.transaction`` and
``_Runner._build``); the database is real. Also printed: the WAL the upgrade wrote (the server's
``pg_current_wal_lsn()`` difference, other sessions included) and the baseline latency of the same
statements before the upgrade. The machine is shared, so figures are of one run; the shape is the point.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import psycopg

from bench.harness import DEFAULT_SERVER_URL, scratch_database, server_version
from flask_idem import _layout, _migrate

DATABASE = "flask_idem_bench_upgrade"
TABLE = "idempotency_keys"
BATCH = 1_000_000
#: A response of the shop's shape (bench/retention.py's), about 260 bytes as JSON text.
FILL = """
INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response, created_at,
                              expires_at)
SELECT i %% 1000, k, sha256(uuid_send(k)), 'POST', '/orders', 'completed',
       jsonb_build_object(
           'status', 201,
           'headers', jsonb_build_array(jsonb_build_array('Content-Type', 'application/json'),
                                        jsonb_build_array('Location', '/orders/' || i)),
           'body', format('{"id": %%s, "amount": 1250, "currency": "EUR", "status": "created", '
                          '"created_at": "2025-01-01T12:00:00Z", "reference": "%%s"}',
                          i, left(md5(i::text), 8))),
       now() - interval '1 hour', now() + make_interval(secs => 86400.0 * i / %(rows)s)
FROM (SELECT gen_random_uuid() AS k, i FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i) AS keys
"""
#: What the writer sends: a finished key, as flask-idem's layout-3 insert_completed writes it.
WRITE = """
INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response, expires_at)
VALUES (7, %s, sha256('bench'), 'POST', '/orders', 'completed', '{"status": 201}', now() + interval '1 day')
"""
#: What the reader sends: a key's row, as a replay reads it.
READ = "SELECT status, response FROM idempotency_keys WHERE org_id = 7 AND idem_key = %s"
#: Lock requests of this database's other sessions, not granted, that the migration's connection holds
#: up (directly, or by being ahead of them in the lock's queue), and how long each has waited so far
#: (tests/test_online_upgrade.py's sampler).
BLOCKED = """
SELECT l.pid, l.waitstart, extract(epoch FROM clock_timestamp() - l.waitstart)::float8
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE NOT l.granted AND l.waitstart IS NOT NULL AND a.datname = current_database()
    AND a.application_name IS DISTINCT FROM 'flask-idem migrate' AND l.pid <> pg_backend_pid()
    AND EXISTS (
        SELECT FROM pg_stat_activity AS m
        WHERE m.datname = current_database() AND m.application_name = 'flask-idem migrate'
            AND m.pid = ANY (pg_blocking_pids(l.pid))
    )
"""
STEPS = ("DDL", "unique index", "validate", "swap + record")


@dataclass
class Timed:
    """Statements sent one after the other by a thread: (start, seconds) of each."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def during(self, start: float, end: float) -> list[float]:
        """Seconds of the statements that were running at some moment of ``[start, end]``."""
        return [seconds for began, seconds in self.samples if began <= end and began + seconds >= start]


def _client(url: str, statement: str, out: Timed, stop: threading.Event, keys: list[uuid.UUID]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = 0")
        while not stop.is_set():
            if statement is WRITE:
                key = uuid.uuid4()
            else:
                key = keys[-1] if keys else uuid.uuid4()
            began = time.perf_counter()
            conn.execute(statement, (key,))  # type: ignore[call-overload]  # the module's constants
            out.samples.append((began, time.perf_counter() - began))
            if statement is WRITE:
                keys.append(key)
            time.sleep(0.002)


def _sampler(url: str, waits: dict[tuple[int, Any], tuple[float, float]], stop: threading.Event) -> None:
    """Every 5 ms: each wait of a writer or reader on the migration, (when it was seen last, its length)."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            for pid, began, seconds in conn.execute(BLOCKED).fetchall():
                waits[pid, began] = (time.perf_counter(), max(waits.get((pid, began), (0, 0.0))[1], seconds))
            time.sleep(0.005)


@contextmanager
def step_timer() -> Iterator[list[tuple[float, float]]]:
    """(start, end) of each transaction and index build of the migration, in order."""
    windows: list[tuple[float, float]] = []
    transaction, build = _migrate._Runner.transaction, _migrate._Runner._build

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                windows.append((began, time.perf_counter()))

        return run

    with (
        mock.patch.object(_migrate._Runner, "transaction", timed(transaction)),
        mock.patch.object(_migrate._Runner, "_build", timed(build)),
    ):
        yield windows


def fill(url: str, rows: int) -> float:
    """Make the key table in layout 3 and fill it with ``rows`` keys; the seconds it took."""
    to_layout_3 = _layout.revisions()[:3]
    with mock.patch.object(_layout, "revisions", lambda: to_layout_3):
        _migrate.upgrade(url, table=TABLE, echo=lambda _: None)
    began = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for first in range(1, rows + 1, BATCH):
            conn.execute(FILL, {"rows": rows, "first": first, "last": min(first + BATCH - 1, rows)})
        conn.execute("VACUUM ANALYZE idempotency_keys")
    return time.perf_counter() - began


def _lsn(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
    assert row is not None
    return row[0]


def measure(server: str, rows: int) -> dict[str, Any]:
    with scratch_database(server, DATABASE) as url:
        filled = fill(url, rows)
        with psycopg.connect(url, autocommit=True) as conn:
            size = conn.execute("SELECT pg_total_relation_size('idempotency_keys')").fetchone()[0]  # type: ignore[index]
            keys: list[uuid.UUID] = []
            writes, reads, stop = Timed(), Timed(), threading.Event()
            waits: dict[tuple[int, Any], tuple[float, float]] = {}
            threads = [
                threading.Thread(target=_client, args=(url, WRITE, writes, stop, keys)),
                threading.Thread(target=_client, args=(url, READ, reads, stop, keys)),
                threading.Thread(target=_sampler, args=(url, waits, stop)),
            ]
            for thread in threads:
                thread.start()
            try:
                time.sleep(1.0)  # the baseline
                base_end = time.perf_counter()
                wal_before = _lsn(conn)
                with step_timer() as windows:
                    began = time.perf_counter()
                    report = _migrate.upgrade(url, table=TABLE, echo=lambda _: None)
                    ended = time.perf_counter()
                wal = conn.execute(
                    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal_before,)
                ).fetchone()[0]  # type: ignore[index]
                time.sleep(0.5)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
            index = conn.execute("SELECT pg_relation_size('idempotency_keys_p0_key_idx')").fetchone()[0]  # type: ignore[index]
        assert report.applied == [4], report
        # The migration's transactions and build in order: the DDL, the build, the validation, the swap
        # (each transaction once: nothing waited past the lock timeout on this quiet table).
        labelled = dict(zip(STEPS, windows, strict=True))
        return {
            "rows": rows,
            "fill": filled,
            "size": size,
            "index": index,
            "total": ended - began,
            "locked": max((seconds for _, seconds in waits.values()), default=0.0),
            "locked_steps": {
                name: max((s for seen, s in waits.values() if start <= seen <= end + 0.01), default=0.0)
                for name, (start, end) in labelled.items()
            },
            "steps": {
                name: (
                    end - start,
                    max(writes.during(start, end), default=0.0),
                    max(reads.during(start, end), default=0.0),
                )
                for name, (start, end) in labelled.items()
            },
            "write_max": max(writes.during(began, ended), default=0.0),
            "read_max": max(reads.during(began, ended), default=0.0),
            "base": [s for t, s in writes.samples if t < base_end],
            "retries": report.lock_retries,
            "wal": wal,
            "writes": len(writes.during(began, ended)),
        }


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| keys in layout 3 | table size | upgrade | per million keys | "
        + " | ".join(STEPS)
        + " | unique index size | WAL |",
        "| ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in STEPS) + " | ---: | ---: |",
    ]
    for r in results:
        per_million = r["total"] * 1_000_000 / r["rows"]
        steps = " | ".join(ms(r["steps"][name][0]) for name in STEPS)
        lines.append(
            f"| {r['rows']:,} | {r['size'] / 2**20:,.0f} MB | {ms(r['total'])} | {ms(per_million)} | {steps}"
            f" | {r['index'] / 2**20:,.0f} MB | {r['wal'] / 2**20:,.0f} MB |"
        )
    lines += [
        "",
        "Held up: the longest wait of the writer or the reader on a lock of the migration (sampled every"
        " 5 ms from pg_locks), in all and while each step ran; and the slowest write / read statement"
        " during the upgrade (lock waits and a busy machine alike), against the writes before it:",
        "",
        "| keys | lock wait on the migration | "
        + " | ".join(STEPS)
        + " | slowest write / read during | write before: p50 / max |",
        "| ---: | ---: | " + " | ".join("---:" for _ in STEPS) + " | ---: | ---: |",
    ]
    for r in results:
        locked = " | ".join(ms(r["locked_steps"][n]) for n in STEPS)
        base = r["base"]
        lines.append(
            f"| {r['rows']:,} | {ms(r['locked'])} | {locked} | {ms(r['write_max'])} / {ms(r['read_max'])}"
            f" | {ms(statistics.median(base))} / {ms(max(base))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--quick", action="store_true", help="20,000 keys only")
    parser.add_argument("--server", default=DEFAULT_SERVER_URL)
    args = parser.parse_args()
    rows = [20_000] if args.quick else args.rows
    import os

    print(
        f"PostgreSQL {server_version(args.server)}, {os.cpu_count()} CPUs, load average"
        f" {', '.join(f'{v:.2f}' for v in os.getloadavg())} at the start (a shared machine)"
    )
    results = []
    for count in rows:
        result = measure(args.server, count)
        print(
            f"  {count:,} keys: filled in {result['fill']:.1f} s; upgraded in {ms(result['total'])},"
            f" {result['writes']} writes meanwhile, {result['retries']} lock retries",
            flush=True,
        )
        results.append(result)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
