"""Prometheus metrics: counters from the signals, the key table's gauges, and the shop under gunicorn.

The in-process tests give each application a registry of its own. The end-to-end test serves the shop
with gunicorn in prometheus-client's multiprocess mode and compares scrapes of ``/metrics`` taken before
and after a scripted series of requests, conflicts and a recovery run by another process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
from flask import Flask
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from flask_idem import OutcomeUnknown, _partitions
from flask_idem.errors import ConfigurationError
from flask_idem.metrics import Metrics
from flask_idem.recovery import recover

from .support import citus
from .support.flow_app import Ledger, build_flow_app
from .support.helpers import ROOT, close_pool, gunicorn, headers, wait_for
from .support.notes_app import build_app, post
from .support.partitions import insert, passed_table
from .support.webhook_app import SCHEMA as HOOK_SCHEMA
from .support.webhook_app import build_webhook_app, event, sign

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a text exposition, by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return found.get((name, frozenset(labels.items())), 0.0)


def scrape(registry: CollectorRegistry) -> Samples:
    from prometheus_client import generate_latest

    return samples(generate_latest(registry).decode())


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def notes(make_app: Callable[..., Flask], registry: CollectorRegistry) -> Flask:
    app = make_app()
    Metrics(app, registry=registry)
    return app


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def flow_app(
    database_url: str, db: psycopg.Connection[Any], ledger: Ledger, registry: CollectorRegistry
) -> Iterator[Flask]:
    app = build_flow_app(database_url, ledger, IDEM_RECOVERY_DEADLINE=3600)
    Metrics(app, registry=registry)
    yield app
    close_pool(app)


def outcome(found: Samples, endpoint: str, name: str) -> float:
    return value(found, "flask_idem_outcomes_total", endpoint=endpoint, outcome=name)


def test_outcomes_are_counted_by_route(notes: Flask, registry: CollectorRegistry) -> None:
    """Each outcome increments flask_idem_outcomes_total{endpoint, outcome}; store operations are timed."""
    key = uuid.uuid4()
    post(notes, "/notes", key, {"body": "a"})
    post(notes, "/notes", key, {"body": "a"})
    post(notes, "/notes", key, {"body": "b"})
    post(notes, "/notes/500", uuid.uuid4())
    found = scrape(registry)
    assert outcome(found, "create", "key_reserved") == 1
    assert outcome(found, "create", "response_stored") == 1
    assert outcome(found, "create", "response_replayed") == 1
    assert outcome(found, "create", "mismatch_rejected") == 1
    assert outcome(found, "fail_with_500", "key_reserved") == 1
    assert outcome(found, "fail_with_500", "response_stored") == 0
    assert value(found, "flask_idem_store_duration_seconds_count", operation="reserve") == 4
    assert value(found, "flask_idem_store_duration_seconds_count", operation="complete") == 1
    assert value(found, "flask_idem_store_duration_seconds_sum", operation="reserve") > 0


def test_webhook_deliveries_are_counted_by_source(
    database_url: str, direct_database_url: str, db: psycopg.Connection[Any], registry: CollectorRegistry
) -> None:
    """flask_idem_webhook_deliveries_total{source, outcome, check} counts each webhook outcome, with the
    failed check of a rejected delivery."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(HOOK_SCHEMA)
    app = build_webhook_app(database_url)[0]
    try:
        Metrics(app, registry=registry)
        client = app.test_client()
        body = event("evt_metrics")
        client.post("/hooks/plain", data=body, headers={"X-Test-Signature": "00"})
        client.post("/hooks/plain", data=body, headers=sign(body))
        client.post("/hooks/plain", data=body, headers=sign(body))
        client.post("/hooks/plain", data=body, headers=sign(body))
    finally:
        close_pool(app)
    found = scrape(registry)

    def delivered(outcome: str, check: str = "") -> float:
        name = "flask_idem_webhook_deliveries_total"
        return value(found, name, source="test", outcome=outcome, check=check)

    assert delivered("webhook_rejected", "signature") == 1
    assert delivered("webhook_verified") == 3
    assert delivered("webhook_handled") == 1
    assert delivered("webhook_duplicate") == 2
    assert outcome(found, "plain", "webhook_handled") == 1  # and by route, as every outcome


def table_gauges(registry: CollectorRegistry) -> tuple[float, ...]:
    """processing, stranded, flagged and the oldest processing age, as a scrape reads them."""
    found = scrape(registry)
    labels = {"table": "idempotency_keys"}
    assert value(found, "flask_idem_key_table_up", **labels) == 1
    names = ("keys_processing", "keys_stranded", "keys_flagged", "oldest_processing_age_seconds")
    return tuple(value(found, f"flask_idem_{name}", **labels) for name in names)


def test_steps_and_stranded_requests(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any], registry: CollectorRegistry
) -> None:
    """Steps are timed by kind; a stranded request shows in the gauges until the recovery job finishes it."""
    assert table_gauges(registry) == (0, 0, 0, 0)
    ledger.lose_answer = True
    assert post(flow_app, "/transfers", uuid.uuid4(), {"amount": 7}).status_code == 503
    db.execute("UPDATE idempotency_keys SET created_at = now() - interval '10 minutes'")
    processing, stranded, flagged, oldest = table_gauges(registry)
    assert (processing, stranded, flagged) == (1, 1, 0)  # the lease was given up with the 503
    assert 590 < oldest < 700
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    assert len(recover(flow_app).completed) == 1
    assert table_gauges(registry) == (0, 0, 0, 0)
    found = scrape(registry)
    step = "flask_idem_step_duration_seconds_count"
    assert value(found, step, flow="notes.transfer", step="prepare", kind="database") == 1
    assert value(found, step, flow="notes.transfer", step="post", kind="call") == 1  # by the recovery job
    assert outcome(found, "transfer", "outcome_unknown") == 1
    assert outcome(found, "transfer", "recovered") == 1


def test_flagged_requests(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any], registry: CollectorRegistry
) -> None:
    """A request given up by the recovery job counts as given_up and shows as flagged."""
    ledger.fail_next = OutcomeUnknown
    post(flow_app, "/transfers", uuid.uuid4(), {"amount": 7})
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now(), created_at = now() - interval '2 hours'")
    assert len(recover(flow_app).failed) == 1
    assert table_gauges(registry) == (0, 0, 1, 0)
    assert outcome(scrape(registry), "transfer", "given_up") == 1


def test_unreadable_key_table_is_reported_not_raised(
    db: Any, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """When the database cannot be reached, the scrape still answers, with key_table_up 0 and no secret."""
    secret = "s3cr3t-metrics-pw"
    app, _ = build_app(
        f"postgresql://idem:{secret}@127.0.0.1:1/private?connect_timeout=1", IDEM_POOL_TIMEOUT=0.5
    )
    Metrics(app, registry=registry)
    try:
        found = scrape(registry)
    finally:
        close_pool(app)
    assert value(found, "flask_idem_key_table_up", table="idempotency_keys") == 0
    assert ("flask_idem_keys_processing", frozenset({("table", "idempotency_keys")})) not in found
    assert "PoolTimeout" in caplog.text
    assert secret not in caplog.text and "private" not in caplog.text


def test_gauges_read_only_small_indexes(db: psycopg.Connection[Any], make_app: Callable[..., Flask]) -> None:
    """The scrape's statement reads the partial indexes, not the finished rows: no sequential scan."""
    app = make_app()
    db.execute(
        "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response,"
        " expires_at) SELECT 1, gen_random_uuid(), sha256(i::text::bytea), 'POST', '/notes', 'completed',"
        " '{}'::jsonb, now() + interval '1 day' FROM generate_series(1, 50000) AS i"
    )
    db.execute("ANALYZE idempotency_keys")
    from flask_idem._state import get_state

    statement = get_state(app).store._sql.state
    plan = json.dumps(db.execute(b"EXPLAIN (FORMAT JSON) " + statement).fetchone())
    # No sequential scan of rows: the planner may scan a partition made ahead, empty and
    # never analysed, rather than open its index; the partition holding the rows is read by index.
    scanned = re.findall(r'"Node Type": "Seq Scan", [^{}]*?"Relation Name": "([^"]+)"', plan)
    for relation in {unsharded(db, name) for name in scanned}:
        [(rows,)] = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(relation))).fetchall()
        assert rows == 0, (relation, plan)
    assert plan.count('"Seq Scan"') == len(scanned), plan
    # Rows with a lease are in two small partial indexes (the due index has the lease index's
    # predicate): either will do, as the partitions' own indexes of those.
    used = {unsharded(db, name) for name in re.findall(r'"Index Name": "([^"]+)"', plan)}
    predicates = {
        name: predicate
        for name, predicate in db.execute(
            "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index AS i"
            " JOIN pg_class AS c ON c.oid = i.indexrelid WHERE c.relname = ANY(%s)",
            (list(used),),
        )
    }
    assert sorted(predicates) == sorted(used), plan
    assert {predicates[name] for name in used} <= {"(lease_expires_at IS NOT NULL)", "needs_attention"}, plan
    assert "needs_attention" in predicates.values(), plan


def unsharded(db: psycopg.Connection[Any], name: str) -> str:
    """The table or index that ``name`` of a plan stands for: on Citus a plan names a shard's (the worker
    that runs it, for one shard), ``<name>_<shard id>``, which the coordinator has no relation of."""
    shard = re.fullmatch(r"(.+)_(\d+)", name)
    if not citus.ENABLED or shard is None:
        return name
    found = db.execute("SELECT EXISTS (SELECT FROM pg_dist_shard WHERE shardid = %s)", (int(shard[2]),))
    return shard[1] if found.fetchone() == (True,) else name


def test_partition_gauges(
    make_app: Callable[..., Flask],
    direct_database_url: str,
    db: psycopg.Connection[Any],
    registry: CollectorRegistry,
) -> None:
    """The gauges count both tables' partitions and their bytes, say how long the oldest has waited for
    purge and when the newest ends, and flag it running out until purge makes partitions ahead."""
    with passed_table(direct_database_url, "gauge_keys") as table:
        insert(db, table, "running", status="processing", response=None, flow="notes.transfer")
        app = make_app(IDEM_TABLE=table)
        Metrics(app, registry=registry)
        keys, tombstones = {"table": table, "kind": "keys"}, {"table": table, "kind": "tombstones"}

        found = scrape(registry)
        assert value(found, "flask_idem_partitions", **keys) == 1
        assert value(found, "flask_idem_partitions", **tombstones) == 0
        assert (
            value(found, "flask_idem_partitions_bytes", **keys) == _partitions.partitions(db, table)[0].bytes
        )
        assert 7200 <= value(found, "flask_idem_partitions_oldest_passed_seconds", **keys) < 7500
        assert -7500 < value(found, "flask_idem_partitions_newest_end_seconds", table=table) <= -7200
        assert value(found, "flask_idem_partitions_running_out", table=table) == 1

        assert app.test_cli_runner().invoke(args=["idem", "purge"]).exit_code == 0
        found = scrape(registry)
        made = _partitions.partitions(db, table)
        assert value(found, "flask_idem_partitions", **keys) == len(made) >= 4  # see test_cli's stats test
        assert (
            value(found, "flask_idem_partitions", **tombstones)
            == len(_partitions.partitions(db, table + "_tombstones"))
            > 0
        )
        assert value(found, "flask_idem_partitions_bytes", **tombstones) > 0
        # The first partition is kept while its multi-step request runs; the newest ends 8 days ahead
        # (IDEM_KEY_TTL and IDEM_PARTITION_AHEAD), and nothing runs out.
        assert value(found, "flask_idem_partitions_oldest_passed_seconds", **keys) >= 7200
        assert value(found, "flask_idem_partitions_oldest_passed_seconds", **tombstones) == 0
        assert value(found, "flask_idem_partitions_newest_end_seconds", table=table) >= 8 * 86400 - 60
        assert value(found, "flask_idem_partitions_running_out", table=table) == 0


def test_init_app_rules(make_app: Callable[..., Flask], registry: CollectorRegistry) -> None:
    """Metrics need flask-idem initialised first, and refuse a second init_app of one application."""
    app = make_app()
    metrics = Metrics(app, registry=registry)
    with pytest.raises(ConfigurationError, match="already"):
        metrics.init_app(app)
    with pytest.raises(RuntimeError, match="init_app"):
        metrics.init_app(Flask("bare"))


def test_shop_metrics_hold_no_secrets(client: Any, api_key: str, app: Flask) -> None:
    """The shop's /metrics counts by route and outcome only: no API key, idempotency key, org or body."""
    key = uuid.uuid4()
    body = {"amount": 987654321, "currency": "EUR"}
    assert client.post("/orders", json=body, headers=headers(api_key, key)).status_code == 201
    assert client.post("/orders", json=body, headers=headers(api_key, key)).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    text = response.get_data(as_text=True)
    found = samples(text)
    assert outcome(found, "orders.create_order", "response_replayed") >= 1
    for leak in (api_key, str(key), "987654321", "org_id", "Bearer"):
        assert leak not in text, leak


def test_shop_can_turn_metrics_off(database_url: str, db: Any) -> None:
    """METRICS = False leaves /metrics out and connects no receiver."""
    from example_app import create_app

    app = create_app({"TESTING": True, "DATABASE_URL": database_url, "METRICS": False})
    try:
        assert app.test_client().get("/metrics").status_code == 404
        assert "idem_metrics" not in app.extensions
    finally:
        close_pool(app)


def test_metrics_module_imports_nothing_unasked() -> None:
    """Importing flask_idem and serving does not import prometheus_client or OpenTelemetry."""
    code = (
        "import sys, flask_idem, flask_idem.tracing, flask_idem.signals;"
        " assert 'prometheus_client' not in sys.modules;"
        " assert not [m for m in sys.modules if m.startswith('opentelemetry')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- the shop under gunicorn, multiprocess mode ---------------------------------------------------------


@pytest.fixture
def metrics_shop(
    database_url: str, gateway_url: str, tmp_path: Path, db: psycopg.Connection[Any]
) -> Iterator[tuple[str, dict[str, str]]]:
    """The shop under gunicorn (two workers) in multiprocess mode; yields its URL and environment."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {
        "FLASK_DATABASE_URL": database_url,
        "FLASK_GATEWAY_URL": gateway_url,
        "FLASK_GATEWAY_TIMEOUT": "10",
        "FLASK_IDEM_LEASE_TIMEOUT": "5",
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
    }
    args = ("-c", "example_app/gunicorn_conf.py")
    with gunicorn(tmp_path / "gunicorn.log", env=env, workers=2, threads=2, args=args) as (base, _):
        yield base, env


def _get_metrics(base: str) -> Samples:
    response = requests.get(base + "/metrics", timeout=10)
    assert response.status_code == 200
    return samples(response.text)


@pytest.mark.slow
def test_scrapes_count_what_happened(
    metrics_shop: tuple[str, dict[str, str]],
    gateway_url: str,
    api_key: str,
    db: psycopg.Connection[Any],
) -> None:
    """Counts summed over two workers and the recovery process match the scripted requests exactly."""
    base, env = metrics_shop
    session = requests.Session()

    def order(key: uuid.UUID, amount: int = 1250) -> int:
        response = session.post(
            base + "/orders",
            json={"amount": amount, "currency": "EUR"},
            headers=headers(api_key, key),
            timeout=10,
        )
        return response.status_code

    def pay(order_id: int, key: uuid.UUID) -> requests.Response:
        return requests.post(
            base + "/payments",
            json={"order_id": order_id, "source": "tok_visa"},
            headers=headers(api_key, key),
            timeout=20,
        )

    def charges() -> int:
        return len(requests.get(gateway_url + "/charges", timeout=5).json()["charges"])

    def fault(mode: str, delay: float = 0.0) -> None:
        requests.post(
            gateway_url + "/_faults", json={"mode": mode, "count": 1, "delay": delay}, timeout=5
        ).raise_for_status()

    before = _get_metrics(base)

    keys = [uuid.uuid4() for _ in range(6)]
    assert [order(k) for k in keys] == [201] * 6
    assert [order(k) for k in keys] == [200] * 6
    assert order(keys[0], amount=1) == 422
    order_ids = [row[0] for row in db.execute("SELECT id FROM orders ORDER BY id").fetchall()]

    # A duplicate while the first attempt waits on a slow gateway: 409.
    fault("delay", delay=1.5)
    key = uuid.uuid4()
    first: dict[str, requests.Response] = {}
    thread = threading.Thread(target=lambda: first.setdefault("r", pay(order_ids[0], key)))
    thread.start()
    wait_for(lambda: charges() == 1, timeout=10.0)
    assert pay(order_ids[0], key).status_code == 409
    thread.join(20)
    assert first["r"].status_code == 201

    # A charge whose answer is lost: 503, the request stranded until the recovery job finishes it.
    fault("fail_after")
    assert pay(order_ids[1], uuid.uuid4()).status_code == 503
    middle = _get_metrics(base)
    table = {"table": "idempotency_keys"}
    assert value(middle, "flask_idem_keys_processing", **table) == 1
    assert value(middle, "flask_idem_keys_stranded", **table) == 1
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    recovery = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_app", "idem", "recover"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Claimed 1: 1 completed" in recovery.stdout, recovery.stdout + recovery.stderr

    expected = {
        ("orders.create_order", "key_reserved"): 6,
        ("orders.create_order", "response_stored"): 6,
        ("orders.create_order", "response_replayed"): 6,
        ("orders.create_order", "mismatch_rejected"): 1,
        ("payments.create_payment", "key_reserved"): 2,
        ("payments.create_payment", "key_in_flight"): 1,
        ("payments.create_payment", "response_stored"): 2,  # the first payment, and the recovered one
        ("payments.create_payment", "outcome_unknown"): 1,
        ("payments.create_payment", "recovered"): 1,
        ("payments.create_payment", "call_failed"): 0,
        ("payments.create_payment", "given_up"): 0,
    }
    for _ in range(4):  # whichever worker answers, the sums are the same
        after = _get_metrics(base)
        changes = {
            (endpoint, name): outcome(after, endpoint, name) - outcome(before, endpoint, name)
            for endpoint, name in expected
        }
        assert changes == expected
        assert value(after, "flask_idem_keys_processing", **table) == 0
        assert value(after, "flask_idem_keys_stranded", **table) == 0
        assert value(after, "flask_idem_key_table_up", **table) == 1
        steps = "flask_idem_step_duration_seconds_count"
        assert value(after, steps, flow="shop.payments.create", step="charge", kind="call") >= 2
    assert len(os.listdir(env["PROMETHEUS_MULTIPROC_DIR"])) >= 3  # two workers and the recovery process


def test_multiprocess_response_sums_files(
    make_app: Callable[..., Flask], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In multiprocess mode, response() reads the directory's files and adds the key table's gauges."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    app = make_app()
    metrics = Metrics(app, registry=CollectorRegistry())
    found = samples(metrics.response().get_data(as_text=True))
    assert value(found, "flask_idem_key_table_up", table="idempotency_keys") == 1
    assert value(found, "flask_idem_keys_flagged", table="idempotency_keys") == 0
