"""Idempotent Celery tasks on real workers and the real RabbitMQ: redelivery, kills, the relay's duplicates.

Every test runs ``celery worker`` processes (prefork) of tests/support/jobs_app.py on a queue of its own, fed
by the outbox through the relay, and SIGKILLs what a crash would kill, or counts what the retries carry.
Skipped, saying why, where no broker answers (tests/support/celery_workers.py); CI has one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from flask import Flask

from flask_idem.relay import relay

from .support.celery_workers import BROKER_URL, broker_marks, delete_queue, kill, new_queue, running, worker
from .support.helpers import close_pool, wait_for
from .support.jobs_app import SCHEMA, build_jobs_app, jobs, receipts
from .support.servers import ROOT

pytestmark = broker_marks()


@pytest.fixture
def setup(
    database_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> Iterator[tuple[Flask, dict[str, str]]]:
    """The jobs app on a fresh queue, and the environment of its workers; the queue is deleted after."""
    db.execute(SCHEMA)
    env = {
        "JOBS_DATABASE_URL": database_url,
        "JOBS_BROKER_URL": BROKER_URL,
        "JOBS_QUEUE": new_queue(),
        "JOBS_TRACE": str(tmp_path / "trace"),
        "JOBS_MAILDIR": str(tmp_path / "maildir"),
    }
    app = build_jobs_app(
        database_url,
        broker_url=BROKER_URL,
        queue=env["JOBS_QUEUE"],
        trace=env["JOBS_TRACE"],
        maildir=env["JOBS_MAILDIR"],
    )
    yield app, env
    close_pool(app)
    delete_queue(env["JOBS_QUEUE"])


def enqueue(app: Flask, task: str, *args: Any, **kwargs: Any) -> uuid.UUID:
    """Write one message for organisation 1 in a committed transaction; return the task's key."""
    with app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
        return jobs.enqueue(task, *args, conn=conn, org_id=1, key=uuid.uuid4(), **kwargs)


def trace(env: dict[str, str]) -> list[list[str]]:
    path = Path(env["JOBS_TRACE"])
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def completed(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'").fetchone()
    return int(row[0]) if row else 0


def test_workers_run_every_task_once_despite_the_relays_duplicates(
    setup: tuple[Flask, dict[str, str]], db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Eight tasks, each published twice (a relay SIGKILLed between publish and mark, then the next one):
    two worker processes run each task's function once, and the duplicates replay or wait their turn."""
    app, env = setup
    keys = [enqueue(app, "jobs.add", n, hold=0.2) for n in range(6)] + [
        enqueue(app, "jobs.mail", f"{n}@example.com") for n in range(2)
    ]
    script = f"from tests.support.jobs_app import relay_killed_after; relay_killed_after({len(keys)})"
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, **env}, timeout=60)
    assert killed.returncode == -9  # killed after publishing every message, before marking the last
    assert db.execute("SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL").fetchone() == (1,)
    db.execute("UPDATE idempotency_keys_outbox SET claimed_until = now(), sent_at = NULL")  # all again
    assert relay(app).published == len(keys)
    with worker("tests.support.jobs_app", env, tmp_path / "worker.log", concurrency=2):
        wait_for(lambda: completed(db) == len(keys), timeout=90, interval=0.2)
        time.sleep(1.0)  # let the duplicates be delivered too
    started = [line[0] for line in trace(env)]
    assert sorted(started) == sorted(["add"] * 6 + ["mail", "send"] * 2)
    rows = db.execute("SELECT task, count(*) FROM job_effects GROUP BY task ORDER BY task").fetchall()
    assert rows == [("add", 6), ("mail", 2)]
    assert len(set(receipts(env["JOBS_MAILDIR"]))) == len(receipts(env["JOBS_MAILDIR"])) == 2
    assert {str(k) for k in keys} == {r[0] for r in db.execute("SELECT idem_key::text FROM idempotency_keys")}


def test_a_pool_process_killed_mid_task_is_redelivered_and_runs_once(
    setup: tuple[Flask, dict[str, str]], db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """SIGKILL the process running an atomic task inside its transaction: the broker delivers it again
    (reject_on_worker_lost), the first run's writes were rolled back, and the second commits once."""
    app, env = setup
    enqueue(app, "jobs.add", 11, hold=60.0, holds=2)
    relay(app)
    with worker("tests.support.jobs_app", env, tmp_path / "worker.log", concurrency=2) as proc:
        for started in (1, 2):  # the first two runs hold inside their transaction, and are killed there
            wait_for(lambda started=started: len(trace(env)) == started, timeout=60)  # type: ignore[misc]
            victim = int(trace(env)[-1][3])
            assert victim in {p.pid for p in psutil.Process(proc.pid).children()}
            kill(victim)
        wait_for(lambda: completed(db) == 1, timeout=60, interval=0.2)
    assert len(trace(env)) == 3
    assert db.execute("SELECT task, value FROM job_effects").fetchall() == [("add", 11)]


def test_a_whole_worker_killed_between_steps_is_finished_by_the_next(
    setup: tuple[Flask, dict[str, str]], db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """SIGKILL a worker and its pool after a flow task's receipt went out, before it was recorded: the
    broker redelivers to a new worker, which waits for the lease to lapse, takes the task over, finds the
    receipt through the resolver and records it. One receipt; nothing of the first worker left running."""
    app, env = setup
    key = enqueue(app, "jobs.mail", "a@example.com", hold=60.0)
    relay(app)
    with worker("tests.support.jobs_app", env, tmp_path / "worker1.log", concurrency=1) as proc:
        wait_for(lambda: len(receipts(env["JOBS_MAILDIR"])) == 1, timeout=60)  # sent, now holding
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        for pid in family:
            kill(pid)
        proc.wait(10)
    assert running(family) == []
    assert len(receipts(env["JOBS_MAILDIR"])) == 1
    with worker("tests.support.jobs_app", env, tmp_path / "worker2.log", concurrency=1):
        wait_for(lambda: completed(db) == 1, timeout=90, interval=0.2)
    assert [line[0] for line in trace(env)] == ["mail", "send"]  # resolved, not sent again
    assert receipts(env["JOBS_MAILDIR"]) == [f"<{jobs_key_send(key)}@jobs.test>"]
    assert db.execute("SELECT task, value FROM job_effects").fetchall() == [("mail", 1)]


def jobs_key_send(key: uuid.UUID) -> str:
    from flask_idem.flow import Run

    return Run(flow="jobs.mail", org_id=1, key=key).derived_key("send")


def test_a_task_that_always_fails_is_given_up_after_its_attempts(
    setup: tuple[Flask, dict[str, str]], db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """With IDEM_JOB_ATTEMPTS=3, a task that fails every time starts exactly three times on a real worker
    (its failures travel in the retries' idem_failures header), and is left failed and flagged for a
    person, as `flask idem stuck` lists it."""
    app, env = setup
    key = enqueue(app, "jobs.add", 13, fail=1000)
    relay(app)

    def status() -> Any:
        row = db.execute("SELECT status FROM idempotency_keys").fetchone()
        return row[0] if row else None

    with worker("tests.support.jobs_app", {**env, "FLASK_IDEM_JOB_ATTEMPTS": "3"}, tmp_path / "worker.log"):
        wait_for(lambda: status() == "failed", timeout=60, interval=0.2)
        time.sleep(1.5)  # a fourth start would come within the 1 s backoff cap
    assert [line[0] for line in trace(env)] == ["add"] * 3
    assert db.execute("SELECT count(*) FROM job_effects").fetchone() == (0,)
    out = app.test_cli_runner().invoke(args=["idem", "stuck"]).output
    assert f"NEEDS ATTENTION org=1 key={key} task=jobs.add status=failed" in out
    assert "gave up after 3 failed attempt(s)" in out


def test_two_copies_at_once_run_the_task_once(
    setup: tuple[Flask, dict[str, str]], db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Two copies of one message taken by two pool processes at once: one runs the task; the other is
    deferred (a Celery retry) while it runs, then returns the stored result."""
    app, env = setup
    enqueue(app, "jobs.add", 5, hold=3.0)
    relay(app)
    db.execute("UPDATE idempotency_keys_outbox SET sent_at = NULL, claimed_until = now()")
    assert relay(app).published == 1  # the second copy
    log = tmp_path / "worker.log"
    with worker("tests.support.jobs_app", env, log, concurrency=2):
        wait_for(lambda: log.read_text().count(" succeeded in ") == 2, timeout=60, interval=0.2)
    text = log.read_text()
    assert len(trace(env)) == 1
    assert " retry: Retry in " in text
    results = [line.rsplit("s: ", 1)[1] for line in text.splitlines() if " succeeded in " in line]
    assert results == ["{'value': 5, 'doubled': 10}"] * 2
    assert db.execute("SELECT task, value FROM job_effects").fetchall() == [("add", 5)]
