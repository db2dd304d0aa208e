"""Duplicate hammers against a real multi-process server: gunicorn, four workers, real PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import requests

from .support.helpers import count, headers

pytestmark = pytest.mark.slow

ORDER = {"amount": 4200, "currency": "EUR"}


def fire(base: str, requests_to_send: list[dict[str, Any]], path: str = "/orders") -> list[requests.Response]:
    """POST every request to ``path`` at once, each from its own thread; return the responses in order."""
    barrier = threading.Barrier(len(requests_to_send))
    results: list[requests.Response | BaseException | None] = [None] * len(requests_to_send)

    def send(i: int, spec: dict[str, Any]) -> None:
        with requests.Session() as session:
            barrier.wait(30)
            try:
                results[i] = session.post(base + path, timeout=30, **spec)
            except BaseException as e:  # reported below, with the others
                results[i] = e

    threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate(requests_to_send)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results if not isinstance(r, requests.Response)]
    assert not errors, errors
    return results  # type: ignore[return-value]


def test_one_key_hammered(
    gunicorn_shop: str, make_org: Callable[[str], tuple[int, str]], db: psycopg.Connection[Any]
) -> None:
    """Sixty concurrent requests with one key make exactly one order; answers are 201, 200 or 409."""
    _, api_key = make_org("hammer")
    key = uuid.uuid4()
    spec = {"json": ORDER, "headers": headers(api_key, key)}
    responses = fire(gunicorn_shop, [spec] * 60)
    statuses = Counter(r.status_code for r in responses)
    print("answers to 60 duplicates:", dict(statuses))
    assert set(statuses) <= {200, 201, 409}, statuses
    assert statuses[201] == 1, statuses
    assert count(db, "orders") == 1
    created = next(r for r in responses if r.status_code == 201)
    for r in responses:
        if r.status_code == 200:
            assert r.content == created.content
            assert r.headers["Idempotent-Replayed"] == "true"
        elif r.status_code == 409:
            assert r.headers["Retry-After"] == "1"
            assert r.headers["Content-Type"] == "application/problem+json"
    # Every 409 is told to retry; after the first attempt finished, a retry replays it.
    retry = requests.post(gunicorn_shop + "/orders", timeout=30, **spec)
    assert retry.status_code == 200
    assert retry.content == created.content


def test_many_keys_many_duplicates_and_orgs(
    gunicorn_shop: str, make_org: Callable[[str], tuple[int, str]], db: psycopg.Connection[Any]
) -> None:
    """Two orgs sharing ten keys, each sent five times at once, make exactly twenty orders."""
    orgs = [make_org("left")[1], make_org("right")[1]]
    keys = [uuid.uuid4() for _ in range(10)]
    specs = [
        {"json": {**ORDER, "amount": i + 1}, "headers": headers(api_key, key)}
        for api_key in orgs
        for i, key in enumerate(keys)
        for _ in range(5)
    ]
    responses = fire(gunicorn_shop, specs)
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 201, 409}, statuses
    assert statuses[201] == 20, statuses
    assert count(db, "orders") == 20
    rows = db.execute("SELECT org_id, idempotency_key, amount FROM orders ORDER BY org_id, amount").fetchall()
    assert len({(org, key) for org, key, _ in rows}) == 20
    assert sorted(amount for _, _, amount in rows) == sorted(list(range(1, 11)) * 2)
