"""Idempotent background jobs (flask_idem.jobs): one delivery at a time, in this process.

Most tests hand deliveries of the tasks of tests/support/jobs_app.py to the runner-neutral core, as a worker
would, against the real key table; others run tasks with a second runner, tests/support/inline_jobs.py,
which delivers what the relay published synchronously. The Celery workers themselves, on RabbitMQ, are in
test_celery.py.
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem import _delivery, _jobs_state
from flask_idem.jobs import (
    Defer,
    Done,
    Dropped,
    Envelope,
    JobGivenUp,
    JobMismatch,
    Message,
    task_key,
)
from flask_idem.relay import relay

from .support import inline_jobs, pgbouncer
from .support.celery_workers import BROKER_URL
from .support.helpers import close_pool, wait_for
from .support.inline_jobs import build_inline_app, inline
from .support.jobs_app import SCHEMA, build_jobs_app, jobs, receipts
from .support.servers import ROOT


@pytest.fixture
def jobs_app(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> Iterator[Flask]:
    """The jobs app on this worker's database; nothing is published (the relay tests swap the publisher)."""
    db.execute(SCHEMA)
    app = build_jobs_app(
        database_url,
        broker_url=BROKER_URL,
        queue="unused",
        trace=str(tmp_path / "trace"),
        maildir=str(tmp_path / "maildir"),
        IDEM_JOB_ATTEMPTS=3,
    )
    yield app
    close_pool(app)


@pytest.fixture
def inline_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The application of the second runner (tests/support/inline_jobs.py), its queue empty."""
    db.execute(inline_jobs.SCHEMA)
    inline.queue.clear()
    app = build_inline_app(database_url)
    yield app
    close_pool(app)


def deliver(app: Flask, task: str, *args: Any, key: uuid.UUID, failures: int = 0, **kwargs: Any) -> Any:
    """One delivery of ``task`` for organisation 1, enqueued just now."""
    delivery = _delivery.Delivery(1, key, args, kwargs, enqueued_at=time.time(), failures=failures)
    return _delivery.run_delivery(app, jobs.tasks[task], delivery, rng=random.Random(0))


def runs(app: Flask) -> list[str]:
    """The trace: one line per start of a task's function or step."""
    path = Path(app.config["JOBS_TRACE"])
    return path.read_text().split("\n")[:-1] if path.exists() else []


def crash_after_send(app: Flask, to: str, key: uuid.UUID) -> None:
    """Deliver ``jobs.mail`` and end it after its receipt went out, before that step is recorded."""
    from flask_idem._state import get_state

    state = get_state(app)

    def crash(point: str, conn: Any) -> None:
        if point == "send":
            raise SystemExit("killed")  # as a worker killed between the call and its record

    state.hooks.append(crash)
    try:
        with pytest.raises(SystemExit):
            deliver(app, "jobs.mail", to, key=key)
    finally:
        state.hooks.remove(crash)


def effects(db: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return db.execute("SELECT task, value FROM job_effects ORDER BY task").fetchall()


def test_a_redelivered_task_returns_the_stored_result_without_running(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """The first delivery runs and commits with its key; the next one gets that result back."""
    key = uuid.uuid4()
    first = deliver(jobs_app, "jobs.add", 21, key=key)
    again = deliver(jobs_app, "jobs.add", 21, key=key)
    assert first == _delivery.Done({"value": 21, "doubled": 42})
    assert again == _delivery.Done({"value": 21, "doubled": 42}, replayed=True)
    assert effects(db) == [("add", 21)]
    assert len(runs(jobs_app)) == 1
    row = db.execute("SELECT method, path, task, status, response FROM idempotency_keys").fetchone()
    assert row == (None, None, "jobs.add", "completed", {"result": {"value": 21, "doubled": 42}})


def test_a_duplicate_is_deferred_while_the_first_runs(jobs_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A second delivery of a key held by a running one is put off (not run, not failed), then replays."""
    key = uuid.uuid4()
    first: list[Any] = []
    running = threading.Thread(
        target=lambda: first.append(deliver(jobs_app, "jobs.add", 5, hold=1.5, key=key))
    )
    running.start()
    wait_for(lambda: bool(runs(jobs_app)), 15, 0.02, message="the first delivery never ran")
    second = deliver(jobs_app, "jobs.add", 5, hold=1.5, key=key)
    running.join()
    assert isinstance(second, _delivery.Defer) and not second.failed
    assert 0 <= second.countdown <= 1.0  # IDEM_JOB_BACKOFF_CAP of the jobs app
    assert first == [_delivery.Done({"value": 5, "doubled": 10})]
    assert deliver(jobs_app, "jobs.add", 5, hold=1.5, key=key).replayed  # type: ignore[union-attr]
    assert effects(db) == [("add", 5)]


def test_other_arguments_under_one_key_are_refused(jobs_app: Flask, db: psycopg.Connection[Any]) -> None:
    """Same key, different arguments: JobMismatch, as a route answers 422; nothing runs."""
    key = uuid.uuid4()
    deliver(jobs_app, "jobs.add", 1, key=key)
    with pytest.raises(JobMismatch):
        deliver(jobs_app, "jobs.add", 2, key=key)
    assert effects(db) == [("add", 1)]


def test_failures_back_off_then_give_up_and_flag(jobs_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A failing task is retried with a jittered, capped countdown; at IDEM_JOB_ATTEMPTS it is flagged.

    The failed attempts' writes are rolled back each time; `flask idem stuck` lists the task.
    """
    key = uuid.uuid4()
    outcomes = [deliver(jobs_app, "jobs.add", 3, fail=9, key=key, failures=n) for n in range(2)]
    assert all(isinstance(o, _delivery.Defer) and o.failed and 0 <= o.countdown <= 1.0 for o in outcomes)
    with pytest.raises(JobGivenUp):
        deliver(jobs_app, "jobs.add", 3, fail=9, key=key, failures=2)
    assert effects(db) == []
    row = db.execute("SELECT status, needs_attention, last_error FROM idempotency_keys").fetchone()
    assert row is not None and row[:2] == ("failed", True) and "RuntimeError" in row[2]
    with pytest.raises(JobGivenUp):  # a later delivery does not run it again
        deliver(jobs_app, "jobs.add", 3, fail=9, key=key)
    assert len(runs(jobs_app)) == 3
    out = jobs_app.test_cli_runner().invoke(args=["idem", "stuck"]).output
    assert f"NEEDS ATTENTION org=1 key={key} task=jobs.add status=failed" in out


def test_past_the_deadline_a_task_is_given_up_without_running(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A delivery enqueued longer ago than IDEM_JOB_DEADLINE is flagged, not run."""
    delivery = _delivery.Delivery(1, uuid.uuid4(), (4,), {}, enqueued_at=time.time() - 7200)
    with pytest.raises(JobGivenUp):
        _delivery.run_delivery(jobs_app, jobs.tasks["jobs.add"], delivery, rng=random.Random(0))
    assert runs(jobs_app) == []
    assert db.execute("SELECT status, needs_attention FROM idempotency_keys").fetchall() == [("failed", True)]


def test_a_flow_task_killed_after_its_call_is_finished_not_repeated(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Crash after the receipt was sent, before it was recorded: the redelivery takes the request over
    and asks the resolver, which finds the receipt; it is recorded, not sent twice. (A worker killed
    with SIGKILL, whose lease must lapse first, is in test_celery.py.)"""

    key = uuid.uuid4()
    crash_after_send(jobs_app, "a@example.com", key)
    assert db.execute("SELECT status, step FROM idempotency_keys").fetchone() == ("processing", "intent")
    done = deliver(jobs_app, "jobs.mail", "a@example.com", key=key)
    assert isinstance(done, _delivery.Done) and done.result["sent"].startswith("<")
    assert len(receipts(jobs_app.config["JOBS_MAILDIR"])) == 1
    assert [line.split()[0] for line in runs(jobs_app)] == ["mail", "send"]
    assert effects(db) == [("mail", 1)]


class Recorder:
    """A publisher that keeps what it is given, and can fail: the relay's side of the broker."""

    def __init__(self) -> None:
        self.published: list[Message] = []
        self.down = False

    def publish(self, message: Message) -> None:
        if self.down:
            raise ConnectionError("broker away")
        self.published.append(message)


def test_the_outbox_sends_what_commits_and_the_relay_publishes_at_least_once(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Messages written in a rolled-back transaction vanish; a relay killed between publish and mark
    leaves its messages to be published again when its claim lapses; the consumer runs the task once."""
    from flask_idem._state import get_state

    recorder = Recorder()
    jobs_app.extensions["idem_jobs"] = state = _jobs_state.JobsState.create(jobs_app, recorder)
    pool = get_state(jobs_app).source
    kept = uuid.uuid4()
    with jobs_app.app_context():
        with pool.connection() as conn, conn.transaction():
            jobs.enqueue("jobs.add", 7, conn=conn, org_id=1, key=kept)
        with pytest.raises(RuntimeError), pool.connection() as conn, conn.transaction():
            jobs.enqueue("jobs.add", 8, conn=conn, org_id=1, key=uuid.uuid4())
            raise RuntimeError("the view failed")
    assert state.outbox.state().unsent == 1

    def killed(message: Message) -> None:
        raise SystemExit("relay killed between publish and mark")

    with pytest.raises(SystemExit):
        relay(jobs_app, after_publish=killed)
    assert relay(jobs_app).published == 0  # its claim holds for IDEM_OUTBOX_LEASE
    db.execute("UPDATE idempotency_keys_outbox SET claimed_until = now()")
    assert relay(jobs_app).published == 1
    assert state.outbox.state().unsent == 0
    first, second = recorder.published
    assert first.id == second.id and first.envelope.key == kept and second.args == [7]

    recorder.down = True  # a failed publish is released, with its error, for a later pass
    with jobs_app.app_context(), pool.connection() as conn, conn.transaction():
        jobs.enqueue("jobs.add", 9, conn=conn, org_id=1, key=uuid.uuid4())
    assert relay(jobs_app).failed == 1
    assert db.execute("SELECT last_error FROM idempotency_keys_outbox WHERE sent_at IS NULL").fetchone() == (
        "ConnectionError",
    )

    for message in recorder.published:  # the consumer absorbs the relay's duplicate
        env = message.envelope
        delivery = _delivery.Delivery(
            env.org_id, env.key, tuple(message.args), message.kwargs, env.enqueued_at
        )
        _delivery.run_delivery(jobs_app, jobs.tasks[message.task], delivery, rng=random.Random(0))
    assert effects(db) == [("add", 7)]


def test_the_envelope_round_trips_and_refuses_what_is_not_one() -> None:
    """Headers carry org, key, enqueue time and failures; a message without them is refused."""
    from flask_idem.jobs import JobError

    envelope = Envelope(3, uuid.uuid4(), 1700000000.5, failures=2, deferrals=5)
    assert Envelope.from_headers(envelope.headers()) == envelope
    older = {name: value for name, value in envelope.headers().items() if name != "idem_deferrals"}
    assert Envelope.from_headers(older).deferrals == 0  # a message written before deferrals were counted
    with pytest.raises(JobError, match="malformed"):
        Envelope.from_headers({**envelope.headers(), "idem_deferrals": -1})
    with pytest.raises(JobError, match="no idempotency envelope"):
        Envelope.from_headers({})
    with pytest.raises(JobError, match="malformed"):
        Envelope.from_headers({**envelope.headers(), "idem_org": "3"})
    assert task_key(1, envelope.key, "a") != task_key(2, envelope.key, "a") != task_key(1, envelope.key, "b")


def test_task_outcomes_are_signalled_and_counted_by_task(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Deliveries send the request's outcome signals with ``task``; Metrics counts them by task, and
    reads the outbox's unsent messages at scrape time."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from flask_idem import signals
    from flask_idem.metrics import Metrics

    registry = CollectorRegistry()
    Metrics(jobs_app, registry=registry)
    jobs_app.extensions["idem_jobs"] = _jobs_state.JobsState.create(jobs_app, Recorder())
    deferred: list[dict[str, Any]] = []
    signals.job_deferred.connect(lambda sender, **data: deferred.append(data), sender=jobs_app, weak=False)
    key = uuid.uuid4()
    deliver(jobs_app, "jobs.add", 1, key=key)
    deliver(jobs_app, "jobs.add", 1, key=key)
    deliver(jobs_app, "jobs.add", 2, fail=1, key=uuid.uuid4())
    with jobs_app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
        jobs.enqueue("jobs.add", 3, conn=conn, org_id=1, key=uuid.uuid4())
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }

    def task(outcome: str) -> float:
        return found.get(
            ("flask_idem_task_outcomes_total", (("outcome", outcome), ("task", "jobs.add"))), 0.0
        )

    assert (task("key_reserved"), task("response_stored"), task("response_replayed")) == (2, 1, 1)
    assert task("job_deferred") == 1
    assert [(d["task"], d["failures"], d["reason"]) for d in deferred] == [("jobs.add", 1, "RuntimeError")]
    assert found[("flask_idem_outbox_unsent", (("table", "idempotency_keys"),))] == 1


def test_the_relay_claims_messages_of_every_organisation_oldest_first(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Messages of several organisations (several shards on Citus) are claimed together, oldest first,
    ``limit`` per pass."""
    recorder = Recorder()
    jobs_app.extensions["idem_jobs"] = _jobs_state.JobsState.create(jobs_app, recorder)
    with jobs_app.app_context():
        for n in range(6):
            with jobs.idem.pool.connection() as conn, conn.transaction():
                jobs.enqueue("jobs.add", n, conn=conn, org_id=n % 3 + 1, key=uuid.uuid4())
    assert relay(jobs_app, limit=4).published == 4
    assert relay(jobs_app, limit=4).published == 2
    assert [m.args[0] for m in recorder.published] == list(range(6))
    assert {m.envelope.org_id for m in recorder.published} == {1, 2, 3}


def test_mistakes_are_refused_with_what_to_change(jobs_app: Flask) -> None:
    """Bad settings, a task option the decorator owns, a name taken, a second init_app, init_app before
    the extension's, and an enqueue without its transaction: each is refused, naming the fix."""
    from celery import Celery

    from flask_idem import ConfigurationError, Idempotency
    from flask_idem.celery import CeleryJobs
    from flask_idem.jobs import JobPolicy

    with pytest.raises(ConfigurationError, match="IDEM_JOB_ATTEMPTS must be a positive integer"):
        JobPolicy.from_config({"IDEM_JOB_ATTEMPTS": 0})
    with pytest.raises(ConfigurationError, match="IDEM_JOB_DEADLINE must be a positive number"):
        JobPolicy.from_config({"IDEM_JOB_DEADLINE": "soon"})
    with pytest.raises(ConfigurationError, match="acks_late"):
        jobs.task(name="jobs.other", acks_late=False)
    with pytest.raises(ConfigurationError, match="named 'jobs.add'"):
        jobs.task(name="jobs.add")(lambda job: None)
    with pytest.raises(ConfigurationError, match="call init_app once"):
        jobs.init_app(jobs_app, Celery("again", set_as_current=False))
    with pytest.raises(ConfigurationError, match="idem.init_app"):
        CeleryJobs(Idempotency()).init_app(Flask("bare"), Celery("bare", set_as_current=False))
    with jobs_app.app_context(), pytest.raises(ConfigurationError, match="conn=run.connection"):
        jobs.enqueue("jobs.add", 1)
    with pytest.raises(ConfigurationError, match="IDEM_OUTBOX_LEASE"):
        app = Flask("lease")
        app.config.update(IDEM_DATABASE_URL=jobs_app.config["IDEM_DATABASE_URL"], IDEM_OUTBOX_LEASE=-1)
        Idempotency(app, scope=lambda: 1)
        CeleryJobs(Idempotency()).init_app(app, Celery("lease", set_as_current=False))


def test_flask_idem_recover_finishes_a_task_whose_message_never_came_back(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A flow task stranded after its call (its message lost): the recovery job finishes it through the
    resolver, and `flask idem stuck` names it as a task meanwhile."""
    from flask_idem.recovery import recover

    key = uuid.uuid4()
    crash_after_send(jobs_app, "b@example.com", key)
    db.execute(
        "UPDATE idempotency_keys SET next_attempt_at = now(), created_at = now() - interval '2 minutes'"
    )
    out = jobs_app.test_cli_runner().invoke(args=["idem", "stuck", "--older-than", "60"]).output
    assert (
        f"slow            org=1 key={key} task=jobs.mail status=processing flow=jobs.mail step=intent" in out
    )
    report = recover(jobs_app)
    assert [entry[:2] for entry in report.completed] == [(1, key)]
    assert len(receipts(jobs_app.config["JOBS_MAILDIR"])) == 1
    assert [line.split()[0] for line in runs(jobs_app)] == ["mail", "send"]
    again = deliver(jobs_app, "jobs.mail", "b@example.com", key=key)
    assert isinstance(again, _delivery.Done) and again.replayed


def test_flask_idem_relay_publishes_and_says_so(jobs_app: Flask, make_app: Any) -> None:
    """`flask idem relay` runs one pass and prints its counts; on an application without background
    jobs it says how to set them up."""
    recorder = Recorder()
    jobs_app.extensions["idem_jobs"] = _jobs_state.JobsState.create(jobs_app, recorder)
    with jobs_app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
        jobs.enqueue("jobs.add", 5, conn=conn, org_id=1, key=uuid.uuid4())
    result = jobs_app.test_cli_runner().invoke(args=["idem", "relay"])
    assert result.exit_code == 0, result.output
    assert result.output == "Published 1, failed 0, taken over 0; purged 0 sent message(s).\n"
    assert len(recorder.published) == 1
    plain = make_app().test_cli_runner().invoke(args=["idem", "relay"])
    assert plain.exit_code == 1 and "jobs.init_app(app, celery_app)" in plain.output


class Leaky:
    """A publisher whose error quotes its broker's URL, credentials included."""

    def publish(self, message: Message) -> None:
        raise ConnectionError("cannot reach amqp://guest:s3cret@broker.example:5672// now")


def test_flask_idem_relay_says_why_a_publish_failed_and_exits_1(
    jobs_app: Flask, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """With the broker on a closed port, one pass of `flask idem relay` exits 1, and its output and the
    log name the task, the broker's host:port and the reason; a reason that quotes a URL loses its
    credentials."""
    from celery import Celery

    from flask_idem.celery import CeleryPublisher

    closed = Celery("closed", broker="amqp://guest:s3cret@127.0.0.1:1//", set_as_current=False)
    # no connection retries: kombu's would take 6 s to give up
    closed.conf.broker_transport_options = {"confirm_publish": True, "max_retries": 0}
    outputs = []
    for publisher in (CeleryPublisher(closed), Leaky()):
        db.execute("DELETE FROM idempotency_keys_outbox")  # one message per pass
        jobs_app.extensions["idem_jobs"] = _jobs_state.JobsState.create(jobs_app, publisher)
        with jobs_app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
            jobs.enqueue("jobs.add", 5, conn=conn, org_id=1, key=uuid.uuid4())
        caplog.clear()
        with caplog.at_level(logging.WARNING, "flask_idem"):
            result = jobs_app.test_cli_runner().invoke(args=["idem", "relay"])
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Published 0, failed 1, taken over 0;")
        outputs.append(result.output)
        assert "s3cret" not in result.output + caplog.text
    refused = (
        "Relay could not publish the message of task jobs.add to the broker at 127.0.0.1:1:"
        " OperationalError: [Errno 111] Connection refused."
    )
    leaked = (
        "Relay could not publish the message of task jobs.add:"
        " ConnectionError: cannot reach amqp://broker.example:5672// now."
    )
    assert refused in outputs[0]
    assert leaked in outputs[1] and leaked in caplog.text


def test_background_jobs_need_the_layout(
    jobs_app: Flask, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a request, on a key table a layout older than the code's, an enqueue and a relay pass are
    refused, naming `flask idem migrate`; on the code's layout they work."""
    from flask_idem import ConfigurationError, _layout

    recorder = Recorder()
    jobs_app.extensions["idem_jobs"] = _jobs_state.JobsState.create(jobs_app, recorder)
    newer = _layout.latest() + 1
    with monkeypatch.context() as patch:
        patch.setattr(_layout, "latest", lambda: newer)  # code of a layout the table does not have yet
        with jobs_app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
            with pytest.raises(
                ConfigurationError, match=f"has layout 1; .* layout {newer}.*flask idem migrate"
            ):
                jobs.enqueue("jobs.add", 1, conn=conn, org_id=1, key=uuid.uuid4())
        with pytest.raises(ConfigurationError, match="flask idem migrate"):
            relay(jobs_app)
    with jobs_app.app_context(), jobs.idem.pool.connection() as conn, conn.transaction():
        jobs.enqueue("jobs.add", 1, conn=conn, org_id=1, key=uuid.uuid4())
    assert relay(jobs_app).published == 1


class Ceiling(random.Random):
    """Draws the top of every interval, so that a countdown is its backoff window's upper bound."""

    def uniform(self, a: float, b: float) -> float:
        return b


def held_mail(app: Flask, db: psycopg.Connection[Any], to: str) -> uuid.UUID:
    """A ``jobs.mail`` task stranded after its call, its lease held for an hour (another delivery's)."""
    key = uuid.uuid4()
    crash_after_send(app, to, key)
    db.execute("UPDATE idempotency_keys SET lease_expires_at = now() + interval '1 hour'")
    return key


def test_a_duplicate_waits_longer_after_each_deferral_up_to_the_cap(
    jobs_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Each deferral of a duplicate while another delivery holds the key carries one more deferral, and
    its window doubles: 0.4 s, 0.8 s, then the 1.0 s cap (backoff 0.2 s); it is not counted a failure."""
    key = held_mail(jobs_app, db, "c@example.com")
    envelope, windows = Envelope(1, key, time.time()), []
    for _ in range(4):
        delivery = _delivery.Delivery.of(envelope, ["c@example.com"], {})
        outcome = _delivery.run_delivery(jobs_app, jobs.tasks["jobs.mail"], delivery, rng=Ceiling())
        assert isinstance(outcome, Defer) and not outcome.failed
        windows.append(outcome.countdown)
        envelope = outcome.envelope
    assert windows == [0.4, 0.8, 1.0, 1.0]
    assert (envelope.deferrals, envelope.failures) == (4, 0)
    assert [line.split()[0] for line in runs(jobs_app)] == ["mail", "send"]


def test_a_duplicate_stops_waiting_at_the_deadline(
    jobs_app: Flask, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Past IDEM_JOB_DEADLINE a duplicate is not deferred again: while the key is held it stops, with a
    warning; once the holder's lease has lapsed, it gives the task up and flags it."""
    key = held_mail(jobs_app, db, "d@example.com")
    late = _delivery.Delivery.of(Envelope(1, key, time.time() - 7200, deferrals=12), ["d@example.com"], {})
    spec = jobs.tasks["jobs.mail"]
    with caplog.at_level(logging.WARNING, logger="flask_idem"):
        assert isinstance(_delivery.run_delivery(jobs_app, spec, late, rng=Ceiling()), Dropped)
    assert "deadline passed before it ran; this delivery stops" in caplog.text
    db.execute("UPDATE idempotency_keys SET lease_expires_at = now()")
    with pytest.raises(JobGivenUp):
        _delivery.run_delivery(jobs_app, spec, late, rng=Ceiling())
    assert db.execute("SELECT status, needs_attention FROM idempotency_keys").fetchall() == [("failed", True)]
    assert [line.split()[0] for line in runs(jobs_app)] == ["mail", "send"]


# -- the second runner (tests/support/inline_jobs.py) ------------------------------------------------------


def order(app: Flask, key: uuid.UUID, **body: Any) -> Any:
    return app.test_client().post("/orders", json=body, headers={"Idempotency-Key": str(key), "X-Org": "1"})


def test_enqueue_in_a_view_derives_its_key_and_commits_with_the_view(
    inline_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """An enqueue with no key= in an idempotent view takes the request's derived key and commits with the
    view: a replayed request enqueues nothing more, a failed one leaves nothing; the task runs once."""
    key = uuid.uuid4()
    first, again = order(inline_app, key, value=4), order(inline_app, key, value=4)
    assert (first.status_code, again.status_code, again.headers["Idempotent-Replayed"]) == (201, 200, "true")
    assert order(inline_app, uuid.uuid4(), value=5, fail=True).status_code == 500
    derived = task_key(1, key, "inline.add")
    assert first.json == {"task_key": str(derived)}
    outbox = db.execute("SELECT org_id, task, idem_key, args FROM idempotency_keys_outbox").fetchall()
    assert outbox == [(1, "inline.add", derived, [4])]
    assert relay(inline_app).published == 1
    assert inline.run(inline_app) == [Done({"value": 4, "org_id": 1})]
    assert db.execute("SELECT org_id, idem_key, value FROM inline_effects").fetchall() == [(1, derived, 4)]


def test_one_task_key_in_two_organisations_is_two_tasks(
    inline_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """The same task key enqueued by two organisations runs in each, with its own arguments and result;
    a second message of the first organisation's replays its result."""
    key = uuid.uuid4()
    with inline_app.app_context():
        for org_id in (1, 2, 1):
            with inline_jobs.idem.pool.connection() as conn, conn.transaction():
                inline.enqueue("inline.add", 10 * org_id, conn=conn, org_id=org_id, key=key)
    assert relay(inline_app).published == 3
    assert inline.run(inline_app) == [
        Done({"value": 10, "org_id": 1}),
        Done({"value": 20, "org_id": 2}),
        Done({"value": 10, "org_id": 1}, replayed=True),
    ]
    effects = db.execute("SELECT org_id, idem_key, value FROM inline_effects ORDER BY org_id").fetchall()
    assert effects == [(1, key, 10), (2, key, 20)]


def test_a_flow_task_is_given_up_after_its_attempts(inline_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A flow task whose call never learns its outcome is delivered again with its failures counted in
    its envelope, given up and flagged at the third (IDEM_JOB_ATTEMPTS), and never called again."""
    key, url = uuid.uuid4(), "https://hooks.example/1"
    with inline_app.app_context(), inline_jobs.idem.pool.connection() as conn, conn.transaction():
        inline.enqueue("inline.notify", url, conn=conn, org_id=1, key=key)
    relay(inline_app)
    outcomes = inline.run(inline_app)
    assert [type(o) for o in outcomes] == [Defer, Defer, JobGivenUp]
    assert [o.envelope.failures for o in outcomes if isinstance(o, Defer)] == [1, 2]
    assert inline_app.config["INLINE_CALLS"] == [url] * 3
    row = db.execute("SELECT status, needs_attention, flow FROM idempotency_keys").fetchone()
    assert row == ("failed", True, "inline.notify")
    out = inline_app.test_cli_runner().invoke(args=["idem", "stuck"]).output
    assert f"NEEDS ATTENTION org=1 key={key} task=inline.notify status=failed" in out
    db.execute("UPDATE idempotency_keys_outbox SET sent_at = NULL, claimed_until = now()")
    relay(inline_app)  # another copy of the message
    assert [type(o) for o in inline.run(inline_app)] == [JobGivenUp]
    assert len(inline_app.config["INLINE_CALLS"]) == 3


def test_flask_idem_relay_loop_goes_on_after_a_database_error_and_stops_on_sigterm(
    inline_app: Flask, db: psycopg.Connection[Any], database_url: str, tmp_path: Path
) -> None:
    """`flask idem relay --loop` in a process of its own: a pass that fails is logged and the next pass
    publishes; SIGTERM ends it after its pass, with status 0.

    The pass fails on a connection the server closed while its statement waited on a lock the test
    holds; behind PgBouncer, which replaces a closed server connection without its client seeing
    anything, on the outbox table renamed for a moment instead.
    """

    def enqueue() -> None:  # on a connection of its own: the server closes the pool's below
        with inline_app.app_context(), psycopg.connect(database_url) as conn, conn.transaction():
            inline.enqueue("inline.add", 1, conn=conn, org_id=1, key=uuid.uuid4())

    def unsent() -> int:
        row = db.execute("SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL").fetchone()
        return int(row[0]) if row else -1

    waiting = (
        "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend' AND wait_event_type = 'Lock'"
    )

    def relay_waits() -> bool:
        row = db.execute(f"SELECT count(*) {waiting}").fetchone()
        return bool(row and row[0])

    def pass_failed() -> None:
        if not pgbouncer.ENABLED:  # terminated mid-statement: no window to hit by chance
            with psycopg.connect(database_url) as holder:
                holder.execute("LOCK TABLE idempotency_keys_outbox IN ACCESS EXCLUSIVE MODE")
                wait_for(relay_waits, timeout=30)
                db.execute(f"SELECT pg_terminate_backend(pid) {waiting}")
            failed = "Relay pass failed: AdminShutdown (SQLSTATE 57P01)"
            wait_for(lambda: failed in log.read_text(), timeout=30)
            return
        db.execute("ALTER TABLE idempotency_keys_outbox RENAME TO idempotency_keys_outbox_away")
        try:
            failed = "Relay pass failed: UndefinedTable (SQLSTATE 42P01)"
            wait_for(lambda: failed in log.read_text(), timeout=30)
        finally:
            db.execute("ALTER TABLE idempotency_keys_outbox_away RENAME TO idempotency_keys_outbox")

    log = tmp_path / "relay.log"
    app = f"tests.support.inline_jobs:build_inline_app({database_url!r})"
    args = [sys.executable, "-m", "flask", "--app", app, "idem", "relay", "--loop", "--interval", "0.1"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        enqueue()
        wait_for(lambda: unsent() == 0, timeout=30)
        pass_failed()
        enqueue()
        wait_for(lambda: unsent() == 0, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert "Relaying every 0.1 s when idle" in output
    assert output.count("Published 1, failed 0") == 2, output
