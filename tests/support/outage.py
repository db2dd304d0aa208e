"""Load on the shop while the path to its database misbehaves, and what every request got.

``clients`` threads place orders one after another, each with a fresh key and one attempt (no retry, so
that nothing hides a failure). Reads (``GET /orders``) and health checks (``GET /health``) go out on a
fixed schedule, each in a thread of its own, so that a stuck one does not hold up the next. Every request
becomes a :class:`Sample`; :meth:`Load.fault` marks the moment of the fault, from which samples are timed.
Used by the fault tests (``tests/test_faults.py``) and by ``bench/faults.py``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import requests

__all__ = ["ORDER", "Load", "Sample", "check_orders", "retry_unsettled", "running_load"]

#: The order every client places.
ORDER = {"amount": 1250, "currency": "EUR"}


@dataclass(frozen=True)
class Sample:
    """One request and how it ended."""

    kind: str  # "order", "read" or "health"
    #: When it was sent and answered (``time.monotonic()``).
    sent: float
    answered: float
    #: Its HTTP status; ``None`` when no answer came (a timeout or a broken connection).
    status: int | None
    key: uuid.UUID | None = None
    body: bytes | None = None
    #: Its ``Retry-After`` header, if it had one.
    retry_after: str | None = None

    @property
    def seconds(self) -> float:
        return self.answered - self.sent

    @property
    def ok(self) -> bool:
        return self.status is not None and self.status < 300


class Load:
    """The load: start it, mark the fault, stop it, read its samples.

    :param base: the shop's base URL.
    :param api_key: an organisation's API key.
    :param clients: threads placing orders.
    :param every: seconds between two reads, and between two health checks.
    :param timeout: the client's timeout of one request, in seconds.
    """

    def __init__(
        self, base: str, api_key: str, *, clients: int = 8, every: float = 0.25, timeout: float = 30.0
    ) -> None:
        self.base = base
        self.auth = {"Authorization": f"Bearer {api_key}"}
        self.clients = clients
        self.every = every
        self.timeout = timeout
        self.samples: list[Sample] = []
        #: When the fault came (``time.monotonic()``); until :meth:`fault`, the start of the load.
        self.fault_at = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._timed = ThreadPoolExecutor(64)

    def start(self) -> None:
        self.fault_at = time.monotonic()
        self._threads = [threading.Thread(target=self._orders) for _ in range(self.clients)]
        self._threads.append(threading.Thread(target=self._schedule))
        for thread in self._threads:
            thread.start()

    def fault(self) -> None:
        """Mark now as the moment of the fault."""
        self.fault_at = time.monotonic()

    def stop(self) -> list[Sample]:
        """Stop sending, wait for every answer, and return the samples."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._timed.shutdown(wait=True)
        return self.samples

    def since_fault(self, sample: Sample) -> float:
        """Seconds from the fault to when ``sample`` was sent (negative: before it)."""
        return sample.sent - self.fault_at

    def _record(self, kind: str, send: Callable[[], requests.Response], key: uuid.UUID | None = None) -> None:
        sent = time.monotonic()
        try:
            response = send()
        except requests.RequestException:
            sample = Sample(kind, sent, time.monotonic(), None, key)
        else:
            body = response.content if kind == "order" else None
            retry_after = response.headers.get("Retry-After")
            sample = Sample(kind, sent, time.monotonic(), response.status_code, key, body, retry_after)
        with self._lock:
            self.samples.append(sample)

    def _orders(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                key = uuid.uuid4()
                self._record("order", self._post(session, key), key)

    def _post(self, session: requests.Session, key: uuid.UUID) -> Callable[[], requests.Response]:
        headers = {**self.auth, "Idempotency-Key": str(key)}
        return lambda: session.post(self.base + "/orders", json=ORDER, headers=headers, timeout=self.timeout)

    def _schedule(self) -> None:
        while not self._stop.wait(self.every):
            self._timed.submit(self._record, "read", self._get("/orders"))
            self._timed.submit(self._record, "health", self._get("/health"))

    def _get(self, path: str) -> Callable[[], requests.Response]:
        return lambda: requests.get(self.base + path, headers=self.auth, timeout=self.timeout)


@contextmanager
def running_load(base: str, api_key: str, **options: Any) -> Iterator[Load]:
    """A started :class:`Load`, stopped when the block ends (also when it fails)."""
    load = Load(base, api_key, **options)
    load.start()
    try:
        yield load
    finally:
        load.stop()


def retry_unsettled(base: str, api_key: str, samples: list[Sample]) -> list[Sample]:
    """Retry, with its own key, every order whose outcome its client did not learn (a 503, no answer),
    through the retry helper (which waits out a 409 while the first attempt is still held somewhere);
    return the retries' samples, which :func:`check_orders` then holds to the same standard."""
    from flask_idem.client import IdempotentClient, RequestsTransport, RetriesExhausted, RetryPolicy

    policy = RetryPolicy(attempts=30, deadline=60.0, base=0.2, cap=2.0, attempt_timeout=15.0)
    retried: list[Sample] = []
    auth = {"Authorization": f"Bearer {api_key}"}
    with requests.Session() as session:
        client = IdempotentClient(RequestsTransport(session), policy=policy)
        for sample in samples:
            if sample.kind != "order" or sample.status in (200, 201):
                continue
            sent = time.monotonic()
            try:
                response = client.post(
                    base + "/orders",
                    json=ORDER,
                    headers=auth,
                    key=sample.key,
                )
                status, body = response.status_code, response.content
            except RetriesExhausted as e:
                status, body = e.status, None
            retried.append(Sample("order", sent, time.monotonic(), status, sample.key, body))
    return retried


def check_orders(db: psycopg.Connection[Any], samples: list[Sample]) -> None:
    """Nothing acknowledged lost, nothing duplicated: every acknowledged order is in the table, as it was
    answered, and no key has more than one order."""
    rows = {
        key: (order_id, amount)
        for order_id, key, amount in db.execute("SELECT id, idempotency_key, amount FROM orders").fetchall()
    }
    dupes = db.execute(
        "SELECT idempotency_key FROM orders GROUP BY org_id, idempotency_key HAVING count(*) > 1"
    ).fetchall()
    assert not dupes, f"orders made twice under one key: {dupes}"
    acknowledged = [s for s in samples if s.kind == "order" and s.status in (200, 201)]
    assert acknowledged, "no order was acknowledged"
    for sample in acknowledged:
        assert sample.body is not None and sample.key is not None
        answer = json.loads(sample.body)
        assert rows.get(sample.key) == (answer["id"], ORDER["amount"]), f"acknowledged, then lost: {answer}"
