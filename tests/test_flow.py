"""Multi-step flows of the extension itself: declaration rules, step bookkeeping, leases, early answers.

The outside party here is a small in-process ledger (a dict keyed by derived key) that can be told to
fail; the database is the real one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem.errors import ConfigurationError
from flask_idem.flow import Flow, OutcomeUnknown, Run
from flask_idem.jobs import Job, task_key

from .support.flow_app import Ledger, row
from .support.helpers import count
from .support.notes_app import ORG, post


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
    derived = run.derived_key("a")  # the canonical text of a version 5 UUID, as docs/flows.rst says
    assert isinstance(derived, str) and str(uuid.UUID(derived)) == derived
    assert uuid.UUID(derived).version == 5


def test_a_jobs_derived_key_is_a_runs() -> None:
    """``Job.derived_key`` returns what ``Run.derived_key`` does for the task's key, the same type (the
    text of a UUID, what an outside party is sent), and the text of ``task_key`` for an enqueued task."""
    key = uuid.uuid4()
    derived = Job(name="jobs.mail", org_id=1, key=key).derived_key("send")
    assert derived == Run(flow="jobs.mail", org_id=1, key=key).derived_key("send")
    assert isinstance(derived, str) and derived == str(task_key(1, key, "send", flow="jobs.mail"))
    assert derived != Job(name="jobs.mail", org_id=2, key=key).derived_key("send")


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
