"""What every check shares: the failure type, the request to send, the effect counters, the test hook.

The kit reaches inside a request through the extension's test hooks (:meth:`.IdemState.fire`), after the
view ran and after each step: raising :class:`WorkerKilled` there ends the request as a crash would;
waiting there holds the request inside its transaction.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from flask import Flask
from flask.testing import FlaskClient
from psycopg import sql
from werkzeug.test import TestResponse

from .._keys import HEADER
from .._replay import REPLAYED_HEADER
from .._state import Hook, get_state

__all__ = ["Effect", "NotRetrySafe", "Rows", "WorkerKilled"]

#: A count of what the view does (rows it writes, calls an outside party saw): one per request that did
#: its work. Called between requests, never during one.
Effect = Callable[[], int]

#: How long the kit waits for a request it holds or for a thread it started: a bound, never a pause.
WAIT = 30.0


class NotRetrySafe(AssertionError):
    """A check found that a route is not safe to retry; the message says what happened and why."""


class WorkerKilled(BaseException):
    """Raised by the kit inside a request to end it as a crash would.

    A :class:`BaseException`, like the signal that kills a worker: Flask's error handlers and the
    view's ``except Exception`` blocks do not catch it, and the transaction open at that point is
    rolled back.
    """


class Rows:
    """An :data:`Effect`: the number of rows in ``table`` (optionally ``WHERE where``).

    :param conn: an autocommit connection to the test database, such as the ``idem_db`` fixture.
    :param where: an SQL condition; ``params`` fill its ``%s`` placeholders.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        table: str,
        *,
        where: str | None = None,
        params: Sequence[Any] = (),
    ) -> None:
        self.conn = conn
        self.table = table
        self.params = tuple(params)
        query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(*table.split(".")))
        if where is not None:
            query = sql.SQL("{} WHERE {}").format(query, sql.SQL(where))
        self.query = query
        self.description = f"the rows in {table}" + (f" where {where}" if where else "")

    def __call__(self) -> int:
        row = self.conn.execute(self.query, self.params).fetchone()
        return 0 if row is None else int(row[0])

    def __str__(self) -> str:
        return self.description


# Shown as flask_idem.testing.NotRetrySafe in failures and in the documentation, where users import them.
NotRetrySafe.__module__ = WorkerKilled.__module__ = Rows.__module__ = "flask_idem.testing"


def describe(effect: Effect) -> str:
    """Plain words for an effect: a :class:`Rows` says what it counts; a function gives its name."""
    if isinstance(effect, Rows):
        return str(effect)
    doc = (getattr(effect, "__doc__", None) or "").strip()
    if doc:
        return doc.splitlines()[0].rstrip(".")
    return f"{getattr(effect, '__name__', repr(effect))}()"


def client_of(target: Flask | FlaskClient) -> FlaskClient:
    """A test client: ``target`` itself, or a new one of the application ``target``."""
    return target.test_client() if isinstance(target, Flask) else target


def start(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    json: Any,
    headers: Mapping[str, str] | None,
    data: bytes | str | None = None,
) -> tuple[FlaskClient, Call, uuid.UUID, Any]:
    """How a check starts: a test client of ``target``, the request, a new key and the body for it."""
    call = Call(method, path, json, data, headers or {})
    return client_of(target), call, uuid.uuid4(), call.body()


@dataclass(frozen=True)
class Call:
    """One request, sent again with a key of the kit's choosing.

    ``json`` may be a function: it is called for each new key, for routes that cannot run twice on the
    same data (paying the same order twice is refused), while a retry re-sends the same body.
    """

    method: str
    path: str
    json: Any = None
    data: bytes | str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"

    def body(self) -> Any:
        """The JSON body for a new key."""
        return self.json() if callable(self.json) else self.json

    def send(self, client: FlaskClient, key: uuid.UUID | None, *, json: Any = None) -> TestResponse:
        """Send the request with ``key`` (none when ``None``) and the JSON body ``json``."""
        sent = dict(self.headers)
        if key is not None:
            sent[HEADER] = str(key)
        if self.data is not None:
            return client.open(self.path, method=self.method, data=self.data, headers=sent)
        return client.open(self.path, method=self.method, json=json, headers=sent)


def replayed(response: TestResponse) -> bool:
    """Whether ``response`` is a stored answer given again."""
    return response.headers.get(REPLAYED_HEADER) == "true"


def show(response: TestResponse) -> str:
    """A response in a few words: status and the start of its body."""
    body = response.get_data(as_text=True)
    return f"{response.status_code} {body[:200]!r}" + (" (replayed)" if replayed(response) else "")


def fail(message: str) -> NotRetrySafe:
    """The failure to raise, its message in one paragraph."""
    return NotRetrySafe(message)


@contextmanager
def hooked(app: Flask, hook: Hook) -> Iterator[None]:
    """Install ``hook`` among the application's test hooks for the duration of the block."""
    hooks = get_state(app).hooks
    hooks.append(hook)
    try:
        yield
    finally:
        hooks.remove(hook)


class Killer:
    """A hook that kills the request of one thread at one point, once; it remembers the points seen."""

    def __init__(self, point: str | None) -> None:
        self.point = point
        self.thread = threading.get_ident()
        self.seen: list[str] = []
        #: The points reached with no connection: after call steps.
        self.outside: list[str] = []
        self.killed = False

    def __call__(self, point: str, conn: psycopg.Connection[Any] | None) -> None:
        if threading.get_ident() != self.thread:
            return
        self.seen.append(point)
        if conn is None:
            self.outside.append(point)
        if point == self.point and not self.killed:
            self.killed = True
            raise WorkerKilled(point)


def send_and_kill(client: FlaskClient, call: Call, key: uuid.UUID, json: Any, point: str) -> Killer:
    """Send the request and kill it at ``point``; return the hook, which says whether it got there."""
    killer = Killer(point)
    with hooked(client.application, killer):
        try:
            call.send(client, key, json=json)
        except WorkerKilled:
            pass
    return killer


def at_once(
    app: Flask, threads: int, send: Callable[[FlaskClient], TestResponse], what: str
) -> list[TestResponse]:
    """``threads`` threads call ``send`` with a client of ``app`` each, released together by a barrier;
    their answers. ``what`` names the requests in the failure when one of them did not end with an answer.
    """
    barrier = threading.Barrier(threads)
    answers: list[TestResponse | BaseException] = []
    lock = threading.Lock()

    def attempt() -> None:
        client = app.test_client()
        try:
            barrier.wait(WAIT)
            answer: TestResponse | BaseException = send(client)
        except BaseException as e:  # reported by the main thread
            answer = e
        with lock:
            answers.append(answer)

    workers = [threading.Thread(target=attempt, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WAIT)
    broken = [a for a in answers if not isinstance(a, TestResponse)]
    if broken or len(answers) != threads:
        raise fail(f"{len(answers)} of {threads} concurrent {what} ended; errors: {broken!r}")
    return [a for a in answers if isinstance(a, TestResponse)]
