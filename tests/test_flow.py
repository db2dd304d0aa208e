"""Multi-step flows of the extension itself: declaration rules, step bookkeeping, leases, early answers.

The outside party here is a small in-process ledger (a dict keyed by derived key) that can be told to
fail; the database is the real one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, abort, current_app, request

from flask_idem import Idempotency
from flask_idem.errors import ConfigurationError
from flask_idem.flow import Flow, OutcomeUnknown, Run

from .helpers import close_pool, count
from .notes_app import ORG, org_from_header, post


class Ledger:
    """The outside party: records one entry per key, and fails on demand."""

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}
        self.calls: list[str] = []
        self.fail_next: type[Exception] | None = None
        self.lose_answer = False

    def record(self, key: str, amount: int) -> dict[str, Any]:
        self.calls.append("record")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error("the ledger is down")
        self.entries.setdefault(key, amount)
        if self.lose_answer:  # recorded, but the answer never reaches the caller
            self.lose_answer = False
            raise OutcomeUnknown("connection reset")
        return {"entry": key, "amount": self.entries[key]}

    def find(self, key: str) -> dict[str, Any] | None:
        self.calls.append("find")
        return {"entry": key, "amount": self.entries[key]} if key in self.entries else None


def build_flow_app(database_url: str, ledger: Ledger, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update({"IDEM_DATABASE_URL": database_url, "IDEM_LEASE_TIMEOUT": 30, **config})
    idem = Idempotency(app, scope=org_from_header)
    flow = Flow("notes.transfer")
    steps_run: list[str] = []
    app.config["STEPS_RUN"] = steps_run

    @flow.step
    def prepare(run: Run) -> dict[str, Any]:
        steps_run.append("prepare")
        if current_app.config.get("PREPARE_ABORT"):
            abort(409 if current_app.config["PREPARE_ABORT"] == 409 else 410)
        if current_app.config.get("PREPARE_RAISE"):
            current_app.config["PREPARE_RAISE"] = False
            raise RuntimeError("prepare broke")
        run.connection.execute("INSERT INTO notes (org_id, body) VALUES (%s, 'prepared')", (run.org_id,))
        return {"prepared": True}

    @flow.call(resolve=lambda run: ledger.find(run.derived_key("post")))
    def post(run: Run) -> dict[str, Any]:
        steps_run.append("post")
        return ledger.record(run.derived_key("post"), run.intent["amount"])

    @flow.finish
    def done(run: Run) -> Any:
        steps_run.append("done")
        if current_app.config.get("FINISH_500"):
            current_app.config["FINISH_500"] = False
            return {"error": "later"}, 500
        return {"entry": run.results["post"]["entry"], "amount": run.results["post"]["amount"]}, 201

    @app.post("/transfers")
    @idem.idempotent(flow=flow)
    def transfer() -> Any:
        amount = request.get_json()["amount"]
        if amount < 0:
            return {"error": "negative"}, 400
        if amount == 0:
            abort(404)
        idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, 'intent')", (org_from_header(),)
        )
        return {"amount": amount}

    return app


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def flow_app(database_url: str, db: psycopg.Connection[Any], ledger: Ledger) -> Iterator[Flask]:
    app = build_flow_app(database_url, ledger)
    yield app
    close_pool(app)


def row(db: psycopg.Connection[Any]) -> tuple[Any, ...]:
    found = db.execute("SELECT status, step, attempts, last_error FROM idempotency_keys").fetchone()
    assert found is not None
    return tuple(found)


def test_all_steps_run_once(flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]) -> None:
    """Intent, database step, call and finish each run once; a retry replays without running any."""
    key = uuid.uuid4()
    first = post(flow_app, "/transfers", key, {"amount": 7})
    assert first.status_code == 201
    assert flow_app.config["STEPS_RUN"] == ["prepare", "post", "done"]
    assert len(ledger.entries) == 1
    assert post(flow_app, "/transfers", key, {"amount": 7}).data == first.data
    assert flow_app.config["STEPS_RUN"] == ["prepare", "post", "done"]
    assert row(db) == ("completed", "post", 0, None)
    assert count(db, "notes") == 2


def test_finished_steps_are_not_run_again(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """After an unknown outcome, the retry resumes at the call: the database step is not repeated."""
    key = uuid.uuid4()
    ledger.fail_next = OutcomeUnknown
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 503
    assert row(db) == ("processing", "prepare", 0, "OutcomeUnknown")
    retry = post(flow_app, "/transfers", key, {"amount": 7})
    assert retry.status_code == 201
    assert flow_app.config["STEPS_RUN"] == ["prepare", "post", "post", "done"]
    assert ledger.calls == ["record", "find", "record"]  # resumed: asked first, then called
    assert row(db) == ("completed", "post", 1, "OutcomeUnknown")
    assert count(db, "notes") == 2


def test_resolver_answer_skips_the_call(flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]) -> None:
    """When the outside party has the entry on record, a resumed call step takes it instead of calling."""
    key = uuid.uuid4()
    ledger.lose_answer = True
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 503
    retry = post(flow_app, "/transfers", key, {"amount": 7})
    assert retry.status_code == 201
    assert ledger.calls == ["record", "find"]
    assert retry.json == {"entry": next(iter(ledger.entries)), "amount": 7}
    assert len(ledger.entries) == 1


def test_recorded_call_is_not_repeated(flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]) -> None:
    """A call step recorded before the finish failed is neither asked nor called again on resume."""
    key = uuid.uuid4()
    flow_app.config["FINISH_500"] = True
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 500
    assert row(db)[:2] == ("processing", "post")
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 201
    assert ledger.calls == ["record"]
    assert flow_app.config["STEPS_RUN"] == ["prepare", "post", "done", "done"]


def test_any_exception_in_a_call_is_an_unknown_outcome(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """A call step failing with any exception answers 503 and the key stays processing."""
    ledger.fail_next = KeyError
    response = post(flow_app, "/transfers", uuid.uuid4(), {"amount": 7})
    assert response.status_code == 503
    assert response.json["type"] == "urn:flask-idem:problem:outcome-pending"
    assert row(db)[0] == "processing"


def test_exception_in_a_database_step_rolls_it_back_and_frees_the_lease(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """A failing database step keeps the intent, undoes its own writes, and leaves the request resumable."""
    key = uuid.uuid4()
    flow_app.config["PREPARE_RAISE"] = True
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 500
    assert row(db) == ("processing", "intent", 0, "RuntimeError")
    assert db.execute("SELECT body FROM notes").fetchall() == [("intent",)]
    assert post(flow_app, "/transfers", key, {"amount": 7}).status_code == 201
    assert db.execute("SELECT body FROM notes ORDER BY id").fetchall() == [("intent",), ("prepared",)]


def test_client_error_in_a_step_ends_the_request(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any]
) -> None:
    """abort() with a 4xx in a database step is the final answer: stored, replayed, nothing called outside."""
    key = uuid.uuid4()
    flow_app.config["PREPARE_ABORT"] = 410
    first = post(flow_app, "/transfers", key, {"amount": 7})
    assert first.status_code == 410
    assert post(flow_app, "/transfers", key, {"amount": 7}).data == first.data
    assert row(db)[0] == "completed"
    assert ledger.calls == []


@pytest.mark.parametrize(("amount", "status"), [(-1, 400), (0, 404)], ids=["returned", "aborted"])
def test_view_can_answer_at_once(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any], amount: int, status: int
) -> None:
    """A view that returns a response instead of an intent answers at once; the answer is stored."""
    key = uuid.uuid4()
    assert post(flow_app, "/transfers", key, {"amount": amount}).status_code == status
    assert post(flow_app, "/transfers", key, {"amount": amount}).headers["Idempotent-Replayed"] == "true"
    assert flow_app.config["STEPS_RUN"] == []
    assert row(db)[0] == "completed"


def test_missing_key_is_refused(flow_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A multi-step route always needs a key."""
    response = flow_app.test_client().post("/transfers", json={"amount": 1}, headers=ORG)
    assert response.status_code == 400
    assert count(db, "idempotency_keys") == 0


def test_derived_keys() -> None:
    """Derived keys are stable per (org, key, flow, step) and differ when any of them differs."""
    key = uuid.uuid4()
    run = Run(flow="f", org_id=1, key=key)
    assert run.derived_key("a") == Run(flow="f", org_id=1, key=key).derived_key("a")
    others = {
        Run(flow="f", org_id=2, key=key).derived_key("a"),
        Run(flow="g", org_id=1, key=key).derived_key("a"),
        Run(flow="f", org_id=1, key=uuid.uuid4()).derived_key("a"),
        run.derived_key("b"),
    }
    assert run.derived_key("a") not in others and len(others) == 4
    uuid.UUID(run.derived_key("a"))


def test_call_steps_have_no_connection() -> None:
    """A call step cannot reach a database connection."""
    with pytest.raises(RuntimeError):
        _ = Run(flow="f", org_id=1, key=uuid.uuid4()).connection


@pytest.mark.parametrize(
    "declare",
    [
        lambda f: (f.step(_step), f.step(_step)),
        lambda f: (f.finish(_step), f.step(_other)),
        lambda f: (f.finish(_step), f.finish(_other)),
        lambda f: f.step(_named("intent")),
    ],
    ids=["duplicate-step", "step-after-finish", "two-finishes", "reserved-name"],
)
def test_declaration_errors(declare: Callable[[Flow], Any]) -> None:
    """Mistakes in declaring a flow are configuration errors raised at import time."""
    with pytest.raises(ConfigurationError):
        declare(Flow("x"))


def test_route_errors(database_url: str) -> None:
    """A flow without a finish fails its first request; optional keys and duplicate names fail at once."""
    idem = Idempotency(scope=lambda: 1)
    with pytest.raises(ConfigurationError):
        idem.idempotent(flow=Flow("a"), required=False)
    idem.idempotent(flow=Flow("b"))
    with pytest.raises(ConfigurationError):
        idem.idempotent(flow=Flow("b"))
    with pytest.raises(ConfigurationError):
        Flow("")
    with pytest.raises(ConfigurationError, match="finish"):
        Flow("c").check()


def _step(run: Run) -> None:
    return None


def _other(run: Run) -> None:
    return None


def _named(name: str) -> Callable[[Run], None]:
    def step(run: Run) -> None:
        return None

    step.__name__ = name
    return step


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
    """`recover --loop` (run_forever) finishes a stranded request and stops when told to."""
    import threading

    from flask_idem.recovery import run_forever

    key = uuid.uuid4()
    ledger.lose_answer = True
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 503
    assert db.execute("SELECT next_attempt_at > now() FROM idempotency_keys").fetchone() == (True,)
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    stop = threading.Event()
    worker = threading.Thread(target=run_forever, args=(flow_app,), kwargs={"interval": 0.05, "stop": stop})
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while row(db)[0] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
    assert ledger.calls == ["record", "find"]
    assert post(flow_app, "/transfers", key, {"amount": 3}).status_code == 200


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
