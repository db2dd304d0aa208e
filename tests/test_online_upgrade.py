"""The upgrade under load: `flask idem migrate` on a full first-release table while requests keep coming.

Writers and retries run against the notes app the whole time, and as the upgrade starts a transaction
that wrote to the table stays open for a second (a slow request, a batch job). The test asserts what a
client sees (no 5xx, every key's note written once, replays) and how long any application backend
waited on a lock because of the migration: every few milliseconds a sampler reads ``pg_locks`` for lock
requests not granted whose blocking processes (``pg_blocking_pids``) include the migration's connection,
and how long each has waited (``waitstart``). The bound is the migration's lock timeout plus a little
slack: a statement that needs a strong lock waits that long at most, and then gives way. The control
runs the same upgrade with a plain ``CREATE INDEX`` instead of a concurrent build: it queues behind the
open transaction, every writer queues behind it, and the sampler sees them wait, so that a blocking
upgrade fails the first test. Both print their figures (the upgrades page quotes them).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idem import _layout, _migrate

from .support import citus
from .support.helpers import app_factory
from .support.layouts import catalog, check_distributed, create_first_release, drop, layout_of
from .support.notes_app import build_app, post

pytestmark = pytest.mark.slow

TABLE = "loaded_keys"
ROWS = 200_000
WRITERS = 6
#: The migration's lock timeout (IDEM_MIGRATION_LOCK_TIMEOUT), and the longest an application backend
#: may wait on the migration: that, and some slack for a busy machine.
LOCK_TIMEOUT = 0.1
BOUND = LOCK_TIMEOUT + 0.1
#: How long the transaction open as the upgrade starts stays open.
HOLD = 1.0

#: Lock requests of this database's application backends, not granted, that the migration's connection
#: holds up (directly, or by being ahead of them in the lock's queue); how long each has waited so far.
_BLOCKED = """
SELECT l.pid, l.waitstart, extract(epoch FROM clock_timestamp() - l.waitstart)
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE NOT l.granted AND l.waitstart IS NOT NULL AND a.datname = current_database()
    AND a.application_name IS DISTINCT FROM 'flask-idem migrate' AND l.pid <> pg_backend_pid()
    AND EXISTS (
        SELECT FROM pg_stat_activity AS m
        WHERE m.datname = current_database() AND m.application_name = 'flask-idem migrate'
            AND m.pid = ANY (pg_blocking_pids(l.pid))
    )
"""


@dataclass
class Run:
    """What one upgrade under load measured."""

    #: What the upgrade did, or the error it failed with.
    report: _migrate.Report | psycopg.Error
    seconds: float
    #: (during the upgrade, status, seconds) of every request.
    answers: list[tuple[bool, int, float]] = field(default_factory=list)
    keys: list[uuid.UUID] = field(default_factory=list)
    #: The longest each wait on the migration was seen to last, by (pid, when it began).
    waits: dict[tuple[int, Any], float] = field(default_factory=dict)

    def longest_wait(self) -> float:
        return max(self.waits.values(), default=0.0)

    def summary(self, title: str) -> str:
        statuses = Counter(status for _, status, _ in self.answers)
        before = [seconds for during, _, seconds in self.answers if not during]
        during = [seconds for during, _, seconds in self.answers if during]

        def ms(values: list[float], q: int) -> str:
            if len(values) < 2:
                return "-"
            return f"{statistics.quantiles(values, n=100, method='inclusive')[q - 1] * 1000:.0f}"

        report = self.report
        if isinstance(report, psycopg.Error):
            outcome = f"failed ({type(report).__name__}) after {self.seconds:.2f} s"
        else:
            outcome = f"to layout {report.after} in {self.seconds:.2f} s, {report.lock_retries} lock retries"
        return (
            f"\n{title}: upgrade of {ROWS:,} rows {outcome}; {len(self.answers)} requests ({dict(statuses)})"
            f"\n  latency before: p50 {ms(before, 50)} ms, p99 {ms(before, 99)} ms,"
            f" max {max(before, default=0) * 1000:.0f} ms"
            f"\n  latency during: p50 {ms(during, 50)} ms, p99 {ms(during, 99)} ms,"
            f" max {max(during, default=0) * 1000:.0f} ms ({len(during)} requests)"
            f"\n  waits of application backends on the migration's locks: {len(self.waits)},"
            f" longest {self.longest_wait() * 1000:.0f} ms (bound {BOUND * 1000:.0f} ms)"
        )


@pytest.fixture
def loaded(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """The first release's key table with ROWS finished keys in it; dropped afterwards."""
    drop(direct_database_url, TABLE)
    create_first_release(direct_database_url, TABLE, distributed=citus.ENABLED)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
            " SELECT i %% 50, gen_random_uuid(), sha256(i::text::bytea), 'POST', '/notes', 'completed',"
            " '{{\"status\": 201}}', now() + interval '1 day' FROM generate_series(1, %s) AS i"
        ).format(sql.Identifier(TABLE)),
        (ROWS,),
    )
    db.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(TABLE)))
    yield TABLE
    drop(direct_database_url, TABLE)


@pytest.fixture
def notes(database_url: str) -> Iterator[Callable[..., Flask]]:
    with app_factory(lambda **config: build_app(database_url, **config)[0]) as make:
        yield make


def upgrade_under_load(app: Flask, url: str, table: str) -> Run:
    """Upgrade ``table`` to the latest layout while WRITERS threads post fresh keys and retry each."""
    stop, upgrading = threading.Event(), threading.Event()
    lock = threading.Lock()
    answers: list[tuple[bool, int, float]] = []
    keys: list[uuid.UUID] = []
    waits: dict[tuple[int, Any], float] = {}

    def writer() -> None:
        while not stop.is_set():
            key = uuid.uuid4()
            for _ in range(2):  # the request, then its retry
                during = upgrading.is_set()
                started = time.perf_counter()
                status = post(app, "/notes", key, {"body": str(key)}).status_code
                with lock:
                    answers.append((during, status, time.perf_counter() - started))
            with lock:
                keys.append(key)

    def sampler() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while not stop.is_set():
                for pid, began, seconds in conn.execute(_BLOCKED).fetchall():
                    waits[pid, began] = max(waits.get((pid, began), 0.0), float(seconds))
                time.sleep(0.005)

    def holder() -> None:
        with psycopg.connect(url) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response,"
                    " expires_at) VALUES (1, gen_random_uuid(), sha256('x'), 'POST', '/x', 'completed',"
                    " '{{}}', now())"
                ).format(sql.Identifier(table))
            )
            held.set()
            time.sleep(HOLD)

    held = threading.Event()
    threads = [threading.Thread(target=writer) for _ in range(WRITERS)] + [threading.Thread(target=sampler)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # load before the upgrade, for comparison
        upgrading.set()
        threads.append(threading.Thread(target=holder))
        threads[-1].start()
        held.wait(10)
        started = time.perf_counter()
        report: _migrate.Report | psycopg.Error
        try:
            report = _migrate.upgrade(url, table=table, distributed=citus.ENABLED, lock_timeout=LOCK_TIMEOUT)
        except psycopg.Error as e:  # the control's, on Citus
            report = e
        took = time.perf_counter() - started
        upgrading.clear()
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return Run(report, took, answers, keys, waits)


def test_upgrade_under_load(
    loaded: str, notes: Callable[..., Flask], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """No 5xx, no note written twice, and no request held up by the migration for longer than its lock
    timeout, while every layout after the first is applied to a table of 200,000 keys."""
    app = notes(IDEM_TABLE=loaded, IDEM_POOL_MAX_SIZE=WRITERS + 2)
    run = upgrade_under_load(app, direct_database_url, loaded)
    print(run.summary("CREATE INDEX CONCURRENTLY"))
    assert isinstance(run.report, _migrate.Report), run.report
    assert run.report.applied == list(range(2, _layout.latest() + 1))
    assert layout_of(db, loaded) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, loaded)["indexes"])
    if citus.ENABLED:
        check_distributed(db, loaded)
    assert any(during for during, _, _ in run.answers)  # requests were served while it ran
    statuses = Counter(status for _, status, _ in run.answers)
    assert set(statuses) <= {200, 201, 409}, statuses  # no 5xx, nothing refused
    assert run.longest_wait() <= BOUND, run.waits
    written = dict(
        db.execute(
            "SELECT body, count(*) FROM notes WHERE body = ANY(%s) GROUP BY body",
            ([str(k) for k in run.keys],),
        ).fetchall()
    )
    assert written == {str(key): 1 for key in run.keys}  # each key's note once: no duplicate, none lost


def test_control_a_plain_index_build_is_seen_blocking(
    loaded: str,
    notes: Callable[..., Flask],
    direct_database_url: str,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: with layout 2's index built by a plain CREATE INDEX, which waits for a SHARE lock on
    the table behind the open transaction, the sampler sees the writers queued behind it past the bound
    (on Citus, whose deadlock detector may cancel the build once they have waited a while)."""

    def plain_build(runner: Any, index: _layout.Index) -> None:
        head = "CREATE UNIQUE INDEX IF NOT EXISTS {} " if index.unique else "CREATE INDEX IF NOT EXISTS {} "
        create = sql.SQL(head).format(runner.names[index.name])
        runner.conn.execute(create + sql.SQL(index.definition).format(**runner.names))

    monkeypatch.setattr(_migrate._Runner, "_build", plain_build)
    app = notes(IDEM_TABLE=loaded, IDEM_POOL_MAX_SIZE=WRITERS + 2)
    run = upgrade_under_load(app, direct_database_url, loaded)
    print(run.summary("plain CREATE INDEX (the control)"))
    assert run.longest_wait() > BOUND, run.waits
    if citus.ENABLED and isinstance(run.report, psycopg.errors.DeadlockDetected):
        return
    assert isinstance(run.report, _migrate.Report), run.report
    assert layout_of(db, loaded) == _layout.latest()
