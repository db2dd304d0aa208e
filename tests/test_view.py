"""What a decorated view answers, against a real PostgreSQL: replay, mismatch, in flight, rollback."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask
from werkzeug.datastructures import MultiDict

from flask_idem.errors import PROBLEM_JSON

from .support.helpers import count
from .support.notes_app import ORG, post


@pytest.fixture
def notes_app(make_app: Callable[..., Flask]) -> Flask:
    """The test application with default configuration."""
    return make_app()


def key_rows(db: psycopg.Connection[Any]) -> int:
    return count(db, "idempotency_keys")


def test_retry_replays_the_first_response(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """The same key and body twice: 201, then 200 with the same body, Location and a replay mark."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes", key, {"body": "hello"})
    second = post(notes_app, "/notes", key, {"body": "hello"})
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.data == first.data
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["Content-Type"] == first.headers["Content-Type"] == "application/json"
    assert count(db, "notes") == 1
    assert db.execute("SELECT status FROM idempotency_keys").fetchall() == [("completed",)]


def test_key_is_scoped_to_the_org(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """Another organisation using the same key gets its own, independent operation."""
    key = uuid.uuid4()
    mine = post(notes_app, "/notes", key, {"body": "mine"})
    theirs = post(notes_app, "/notes", key, {"body": "theirs"}, **{"X-Org": "2"})
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert mine.json["id"] != theirs.json["id"]
    assert count(db, "notes") == 2


def test_changed_body_is_rejected(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """The same key with a different body is a 422 and changes nothing."""
    key = uuid.uuid4()
    assert post(notes_app, "/notes", key, {"body": "one"}).status_code == 201
    before = db.execute("SELECT response FROM idempotency_keys").fetchone()
    rejected = post(notes_app, "/notes", key, {"body": "two"})
    assert rejected.status_code == 422
    assert rejected.mimetype == PROBLEM_JSON
    assert rejected.json["type"] == "urn:flask-idem:problem:key-mismatch"
    assert count(db, "notes") == 1
    assert db.execute("SELECT response FROM idempotency_keys").fetchone() == before


def test_changed_route_is_rejected(notes_app: Flask) -> None:
    """The same key on another route is a different request, not a retry."""
    key = uuid.uuid4()
    assert post(notes_app, "/notes", key, {"body": "one"}).status_code == 201
    assert post(notes_app, "/notes/404", key, {"body": "one"}).status_code == 422


@pytest.mark.parametrize("where", ["config", "decorator"])
def test_mismatch_can_replay_the_original(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], where: str
) -> None:
    """With on_mismatch "replay", a changed body gets the original response, which stays intact."""
    notes_app = make_app(IDEM_ON_MISMATCH="replay") if where == "config" else make_app()
    path = "/notes" if where == "config" else "/notes/replayable"
    key = uuid.uuid4()
    first = post(notes_app, path, key, {"body": "original"})
    second = post(notes_app, path, key, {"body": "changed"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json == first.json
    assert db.execute("SELECT body FROM notes").fetchall() == [("original",)]


def test_missing_key_is_a_400_before_any_database_work(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A write without Idempotency-Key is refused and leaves no trace."""
    response = post(notes_app, "/notes", None, {"body": "x"})
    assert response.status_code == 400
    assert response.json["type"] == "urn:flask-idem:problem:missing-key"
    assert (key_rows(db), count(db, "notes")) == (0, 0)


@pytest.mark.parametrize(
    "values",
    [
        ["not-a-uuid"],
        [""],
        [str(uuid.uuid4()), str(uuid.uuid4())],
        [f"{uuid.uuid4()},x"],
        ["x" * 5000],
    ],
    ids=["not-uuid", "empty", "twice", "comma", "huge"],
)
def test_malformed_key_is_a_400(notes_app: Flask, db: psycopg.Connection[Any], values: list[str]) -> None:
    """A malformed key header is refused with problem+json and nothing is written."""
    headers = [("X-Org", "1")] + [("Idempotency-Key", v) for v in values]
    response = notes_app.test_client().post("/notes", json={"body": "x"}, headers=headers)
    assert response.status_code == 400
    assert response.mimetype == PROBLEM_JSON
    assert (key_rows(db), count(db, "notes")) == (0, 0)


def test_invalid_json_is_a_400(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A body that is not JSON has no fingerprint: 400 and no key row."""
    response = notes_app.test_client().post(
        "/notes",
        data=b'{"body": ',
        content_type="application/json",
        headers={**ORG, "Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 400
    assert response.json["type"] == "urn:flask-idem:problem:invalid-body"
    assert key_rows(db) == 0


def test_no_org_is_a_401(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """Without an organisation there is no scope for the key: 401, never a global key."""
    response = notes_app.test_client().post(
        "/notes", json={"body": "x"}, headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    assert response.status_code == 401
    assert response.mimetype == PROBLEM_JSON
    assert key_rows(db) == 0


def test_safe_methods_pass_through(notes_app: Flask) -> None:
    """GET on a decorated route needs no key and stores nothing."""
    response = notes_app.test_client().get("/notes", headers=ORG)
    assert response.status_code == 200
    assert response.json == {"count": 0}


def test_exception_rolls_everything_back(make_app: Callable[..., Flask], db: psycopg.Connection[Any]) -> None:
    """An exception in the view leaves neither key row nor business row, and a retry runs again."""
    notes_app = make_app()
    key = uuid.uuid4()
    assert post(notes_app, "/notes/raise", key).status_code == 500
    assert (key_rows(db), count(db, "notes")) == (0, 0)
    notes_app.config["FAIL"] = False
    assert post(notes_app, "/notes/raise", key).status_code == 201
    assert (key_rows(db), count(db, "notes")) == (1, 1)


def test_5xx_response_is_not_stored(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A 5xx returned by the view rolls its writes back and is not replayed."""
    key = uuid.uuid4()
    for _ in range(2):
        response = post(notes_app, "/notes/500", key)
        assert response.status_code == 500
        assert "Idempotent-Replayed" not in response.headers
    assert (key_rows(db), count(db, "notes")) == (0, 0)


def test_4xx_is_stored_and_replayed(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """abort(404) is an answer: stored with the view's writes and replayed as it was."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes/404", key)
    second = post(notes_app, "/notes/404", key)
    assert (first.status_code, second.status_code) == (404, 404)
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.data == first.data
    assert (key_rows(db), count(db, "notes")) == (1, 1)


def test_other_statuses_replay_as_they_were_without_cookies(notes_app: Flask) -> None:
    """A 202 replays as 202; cookies and unlisted headers are not replayed."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes/202", key)
    second = post(notes_app, "/notes/202", key)
    assert (first.status_code, second.status_code) == (202, 202)
    assert "Set-Cookie" in first.headers
    assert "Set-Cookie" not in second.headers
    assert "X-Request-Id" not in second.headers


def test_binary_body_replays_byte_for_byte(notes_app: Flask) -> None:
    """A body that is not UTF-8 text is stored as base64 and replayed exactly."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes/binary", key)
    second = post(notes_app, "/notes/binary", key)
    assert second.data == first.data
    assert second.headers["Content-Type"] == "application/octet-stream"


def test_swallowed_database_error_is_not_a_success(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A view that hides a database error cannot report success for a rolled-back transaction."""
    response = post(notes_app, "/notes/swallow", uuid.uuid4())
    assert response.status_code == 500
    assert response.mimetype == PROBLEM_JSON
    assert (key_rows(db), count(db, "notes")) == (0, 0)


def test_savepoint_recovery_is_fine(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A view that recovers from an error with a savepoint commits normally."""
    assert post(notes_app, "/notes/savepoint", uuid.uuid4()).status_code == 201
    assert (key_rows(db), count(db, "notes")) == (1, 1)


def test_optional_key(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A route that does not require a key runs without one, in a transaction, storing no key."""
    response = post(notes_app, "/notes/optional", None)
    assert response.status_code == 201
    assert response.json["key"] == "None"
    assert (key_rows(db), count(db, "notes")) == (0, 1)
    key = uuid.uuid4()
    assert post(notes_app, "/notes/optional", key).json["key"] == str(key)
    assert post(notes_app, "/notes/optional", key).status_code == 200


def test_expired_key_is_treated_as_new(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """Past its retention and tombstone periods a key is new again: the view runs and its row is replaced."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes", key, {"body": "a"})
    db.execute("UPDATE idempotency_keys SET expires_at = now() - interval '30 days 1 second'")
    second = post(notes_app, "/notes", key, {"body": "b"})
    assert (first.status_code, second.status_code) == (201, 201)
    assert count(db, "notes") == 2
    assert second.json["id"] != first.json["id"]
    row = db.execute(
        "SELECT expires_at > now(), (response->>'body')::jsonb->'id' FROM idempotency_keys"
    ).fetchone()
    assert row == (True, second.json["id"])


def test_ttl_comes_from_the_database_clock(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """expires_at is the database's now() plus IDEM_KEY_TTL."""
    notes_app = make_app(IDEM_KEY_TTL=3600)
    post(notes_app, "/notes", uuid.uuid4(), {"body": "a"})
    row = db.execute("SELECT extract(epoch FROM expires_at - created_at) FROM idempotency_keys").fetchone()
    assert row is not None and 3599 <= float(row[0]) <= 3601


def test_in_flight_duplicate_gets_409_at_once(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """While the first attempt holds its transaction, a duplicate is told 409 without waiting for it."""
    entered, release = threading.Event(), threading.Event()
    notes_app.config.update(ENTERED=entered, RELEASE=release)
    key = uuid.uuid4()
    results: dict[str, Any] = {}

    def first() -> None:
        results["first"] = post(notes_app, "/notes/block", key)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(10)
        duplicate = post(notes_app, "/notes/block", key)
        still_running = thread.is_alive()
    finally:
        release.set()
        thread.join(15)
    assert still_running, "the duplicate waited for the first attempt to finish"
    assert duplicate.status_code == 409
    assert duplicate.headers["Retry-After"] == "1"
    assert duplicate.json["type"] == "urn:flask-idem:problem:key-in-use"
    assert results["first"].status_code == 201
    replay = post(notes_app, "/notes/block", key)
    assert replay.status_code == 200
    assert replay.json == results["first"].json
    assert count(db, "notes") == 1


def test_concurrent_duplicates_in_threads(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """Twenty threads sending one key create one note; every answer is 201, 200 or 409."""
    notes_app = make_app(IDEM_POOL_MAX_SIZE=20)
    key = uuid.uuid4()
    barrier = threading.Barrier(20)
    statuses: list[int] = []

    def attempt() -> None:
        barrier.wait()
        statuses.append(post(notes_app, "/notes", key, {"body": "once"}).status_code)

    threads = [threading.Thread(target=attempt) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(statuses) == 20
    assert set(statuses) <= {200, 201, 409}
    assert statuses.count(201) == 1
    assert count(db, "notes") == 1


def test_expired_key_being_renewed_is_in_flight(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """While one request renews an expired key, a duplicate gets 409 at once, not a wait or a stale replay."""
    key = uuid.uuid4()
    entered, release = threading.Event(), threading.Event()
    notes_app.config.update(ENTERED=entered, RELEASE=release)
    release.set()
    assert post(notes_app, "/notes/block", key).status_code == 201
    db.execute("UPDATE idempotency_keys SET expires_at = now() - interval '30 days 1 second'")
    db.execute("DELETE FROM notes")
    entered.clear()
    release.clear()
    results: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: results.setdefault("renewal", post(notes_app, "/notes/block", key))
    )
    thread.start()
    try:
        assert entered.wait(10)
        duplicate = post(notes_app, "/notes/block", key)
        still_running = thread.is_alive()
    finally:
        release.set()
        thread.join(15)
    assert still_running
    assert duplicate.status_code == 409
    assert results["renewal"].status_code == 201
    assert count(db, "notes") == 1


def test_file_responses_are_stored(notes_app: Flask) -> None:
    """A send_file answer is read into the key row and replayed byte for byte."""
    key = uuid.uuid4()
    first = post(notes_app, "/notes/file", key)
    second = post(notes_app, "/notes/file", key)
    assert first.status_code == second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.data == first.data == b"%PDF-\x00\xff receipt"
    assert second.mimetype == "application/pdf"


def test_no_scope_carries_a_challenge(notes_app: Flask) -> None:
    """The 401 for a request without an organisation names an authentication scheme."""
    response = notes_app.test_client().post(
        "/notes", json={"body": "x"}, headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_prepared_statements_can_be_turned_off(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """With IDEM_PREPARE_THRESHOLD None (PgBouncer before 1.21) requests work the same."""
    notes_app = make_app(IDEM_PREPARE_THRESHOLD=None)
    for i in range(8):
        assert post(notes_app, "/notes", uuid.uuid4(), {"body": f"n{i}"}).status_code == 201
    assert count(db, "notes") == 8


def test_key_from_a_form_field(notes_app: Flask, db: psycopg.Connection[Any]) -> None:
    """key_from: the key comes from a form field; the whole form is still fingerprinted and replayed."""
    client = notes_app.test_client()
    key = str(uuid.uuid4())
    form = {"idempotency_key": key, "body": "from a form"}
    first = client.post("/notes/form", data=form, headers=ORG)
    second = client.post("/notes/form", data=form, headers=ORG)
    changed = client.post("/notes/form", data={**form, "body": "other"}, headers=ORG)
    header_only = client.post("/notes/form", data={"body": "x"}, headers={**ORG, "Idempotency-Key": key})
    assert first.status_code == 201, first.data
    assert first.json is not None and first.json["key"] == key
    assert (second.status_code, second.headers["Idempotent-Replayed"]) == (200, "true")
    assert second.data == first.data
    assert changed.status_code == 422
    assert header_only.status_code == 400  # the route reads the form only: no key there
    assert count(db, "notes") == 1


@pytest.mark.parametrize("values", [["not-a-uuid"], [str(uuid.uuid4())] * 2], ids=["not-uuid", "twice"])
def test_key_from_validates_like_the_header(
    notes_app: Flask, db: psycopg.Connection[Any], values: list[str]
) -> None:
    """A form key that is not exactly one UUID is a 400, and nothing is written."""
    data = MultiDict([("body", "x")] + [("idempotency_key", v) for v in values])
    response = notes_app.test_client().post("/notes/form", data=data, headers=ORG)
    assert response.status_code == 400
    assert response.mimetype == PROBLEM_JSON
    assert (key_rows(db), count(db, "notes")) == (0, 0)
