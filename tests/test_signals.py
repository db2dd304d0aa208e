"""Signals and outcome logs: each outcome sends its signal once, with the application as sender.

Requests go through Flask's test client to the real database; the multi-step cases use the flow of
``tests/test_flow.py`` and its in-process ledger.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem import OutcomeUnknown, _delivery, signals
from flask_idem.recovery import recover

from .support.flow_app import Ledger, build_flow_app
from .support.helpers import ROOT, age, close_pool
from .support.jobs_app import build_jobs_app, jobs
from .support.notes_app import build_app, post

Event = tuple[str, dict[str, Any]]


@contextmanager
def recorded(app: Flask) -> Iterator[list[Event]]:
    """Every outcome signal ``app`` sends while the block runs, in order, as ``(name, arguments)``."""
    events: list[Event] = []
    lock = threading.Lock()

    def receiver(name: str) -> Callable[..., None]:
        def receive(sender: Flask, **data: Any) -> None:
            assert sender is app
            with lock:
                events.append((name, data))

        return receive

    with ExitStack() as stack:
        for signal in signals.OUTCOMES:
            stack.enter_context(signal.connected_to(receiver(signal.name), sender=app))
        yield events


def names(events: list[Event]) -> list[str]:
    return [name for name, _ in events]


@pytest.fixture
def notes(make_app: Callable[..., Flask]) -> Flask:
    return make_app()


class HookedLedger(Ledger):
    """The ledger, with something to do once, inside the next call step, before it records."""

    hook: Callable[[], None] | None = None

    def record(self, key: str, amount: int) -> dict[str, Any]:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().record(key, amount)


@pytest.fixture
def ledger() -> HookedLedger:
    return HookedLedger()


@pytest.fixture
def flow_app(database_url: str, db: psycopg.Connection[Any], ledger: HookedLedger) -> Iterator[Flask]:
    app = build_flow_app(database_url, ledger, IDEM_RECOVERY_DEADLINE=3600)
    yield app
    close_pool(app)


# -- atomic routes --------------------------------------------------------------------------------------


def test_first_attempt_reserves_and_stores(notes: Flask) -> None:
    """A first attempt sends key-reserved, then response-stored with the status, both with org, key, route."""
    key = uuid.uuid4()
    with recorded(notes) as events:
        assert post(notes, "/notes", key, {"body": "a"}).status_code == 201
    common = {"org_id": 1, "key": key, "endpoint": "create", "flow": None}
    assert events == [("key-reserved", common), ("response-stored", {**common, "status": 201})]


def test_retry_is_replayed(notes: Flask) -> None:
    """A retry sends response-replayed with the stored status, and nothing else."""
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": "a"})
    with recorded(notes) as events:
        assert post(notes, "/notes", key, {"body": "a"}).status_code == 200
    assert events == [("response-replayed", {"org_id": 1, "key": key, "endpoint": "create", "status": 201})]


def test_mismatch_rejected(notes: Flask) -> None:
    """A key reused with another body sends mismatch-rejected (422)."""
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": "a"})
    with recorded(notes) as events:
        assert post(notes, "/notes", key, {"body": "b"}).status_code == 422
    assert events == [("mismatch-rejected", {"org_id": 1, "key": key, "endpoint": "create"})]


def test_mismatch_replayed(notes: Flask) -> None:
    """With on_mismatch="replay", a different request sends mismatch-replayed, not response-replayed."""
    key = uuid.uuid4()
    post(notes, "/notes/replayable", key, {"body": "a"})
    with recorded(notes) as events:
        assert post(notes, "/notes/replayable", key, {"body": "b"}).status_code == 200
    assert events == [
        ("mismatch-replayed", {"org_id": 1, "key": key, "endpoint": "replayable", "status": 201})
    ]


def test_in_flight_duplicate(notes: Flask) -> None:
    """A duplicate of a running request sends key-in-flight (409)."""
    entered, release = threading.Event(), threading.Event()
    notes.config.update(ENTERED=entered, RELEASE=release)
    key = uuid.uuid4()
    with recorded(notes) as events:
        thread = threading.Thread(target=post, args=(notes, "/notes/block", key))
        thread.start()
        try:
            assert entered.wait(10)
            assert post(notes, "/notes/block", key).status_code == 409
        finally:
            release.set()
            thread.join(15)
    assert names(events) == ["key-reserved", "key-in-flight", "response-stored"]
    assert events[1][1] == {"org_id": 1, "key": key, "endpoint": "block"}


def test_server_error_is_not_stored(notes: Flask) -> None:
    """A view answering 500 is rolled back: key-reserved, and no response-stored."""
    with recorded(notes) as events:
        assert post(notes, "/notes/500", uuid.uuid4()).status_code == 500
    assert names(events) == ["key-reserved"]


def test_lost_connection_is_store_unavailable(notes: Flask) -> None:
    """A connection killed mid-request sends store-unavailable with the error's class and SQLSTATE."""
    key = uuid.uuid4()
    with recorded(notes) as events:
        assert post(notes, "/notes/terminate", key).status_code == 503
    assert events[-1] == (
        "store-unavailable",
        {"org_id": 1, "key": key, "endpoint": "terminate", "error": "AdminShutdown", "sqlstate": "57P01"},
    )


def test_unreachable_database_is_store_unavailable(db: Any) -> None:
    """A pool that cannot connect sends store-unavailable (PoolTimeout, no SQLSTATE)."""
    app, _ = build_app("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1", IDEM_POOL_TIMEOUT=0.5)
    key = uuid.uuid4()
    try:
        with recorded(app) as events:
            assert post(app, "/notes", key, {"body": "x"}).status_code == 503
    finally:
        close_pool(app)
    assert events == [
        (
            "store-unavailable",
            {"org_id": 1, "key": key, "endpoint": "create", "error": "PoolTimeout", "sqlstate": None},
        )
    ]


UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"


def test_an_unreachable_database_is_store_unavailable_for_a_task(tmp_path: Path) -> None:
    """A task's delivery that cannot reach the key table sends store-unavailable, as a request does, and
    is a failed attempt to be delivered again."""
    app = build_jobs_app(
        UNREACHABLE,
        broker_url="memory://",
        queue="unused",
        trace=str(tmp_path / "trace"),
        maildir=str(tmp_path / "maildir"),
        IDEM_POOL_TIMEOUT=0.5,
    )
    key = uuid.uuid4()
    delivery = _delivery.Delivery(1, key, (1,), {}, enqueued_at=time.time())
    try:
        with recorded(app) as events:
            outcome = _delivery.run_delivery(app, jobs.tasks["jobs.add"], delivery, rng=random.Random(0))
    finally:
        close_pool(app)
    assert isinstance(outcome, _delivery.Defer) and outcome.failed
    assert [data for name, data in events if name == "store-unavailable"] == [
        {
            "org_id": 1,
            "key": key,
            "endpoint": None,
            "task": "jobs.add",
            "error": "PoolTimeout",
            "sqlstate": None,
        }
    ]


def test_an_unreachable_database_is_store_unavailable_for_recovery(db: Any) -> None:
    """A recovery pass that cannot reach the key table sends store-unavailable and ends with the error."""
    app, _ = build_app(UNREACHABLE, IDEM_POOL_TIMEOUT=0.5)
    try:
        with recorded(app) as events, pytest.raises(psycopg.OperationalError):
            recover(app)
    finally:
        close_pool(app)
    assert events == [
        (
            "store-unavailable",
            {"org_id": None, "key": None, "endpoint": None, "error": "PoolTimeout", "sqlstate": None},
        )
    ]


def test_receivers_for_another_app_hear_nothing(notes: Flask, make_app: Callable[..., Flask]) -> None:
    """Signals are sent with the application as sender: a receiver connected for another one is not called."""
    other = make_app()
    with recorded(other) as events:
        post(notes, "/notes", uuid.uuid4(), {"body": "a"})
    assert events == []


def test_store_operations_are_timed(notes: Flask) -> None:
    """store-operation reports each key-table operation of a request with its duration."""
    seen: list[tuple[str, float]] = []

    def receive(sender: Flask, *, operation: str, duration: float, **extra: Any) -> None:
        seen.append((operation, duration))

    with signals.store_operation.connected_to(receive, sender=notes):
        post(notes, "/notes", uuid.uuid4(), {"body": "a"})
    assert [op for op, _ in seen] == ["reserve", "complete"]
    assert all(0 < duration < 30 for _, duration in seen)


# -- multi-step routes ----------------------------------------------------------------------------------


def test_flow_steps(flow_app: Flask) -> None:
    """A flow sends key-reserved with its name, step-finished per step (with its kind and time), then
    response-stored."""
    key = uuid.uuid4()
    with recorded(flow_app) as events:
        assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 201
    assert names(events) == ["key-reserved", "step-finished", "step-finished", "response-stored"]
    common = {"org_id": 1, "key": key, "endpoint": "transfer", "flow": "notes.transfer"}
    assert events[0][1] == common
    (_, prepare), (_, call) = events[1:3]
    assert (prepare["step"], prepare["outside"], call["step"], call["outside"]) == (
        "prepare",
        False,
        "post",
        True,
    )
    assert prepare.keys() == {*common, "step", "outside", "duration"}
    assert 0 < call["duration"] < 30
    assert events[3][1] == {**common, "status": 201}


@pytest.mark.parametrize(
    ("amount", "config", "status"),
    [(-1, {}, 400), (7, {"PREPARE_ABORT": 410}, 410)],
    ids=["view-answers", "step-aborts"],
)
def test_flow_answering_early_stores_it(
    flow_app: Flask, amount: int, config: dict[str, Any], status: int
) -> None:
    """A flow whose view or database step answers a 4xx at once sends response-stored with it."""
    flow_app.config.update(config)
    with recorded(flow_app) as events:
        assert post(flow_app, "/transfers", uuid.uuid4(), {"amount": amount}).status_code == status
    assert names(events)[0] == "key-reserved"
    assert events[-1][0] == "response-stored" and events[-1][1]["status"] == status


@pytest.mark.parametrize(
    ("error", "signal"),
    [(OutcomeUnknown, "outcome-unknown"), (KeyError, "call-failed")],
    ids=["outcome-unknown", "bug"],
)
def test_unknown_outcome_and_bug_are_told_apart(
    flow_app: Flask, ledger: HookedLedger, error: type[Exception], signal: str
) -> None:
    """OutcomeUnknown sends outcome-unknown; any other exception in a call step sends call-failed."""
    key = uuid.uuid4()
    ledger.fail_next = error
    with recorded(flow_app) as events:
        assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 503
    assert names(events) == ["key-reserved", "step-finished", signal]
    assert events[-1][1] == {
        "org_id": 1,
        "key": key,
        "endpoint": "transfer",
        "flow": "notes.transfer",
        "step": "post",
        "exception": error.__name__,
    }


def test_retry_takes_over(flow_app: Flask, ledger: HookedLedger) -> None:
    """A retry of a request whose lease was given up sends lease-taken-over with the last finished step."""
    key = uuid.uuid4()
    ledger.fail_next = OutcomeUnknown
    post(flow_app, "/transfers", key, {"amount": 7})
    with recorded(flow_app) as events:
        assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 201
    assert names(events) == ["lease-taken-over", "step-finished", "response-stored"]
    assert events[0][1] == {
        "org_id": 1,
        "key": key,
        "endpoint": "transfer",
        "flow": "notes.transfer",
        "step": "prepare",
    }


def test_worker_that_lost_its_lease(
    flow_app: Flask, ledger: HookedLedger, db: psycopg.Connection[Any]
) -> None:
    """A worker whose request was taken over while it called outside sends lease-lost and answers 409."""
    key = uuid.uuid4()
    retry: dict[str, int] = {}

    def taken_over_meanwhile() -> None:
        db.execute("UPDATE idempotency_keys SET lease_expires_at = now()")
        retry["status"] = post(flow_app, "/transfers", key, {"amount": 7}).status_code

    ledger.hook = taken_over_meanwhile
    with recorded(flow_app) as events:
        assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 409
    assert retry == {"status": 201}
    assert names(events) == [
        "key-reserved",
        "step-finished",  # prepare, by the first worker
        "lease-taken-over",  # the retry, inside the first worker's call step
        "step-finished",
        "response-stored",
        "lease-lost",  # the first worker, back from its call
    ]
    assert events[-1][1] == {"org_id": 1, "key": key, "endpoint": "transfer", "flow": "notes.transfer"}


def test_recovery_finishes(flow_app: Flask, ledger: HookedLedger, db: psycopg.Connection[Any]) -> None:
    """The recovery job sends step-finished, response-stored and recovered, with the route's endpoint."""
    key = uuid.uuid4()
    ledger.lose_answer = True
    post(flow_app, "/transfers", key, {"amount": 7})
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    with recorded(flow_app) as events:
        assert len(recover(flow_app).completed) == 1
    assert names(events) == ["step-finished", "response-stored", "recovered"]
    assert events[-1][1] == {
        "org_id": 1,
        "key": key,
        "endpoint": "transfer",
        "flow": "notes.transfer",
        "status": 201,
        "attempts": 1,
    }


def test_recovery_gives_up(
    flow_app: Flask, ledger: HookedLedger, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Past the deadline, the recovery job sends given-up and logs it at ERROR with its fields."""
    key = uuid.uuid4()
    ledger.fail_next = OutcomeUnknown
    post(flow_app, "/transfers", key, {"amount": 7})
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now(), created_at = now() - interval '2 hours'")
    with recorded(flow_app) as events:
        assert len(recover(flow_app).failed) == 1
    assert events == [
        (
            "given-up",
            {
                "org_id": 1,
                "key": key,
                "endpoint": "transfer",
                "flow": "notes.transfer",
                "reason": "recovery deadline passed",
                "attempts": 1,
            },
        )
    ]
    (record,) = [r for r in caplog.records if getattr(r, "idem_outcome", None) == "given_up"]
    assert record.levelno == logging.ERROR
    assert (record.idem_flow, record.idem_key_hash, record.idem_attempts) == (  # type: ignore[attr-defined]
        "notes.transfer",
        signals.key_hash(key),
        1,
    )


# -- logs -----------------------------------------------------------------------------------------------


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="flask_idem")
    return caplog


def outcome_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "idem_outcome")]


def test_one_log_record_per_outcome(notes: Flask, logs: pytest.LogCaptureFixture) -> None:
    """Each outcome is logged once on flask_idem with idem_* fields: DEBUG if normal, INFO for a conflict."""
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": "a"})
    post(notes, "/notes", key, {"body": "a"})
    post(notes, "/notes", key, {"body": "b"})
    found = [(r.idem_outcome, r.levelno) for r in outcome_records(logs)]  # type: ignore[attr-defined]
    assert found == [
        ("key_reserved", logging.DEBUG),
        ("response_stored", logging.DEBUG),
        ("response_replayed", logging.DEBUG),
        ("mismatch_rejected", logging.INFO),
    ]
    stored = outcome_records(logs)[1]
    assert stored.name == "flask_idem"
    assert (
        stored.__dict__.items()
        >= {
            "idem_org_id": 1,
            "idem_key_hash": signals.key_hash(key),
            "idem_endpoint": "create",
            "idem_status": 201,
            "idem_flow": None,
        }.items()
    )
    assert stored.getMessage() == (
        f"Response stored: org_id=1 key_hash={signals.key_hash(key)} status=201 endpoint=create."
    )
    assert len(signals.key_hash(key)) == 12 and signals.key_hash(key) != signals.key_hash(uuid.uuid4())


def test_quiet_at_info(notes: Flask, caplog: pytest.LogCaptureFixture) -> None:
    """At INFO, a first attempt and its replay log nothing."""
    caplog.set_level(logging.INFO, logger="flask_idem")
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": "a"})
    post(notes, "/notes", key, {"body": "a"})
    assert outcome_records(caplog) == []


SECRET = "hunter2-c0rrect-h0rse"


def test_logs_hold_no_request_data(notes: Flask, flow_app: Flask, logs: pytest.LogCaptureFixture) -> None:
    """No outcome record, message or field, holds anything of the request body or its headers."""
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": SECRET}, Authorization=f"Bearer {SECRET}x")
    post(notes, "/notes", key, {"body": SECRET + "2"})
    post(flow_app, "/transfers", uuid.uuid4(), {"amount": 4242424242})
    records = outcome_records(logs)
    assert len(records) == 7
    for record in records:
        text = record.getMessage() + repr(record.__dict__)
        assert SECRET not in text
        assert "4242424242" not in text
        assert str(key) not in text and key.hex not in text  # the key itself is never logged


def test_every_signal_is_documented() -> None:
    """docs/observing.rst and docs/api.rst name every signal, and the module exports each."""
    observing = (ROOT / "docs" / "observing.rst").read_text()
    api = (ROOT / "docs" / "api.rst").read_text()
    for signal in (*signals.OUTCOMES, signals.store_operation):
        attribute = signal.name.replace("-", "_")
        assert getattr(signals, attribute) is signal
        assert attribute in signals.__all__
        assert f"``{signal.name}``" in observing, signal.name
        assert f".. autodata:: {attribute}" in api or f"data:: {attribute}" in api, attribute


@pytest.mark.parametrize(("path", "status"), [("/notes", 303), ("/notes/404", 410)], ids=["location", "none"])
def test_retry_after_retention_hits_the_tombstone(
    make_app: Callable[..., Flask],
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    path: str,
    status: int,
) -> None:
    """A retry past retention sends tombstone-hit with its status (303 to Location, or 410), at INFO."""
    app = make_app(IDEM_KEY_TTL=60)
    key = uuid.uuid4()
    post(app, path, key, {"body": "a"})
    age(db, "61 seconds")
    with recorded(app) as events:
        assert post(app, path, key, {"body": "a"}).status_code == status
    endpoint = "create" if path == "/notes" else "fail_with_abort"
    assert events == [("tombstone-hit", {"org_id": 1, "key": key, "endpoint": endpoint, "status": status})]
    (record,) = [r for r in outcome_records(logs) if r.idem_outcome == "tombstone_hit"]  # type: ignore[attr-defined]
    assert record.levelno == logging.INFO
