"""Checked by mypy (``files`` in setup.cfg), never run: the public API reads well to a type checker.

Each block uses one part of the public surface the way the documentation shows it, with the types a user
would write down; a change that makes any of it ill-typed fails ``tests/test_layers.py``.
"""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from typing import Any

import requests
from flask import Flask, Response
from flask.testing import FlaskClient
from psycopg import Connection
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool
from werkzeug.exceptions import Conflict, HTTPException
from werkzeug.test import TestResponse

from flask_idem import (
    HEADER,
    REPLAYED_HEADER,
    ConfigurationError,
    DatabaseFailed,
    DatabaseUnavailable,
    Fingerprint,
    Flow,
    Idempotency,
    IdempotencyError,
    InvalidBody,
    InvalidKey,
    KeyInUse,
    KeyMismatch,
    MissingKey,
    NoScope,
    OnMismatch,
    OperationFailed,
    OutcomePending,
    OutcomeUnknown,
    ResponseNotStored,
    Run,
    ScopeFunc,
    StoredResponseUnreadable,
    StoreResponse,
)
from flask_idem.client import (
    AttemptInfo,
    CallFailed,
    FlaskTransport,
    IdempotentClient,
    Rejected,
    RequestsTransport,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    set_testing,
)
from flask_idem.errors import PROBLEM_JSON, database_error, problem
from flask_idem.recovery import RecoveryReport, backoff, recover, run_forever


def org() -> int | None:
    return 1


scope: ScopeFunc = org
policy: OnMismatch = "replay"
idem = Idempotency(scope=scope)
app = Flask(__name__)
idem.init_app(app)


@app.post("/orders")
@idem.idempotent(ttl=3600, on_mismatch=policy, required=True)
def create() -> tuple[dict[str, str], int]:
    conn: Connection[TupleRow] = idem.connection
    key: uuid.UUID | None = idem.key
    conn.execute("SELECT 1")
    return {"key": str(key)}, 201


@app.post("/notes")
@idem.idempotent(ttl=timedelta(hours=1), on_mismatch="reject", scope=lambda: 2)
def create_note() -> Response:
    return Response(status=204)


# -- per-route policies: what counts as the same request, what a stored answer keeps, async views ----------

before = Fingerprint(exclude=["/client_ts"])
route_policy = Fingerprint(
    include=["/amount", "/currency"],
    exclude=(),
    headers=["X-Currency"],
    custom=lambda: {"ref": 1},
    version=2,
    previous=[before, Fingerprint()],
)
counted: list[str] = route_policy.counted()
keeping: StoreResponse = "encrypted"


@app.post("/quotes")
@idem.idempotent(fingerprint=route_policy, store_response=keeping)
async def create_quote() -> tuple[dict[str, str], int]:
    conn: Connection[TupleRow] = idem.connection
    conn.execute("SELECT 1")
    return {"id": "q1"}, 201


@app.post("/tokens")
@idem.idempotent(store_response="location")
def mint() -> tuple[dict[str, str], int, dict[str, str]]:
    return {"token": "t"}, 201, {"Location": "/tokens/1"}


storage_errors: tuple[type[IdempotencyError], ...] = (ResponseNotStored, StoredResponseUnreadable)

with app.app_context():
    pool: ConnectionPool[Any] = idem.pool
    idem.create_table()
    idem.check_layout()
    warning: str | None = idem.partition_warning()
    idem.close()

# -- multi-step flows: both forms of Flow.call, the finish step, what a step sees --------------------------

pay = Flow("payments.create", lease_timeout=timedelta(seconds=30))
other = Flow("refunds.create", lease_timeout=10.0)


@pay.call
def charge(run: Run) -> dict[str, Any]:
    derived: str = run.derived_key()
    if run.resumed:
        raise OutcomeUnknown("gateway unreachable")
    return {"id": derived, "amount": run.intent["amount"]}


@pay.call(resolve=lambda run: None)
def confirm(run: Run) -> dict[str, Any]:
    return {"confirmed": run.results["charge"]["id"]}


@pay.step
def record(run: Run) -> None:
    run.connection.execute("SELECT 1")


@pay.finish
def done(run: Run) -> tuple[dict[str, Any], int]:
    return {"id": run.intent["payment_id"]}, 201


@app.post("/payments")
@idem.idempotent(flow=pay)
def create_payment() -> dict[str, Any]:
    return {"payment_id": 1, "amount": 1250}


report: RecoveryReport = recover(app, limit=10, rng=random.Random(1))
claimed: int = report.claimed
wait: float = backoff(3, base=2.0, cap=300.0, rng=random.Random(1))
run_forever(app, interval=5.0, on_pass=lambda r: print(r.claimed))

# -- errors: every exported class is an IdempotencyError and a Werkzeug HTTPException -----------------------

errors: tuple[type[IdempotencyError], ...] = (
    MissingKey,
    InvalidKey,
    InvalidBody,
    NoScope,
    KeyInUse,
    KeyMismatch,
    DatabaseUnavailable,
    OutcomePending,
    OperationFailed,
    DatabaseFailed,
)
http_error: type[HTTPException] = KeyInUse
conflict: type[Conflict] = KeyInUse
in_use = KeyInUse(retry_after=2)
body: dict[str, Any] = in_use.to_dict()
rendered: Response = problem(in_use)
config_error: type[RuntimeError] = ConfigurationError
headers: tuple[str, str, str] = (HEADER, REPLAYED_HEADER, PROBLEM_JSON)


@app.errorhandler(KeyInUse)
def key_in_use(e: KeyInUse) -> Response:
    return problem(e)


def translate(e: Exception) -> IdempotencyError | None:
    import psycopg

    return database_error(e) if isinstance(e, psycopg.Error) else None


# -- the client helper over requests and over Flask's test client --------------------------------------

with set_testing(True):
    http = IdempotentClient(
        RequestsTransport(),
        policy=RetryPolicy(attempts=5, deadline=30.0, base=0.1, cap=5.0),
        budget=RetryBudget(),
        on_attempt=lambda info: print(info.number),
        rng=random.Random(7),
    )
    try:
        answer: requests.Response = http.post("http://127.0.0.1:5000/orders", json={"amount": 1250})
    except Rejected as e:
        status: int | None = e.status
    except (RetriesExhausted, CallFailed):
        pass

    test_client: FlaskClient = app.test_client()
    local = IdempotentClient(FlaskTransport(test_client))
    in_process: TestResponse = local.request("POST", "/orders", json={}, key=uuid.uuid4())


def seen(info: AttemptInfo) -> None:
    print(info.number, info.status, info.wait)


# -- background jobs: an idempotent Celery task, the outbox, the relay ------------------------------------


def background_jobs(idem: Idempotency, app: Flask) -> None:
    from celery import Celery

    from flask_idem.celery import CeleryJobs
    from flask_idem.jobs import Envelope, Job, JobGivenUp, JobMismatch, JobPolicy, Message, task_key
    from flask_idem.relay import RelayReport, relay, relay_forever

    jobs = CeleryJobs(idem, policy=JobPolicy(attempts=5, deadline=600.0, backoff=1.0, backoff_cap=30.0))
    jobs.init_app(app, Celery("shop"))

    @jobs.task(name="shop.fulfil", queue="shop")
    def fulfil(job: Job, order_id: int) -> dict[str, Any]:
        job.connection.execute("UPDATE orders SET fulfilled = true WHERE id = %s", (order_id,))
        key: str = job.derived_key("shop.receipt")
        return {"order_id": order_id, "receipt_key": key}

    with idem.pool.connection() as conn, conn.transaction():
        enqueued: uuid.UUID = jobs.enqueue(fulfil, 7, conn=conn, org_id=1, key=task_key(1, uuid.uuid4(), "x"))
    report: RelayReport = relay(app, limit=50)
    published: int = report.published
    headers: dict[str, Any] = Envelope(1, enqueued, 1700000000.0).headers()
    refused: tuple[type[Exception], ...] = (JobMismatch, JobGivenUp)
    relay_forever(app, interval=1.0, on_pass=lambda done: print(done.published))
    print(published, headers, refused, Message)


def another_runner(idem: Idempotency, app: Flask) -> None:
    from flask_idem.jobs import Defer, Done, Dropped, Envelope, Job, JobError, Jobs, Message, TaskSpec

    class Runner(Jobs):
        def __init__(self, idem: Idempotency) -> None:
            super().__init__(idem)
            self.sent: list[Message] = []

        def publish(self, message: Message) -> None:
            self.sent.append(message)

        def make_task(self, spec: TaskSpec, **options: Any) -> TaskSpec:
            return spec

        def work(self, app: Flask) -> list[Any]:
            done: list[Any] = []
            for message in self.sent:
                try:
                    outcome = self.deliver(
                        app, self.tasks[message.task], message.envelope, message.args, message.kwargs
                    )
                except JobError:
                    continue
                if isinstance(outcome, Done):
                    done.append(outcome.result)
                elif isinstance(outcome, Defer):
                    later: Envelope = outcome.envelope
                    print(outcome.countdown, later.failures, later.deferrals)
                elif isinstance(outcome, Dropped):
                    print(outcome.reason)
            return done

    runner = Runner(idem)
    runner.init_app(app, runner)

    @runner.task(name="shop.note")
    def note(job: Job, text: str) -> dict[str, Any]:
        return {"text": text, "org": job.org_id}

    with idem.pool.connection() as conn, conn.transaction():
        key: uuid.UUID = runner.enqueue(note, "hello", conn=conn, org_id=1, key=uuid.uuid4())
    print(key, runner.work(app))
