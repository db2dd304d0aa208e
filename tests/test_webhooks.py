"""Inbound webhooks (``@idem.webhook``): verification first, then each event handled once, whatever the
redeliveries, against the real database.

Deliveries go through Flask's test client to :mod:`tests.support.webhook_app`, whose source is a
:func:`flask_idem.webhooks.generic` one checking a plain HMAC; a gunicorn-served copy is SIGKILLed inside
a handler.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
import requests
from flask import Flask
from werkzeug.test import TestResponse

from flask_idem._webhook import event_key

from .support.helpers import age, close_pool, count, gunicorn, wait_for
from .support.webhook_app import HOLD_LOCK, SCHEMA, build_webhook_app, event, sign, source
from .test_signals import recorded


@pytest.fixture(scope="module")
def schema(direct_database_url: str) -> None:
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(SCHEMA)


@pytest.fixture
def hooks(database_url: str, schema: None, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    app = build_webhook_app(database_url, IDEM_POOL_MAX_SIZE=20)[0]
    yield app
    close_pool(app)


def deliver(app: Flask, path: str, body: bytes, **headers: str) -> TestResponse:
    return app.test_client().post(path, data=body, headers={**sign(body), **headers})


def effects(db: psycopg.Connection[Any], event_id: str | None = None) -> int:
    if event_id is None:
        return count(db, "hook_effects")
    row = db.execute("SELECT count(*) FROM hook_effects WHERE event_id = %s", (event_id,)).fetchone()
    assert row is not None
    return int(row[0])


def is_problem(response: TestResponse, status: int, kind: str) -> bool:
    return (
        response.status_code == status
        and response.headers["Content-Type"] == "application/problem+json"
        and response.json is not None
        and response.json["type"] == f"urn:flask-idem:problem:{kind}"
    )


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-Test-Signature": "0" * 64}, {"X-Test-Signature": ""}],
    ids=["missing", "wrong", "empty"],
)
def test_bad_signature_is_400_and_writes_nothing(
    hooks: Flask, db: psycopg.Connection[Any], headers: dict[str, str]
) -> None:
    """A delivery with a missing or wrong signature is a 400 problem naming the check; nothing is written."""
    body = event("evt_bad")
    response = hooks.test_client().post(
        "/hooks/plain", data=body, headers={"Content-Type": "application/json", **headers}
    )
    assert is_problem(response, 400, "webhook-rejected"), response.get_data()
    assert response.json is not None and response.json["check"] == "signature"
    assert count(db, "idempotency_keys") == 0
    assert effects(db) == 0


def test_redelivery_replays_the_first_answer(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """A redelivered event gets the first answer again (status and body, Idempotent-Replayed) and the
    handler does not run again."""
    body = event("evt_1", amount=10)
    first = deliver(hooks, "/hooks/plain", body)
    again = deliver(hooks, "/hooks/plain", body)
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert effects(db, "evt_1") == 1
    assert count(db, "idempotency_keys") == 1


def test_fifty_concurrent_deliveries_run_the_handler_once(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """Fifty deliveries of one event at once run its handler once; the others are 200 replays or 409 with
    Retry-After."""
    body = event("evt_storm")
    barrier = threading.Barrier(50)
    answers: list[TestResponse | BaseException] = []
    lock = threading.Lock()

    def attempt() -> None:
        try:
            barrier.wait(30)
            answer: TestResponse | BaseException = deliver(hooks, "/hooks/plain", body)
        except BaseException as e:  # reported below
            answer = e
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=attempt) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    responses = [a for a in answers if isinstance(a, TestResponse)]
    assert len(responses) == 50, answers
    assert effects(db, "evt_storm") == 1
    firsts = [r for r in responses if r.status_code == 200 and "Idempotent-Replayed" not in r.headers]
    assert len(firsts) == 1
    for r in responses:
        if r.status_code == 409:
            assert is_problem(r, 409, "key-in-use") and r.headers["Retry-After"]
        elif r is not firsts[0]:
            assert r.status_code == 200 and r.headers["Idempotent-Replayed"] == "true"
            assert r.get_data() == firsts[0].get_data()


@pytest.mark.parametrize("path", ["/hooks/raise", "/hooks/500"], ids=["raises", "answers-5xx"])
def test_failing_handler_rolls_back_and_redelivery_runs_it(
    hooks: Flask, db: psycopg.Connection[Any], path: str
) -> None:
    """A handler that raises after its writes, or answers 5xx, leaves nothing (no key row, no write); the
    redelivery runs it and commits."""
    body = event("evt_fail")
    failed = deliver(hooks, path, body)
    # The handler's own exception is the application's 500 (Flask's, or its error handler's).
    assert failed.status_code == (500 if path == "/hooks/raise" else 503)
    assert count(db, "idempotency_keys") == 0
    assert effects(db) == 0
    hooks.config["FAIL"] = False
    handled = deliver(hooks, path, body)
    assert handled.status_code == 200 and handled.json == {"ok": True}
    assert effects(db, "evt_fail") == 1
    again = deliver(hooks, path, body)
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert effects(db, "evt_fail") == 1


def test_past_the_window_is_200_and_not_run(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """An event redelivered after the source's window is answered 200 with nothing run (never 410)."""
    body = event("evt_old")
    assert deliver(hooks, "/hooks/plain", body).status_code == 200
    age(db, "3 days 1 second")
    with recorded(hooks) as events:
        late = deliver(hooks, "/hooks/plain", body)
    assert late.status_code == 200 and late.get_data() == b""
    assert [d["status"] for n, d in events if n == "webhook-duplicate"] == [200]
    assert [d["status"] for n, d in events if n == "tombstone-hit"] == [200]  # what was answered
    assert effects(db, "evt_old") == 1


def test_short_window_source(database_url: str, schema: None, db: psycopg.Connection[Any]) -> None:
    """A source's own window applies: one of a second answers a redelivery 1.1 s later with 200, not run."""
    app, idem = build_webhook_app(database_url)
    runs: list[str] = []

    @app.post("/hooks/short")
    @idem.webhook(source("short", window=1))
    def short() -> Any:
        runs.append(idem.event.id)
        return {"run": len(runs)}

    try:
        body = event("evt_short")
        assert deliver(app, "/hooks/short", body).json == {"run": 1}
        threading.Event().wait(1.1)
        late = deliver(app, "/hooks/short", body)
        assert (late.status_code, late.get_data()) == (200, b"")
        assert runs == ["evt_short"]
    finally:
        close_pool(app)


def test_same_event_id_with_another_body_is_422(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """The same event id delivered with another body is refused with 422; the handler does not run again."""
    assert deliver(hooks, "/hooks/plain", event("evt_dup", amount=1)).status_code == 200
    other = deliver(hooks, "/hooks/plain", event("evt_dup", amount=2))
    assert is_problem(other, 422, "key-mismatch"), other.get_data()
    assert effects(db, "evt_dup") == 1


def test_scope_keeps_tenants_apart(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """With ``scope=``, two tenants' equal event ids are two events; each is handled once."""
    body = event("evt_shared")
    a = deliver(hooks, "/hooks/tenant/a", body)
    b = deliver(hooks, "/hooks/tenant/b", body)
    assert (a.status_code, b.status_code) == (200, 200)
    assert "Idempotent-Replayed" not in b.headers
    assert deliver(hooks, "/hooks/tenant/a", body).headers["Idempotent-Replayed"] == "true"
    rows = db.execute("SELECT tenant FROM hook_effects ORDER BY tenant").fetchall()
    assert rows == [("a",), ("b",)]
    orgs = db.execute("SELECT DISTINCT org_id FROM idempotency_keys").fetchall()
    assert len(orgs) == 2 and all(org < 0 for (org,) in orgs)


def test_webhook_org_ids_never_meet_an_organisation(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """An idempotent route of organisation 1 sent the webhook row's own key does not see that row."""
    assert deliver(hooks, "/hooks/plain", event("evt_org")).status_code == 200
    key = event_key(source(), "evt_org")
    (stored_key,) = db.execute("SELECT idem_key FROM idempotency_keys").fetchone() or (None,)
    assert stored_key == key
    response = hooks.test_client().post(
        "/notes", json={}, headers={"X-Org": "1", "Idempotency-Key": str(key)}
    )
    assert response.status_code == 201 and "Idempotent-Replayed" not in response.headers
    orgs = sorted(org for (org,) in db.execute("SELECT org_id FROM idempotency_keys").fetchall())
    assert orgs[0] < 0 and orgs[1] == 1


def test_each_outcome_sends_its_signal_once(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """Rejected (with its check), verified, handled and duplicate (with its status) are each sent once."""
    body = event("evt_signals")
    with recorded(hooks) as events:
        hooks.test_client().post("/hooks/plain", data=body, headers={"X-Test-Signature": "00"})
    hooked = [(n, d) for n, d in events if n.startswith("webhook-")]
    assert [(n, d["check"], d["source"]) for n, d in hooked] == [("webhook-rejected", "signature", "test")]
    with recorded(hooks) as events:
        deliver(hooks, "/hooks/plain", body)
    hooked = [(n, d) for n, d in events if n.startswith("webhook-")]
    assert [n for n, _ in hooked] == ["webhook-verified", "webhook-handled"]
    assert hooked[1][1]["status"] == 200 and hooked[1][1]["event_id"] == "evt_signals"
    assert hooked[1][1]["org_id"] < 0 and hooked[1][1]["key"] == event_key(source(), "evt_signals")
    with recorded(hooks) as events:
        deliver(hooks, "/hooks/plain", body)
    hooked = [(n, d) for n, d in events if n.startswith("webhook-")]
    assert [n for n, _ in hooked] == ["webhook-verified", "webhook-duplicate"]
    assert hooked[1][1]["status"] == 200 and hooked[1][1]["source"] == "test"
    with recorded(hooks) as events:
        deliver(hooks, "/hooks/plain", event("evt_signals", changed=True))
    duplicates = [d["status"] for n, d in events if n == "webhook-duplicate"]
    assert duplicates == [422]


def test_failed_handler_sends_no_handled_signal(hooks: Flask, db: psycopg.Connection[Any]) -> None:
    """A handler that answers 5xx is verified but not handled: no webhook-handled signal."""
    with recorded(hooks) as events:
        deliver(hooks, "/hooks/500", event("evt_503"))
    assert [n for n, _ in events if n.startswith("webhook-")] == ["webhook-verified"]


@pytest.mark.slow
def test_worker_killed_mid_handler_then_redelivered(
    database_url: str,
    direct_database_url: str,
    schema: None,
    db: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    """A worker SIGKILLed inside a handler, after its write, leaves nothing; the redelivery handles the
    event, exactly once."""
    env = {"WEBHOOK_DATABASE_URL": database_url, "FLASK_IDEM_POOL_MAX_SIZE": "4"}
    body = event("evt_killed")
    outcome: dict[str, Any] = {}
    with gunicorn(
        tmp_path / "gunicorn.log",
        env=env,
        workers=1,
        threads=2,
        app="tests.support.webhook_app:served()",
        probe="/hooks/hold",
    ) as (base, master):

        def post() -> requests.Response:
            return requests.post(base + "/hooks/hold", data=body, headers=sign(body), timeout=30)

        def first() -> None:
            try:
                outcome["response"] = post()
            except requests.RequestException as e:
                outcome["error"] = e

        with psycopg.connect(direct_database_url, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (HOLD_LOCK,))
            thread = threading.Thread(target=first)
            thread.start()
            wait_for(
                lambda: bool(
                    db.execute(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
                        " AND NOT granted",
                        (HOLD_LOCK,),
                    ).fetchone()[0]  # type: ignore[index]
                ),
                timeout=30,
            )
            for worker in psutil.Process(master.pid).children():
                os.kill(worker.pid, signal.SIGKILL)
            thread.join(30)
            assert "error" in outcome, outcome
            holder.execute("SELECT pg_advisory_unlock(%s)", (HOLD_LOCK,))
        answers: list[requests.Response] = []

        def redelivered() -> bool:
            try:
                answers.append(post())
            except requests.ConnectionError:  # gunicorn is still replacing its worker
                return False
            return answers[-1].status_code != 409

        wait_for(redelivered, timeout=30, interval=0.2)
        assert answers[-1].status_code == 200, answers[-1].text
        assert "Idempotent-Replayed" not in answers[-1].headers
        again = post()
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert Counter(r for (r,) in db.execute("SELECT event_id FROM hook_effects").fetchall()) == {
        "evt_killed": 1
    }


def test_unreachable_database_is_503_and_store_unavailable(schema: None) -> None:
    """A delivery that cannot reach the key table is a 503 with Retry-After (the sender delivers it again)
    and sends store-unavailable, as a request does: the two HTTP doors share one database boundary."""
    app = build_webhook_app("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1", IDEM_POOL_TIMEOUT=0.5)[
        0
    ]
    body = event("evt_unreachable")
    try:
        with recorded(app) as events:
            response = deliver(app, "/hooks/plain", body)
    finally:
        close_pool(app)
    assert is_problem(response, 503, "store-unavailable") and "Retry-After" in response.headers
    unavailable = [data for name, data in events if name == "store-unavailable"]
    assert unavailable == [
        {
            "org_id": source().org_id(None),
            "key": event_key(source(), "evt_unreachable"),
            "endpoint": "plain",
            "error": "PoolTimeout",
            "sqlstate": None,
        }
    ]
