"""The upgrade under load: `flask idem migrate` on a full first-release table while requests keep coming.

Writers and retries run against the notes app the whole time; the test asserts what a client sees (no
5xx, every key's note written once, replays) and prints what was measured: the requests' latencies
before and during the upgrade, and every wait of an application backend on a lock while it ran (sampled
from ``pg_stat_activity``). Figures are printed, not asserted.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idem import _layout, _migrate

from .support import citus
from .support.helpers import app_factory
from .support.layouts import catalog, create_first_release, drop, layout_of
from .support.notes_app import build_app, post

pytestmark = pytest.mark.slow

TABLE = "loaded_keys"
ROWS = 200_000
WRITERS = 6


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


def test_upgrade_under_load(
    loaded: str, notes: Callable[..., Flask], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """No 5xx, no note written twice, while layout 2's index is built on a table of 200,000 keys."""
    app = notes(IDEM_TABLE=loaded, IDEM_POOL_MAX_SIZE=WRITERS + 2)
    stop = threading.Event()
    upgrading = threading.Event()
    answers: list[tuple[bool, int, float]] = []  # (during the upgrade, status, seconds)
    keys: list[uuid.UUID] = []
    lock = threading.Lock()

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

    waits: list[float] = []

    def sampler() -> None:
        with psycopg.connect(direct_database_url, autocommit=True) as conn:
            while not stop.is_set():
                if upgrading.is_set():
                    rows = conn.execute(
                        "SELECT extract(epoch FROM now() - query_start) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                        " AND application_name <> 'flask-idem migrate' AND pid <> pg_backend_pid()"
                    ).fetchall()
                    waits.extend(float(row[0]) for row in rows)
                time.sleep(0.01)

    threads = [threading.Thread(target=writer) for _ in range(WRITERS)] + [threading.Thread(target=sampler)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # load before the upgrade, for comparison
        upgrading.set()
        started = time.perf_counter()
        report = _migrate.upgrade(direct_database_url, table=loaded, distributed=citus.ENABLED)
        took = time.perf_counter() - started
        upgrading.clear()
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    statuses = Counter(status for _, status, _ in answers)
    before = [seconds for during, _, seconds in answers if not during]
    during = [seconds for during, _, seconds in answers if during]

    def ms(values: list[float], q: int) -> str:
        return (
            f"{statistics.quantiles(values, n=100, method='inclusive')[q - 1] * 1000:.1f}"
            if len(values) > 1
            else "-"
        )

    print(
        f"\nupgrade of {ROWS:,} rows to layout {report.after}: {took:.2f} s,"
        f" {report.lock_retries} lock retries; {len(answers)} requests ({dict(statuses)})"
        f"\nlatency before: p50 {ms(before, 50)} ms, p99 {ms(before, 99)} ms, max {max(before) * 1000:.1f} ms"
        f"\nlatency during: p50 {ms(during, 50)} ms, p99 {ms(during, 99)} ms,"
        f" max {max(during, default=0) * 1000:.1f} ms ({len(during)} requests)"
        f"\napplication backends seen waiting on a lock during the upgrade: {len(waits)} samples,"
        f" longest {max(waits, default=0) * 1000:.1f} ms"
    )
    assert report.applied == list(range(2, _layout.latest() + 1))
    assert layout_of(db, loaded) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, loaded)["indexes"])
    assert during  # requests were served while it ran
    assert set(statuses) <= {200, 201, 409}, statuses  # no 5xx, nothing refused
    written = dict(
        db.execute(
            "SELECT body, count(*) FROM notes WHERE body = ANY(%s) GROUP BY body", ([str(k) for k in keys],)
        ).fetchall()
    )
    assert written == {str(key): 1 for key in keys}  # each key's note once: no duplicate, none lost
