"""``async def`` views under ``@idem.idempotent()``: another thread, the same transaction, the same ``g``.

The kit's checks (replay, mismatch, in flight, scope, hammer, crashes between flow steps) run on the async
twins of the sample application's routes in tests/test_testing.py, and against gunicorn in
tests/test_served.py; this module looks at what is particular to a coroutine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem.errors import ConfigurationError

from .support.helpers import app_factory, count
from .support.policy_app import ORG, build_policy_app


@pytest.fixture
def async_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    with app_factory(lambda **config: build_policy_app(database_url, **config)) as make:
        yield make()


def post(async_app: Flask, path: str, key: uuid.UUID, json: Any) -> Any:
    return async_app.test_client().post(path, json=json, headers={**ORG, "Idempotency-Key": str(key)})


def test_the_coroutine_runs_on_another_thread_inside_the_keys_transaction(
    async_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """asgiref runs the coroutine on a thread of its own; there idem.connection is the connection of the
    key's transaction (it holds the key's lock), idem.key is the key, and what the coroutine
    puts on g is seen by after_request on the request's thread."""
    key = uuid.uuid4()
    first = post(async_app, "/async/notes", key, {"body": "async one"})
    assert first.status_code == 201, first.data
    assert first.json == {
        "id": first.json["id"],
        "key": str(key),
        "reservation_visible": True,
        "other_thread": True,
    }
    assert first.headers["X-View-Thread-Seen"] == "true"
    again = post(async_app, "/async/notes", key, {"body": "async one"})
    assert again.status_code == 200 and again.data == first.data
    assert post(async_app, "/async/notes", key, {"body": "async two"}).status_code == 422
    assert count(db, "notes") == 1
    assert db.execute("SELECT status FROM idempotency_keys").fetchall() == [("completed",)]


def test_an_exception_in_the_coroutine_rolls_back(async_app: Flask, db: psycopg.Connection[Any]) -> None:
    """The coroutine's write and the key are rolled back together when it raises: a retry runs again."""
    async_app.config["PROPAGATE_EXCEPTIONS"] = False
    key = uuid.uuid4()
    assert post(async_app, "/async/fail", key, {}).status_code == 500
    assert count(db, "notes") == 0 and count(db, "idempotency_keys") == 0


def test_an_async_view_called_where_an_event_loop_runs(async_app: Flask, db: psycopg.Connection[Any]) -> None:
    """Called from a thread whose event loop is running (as in a test process that holds Playwright's
    loop open), where asgiref refuses to wait, the coroutine runs from a thread of its own: same
    transaction, same answers."""
    key = uuid.uuid4()

    async def from_a_running_loop() -> list[Any]:
        return [post(async_app, "/async/notes", key, {"body": "in a loop"}) for _ in range(2)]

    first, again = asyncio.run(from_a_running_loop())
    assert first.status_code == 201, first.data
    assert first.json["reservation_visible"] is True
    assert again.status_code == 200 and again.data == first.data
    assert count(db, "notes") == 1


def test_an_async_view_without_asgiref_is_refused_at_decoration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without asgiref (the async extra) the decorator refuses an async def view and says what to
    install; a synchronous view is still accepted."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "asgiref" else find_spec(name, *a)
    )
    idem = Idempotency(scope=lambda: 1)

    async def create() -> dict[str, int]:
        return {}

    def create_sync() -> dict[str, int]:
        return {}

    with pytest.raises(ConfigurationError, match=r"async view.*flask-idem\[async\]"):
        idem.idempotent()(create)
    idem.idempotent()(create_sync)
