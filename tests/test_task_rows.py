"""What a background job's key row holds: its task (no method or path), a fingerprint of its own, and its
result as JSON."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.rows import dict_row

from flask_idem import _delivery
from flask_idem._fingerprint import fingerprint
from flask_idem._state import get_state
from flask_idem._task import task_fingerprint
from flask_idem.flow import Run
from flask_idem.jobs import Done, JobGivenUp, JobMismatch

from .support.celery_workers import BROKER_URL
from .support.helpers import app_factory
from .support.jobs_app import SCHEMA, build_jobs_app, jobs

ORG = 1


@pytest.fixture
def make_jobs_app(
    database_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> Iterator[Callable[..., Flask]]:
    """The jobs app of tests/support/jobs_app.py, one per call (a worker process each), sharing a trace
    and a Maildir; nothing is published."""
    db.execute(SCHEMA)
    with app_factory(
        lambda **config: build_jobs_app(
            database_url,
            broker_url=BROKER_URL,
            queue="unused",
            trace=str(tmp_path / "trace"),
            maildir=str(tmp_path / "maildir"),
            IDEM_JOB_ATTEMPTS=3,
            **config,
        )
    ) as make:
        yield make


def deliver(app: Flask, task: str, *args: Any, key: uuid.UUID, failures: int = 0, **kwargs: Any) -> Any:
    """One delivery of ``task`` for organisation ORG, enqueued just now."""
    delivery = _delivery.Delivery(ORG, key, args, kwargs, enqueued_at=time.time(), failures=failures)
    return _delivery.run_delivery(app, jobs.tasks[task], delivery, rng=random.Random(0))


def give_up(app: Flask, key: uuid.UUID) -> None:
    """Fail ``jobs.add`` at its last attempt: given up, flagged."""
    with pytest.raises(JobGivenUp):
        deliver(app, "jobs.add", 3, fail=9, key=key, failures=2)


def strand(app: Flask, to: str, key: uuid.UUID) -> None:
    """Deliver ``jobs.mail`` and end it after its receipt went out, before that step is recorded."""
    state = get_state(app)

    def crash(point: str, conn: Any) -> None:
        if point == "send":
            raise SystemExit("killed")

    state.hooks.append(crash)
    try:
        with pytest.raises(SystemExit):
            deliver(app, "jobs.mail", to, key=key)
    finally:
        state.hooks.remove(crash)


def rows(db: psycopg.Connection[Any], table: str = "idempotency_keys") -> dict[uuid.UUID, dict[str, Any]]:
    """Every row of ``table`` by key: what it says it is for, its status and what it stores."""
    wanted = ("method", "path", "task", "status", "response", "needs_attention")
    with db.cursor(row_factory=dict_row) as cursor:
        found = cursor.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table))).fetchall()
    return {row["idem_key"]: {name: row[name] for name in wanted if name in row} for row in found}


def stuck(app: Flask) -> str:
    """What `flask idem stuck` prints of every flagged row and every processing one."""
    return app.test_cli_runner().invoke(args=["idem", "stuck", "--older-than", "0"]).output


def sent_to(key: uuid.UUID) -> dict[str, str]:
    """The result of ``jobs.mail`` for ``key``: its receipt's Message-ID."""
    return {"sent": f"<{Run(flow='jobs.mail', org_id=ORG, key=key).derived_key('send')}@jobs.test>"}


def test_a_task_row_names_its_task_and_stores_its_result(
    make_jobs_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A task's row has its name in ``task``, no method or path, and stores ``{"result": ...}``
    (``{"error": ...}`` when given up), for an atomic task and a flow's alike; a redelivery replays it,
    and `flask idem stuck` names the task."""
    app = make_jobs_app()
    added, mailed, failed = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert deliver(app, "jobs.add", 21, key=added) == Done({"value": 21, "doubled": 42})
    strand(app, "n@example.com", mailed)
    assert f"key={mailed} task=jobs.mail status=processing" in stuck(app)
    assert deliver(app, "jobs.mail", "n@example.com", key=mailed) == Done(sent_to(mailed))
    give_up(app, failed)
    found = rows(db)
    assert found[added] == {
        "method": None,
        "path": None,
        "task": "jobs.add",
        "status": "completed",
        "response": {"result": {"value": 21, "doubled": 42}},
        "needs_attention": False,
    }
    assert found[mailed] == {
        "method": None,
        "path": None,
        "task": "jobs.mail",
        "status": "completed",
        "response": {"result": sent_to(mailed)},
        "needs_attention": False,
    }
    assert found[failed] == {
        "method": None,
        "path": None,
        "task": "jobs.add",
        "status": "failed",
        "response": {"error": "RuntimeError; gave up after 3 failed attempt(s)"},
        "needs_attention": True,
    }
    assert deliver(app, "jobs.add", 21, key=added) == Done({"value": 21, "doubled": 42}, replayed=True)
    assert deliver(app, "jobs.mail", "n@example.com", key=mailed) == Done(sent_to(mailed), replayed=True)
    with pytest.raises(JobGivenUp):
        deliver(app, "jobs.add", 3, fail=9, key=failed)
    assert f"NEEDS ATTENTION org=1 key={failed} task=jobs.add status=failed" in stuck(app)


def test_a_task_has_a_fingerprint_of_its_own(
    make_jobs_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A task's row holds the fingerprint of its name and arguments, which no request's can equal (not
    even a POST of the same arguments to a path named after the task); other arguments, or another
    task, under the same key are refused."""
    app = make_jobs_app()
    key = uuid.uuid4()
    assert deliver(app, "jobs.add", 21, key=key) == Done({"value": 21, "doubled": 42})
    [(stored,)] = db.execute(
        "SELECT request_sha FROM idempotency_keys WHERE org_id = %s AND idem_key = %s", (ORG, key)
    ).fetchall()
    assert bytes(stored) == task_fingerprint("jobs.add", [21], {})
    assert task_fingerprint("jobs.add", [21], {}) != task_fingerprint("jobs.add", [22], {})
    assert task_fingerprint("jobs.add", [21], {}) != task_fingerprint("jobs.mail", [21], {})
    body = json.dumps({"args": [21], "kwargs": {}}).encode()
    for method, path in (("TASK", "/_tasks/jobs.add"), ("POST", "/jobs.add"), ("task", "jobs.add")):
        posed = fingerprint(method=method, path=path, query=b"", mimetype="application/json", body=body)
        assert posed != bytes(stored)
    with pytest.raises(JobMismatch):
        deliver(app, "jobs.add", 22, key=key)
