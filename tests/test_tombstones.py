"""A late retry is not a new order: past retention a key leaves a tombstone, and a retry finding one
is never run again (303 to the first answer's Location, or 410).

The tests move the rows' ``expires_at`` back instead of waiting: the database's clock is the only one
that counts (``docs/retention.rst``), and moving the row is moving that clock for it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Flask

from flask_idem._state import get_state
from flask_idem.errors import PROBLEM_JSON

from .support.helpers import age, count
from .support.notes_app import post

DAY = 24 * 3600


def purge(app: Flask) -> tuple[int, int]:
    with app.app_context():
        return get_state().store.purge(batch_size=2)


def test_late_retry_is_sent_to_the_result_through_both_periods(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """Retention, then the tombstone, then neither: 201, 303 before and after purge, then new."""
    app = make_app(IDEM_KEY_TTL=3600, IDEM_TOMBSTONE_TTL=30 * DAY)
    key = uuid.uuid4()
    first = post(app, "/notes", key, {"body": "a"})
    assert first.status_code == 201
    age(db, "1 hour 1 second")  # the stored response has expired, the purge has not run yet
    late = post(app, "/notes", key, {"body": "a"})
    assert late.status_code == 303
    assert late.headers["Location"] == first.headers["Location"]
    assert count(db, "notes") == 1

    assert purge(app) == (0, 1)
    response = db.execute("SELECT response FROM idempotency_keys").fetchone()
    assert response == (
        {"tombstone": True, "status": 201, "headers": [["Location", first.headers["Location"]]]},
    )
    again = post(app, "/notes", key, {"body": "a"})
    assert (again.status_code, again.headers["Location"]) == (303, first.headers["Location"])
    assert count(db, "notes") == 1

    age(db, "29 days 23 hours")  # still inside the tombstone's period
    assert purge(app) == (0, 0)
    assert post(app, "/notes", key, {"body": "a"}).status_code == 303
    age(db, "2 hours")  # past it
    assert purge(app) == (1, 0)
    # The key is new again: any request with it runs (notes' bodies are unique, hence "b").
    assert post(app, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_changed_request_on_a_tombstone_is_refused(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A different request with a tombstoned key is 422, as with a live one, and writes nothing."""
    app = make_app(IDEM_KEY_TTL=60)
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    age(db, "61 seconds")
    purge(app)
    changed = post(app, "/notes", key, {"body": "b"})
    assert changed.status_code == 422
    assert changed.content_type == PROBLEM_JSON
    assert changed.json["retention"] == {"response_seconds": 60.0, "tombstone_seconds": 30.0 * DAY}
    assert count(db, "notes") == 1


def test_tombstone_without_location_is_gone(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A first answer without Location leaves a 410 problem: the operation happened and will not again."""
    app = make_app()
    key = uuid.uuid4()
    assert post(app, "/notes/replayable", key, {"body": "a"}).status_code == 201
    age(db, "1 day 1 second")
    gone = post(app, "/notes/replayable", key, {"body": "a"})
    assert gone.status_code == 410
    assert gone.content_type == PROBLEM_JSON
    assert gone.json["type"] == "urn:flask-idem:problem:key-expired"
    assert "new key" in gone.json["detail"]
    assert count(db, "notes") == 1


def test_tombstone_keeps_no_body_and_no_other_header(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """The tombstone holds the status and Location only, and takes a fraction of the row's room."""
    app = make_app()
    assert post(app, "/notes", uuid.uuid4(), {"body": "a"}).status_code == 201
    before = db.execute("SELECT pg_column_size(k.*) FROM idempotency_keys AS k").fetchone()
    age(db, "1 day 1 second")
    purge(app)
    row = db.execute("SELECT response, pg_column_size(k.*) FROM idempotency_keys AS k").fetchone()
    assert row is not None and before is not None
    assert set(row[0]) == {"tombstone", "status", "headers"}
    assert [name for name, _ in row[0]["headers"]] == ["Location"]
    print(f"row size: {before[0]} bytes with its response, {row[1]} bytes as a tombstone")
    assert row[1] < before[0]


def test_zero_tombstone_period_restores_forgetting(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """IDEM_TOMBSTONE_TTL = 0: past retention the key is new again, and purge deletes the row."""
    app = make_app(IDEM_TOMBSTONE_TTL=0)
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    age(db, "1 day 1 second")
    assert purge(app) == (1, 0)
    assert post(app, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_conflict_publishes_the_retention_policy(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A 409's problem details state how long answers and tombstones are kept, in seconds."""
    app = make_app(IDEM_KEY_TTL=7200, IDEM_TOMBSTONE_TTL=DAY)
    key = uuid.uuid4()
    entered, release = threading.Event(), threading.Event()
    app.config.update(ENTERED=entered, RELEASE=release)
    thread = threading.Thread(target=post, args=(app, "/notes/block", key))
    thread.start()
    try:
        assert entered.wait(10)
        conflict = post(app, "/notes/block", key)
    finally:
        release.set()
        thread.join(15)
    assert conflict.status_code == 409
    assert conflict.json["retention"] == {"response_seconds": 7200.0, "tombstone_seconds": float(DAY)}


def test_purge_skips_locked_rows_instead_of_waiting(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], direct_database_url: str
) -> None:
    """A row another transaction holds is passed over (SKIP LOCKED): purge never waits for a writer."""
    app = make_app()
    keys = [uuid.uuid4() for _ in range(3)]
    for i, key in enumerate(keys):
        assert post(app, "/notes", key, {"body": str(i)}).status_code == 201
    age(db, "1 day 1 second")
    with psycopg.connect(direct_database_url) as other:  # a transaction holding one row's lock
        row = db.execute("SELECT org_id FROM idempotency_keys WHERE idem_key = %s", (keys[0],)).fetchone()
        assert row is not None
        other.execute(  # with its org_id, as a row lock on Citus must name the shard
            "SELECT 1 FROM idempotency_keys WHERE org_id = %s AND idem_key = %s FOR UPDATE", (row[0], keys[0])
        )
        other.execute("SET LOCAL lock_timeout = '10s'")
        with psycopg.connect(direct_database_url, autocommit=True) as watcher:
            watcher.execute("SET lock_timeout = '2s'")  # purge below would fail, not hang, on a wait
        assert purge(app) == (0, 2)
        other.rollback()
    assert purge(app) == (0, 1)
