"""Recovery (flask_idem.recovery): backoff, the recovery loop, `stuck`, and what a recovery job leaves alone.

The shop's own recovery tests, through the real gateway, are in tests/example_app/test_recovery.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from flask import Flask

from flask_idem import Idempotency
from flask_idem.flow import OutcomeUnknown

from .support.flow_app import Ledger, row
from .support.helpers import close_pool, wait_for
from .support.notes_app import post


def test_backoff_is_full_jitter_within_the_cap() -> None:
    """Recovery waits are drawn from [0, min(cap, base * 2**attempt)]."""
    import random

    from flask_idem.recovery import backoff

    rng = random.Random(7)
    for attempt in range(12):
        waits = [backoff(attempt, base=2.0, cap=60.0, rng=rng) for _ in range(200)]
        ceiling = min(60.0, 2.0 * 2**attempt)
        assert all(0 <= w <= ceiling for w in waits)
        assert max(waits) > ceiling * 0.8  # spread over the whole interval, not bunched
    assert backoff(10_000, base=2.0, cap=60.0, rng=rng) <= 60.0


def test_recovery_loop_finishes_stranded_requests(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """`recover --loop` (run_forever) finishes a stranded request, reports that pass, and stops when told to.

    The CLI prints each reported pass (``on_pass``), a line per row, as docs/recovery.rst says.
    """
    import threading

    from flask_idem.recovery import run_forever

    key = uuid.uuid4()
    ledger.lose_answer = True
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 503
    assert db.execute("SELECT next_attempt_at > now() FROM idempotency_keys").fetchone() == (True,)
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    stop = threading.Event()
    reports: list[Any] = []
    worker = threading.Thread(
        target=run_forever,
        args=(flow_app,),
        kwargs={"interval": 0.05, "stop": stop, "on_pass": reports.append},
    )
    worker.start()
    try:
        wait_for(lambda: row(db)[0] == "completed", timeout=10)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
    assert [[done[1] for done in report.completed] for report in reports] == [[key]]  # empty passes: none
    assert ledger.calls == ["record", "find"]
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 200


def test_recovery_finishes_a_request_in_no_request_context(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """The recovery door opens no request context: the finish step runs in the application context, and
    a client error it raises is answered by the application's own error handler, stored and replayed."""
    from flask_idem.recovery import recover

    flow_app.register_error_handler(409, lambda e: ({"handled": "by the application"}, 409))
    key = uuid.uuid4()
    ledger.lose_answer = True
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 503
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    flow_app.config["FINISH_ABORT"] = 409
    report = recover(flow_app)
    assert [done[2] for done in report.completed] == ["answered 409"]
    assert flow_app.config["FINISH_IN_REQUEST"] == [False]
    again = post(flow_app, "/transfers", key, {"amount": 3})
    assert (again.status_code, again.json) == (409, {"handled": "by the application"})
    assert again.headers["Idempotent-Replayed"] == "true"


def test_recovery_loop_runs_the_next_pass_at_once_after_a_full_one(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """A pass that claimed ``limit`` requests is followed by the next at once, not after ``interval``:
    three stranded requests, one per pass, are all finished long before one interval of an hour."""
    import threading

    from flask_idem.recovery import run_forever

    keys = [uuid.uuid4() for _ in range(3)]
    for key in keys:
        ledger.lose_answer = True
        assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 503
        db.execute("DELETE FROM notes")  # its bodies are unique; recovery writes none
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    stop = threading.Event()
    reports: list[Any] = []
    worker = threading.Thread(
        target=run_forever,
        args=(flow_app,),
        kwargs={"interval": 3600.0, "limit": 1, "stop": stop, "on_pass": reports.append},
    )
    worker.start()
    try:
        wait_for(lambda: len(reports) == 3, timeout=10)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
    assert sorted(report.completed[0][1] for report in reports) == sorted(keys)
    statuses = db.execute("SELECT status FROM idempotency_keys").fetchall()
    assert statuses == [("completed",)] * 3


def test_stuck_lists_slow_processing_rows(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """`flask idem stuck` reports a request processing for longer than expected."""
    ledger.fail_next = OutcomeUnknown
    key = uuid.uuid4()
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 503
    runner = flow_app.test_cli_runner()
    assert runner.invoke(args=["idem", "stuck"]).output.strip() == "0 row(s)."
    db.execute("UPDATE idempotency_keys SET created_at = now() - interval '10 minutes'")
    output = runner.invoke(args=["idem", "stuck", "--older-than", "60"]).output
    assert f"slow            org=1 key={key} status=processing" in output
    assert "last_error=OutcomeUnknown" in output


def test_recovery_leaves_unknown_flows_alone(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any], database_url: str
) -> None:
    """A recovery job of an application without the flow claims nothing, and flags nothing."""
    from flask_idem.recovery import recover

    ledger.fail_next = OutcomeUnknown
    assert post(flow_app, "/transfers", uuid.uuid4(), {"amount": 3}).status_code == 503
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now(), created_at = now() - interval '1 day'")
    other = Flask("other")
    other.config.from_prefixed_env()
    other.config["IDEM_DATABASE_URL"] = database_url
    Idempotency(other, scope=lambda: 1)
    try:
        assert recover(other).claimed == 0
    finally:
        close_pool(other)
    assert row(db)[0] == "processing"
    assert db.execute("SELECT needs_attention FROM idempotency_keys").fetchone() == (False,)


def test_recovery_reports_a_failed_finish_as_pending(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """When the finish step answers 5xx during recovery, the request is reported pending, not completed."""
    from flask_idem.recovery import recover

    ledger.fail_next = OutcomeUnknown
    assert post(flow_app, "/transfers", uuid.uuid4(), {"amount": 3}).status_code == 503
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    flow_app.config["FINISH_500"] = True
    report = recover(flow_app)
    assert (len(report.completed), len(report.pending)) == (0, 1)
    assert row(db)[0] == "processing"
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    assert len(recover(flow_app).completed) == 1
    assert row(db)[0] == "completed"
