"""Flask-SQLAlchemy: ``Idempotency(sqlalchemy=db)``; the orders route through ``db.session`` (sqla_app)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from psycopg.conninfo import make_conninfo
from sqlalchemy import create_engine, text
from sqlalchemy.orm import scoped_session, sessionmaker

from example_app.auth import hash_api_key, new_api_key
from flask_idem import ConfigurationError, Idempotency
from flask_idem._state import get_state
from flask_idem.errors import PROBLEM_JSON
from flask_idem.sqla import SessionCommitRefused

from .support import sqla_app
from .support.faultproxy import running_proxy
from .support.helpers import count, gunicorn, headers, wait_for
from .test_concurrency import fire

ORDER = {"amount": 1250, "currency": "EUR"}


@pytest.fixture
def make_sqla_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Callable[..., Flask]]:
    """Build the Flask-SQLAlchemy shop; its engines are disposed of afterwards."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = sqla_app.create_app({"TESTING": True, "DATABASE_URL": database_url, **config})
        apps.append(app)
        return app

    yield make
    for app in apps:
        with app.app_context():
            sqla_app.db.engine.dispose()


@pytest.fixture
def sqla(make_sqla_app: Callable[..., Flask]) -> Flask:
    return make_sqla_app()


@pytest.fixture
def org_key(db: psycopg.Connection[Any]) -> str:
    """The API key of a fresh organisation in the shop's ``orgs`` table."""
    api_key = new_api_key()
    db.execute("INSERT INTO orgs (name, api_key_sha) VALUES ('sqla', %s)", (hash_api_key(api_key),))
    return api_key


def post(app: Flask, path: str, api_key: str, key: uuid.UUID | None, json: Any = ORDER, **extra: str) -> Any:
    return app.test_client().post(path, json=json, headers=headers(api_key, key, **extra))


def checked_out(app: Flask) -> int:
    """Connections of the app's engine that are checked out of its pool now."""
    with app.app_context():
        return int(sqla_app.db.engine.pool.checkedout())  # type: ignore[attr-defined]


def test_create_then_replay(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """A retry replays the first 201 with its Location; one order; the session gives its connection back."""
    key = uuid.uuid4()
    first = post(sqla, "/orders", org_key, key)
    second = post(sqla, "/orders", org_key, key)
    assert first.status_code == 201, first.json
    assert set(first.json) == {"id", "amount", "currency", "created_at"}
    assert first.headers["Location"] == f"/orders/{first.json['id']}"
    assert second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert (second.json, second.headers["Location"]) == (first.json, first.headers["Location"])
    assert count(db, "orders") == 1
    assert db.execute("SELECT status FROM idempotency_keys").fetchall() == [("completed",)]
    assert checked_out(sqla) == 0


def test_mismatch_is_422(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """The same key with another amount is refused and the first order stays as it was."""
    key = uuid.uuid4()
    assert post(sqla, "/orders", org_key, key).status_code == 201
    second = post(sqla, "/orders", org_key, key, json={**ORDER, "amount": 99})
    assert second.status_code == 422
    assert second.mimetype == PROBLEM_JSON
    assert second.json["type"] == "urn:flask-idem:problem:key-mismatch"
    assert db.execute("SELECT amount FROM orders").fetchall() == [(1250,)]


def test_client_errors(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """No key is 400 and an invalid body 422, both problem+json, and nothing is written."""
    missing = post(sqla, "/orders", org_key, None)
    invalid = post(sqla, "/orders", org_key, uuid.uuid4(), json={"amount": "x"})
    assert (missing.status_code, missing.mimetype) == (400, PROBLEM_JSON)
    assert (invalid.status_code, invalid.mimetype) == (422, PROBLEM_JSON)
    assert count(db, "orders") == 0


def test_duplicate_in_flight_is_409_at_once(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """While the first attempt's session transaction is open, a duplicate gets 409 without waiting."""
    entered, release = threading.Event(), threading.Event()
    sqla.config.update(ENTERED=entered, RELEASE=release)
    key = uuid.uuid4()
    results: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: results.update(first=post(sqla, "/orders/block", org_key, key)))
    thread.start()
    try:
        assert entered.wait(10)
        duplicate = post(sqla, "/orders/block", org_key, key)
        still_running = thread.is_alive()
    finally:
        release.set()
        thread.join(15)
    assert still_running, "the duplicate waited for the first attempt to finish"
    assert duplicate.status_code == 409
    assert duplicate.headers["Retry-After"] == "1"
    assert results["first"].status_code == 201
    assert post(sqla, "/orders/block", org_key, key).json == results["first"].json
    assert count(db, "orders") == 1


def test_orm_and_raw_connection_share_the_transaction(sqla: Flask, org_key: str) -> None:
    """idem.connection is the connection under db.session: it sees the view's flushed, uncommitted order."""
    answer = post(sqla, "/orders/raw", org_key, uuid.uuid4())
    assert answer.status_code == 201
    assert answer.json == {"seen_by_raw": 1}


def test_commit_inside_the_view_is_refused(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """db.session.commit() in an idempotent view raises a clear error; nothing is committed, key included."""
    with pytest.raises(SessionCommitRefused, match=r"db\.session\.flush\(\)"):
        post(sqla, "/orders/commit", org_key, uuid.uuid4())
    assert count(db, "orders") == 0
    assert count(db, "idempotency_keys") == 0
    assert checked_out(sqla) == 0


def test_commit_refused_is_a_500_problem(
    make_sqla_app: Callable[..., Flask], org_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside testing mode the client gets a 500 and the log says why."""
    app = make_sqla_app(TESTING=False)
    answer = post(app, "/orders/commit", org_key, uuid.uuid4())
    assert answer.status_code == 500
    assert "db.session.commit() inside an @idem.idempotent() view" in caplog.text


@pytest.mark.parametrize(
    "path", ["/orders/rollback", "/orders/rollback-swallowed"], ids=["raised", "swallowed"]
)
def test_rollback_inside_the_view_fails_the_request(
    sqla: Flask, org_key: str, db: psycopg.Connection[Any], path: str
) -> None:
    """db.session.rollback() drops the key's reservation: the request fails even if the error is caught."""
    key = uuid.uuid4()
    with pytest.raises(SessionCommitRefused):
        post(sqla, path, org_key, key)
    assert count(db, "orders") == 0
    assert count(db, "idempotency_keys") == 0
    assert post(sqla, "/orders", org_key, key).status_code == 201  # the key was never taken
    assert checked_out(sqla) == 0


def test_savepoints_are_fine(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """A failure inside db.session.begin_nested() undoes the savepoint only."""
    key = uuid.uuid4()
    answer = post(sqla, "/orders/savepoint", org_key, key)
    assert answer.status_code == 201
    assert post(sqla, "/orders/savepoint", org_key, key).json == answer.json
    assert count(db, "orders") == 1


def test_view_error_rolls_back_its_orm_writes(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """An exception after the view's ORM write rolls both the write and the key back; the retry runs anew."""
    key = uuid.uuid4()
    with pytest.raises(RuntimeError, match="broke"):
        post(sqla, "/orders/fail", org_key, key)
    assert count(db, "orders") == 0
    assert count(db, "idempotency_keys") == 0
    assert checked_out(sqla) == 0


def test_sqlalchemy_error_is_a_problem(sqla: Flask, org_key: str, db: psycopg.Connection[Any]) -> None:
    """An IntegrityError from the view's flush is answered like the psycopg error it wraps: a 500 problem."""
    answer = post(sqla, "/orders/duplicate", org_key, uuid.uuid4())
    assert (answer.status_code, answer.mimetype) == (500, PROBLEM_JSON)
    assert answer.json["type"] == "urn:flask-idem:problem:database-error"
    assert count(db, "orders") == 0
    assert count(db, "idempotency_keys") == 0


def test_flow_steps_use_the_session(
    sqla: Flask, org_key: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A multi-step route: each step is its own session transaction, none is open during the call step."""
    sqla.config["SEND_FAULTS"] = ["mailer unreachable"]
    key = uuid.uuid4()
    with caplog.at_level(logging.WARNING, "flask_idem"):
        first = post(sqla, "/receipts", org_key, key)
    assert first.status_code == 503
    assert "unknown: mailer unreachable" in caplog.text
    assert db.execute("SELECT status, step FROM idempotency_keys").fetchone() == ("processing", "intent")
    assert count(db, "orders") == 1  # the intent's transaction committed the order
    retry = post(sqla, "/receipts", org_key, key)
    assert retry.status_code == 201, retry.json
    assert (retry.json["amount"], retry.json["sent"]) == (1251, 2)
    assert sqla.config["SENT"] == [False, False]  # no session transaction during the call
    assert post(sqla, "/receipts", org_key, key).json == retry.json
    assert db.execute("SELECT amount FROM orders").fetchall() == [(1251,)]
    assert checked_out(sqla) == 0


def test_recovery_finishes_a_flow_through_the_session(
    sqla: Flask, org_key: str, db: psycopg.Connection[Any]
) -> None:
    """`flask idem recover` resumes a stranded flow; its finish step writes through db.session."""
    sqla.config["SEND_FAULTS"] = ["mailer unreachable"]
    key = uuid.uuid4()
    assert post(sqla, "/receipts", org_key, key).status_code == 503
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    result = sqla.test_cli_runner().invoke(args=["idem", "recover"])
    assert "Claimed 1: 1 completed" in result.output, result.output
    replay = post(sqla, "/receipts", org_key, key)
    assert (replay.status_code, replay.json["amount"]) == (200, 1251)
    assert db.execute("SELECT amount FROM orders").fetchall() == [(1251,)]
    assert checked_out(sqla) == 0


def test_cli_runs_on_the_engine(sqla: Flask) -> None:
    """`flask idem` commands work without IDEM_DATABASE_URL: they use the engine's database."""
    runner = sqla.test_cli_runner()
    assert "is ready" in runner.invoke(args=["idem", "init-db"]).output
    assert runner.invoke(args=["idem", "stuck"]).output.strip() == "0 row(s)."
    assert "Claimed 0" in runner.invoke(args=["idem", "recover"]).output


def test_cli_reports_a_missing_database_through_the_engine(database_url: str) -> None:
    """With SQLAlchemy, the command's first connection is the engine's, and its reason is printed."""
    url = make_conninfo(database_url, dbname="no_such_db_for_sqla")
    app = sqla_app.create_app({"TESTING": True, "DATABASE_URL": url})
    try:
        result = app.test_cli_runner().invoke(args=["idem", "stuck"])
    finally:
        with app.app_context():
            sqla_app.db.engine.dispose()
    assert result.exit_code == 1
    assert "cannot connect to the database: " in result.output
    assert 'database "no_such_db_for_sqla" does not exist' in result.output


def test_setup_mistakes_are_refused(database_url: str) -> None:
    """IDEM_DATABASE_URL beside sqlalchemy=, and idem.init_app before db.init_app, fail at startup."""
    db = SQLAlchemy()
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sqla_app.sqlalchemy_url(database_url)
    with pytest.raises(ConfigurationError, match=r"db\.init_app\(app\) before"):
        Idempotency(app, scope=lambda: 1, sqlalchemy=db)
    db.init_app(app)
    app.config["IDEM_DATABASE_URL"] = database_url
    with pytest.raises(ConfigurationError, match="Remove it"):
        Idempotency(app, scope=lambda: 1, sqlalchemy=db)
    with app.app_context():
        db.engine.dispose()


def test_other_drivers_are_refused() -> None:
    """An engine on another driver is refused when the extension is set up (no connection is made)."""
    session = scoped_session(sessionmaker(create_engine("sqlite://")))
    with pytest.raises(ConfigurationError, match=r"postgresql\+psycopg://"):
        Idempotency(Flask(__name__), scope=lambda: 1, sqlalchemy=session)


def test_plain_scoped_session(database_url: str, db: psycopg.Connection[Any]) -> None:
    """Without Flask-SQLAlchemy: a scoped_session bound to an engine works the same way."""
    engine = create_engine(sqla_app.sqlalchemy_url(database_url))
    session = scoped_session(sessionmaker(engine))
    app = Flask(__name__)
    idem = Idempotency(app, scope=lambda: 7, sqlalchemy=session)
    app.teardown_appcontext(lambda _: session.remove())

    @app.post("/notes")
    @idem.idempotent()
    def create() -> Any:
        session.execute(text("INSERT INTO notes (org_id, body) VALUES (7, 'plain')"))
        return {"ok": True}, 201

    key = {"Idempotency-Key": str(uuid.uuid4())}
    try:
        statuses = [app.test_client().post("/notes", headers=key).status_code for _ in range(2)]
    finally:
        engine.dispose()
    assert statuses == [201, 200]
    assert count(db, "notes") == 1


# -- real processes: the hammer and the crash -------------------------------------------------------------


@pytest.fixture
def sqla_server(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> Iterator[str]:
    """tests.support.sqla_app under gunicorn, two workers of four threads; its base URL."""
    env = {"FLASK_DATABASE_URL": database_url}
    with gunicorn(
        tmp_path / "gunicorn.log",
        env=env,
        workers=2,
        app="tests.support.sqla_app:create_app()",
        probe="/orders",
    ) as (base, _):
        yield base


@pytest.mark.slow
def test_one_key_hammered(sqla_server: str, org_key: str, db: psycopg.Connection[Any]) -> None:
    """Forty concurrent requests with one key make exactly one order through db.session."""
    spec = {"json": ORDER, "headers": headers(org_key, uuid.uuid4())}
    responses = fire(sqla_server, [spec] * 40)
    statuses = Counter(r.status_code for r in responses)
    print("answers to 40 duplicates:", dict(statuses))
    assert set(statuses) <= {200, 201, 409}, statuses
    assert statuses[201] == 1, statuses
    assert count(db, "orders") == 1
    created = next(r for r in responses if r.status_code == 201)
    assert all(r.content == created.content for r in responses if r.status_code == 200)


@pytest.mark.slow
def test_crash_after_the_write_then_retry(
    sqla_server: str, org_key: str, db: psycopg.Connection[Any]
) -> None:
    """A worker killed after its ORM write but before COMMIT leaves nothing; the retry makes one order."""
    key = uuid.uuid4()
    with pytest.raises(requests.ConnectionError):
        requests.post(
            sqla_server + "/orders",
            json=ORDER,
            headers=headers(org_key, key, **{"X-Test-Crash": "kill"}),
            timeout=30,
        )
    assert count(db, "orders") == 0
    assert count(db, "idempotency_keys") == 0
    retries: list[requests.Response] = []

    def retried() -> bool:  # 409 until PostgreSQL has seen the dead worker's connection end, rolled back
        retries.append(
            requests.post(sqla_server + "/orders", json=ORDER, headers=headers(org_key, key), timeout=30)
        )
        return retries[-1].status_code != 409

    wait_for(retried, 15, 0.2, message="the key stayed in flight")
    retry = retries[-1]
    assert retry.status_code == 201, retry.text
    again = requests.post(sqla_server + "/orders", json=ORDER, headers=headers(org_key, key), timeout=30)
    assert (again.status_code, again.json()) == (200, retry.json())
    assert count(db, "orders") == 1


def test_engine_without_timeouts_is_warned_once(
    make_sqla_app: Callable[..., Flask], org_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose connections cannot notice a silent database is named in one warning; the shop's
    engine, with flask-idem's connect options, is not."""
    caplog.set_level(logging.WARNING, logger="flask_idem")
    bare = make_sqla_app(SQLALCHEMY_ENGINE_OPTIONS={"connect_args": {"prepare_threshold": None}})
    for _ in range(2):
        assert post(bare, "/orders", org_key, uuid.uuid4()).status_code == 201
    warnings = [r.getMessage() for r in caplog.records if "SQLAlchemy engine's connections" in r.getMessage()]
    assert len(warnings) == 1
    assert "connect_timeout, keepalives_idle, tcp_user_timeout" in warnings[0]
    caplog.clear()
    assert post(make_sqla_app(), "/orders", org_key, uuid.uuid4()).status_code == 201
    assert not [r for r in caplog.records if "SQLAlchemy engine's connections" in r.getMessage()]


def test_a_silent_session_connection_is_cut_at_the_deadline(
    make_sqla_app: Callable[..., Flask], database_url: str, org_key: str, db: psycopg.Connection[Any]
) -> None:
    """The session's connection goes silent (the peer ACKs, nothing answers) once the view ran: the
    request is answered 503 with Retry-After at the deadline, its order is not kept, and the next request
    works on a new connection."""
    with running_proxy(database_url, release_after=5.0) as proxy:
        app = make_sqla_app(DATABASE_URL=proxy.conninfo(database_url), IDEM_DATABASE_DEADLINE=2.0)
        assert post(app, "/orders", org_key, uuid.uuid4()).status_code == 201
        silence = [True]

        def silence_once(point: str, conn: Any) -> None:
            if point == "view" and silence:
                silence.clear()
                proxy.silence("hung")

        get_state(app).hooks.append(silence_once)
        started = time.monotonic()
        answer = post(app, "/orders", org_key, uuid.uuid4())
        assert answer.status_code == 503, answer.json
        assert answer.mimetype == PROBLEM_JSON and int(answer.headers["Retry-After"]) >= 1
        assert time.monotonic() - started < 2.0 + 3.0
        assert post(app, "/orders", org_key, uuid.uuid4()).status_code == 201
    # The silent transaction ends when its server side is closed.
    wait_for(lambda: count(db, "orders") == 2, 30, 0.2, message="the order of the cut transaction was kept")


def test_an_async_view_writes_through_the_session(
    sqla: Flask, org_key: str, db: psycopg.Connection[Any]
) -> None:
    """An async def view's db.session writes commit with the key, and the kit's crash, replay and in-flight
    checks pass on it."""
    from flask_idem.testing import Rows, check_in_flight, check_replay

    orders = Rows(db, "orders")
    first, again = check_replay(
        sqla, "POST", "/orders/async", json=ORDER, headers=headers(org_key), effect=orders
    )
    assert (first.status_code, again.status_code) == (201, 200)
    held, duplicate = check_in_flight(
        sqla, "POST", "/orders/async", json=ORDER, headers=headers(org_key), effect=orders
    )
    assert (held.status_code, duplicate.status_code) == (201, 409)
    assert checked_out(sqla) == 0
