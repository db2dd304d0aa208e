"""The payment gateway simulator: one charge per key, declines, lookups, and every injected fault."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from example_app.gateway import create_app
from example_app.gateway.store import Store

from ..support.servers import in_thread, wait_for
from ..support.shop_actions import add_fault

ROOT = Path(__file__).resolve().parents[2]
CHARGE = {"amount": 1250, "currency": "EUR", "source": "tok_visa"}
PROBLEM_JSON = "application/problem+json"


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway_db_url(server_url: str) -> Iterator[str]:
    """A throwaway database for the gateway's tables, on the suite's PostgreSQL server."""
    name = f"gateway_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _gateway(db_url: str, *, faults: bool) -> Flask:
    return create_app({"TESTING": True, "DATABASE_URL": db_url, "FAULTS_ENABLED": faults})


def _store(app: Flask) -> Store:
    store: Store = app.extensions["gateway"]
    return store


@pytest.fixture
def gateway_app(gateway_db_url: str) -> Iterator[Flask]:
    """The gateway with fault injection enabled and an empty fault queue."""
    app = _gateway(gateway_db_url, faults=True)
    _store(app).clear_faults()
    yield app
    _store(app).clear_faults()
    _store(app).close()


@pytest.fixture
def gateway(gateway_app: Flask) -> FlaskClient:
    """A test client of the gateway."""
    return gateway_app.test_client()


@pytest.fixture
def werkzeug_gateway(gateway_app: Flask) -> Iterator[str]:
    """The gateway served by Werkzeug's threaded server on a free port, in a thread."""
    with in_thread(gateway_app) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gunicorn_gateway(gateway_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway under gunicorn with two sync workers, both ready, faults enabled."""
    tmp = tmp_path_factory.mktemp("gunicorn")
    config = tmp / "gunicorn_conf.py"
    # post_worker_init runs once a worker has loaded the app: a file per ready worker.
    config.write_text(
        f"def post_worker_init(worker):\n    open({str(tmp)!r} + '/ready-' + str(worker.pid), 'w').close()\n"
    )
    log = tmp / "gunicorn.log"
    env = {**os.environ, "FLASK_DATABASE_URL": gateway_db_url, "FLASK_FAULTS_ENABLED": "true"}
    command = [sys.executable, "-m", "gunicorn", "-w", "2", "-b", "127.0.0.1:0", "-c", str(config)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "example_app.gateway:create_app()"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening() -> re.Match[str] | None:
            return re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", log.read_text())

        def ready() -> bool:
            assert process.poll() is None, "gunicorn exited:\n" + log.read_text()
            return listening() is not None and len(list(tmp.glob("ready-*"))) >= 2

        wait_for(ready, 30, message=lambda: "gunicorn did not start:\n" + log.read_text())
        found = listening()
        assert found is not None
        yield f"http://127.0.0.1:{found[1]}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(params=["werkzeug", "gunicorn"])
def gateway_server(request: pytest.FixtureRequest, gateway_app: Flask) -> str:
    """The gateway as a real HTTP server, by each server it runs under; the fault queue is empty."""
    url: str = request.getfixturevalue(f"{request.param}_gateway")
    return url


# -- helpers -------------------------------------------------------------------------------------------


def new_key() -> str:
    """A fresh key shaped like the shop's: derived from an organisation and a UUID."""
    return f"shop:1:{uuid.uuid4()}"


def post_charge(client: FlaskClient, key: str, **changes: Any) -> Any:
    """``POST /charges`` of :data:`CHARGE` with ``changes``, under ``key``."""
    return client.post("/charges", json={**CHARGE, **changes}, headers={"Idempotency-Key": key})


def http_charge(base: str, key: str) -> requests.Response:
    """``POST /charges`` of :data:`CHARGE` over real HTTP."""
    return requests.post(base + "/charges", json=CHARGE, headers={"Idempotency-Key": key}, timeout=10)


# -- charges -------------------------------------------------------------------------------------------


def test_one_charge_per_key(gateway: FlaskClient) -> None:
    """A repeat with the same key answers 200 with the charge the first request created with 201."""
    key = new_key()
    first = post_charge(gateway, key)
    again = post_charge(gateway, key)
    assert first.status_code == 201
    assert first.json["id"].startswith("ch_")
    assert first.json | {"status": "succeeded"} == first.json
    assert (again.status_code, again.json) == (200, first.json)
    listed = [c for c in gateway.get("/charges").json["charges"] if c["idempotency_key"] == key]
    assert listed == [first.json]


def test_concurrent_requests_with_one_key_make_one_charge(werkzeug_gateway: str) -> None:
    """Of eight simultaneous requests with one key, one creates the charge and all get it."""
    key = new_key()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: http_charge(werkzeug_gateway, key), range(8)))
    assert sorted(a.status_code for a in answers) == [200] * 7 + [201]
    assert len({a.json()["id"] for a in answers}) == 1


@pytest.mark.parametrize(
    "change",
    [{"amount": 1251}, {"currency": "USD"}, {"source": "tok_mastercard"}],
    ids=["amount", "currency", "source"],
)
def test_key_reused_for_another_charge_is_422(gateway: FlaskClient, change: dict[str, Any]) -> None:
    """A key already used for a different amount, currency or source is refused with 422."""
    key = new_key()
    first = post_charge(gateway, key).json
    reused = post_charge(gateway, key, **change)
    assert reused.status_code == 422
    assert reused.content_type == PROBLEM_JSON
    assert gateway.get(f"/charges/by-key/{key}").json == first


def test_decline_is_402_and_repeats(gateway: FlaskClient) -> None:
    """A source ending in ``decline`` is recorded declined and answered 402, the same on a repeat."""
    key = new_key()
    declined = post_charge(gateway, key, source="tok_card_decline")
    again = post_charge(gateway, key, source="tok_card_decline")
    assert declined.status_code == 402
    assert declined.content_type == PROBLEM_JSON
    assert declined.json["charge_id"].startswith("ch_")
    assert (again.status_code, again.json) == (402, declined.json)
    charge = gateway.get(f"/charges/by-key/{key}").json
    assert (charge["id"], charge["status"]) == (declined.json["charge_id"], "declined")


def test_missing_key_is_400(gateway: FlaskClient) -> None:
    """A charge request without an Idempotency-Key is refused with 400 and charges nothing."""
    answer = gateway.post("/charges", json=CHARGE)
    assert (answer.status_code, answer.content_type) == (400, PROBLEM_JSON)


@pytest.mark.parametrize("key", ["k" * 256, "clé", ""], ids=["too-long", "non-ascii", "empty"])
def test_invalid_key_is_400(gateway: FlaskClient, key: str) -> None:
    """A key that is empty, longer than 255 characters or not printable ASCII is refused with 400."""
    answer = post_charge(gateway, key)
    assert (answer.status_code, answer.content_type) == (400, PROBLEM_JSON)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**CHARGE, "amount": 0}, "amount"),
        ({**CHARGE, "amount": "1250"}, "amount"),
        ({**CHARGE, "amount": True}, "amount"),
        ({**CHARGE, "currency": "eur"}, "currency"),
        ({"amount": 1250, "currency": "EUR"}, "source"),
        ({**CHARGE, "extra": 1}, "extra"),
    ],
    ids=["zero", "string-amount", "bool-amount", "lowercase-currency", "no-source", "unknown"],
)
def test_invalid_body_is_422(gateway: FlaskClient, body: dict[str, Any], field: str) -> None:
    """A body with a wrong or missing field is refused with 422 naming the field."""
    answer = gateway.post("/charges", json=body, headers={"Idempotency-Key": new_key()})
    assert (answer.status_code, answer.content_type) == (422, PROBLEM_JSON)
    assert list(answer.json["errors"]) == [field]


def test_card_number_is_refused_and_not_echoed(gateway: FlaskClient) -> None:
    """A source that looks like a card number is refused, and the number never comes back."""
    key = new_key()
    answer = post_charge(gateway, key, source="4242-4242-4242-4242")
    assert answer.status_code == 422
    assert "4242" not in answer.get_data(as_text=True)
    assert gateway.get(f"/charges/by-key/{key}").status_code == 404


def test_lookup_by_key(gateway: FlaskClient) -> None:
    """A charge is found by its key, even one with slashes and spaces; an unused key is 404."""
    key = f"org 7/{uuid.uuid4()}"
    created = post_charge(gateway, key).json
    assert gateway.get("/charges/by-key/" + quote(key, safe="")).json == created
    missing = gateway.get("/charges/by-key/" + quote(new_key(), safe=""))
    assert (missing.status_code, missing.content_type) == (404, PROBLEM_JSON)


def test_list_charges(gateway: FlaskClient) -> None:
    """The listing has every charge with its key and amount."""
    keys = [new_key(), new_key()]
    post_charge(gateway, keys[0], amount=100)
    post_charge(gateway, keys[1], amount=200)
    listed = {c["idempotency_key"]: c["amount"] for c in gateway.get("/charges").json["charges"]}
    assert (listed[keys[0]], listed[keys[1]]) == (100, 200)


# -- faults --------------------------------------------------------------------------------------------


def test_faults_are_404_when_disabled(gateway_db_url: str) -> None:
    """Without FAULTS_ENABLED, ``/_faults`` is 404 and queued faults are ignored."""
    app = _gateway(gateway_db_url, faults=False)
    client = app.test_client()
    try:
        _store(app).add_fault(mode="fail_before", count=1, delay=0)
        assert client.post("/_faults", json={"mode": "fail_before", "count": 1}).status_code == 404
        assert client.get("/_faults").status_code == 404
        assert client.delete("/_faults").status_code == 404
        assert post_charge(client, new_key()).status_code == 201
    finally:
        _store(app).clear_faults()
        _store(app).close()


@pytest.mark.parametrize(
    "fault",
    [
        {"mode": "explode", "count": 1},
        {"mode": "delay", "count": 0},
        {"mode": "delay", "count": 1, "delay": -1},
        {"mode": "delay"},
    ],
    ids=["unknown-mode", "zero-count", "negative-delay", "no-count"],
)
def test_invalid_fault_is_422(gateway: FlaskClient, fault: dict[str, Any]) -> None:
    """A fault with an unknown mode, a count below 1 or a negative delay is refused with 422."""
    answer = gateway.post("/_faults", json=fault)
    assert (answer.status_code, answer.content_type) == (422, PROBLEM_JSON)
    assert gateway.get("/_faults").json == {"faults": []}


def test_delay_fault(gateway: FlaskClient) -> None:
    """A ``delay`` fault charges normally but answers late, and is used up."""
    gateway.post("/_faults", json={"mode": "delay", "count": 1, "delay": 0.3})
    started = time.monotonic()
    answer = post_charge(gateway, new_key())
    assert time.monotonic() - started >= 0.3
    assert answer.status_code == 201
    assert gateway.get("/_faults").json == {"faults": []}


def test_fail_before_fault(gateway: FlaskClient) -> None:
    """A ``fail_before`` fault answers 500 without charging; a retry then charges."""
    key = new_key()
    gateway.post("/_faults", json={"mode": "fail_before", "count": 1})
    failed = post_charge(gateway, key)
    assert (failed.status_code, failed.content_type) == (500, PROBLEM_JSON)
    assert gateway.get(f"/charges/by-key/{key}").status_code == 404
    assert post_charge(gateway, key).status_code == 201


def test_fail_after_fault(gateway: FlaskClient) -> None:
    """A ``fail_after`` fault charges, then answers 500; a retry gets that charge with 200."""
    key = new_key()
    gateway.post("/_faults", json={"mode": "fail_after", "count": 1})
    failed = post_charge(gateway, key)
    assert (failed.status_code, failed.content_type) == (500, PROBLEM_JSON)
    charge = gateway.get(f"/charges/by-key/{key}").json
    assert charge["status"] == "succeeded"
    retry = post_charge(gateway, key)
    assert (retry.status_code, retry.json) == (200, charge)


def test_faults_apply_in_order_to_the_next_requests(gateway: FlaskClient) -> None:
    """Queued faults affect exactly the next ``count`` charge requests each, in the order posted."""
    gateway.post("/_faults", json={"mode": "fail_before", "count": 2})
    gateway.post("/_faults", json={"mode": "fail_after", "count": 1})
    assert [f["remaining"] for f in gateway.get("/_faults").json["faults"]] == [2, 1]
    keys = [new_key() for _ in range(4)]
    assert [post_charge(gateway, key).status_code for key in keys] == [500, 500, 500, 201]
    found = [gateway.get(f"/charges/by-key/{key}").status_code for key in keys]
    assert found == [404, 404, 200, 200]


def test_delete_clears_faults(gateway: FlaskClient) -> None:
    """``DELETE /_faults`` empties the queue, so the next charge succeeds."""
    gateway.post("/_faults", json={"mode": "fail_before", "count": 5})
    assert gateway.delete("/_faults").status_code == 204
    assert gateway.get("/_faults").json == {"faults": []}
    assert post_charge(gateway, new_key()).status_code == 201


@pytest.mark.slow
def test_drop_after_fault(gateway_server: str) -> None:
    """A ``drop_after`` fault charges, then cuts the connection: the gateway gets no answer at all."""
    key = new_key()
    add_fault(gateway_server, mode="drop_after", count=1)
    with pytest.raises(requests.ConnectionError):
        http_charge(gateway_server, key)
    found = requests.get(gateway_server + "/charges/by-key/" + quote(key, safe=""), timeout=10)
    assert found.status_code == 200
    retry = http_charge(gateway_server, key)
    assert (retry.status_code, retry.json()) == (200, found.json())


@pytest.mark.slow
def test_faults_are_shared_by_gunicorn_workers(gunicorn_gateway: str, gateway_app: Flask) -> None:
    """Two workers serving two charge requests at once consume one fault each, then none is left."""
    add_fault(gunicorn_gateway, mode="fail_before", count=2, delay=1.0)
    keys = [new_key() for _ in range(3)]
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        failed = list(pool.map(lambda key: http_charge(gunicorn_gateway, key), keys[:2]))
    # A sync worker serves one request at a time: both sleeping at once means both workers did.
    assert time.monotonic() - started < 1.9
    assert [a.status_code for a in failed] == [500, 500]
    assert http_charge(gunicorn_gateway, keys[2]).status_code == 201
    listed = requests.get(gunicorn_gateway + "/charges", timeout=10).json()["charges"]
    assert [c["idempotency_key"] for c in listed if c["idempotency_key"] in keys] == [keys[2]]
