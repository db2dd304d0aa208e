"""The sample application of the test kit served by gunicorn (real worker processes, real PostgreSQL):
replay, mismatch, 409 in flight, a worker SIGKILLed inside its transaction, and a hammer, each against
``POST /orders`` and its ``async def`` twin ``POST /async/orders``.

A request is held inside its transaction across processes by the advisory lock :data:`HOLD_LOCK`, which
the test takes on its own connection: a request sent with ``X-Hold`` waits for it after the key is
reserved, before its write.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
import requests

from .support.helpers import gunicorn, wait_for
from .support.testkit_app import HOLD_LOCK, SCHEMA
from .test_concurrency import fire

pytestmark = pytest.mark.slow

PATHS = pytest.mark.parametrize("path", ["/orders", "/async/orders"], ids=["sync", "async"])
ORG = {"X-Org": "7"}


@pytest.fixture(scope="module")
def served(
    database_url: str, direct_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any]]:
    """tests/support/testkit_app.py under gunicorn, two workers of four threads: its base URL and master."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(SCHEMA)
    log = Path(tmp_path_factory.mktemp("served")) / "gunicorn.log"
    env = {"KIT_DATABASE_URL": database_url, "FLASK_IDEM_POOL_MAX_SIZE": "4"}
    with gunicorn(
        log, env=env, workers=2, threads=4, app="tests.support.testkit_app:served()", probe="/"
    ) as running:
        yield running


def send(base: str, path: str, key: uuid.UUID, amount: int = 1250, **headers: str) -> requests.Response:
    return requests.post(
        base + path,
        json={"amount": amount},
        headers={**ORG, "Idempotency-Key": str(key), **headers},
        timeout=30,
    )


def orders(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM kit_orders").fetchone()
    return 0 if row is None else int(row[0])


def waiting_for_hold(db: psycopg.Connection[Any]) -> bool:
    """Whether a request is waiting for the hold lock (inside its transaction, its key reserved)."""
    row = db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted",
        (HOLD_LOCK,),
    ).fetchone()
    return row is not None and row[0] > 0


@PATHS
def test_replay_and_mismatch(served: tuple[str, Any], db: psycopg.Connection[Any], path: str) -> None:
    """201, then the same answer replayed as 200; another amount with the key is 422; one order."""
    base, _ = served
    key = uuid.uuid4()
    first = send(base, path, key)
    again = send(base, path, key)
    assert first.status_code == 201, first.text
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    changed = send(base, path, key, amount=99)
    assert changed.status_code == 422 and changed.headers["Content-Type"] == "application/problem+json"
    assert orders(db) == 1


@PATHS
def test_in_flight_then_killed_inside_the_transaction(
    served: tuple[str, Any], db: psycopg.Connection[Any], direct_database_url: str, path: str
) -> None:
    """While the first attempt waits inside its transaction a duplicate gets 409 at once; its worker is
    then SIGKILLed there: nothing it did stays, and a retry makes the one order, then replays it."""
    base, master = served
    key = uuid.uuid4()
    outcome: dict[str, Any] = {}

    def first_attempt() -> None:
        try:
            outcome["response"] = send(base, path, key, **{"X-Hold": "1"})
        except requests.RequestException as e:
            outcome["error"] = e

    with psycopg.connect(direct_database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (HOLD_LOCK,))
        thread = threading.Thread(target=first_attempt)
        thread.start()
        wait_for(lambda: waiting_for_hold(db), timeout=30)
        duplicate = send(base, path, key)
        assert duplicate.status_code == 409 and duplicate.headers["Retry-After"] == "1"
        for worker in psutil.Process(master.pid).children():
            os.kill(worker.pid, signal.SIGKILL)
        thread.join(30)
        assert "error" in outcome, outcome  # the client never heard back
        holder.execute("SELECT pg_advisory_unlock(%s)", (HOLD_LOCK,))
    # The killed worker's backend finds its client gone once it has the lock, and rolls back.
    answers: list[requests.Response] = []

    def retried() -> bool:
        try:
            answers.append(send(base, path, key))
        except requests.ConnectionError:  # gunicorn is still replacing its workers
            return False
        return answers[-1].status_code != 409

    wait_for(retried, timeout=30, interval=0.2)
    assert answers[-1].status_code == 201, answers[-1].text
    assert orders(db) == 1
    again = send(base, path, key)
    assert again.status_code == 200 and again.content == answers[-1].content


@PATHS
def test_one_key_hammered(served: tuple[str, Any], db: psycopg.Connection[Any], path: str) -> None:
    """Thirty concurrent requests with one key make one order; the others are replays or 409s."""
    base, _ = served
    key = uuid.uuid4()
    spec = {"json": {"amount": 1250}, "headers": {**ORG, "Idempotency-Key": str(key)}}
    responses = fire(base, [spec] * 30, path=path)
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 201, 409} and statuses[201] == 1, statuses
    assert orders(db) == 1
    created = next(r for r in responses if r.status_code == 201)
    assert all(r.content == created.content for r in responses if r.status_code == 200)


def test_two_key_headers(served: tuple[str, Any], db: psycopg.Connection[Any]) -> None:
    """Two Idempotency-Key header lines, which gunicorn joins into one value with ", ", are a 400 that
    says the request carried more than one key; nothing is stored or written."""
    base, _ = served
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body = json.dumps({"amount": 1250}).encode()
    try:
        conn.putrequest("POST", "/orders")
        for name, value in [
            ("X-Org", ORG["X-Org"]),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Idempotency-Key", str(uuid.uuid4())),
            ("Idempotency-Key", str(uuid.uuid4())),
        ]:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        problem = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 400 and response.getheader("Content-Type") == "application/problem+json"
    assert problem["type"] == "urn:flask-idem:problem:invalid-key"
    assert "more than one Idempotency-Key" in problem["detail"], problem
    assert orders(db) == 0
