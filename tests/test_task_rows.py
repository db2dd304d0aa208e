"""What a background job's key row holds: on layout 4 its task (no method or path) and its result as
JSON; rows of layout 3 (method ``TASK``, a 200 JSON document) go on working after the upgrade.

The upgrade test writes job rows in every state with this release's code on a layout-3 table (completed;
in progress under a live lease, its worker paused between a call and its record; stranded with a lapsed
lease; given up and flagged), upgrades the table to layout 4 with flask_idem._migrate.upgrade, and shows
what each becomes under a worker started after the upgrade, and what the paused worker does.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.rows import dict_row

from flask_idem import _delivery, _layout, _migrate, _partitions
from flask_idem._partitions.tables import Tables
from flask_idem._state import get_state
from flask_idem.flow import Run
from flask_idem.jobs import Defer, Done, Dropped, JobGivenUp, JobMismatch
from flask_idem.recovery import recover

from .support import citus
from .support.celery_workers import BROKER_URL
from .support.helpers import app_factory
from .support.jobs_app import SCHEMA, build_jobs_app, jobs, receipts
from .support.layouts import create_first_release, drop, layout_of

TABLE = "task_row_keys"
ORG = 1
#: A result of ``jobs.add`` as layout 3 stores it.
OLD_FORM = {
    "status": 200,
    "headers": [["Content-Type", "application/json"]],
    "body": '{"value": 21, "doubled": 42}',
}


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


@pytest.fixture
def layout3(
    direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A key table of layout 3, made by the first release and upgraded as far as layout 3; dropped
    afterwards with its tombstones."""
    drop(direct_database_url, TABLE)
    create_first_release(direct_database_url, TABLE, distributed=citus.ENABLED)
    up_to_3 = tuple(revision for revision in _layout.revisions() if revision.layout <= 3)
    with monkeypatch.context() as patched:
        patched.setattr(_layout, "revisions", lambda: up_to_3)
        _migrate.upgrade(direct_database_url, table=TABLE, distributed=citus.ENABLED)
    assert layout_of(db, TABLE) == 3
    yield TABLE
    drop(direct_database_url, TABLE)
    db.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(TABLE + "_tombstones")))


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


def rows(db: psycopg.Connection[Any], table: str = TABLE) -> dict[uuid.UUID, dict[str, Any]]:
    """Every row of ``table`` by key: what it says it is for (``task`` from layout 4 on), its status and
    what it stores."""
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


def test_a_task_row_on_layout_4_names_its_task_and_stores_its_result(
    make_jobs_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """On the key table of layout 4 a task's row has its name in ``task``, no method or path, and stores
    ``{"result": ...}`` (``{"error": ...}`` when given up), for an atomic task and a flow's alike; a
    redelivery replays it, and `flask idem stuck` names the task."""
    app = make_jobs_app()
    assert layout_of(db, "idempotency_keys") == 4
    added, mailed, failed = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert deliver(app, "jobs.add", 21, key=added) == Done({"value": 21, "doubled": 42})
    strand(app, "n@example.com", mailed)
    assert f"key={mailed} task=jobs.mail status=processing" in stuck(app)
    assert deliver(app, "jobs.mail", "n@example.com", key=mailed) == Done(sent_to(mailed))
    give_up(app, failed)
    found = rows(db, "idempotency_keys")
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


def test_task_rows_of_layout_3_keep_working_after_the_upgrade_to_layout_4(
    layout3: str,
    make_jobs_app: Callable[..., Flask],
    direct_database_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """Job rows in every state, written on layout 3 in its form, after the upgrade: the completed one
    replays its result (and refuses other arguments), the one in progress is deferred while its lease
    is live and then finished by its own worker, the stranded ones are finished by `flask idem recover`
    and by a redelivery (resolved, not sent again), and the flagged one is still given up and listed by
    `flask idem stuck`. Once their partition is retired, each finished one leaves a compact tombstone
    (200, no Location; 500 when failed) and a late delivery ends quietly."""
    before = make_jobs_app(IDEM_TABLE=layout3)
    done, recovered, redelivered, flagged, live = (uuid.uuid4() for _ in range(5))
    assert deliver(before, "jobs.add", 21, key=done) == Done({"value": 21, "doubled": 42})
    strand(before, "r@example.com", recovered)
    strand(before, "d@example.com", redelivered)
    db.execute(
        sql.SQL("UPDATE {} SET lease_expires_at = now(), next_attempt_at = now()").format(
            sql.Identifier(layout3)
        )
    )
    give_up(before, flagged)

    # A worker between the call step of `live` and its record, its lease live, while the table is upgraded.
    paused, go = threading.Event(), threading.Event()

    def pause(point: str, conn: Any) -> None:
        if point == "send":
            paused.set()
            go.wait(60)

    get_state(before).hooks.append(pause)
    outcome: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcome.append(deliver(before, "jobs.mail", "l@example.com", key=live))
    )
    worker.start()
    try:
        assert paused.wait(30), "the worker never reached its call step"
        db.execute(
            sql.SQL("UPDATE {} SET lease_expires_at = now() + interval '1 hour' WHERE idem_key = %s").format(
                sql.Identifier(layout3)
            ),
            (live,),
        )
        old = rows(db)
        assert {key: (row["method"], row["path"]) for key, row in old.items()} == {
            done: ("TASK", "/_tasks/jobs.add"),
            recovered: ("TASK", "/_tasks/jobs.mail"),
            redelivered: ("TASK", "/_tasks/jobs.mail"),
            flagged: ("TASK", "/_tasks/jobs.add"),
            live: ("TASK", "/_tasks/jobs.mail"),
        }
        assert old[done]["response"] == OLD_FORM
        assert old[flagged]["response"]["status"] == 500 and old[flagged]["needs_attention"]

        report = _migrate.upgrade(direct_database_url, table=layout3, distributed=citus.ENABLED)
        assert report.applied == [4] and layout_of(db, layout3) == 4
        after = make_jobs_app(IDEM_TABLE=layout3)  # a worker started after the upgrade

        assert deliver(after, "jobs.add", 21, key=done) == Done({"value": 21, "doubled": 42}, replayed=True)
        with pytest.raises(JobMismatch):
            deliver(after, "jobs.add", 22, key=done)
        deferred = deliver(after, "jobs.mail", "l@example.com", key=live)
        assert isinstance(deferred, Defer) and not deferred.failed
        assert deliver(after, "jobs.mail", "d@example.com", key=redelivered) == Done(sent_to(redelivered))
        report = recover(after)
        assert [entry[:2] for entry in report.completed] == [(ORG, recovered)]
        with pytest.raises(JobGivenUp):
            deliver(after, "jobs.add", 3, fail=9, key=flagged)
        listed = stuck(after)
        assert f"NEEDS ATTENTION org=1 key={flagged} task=jobs.add status=failed" in listed
        assert f"slow            org=1 key={live} task=jobs.mail status=processing" in listed
    finally:
        go.set()
        worker.join(60)
    assert outcome == [Done(sent_to(live))]
    for key, to in ((recovered, "r"), (redelivered, "d"), (live, "l")):
        again = deliver(after, "jobs.mail", f"{to}@example.com", key=key)
        assert again == Done(sent_to(key), replayed=True)
    assert receipts(after.config["JOBS_MAILDIR"]) == sorted(
        sent_to(key)["sent"] for key in (recovered, redelivered, live)
    )

    # The rows stay where they were written (the first partition), each in the form it was finished in:
    # by a worker of layout 3, as layout 3 stores it; by one of layout 4, as layout 4 does.
    first = layout3 + "_p0"
    found = rows(db, first)
    assert {key: row["task"] for key, row in found.items()} == dict.fromkeys(found)
    assert found[done]["response"] == OLD_FORM
    assert json.loads(found[live]["response"]["body"]) == sent_to(live)
    assert found[recovered]["response"] == {"result": sent_to(recovered)}
    assert found[redelivered]["response"] == {"result": sent_to(redelivered)}

    # New tasks on the upgraded table are written as layout 4 writes them; one given up is let go by a
    # person (its flag cleared), so that it leaves a tombstone too.
    fresh, dropped = uuid.uuid4(), uuid.uuid4()
    assert deliver(after, "jobs.add", 5, key=fresh) == Done({"value": 5, "doubled": 10})
    give_up(after, dropped)
    db.execute(
        sql.SQL("UPDATE {} SET needs_attention = false WHERE idem_key = %s").format(sql.Identifier(layout3)),
        (dropped,),
    )
    found = rows(db, first)
    assert (found[fresh]["method"], found[fresh]["path"], found[fresh]["task"]) == (None, None, "jobs.add")
    assert found[fresh]["response"] == {"result": {"value": 5, "doubled": 10}}
    assert found[dropped]["response"] == {"error": "RuntimeError; gave up after 3 failed attempt(s)"}

    # The first partition retired, as `flask idem purge` does once its range has passed: the compact
    # tombstones of its finished rows, then the rows gone (the partition dropped).
    _partitions.maintain(
        direct_database_url, table=layout3, interval=86400.0, horizon=2 * 86400.0, tombstone_ttl=3600.0
    )
    tombstones = sql.Identifier(layout3 + "_tombstones")
    with db.transaction():
        db.execute(
            Tables(layout3).sql("tombstones", partition=sql.Identifier(first)),
            {"tomb": 3600.0, "now": datetime.now(UTC)},
        )
        db.execute(
            sql.SQL("DELETE FROM {} WHERE status <> 'processing' AND NOT needs_attention").format(
                sql.Identifier(first)
            )
        )
    kept = db.execute(sql.SQL("SELECT idem_key, status, location FROM {}").format(tombstones))
    finished = (done, recovered, redelivered, live, fresh)
    assert {row[0]: row[1:] for row in kept} == {
        **{key: (200, None) for key in finished},
        dropped: (-500, None),  # failed: its status kept negative
    }
    assert deliver(after, "jobs.add", 21, key=done) == Dropped("done long ago: its stored result has expired")
    assert isinstance(deliver(after, "jobs.add", 5, key=fresh), Dropped)
    assert isinstance(deliver(after, "jobs.mail", "r@example.com", key=recovered), Dropped)
    assert isinstance(deliver(after, "jobs.add", 3, fail=9, key=dropped), Dropped)
    with pytest.raises(JobGivenUp):
        deliver(after, "jobs.add", 3, fail=9, key=flagged)
