"""Error rendering, and database errors that leak nothing: real failures, forced on a real server."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from werkzeug.exceptions import (
    BadRequest,
    Conflict,
    HTTPException,
    InternalServerError,
    MethodNotAllowed,
    NotFound,
    RequestEntityTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
)

from flask_idem.errors import (
    PROBLEM_JSON,
    DatabaseUnavailable,
    IdempotencyError,
    InvalidKey,
    KeyInUse,
    KeyMismatch,
    WebhookRejected,
    problem,
)

from .support.helpers import close_pool, count
from .support.notes_app import build_app, post

SECRET = "hunter2-c0rrect-h0rse"


def test_errors_are_werkzeug_exceptions() -> None:
    """Each error is also the matching Werkzeug exception, so handlers for either apply."""
    assert isinstance(KeyInUse(), Conflict)
    assert isinstance(InvalidKey(), BadRequest)
    assert KeyMismatch().code == 422
    assert DatabaseUnavailable(retry_after=3).get_headers() == [
        ("Content-Type", PROBLEM_JSON),
        ("Retry-After", "3"),
    ]


def test_problem_renders_any_http_exception() -> None:
    """problem() turns Werkzeug's own exceptions into RFC 9457 documents, keeping their headers."""
    response = problem(MethodNotAllowed(valid_methods=["POST"]))
    assert response.status_code == 405
    assert response.mimetype == PROBLEM_JSON
    assert response.headers["Allow"] == "POST"
    assert response.json is not None
    assert response.json["title"] == "Method Not Allowed"
    assert response.json["type"] == "about:blank"
    assert problem(NotFound()).json["status"] == 404  # type: ignore[index]


def error_classes() -> list[type[IdempotencyError]]:
    """Every subclass of IdempotencyError that flask-idem defines, however deep."""
    found: list[type[IdempotencyError]] = []
    todo = [IdempotencyError]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("flask_idem"):
                found.append(sub)
    return sorted(found, key=lambda cls: cls.__name__)


@pytest.mark.parametrize("cls", error_classes(), ids=lambda cls: cls.__name__)
def test_every_problem_says_whether_it_is_retryable(cls: type[IdempotencyError]) -> None:
    """Each error's body carries a boolean retryable: true for 409 and 503, false for every other status."""
    # Arguments an error requires: WebhookRejected names the check that failed.
    required: dict[str, Any] = {"check": "signature"} if cls is WebhookRejected else {}
    error = cls(retry_after=2) if cls.code in (409, 503) else cls(**required)
    for body in (error.to_dict(), json.loads(error.get_body()), json.loads(problem(error).get_data())):
        assert body["retryable"] is (error.code in (409, 503))
        assert body["type"].startswith("urn:flask-idem:problem:")


def test_extension_members_cannot_override_retryable() -> None:
    """A member passed to an error does not replace the class's retryable."""
    assert KeyMismatch(members={"retryable": True}).to_dict()["retryable"] is False


def documented_problem_types() -> set[tuple[str, int, bool, str]]:
    """The rows of docs/errors.rst's table of problem types: (type, status, retryable, class)."""
    text = (Path(__file__).parent.parent / "docs" / "errors.rst").read_text()
    row = re.compile(
        r"\*   - ``(urn:flask-idem:problem:[a-z-]+)``\n"
        r"\s+- ``(\d{3})``\n"
        r"\s+- ``(true|false)``\n"
        r"\s+- :class:`(\w+)`"
    )
    return {(t, int(status), said == "true", name) for t, status, said, name in row.findall(text)}


def test_docs_table_of_problem_types_matches_the_code() -> None:
    """docs/errors.rst lists every problem type with its status, retryable and class, and nothing else."""
    in_code = {(cls.problem_type, cls.code, cls.retryable, cls.__name__) for cls in error_classes()}
    assert documented_problem_types() == in_code


class StockBeingCounted(Conflict):
    retryable = True


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        (NotFound(), False),
        (Conflict(), False),
        (RequestEntityTooLarge(), False),
        (InternalServerError(), False),
        (RequestTimeout(), True),
        (TooManyRequests(), True),
        (ServiceUnavailable(), True),
        (StockBeingCounted(), True),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, HTTPException) else str(value).lower(),
)
def test_problem_says_whether_other_errors_are_retryable(error: HTTPException, retryable: bool) -> None:
    """problem() gives any exception retryable: its own attribute, else true for 408, 429, 502-504."""
    body = problem(error).json
    assert body is not None
    assert body["type"] == "about:blank"
    assert body["retryable"] is retryable


def test_application_can_override_rendering(database_url: str, db: Any) -> None:
    """An errorhandler registered for one of the errors replaces the default rendering."""
    app, _ = build_app(database_url)

    @app.errorhandler(IdempotencyError)
    def mine(e: IdempotencyError) -> Any:
        return {"mine": e.code}, e.code

    try:
        response = app.test_client().post("/notes", json={}, headers={"X-Org": "1"})
        assert response.status_code == 400
        assert response.json == {"mine": 400}
    finally:
        close_pool(app)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record of every logger, down to DEBUG."""
    caplog.set_level(logging.DEBUG)
    return caplog


def assert_clean(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text


def test_parameters_never_leak(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], logs: pytest.LogCaptureFixture
) -> None:
    """A constraint violation quoting a row value answers 500 with neither body nor log holding it."""
    app = make_app()
    response = post(app, "/notes/secret", uuid.uuid4(), {"body": SECRET})
    assert response.status_code == 500
    assert response.mimetype == PROBLEM_JSON
    assert "UniqueViolation" in logs.text  # the failure is logged, by class
    assert_clean(response.get_data(as_text=True), SECRET)
    assert_clean(logs.text, SECRET)
    assert (count(db, "notes"), count(db, "idempotency_keys")) == (0, 0)


def test_lost_connection_is_a_503(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], logs: pytest.LogCaptureFixture
) -> None:
    """A connection killed by the server mid-request answers 503 with Retry-After, and nothing is kept."""
    app = make_app()
    key = uuid.uuid4()
    response = post(app, "/notes/terminate", key)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.json["type"] == "urn:flask-idem:problem:store-unavailable"
    assert count(db, "idempotency_keys") == 0
    # The pool drops the dead connection; the next request works.
    assert post(app, "/notes", uuid.uuid4(), {"body": "after"}).status_code == 201


def test_unreachable_database_leaks_no_connection_settings(db: Any, logs: pytest.LogCaptureFixture) -> None:
    """With the database unreachable: 503, and no body or log line shows the URL or its password."""
    url = f"postgresql://idem_user:{SECRET}@127.0.0.1:1/idem_private_db?connect_timeout=1"
    app, _ = build_app(url, IDEM_POOL_TIMEOUT=0.5)
    try:
        response = post(app, "/notes", uuid.uuid4(), {"body": "x"})
    finally:
        close_pool(app)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    body = response.get_data(as_text=True)
    assert_clean(body + logs.text, SECRET, url, "idem_private_db", "idem_user")
    assert "PoolTimeout" in logs.text


def test_broken_key_table_is_a_500_without_sql(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], logs: pytest.LogCaptureFixture
) -> None:
    """A failing statement of the extension itself answers 500 without SQL text or values (the table
    goes after the first request checked its layout: before, the answer is 503, see test_migrate)."""
    app = make_app()
    assert post(app, "/notes", uuid.uuid4(), {"body": "first"}).status_code == 201
    db.execute("ALTER TABLE idempotency_keys RENAME TO idempotency_keys_away")
    try:
        key = uuid.uuid4()
        response = post(app, "/notes", key, {"body": SECRET})
    finally:
        db.execute("ALTER TABLE idempotency_keys_away RENAME TO idempotency_keys")
    assert response.status_code == 500
    text = response.get_data(as_text=True) + logs.text
    assert "UndefinedTable" in logs.text
    assert_clean(text, SECRET, str(key), "INSERT INTO", "idempotency_keys_away")
    assert count(db, "notes") == 1  # the first request's


@pytest.mark.parametrize(
    ("sqlstate", "status"),
    [("XX000", 503), ("23514", 500)],
    ids=["no-definite-answer-is-503", "deferred-constraint-is-500"],
)
def test_failed_commit(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], sqlstate: str, status: int
) -> None:
    """A COMMIT that fails without a definite answer (as Citus reports a node lost while committing) is
    503, to be retried with the same key; a deferred constraint refusing the writes stays a 500."""
    app = make_app()
    db.execute(
        "CREATE FUNCTION notes_fail_at_commit() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE EXCEPTION 'refused at commit' USING ERRCODE = TG_ARGV[0]; END$$"
    )
    db.execute(
        "CREATE CONSTRAINT TRIGGER notes_fail_at_commit AFTER INSERT ON notes DEFERRABLE INITIALLY DEFERRED"
        f" FOR EACH ROW EXECUTE FUNCTION notes_fail_at_commit('{sqlstate}')"
    )
    try:
        response = post(app, "/notes", uuid.uuid4(), {"body": SECRET})
    finally:
        db.execute("DROP TRIGGER notes_fail_at_commit ON notes")
        db.execute("DROP FUNCTION notes_fail_at_commit()")
    assert response.status_code == status
    assert response.mimetype == PROBLEM_JSON
    assert (response.headers.get("Retry-After") is not None) == (status == 503)
    assert count(db, "notes") == 0 and count(db, "idempotency_keys") == 0
