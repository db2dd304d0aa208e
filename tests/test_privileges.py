"""Least privilege: the shop, the recovery job, the relay and a Celery worker under a role that may only
read and write rows.

The role gets exactly the ``GRANT`` statements of the upgrades page: ``flask idem migrate --grant`` on
flask-idem's tables, and ``SELECT, INSERT, UPDATE, DELETE`` on the shop's. Anything the running
application or the recovery job sends that needs more (DDL, a table created on the fly, a function
made at start-up) fails these tests. The role connects to PostgreSQL directly: the suite's PgBouncer
logs every client in as the server's superuser.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from functools import reduce
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from example_app import create_app
from example_app.cli import create_org
from flask_idem import _delivery, _grants, _layout
from flask_idem.jobs import Defer

from .support import jobs_app, webhook_app
from .support.celery_workers import BROKER_URL, broker_marks, delete_queue, new_queue, worker
from .support.helpers import app_factory, close_pool, count, headers, wait_for
from .support.servers import ROOT
from .support.shop_actions import charges, pay, payment_statuses, place_order, stranded_payment

pytestmark = pytest.mark.slow

#: What the shop's role needs on the shop's own tables (the upgrades page says the same).
SHOP_GRANT = (
    "GRANT SELECT, INSERT, UPDATE, DELETE ON orgs, orders, payments, receipt_links, fulfilments TO {}"
)


@pytest.fixture(scope="module")
def app_role(direct_database_url: str) -> Iterator[str]:
    """A login role with DML on the shop's and flask-idem's tables and nothing else; its conninfo."""
    role = "idem_app_" + conninfo_to_dict(direct_database_url)["dbname"].removeprefix("flask_idem_test_")
    ident = sql.Identifier(role)
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(ident))
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        conn.execute(sql.SQL(SHOP_GRANT).format(ident))
    yield role
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.fixture
def role_url(app_role: str, direct_database_url: str, database_url: str, db: psycopg.Connection[Any]) -> str:
    """This worker's database as the application's role reaches it, after `migrate --grant` (as owner)."""
    grant(app_role, direct_database_url)
    return make_conninfo(direct_database_url, user=app_role)


def grant(role: str, owner_url: str) -> None:
    """Run `flask idem migrate --grant role` as the tables' owner."""
    owner = create_app({"TESTING": True, "DATABASE_URL": owner_url})
    try:
        result = owner.test_cli_runner().invoke(args=["idem", "migrate", "--grant", role])
    finally:
        close_pool(owner)
    assert result.exit_code == 0, result.output


@pytest.fixture
def role_shop(role_url: str, shop_config: dict[str, Any]) -> Iterator[Flask]:
    """The shop, connected as the application's role, paying through the test gateway."""
    with app_factory(lambda: create_app({**shop_config, "DATABASE_URL": role_url})) as make:
        yield make()


def test_the_upgrades_page_gives_these_grants() -> None:
    """The upgrades page's GRANT statements are the ones the role gets here: the shop's, and each
    revision's (what `migrate --grant` runs)."""
    page = (ROOT / "docs" / "upgrades.rst").read_text()
    assert SHOP_GRANT.format("shop_app") + ";" in page
    names = {**_layout.names("idempotency_keys"), "role": sql.Identifier("shop_app")}
    for revision in _layout.revisions():
        if revision.grants:
            assert sql.SQL(revision.grants).format(**names).as_string(None).replace('"', "") in page


def test_the_role_cannot_change_the_schema(
    role_url: str, role_shop: Flask, shop_config: dict[str, Any]
) -> None:
    """The control: the role may not create tables, so the other tests would catch DDL. `init-db` on a
    table in the latest layout changes nothing, and so needs no more than the role has."""
    assert role_shop.test_cli_runner().invoke(args=["idem", "init-db"]).exit_code == 0
    with app_factory(
        lambda: create_app({**shop_config, "DATABASE_URL": role_url, "IDEM_TABLE": "new_keys"})
    ) as make:
        result = make().test_cli_runner().invoke(args=["idem", "init-db"])
    assert result.exit_code == 1
    assert "InsufficientPrivilege" in result.output
    with psycopg.connect(role_url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("CREATE TABLE sneaky (id int)")


def test_shop_serves_under_the_role(role_shop: Flask, gateway_url: str, db: psycopg.Connection[Any]) -> None:
    """Orders and payments, replays, 422 and 409-free retries: all with SELECT, INSERT, UPDATE, DELETE."""
    client = role_shop.test_client()
    with role_shop.app_context():
        _, api_key = create_org("least")
    key = uuid.uuid4()
    order = {"amount": 700, "currency": "EUR"}
    first = client.post("/orders", json=order, headers=headers(api_key, key))
    again = client.post("/orders", json=order, headers=headers(api_key, key))
    changed = client.post("/orders", json={**order, "amount": 701}, headers=headers(api_key, key))
    assert (first.status_code, again.status_code, changed.status_code) == (201, 200, 422)
    paid = pay(client, api_key, first.json["id"], uuid.uuid4())
    assert paid.status_code == 201, paid.json
    assert payment_statuses(db) == ["succeeded"]
    assert len(charges(gateway_url)) == 1


def test_recovery_and_maintenance_under_the_role(
    role_shop: Flask, gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """`flask idem recover`, `stuck` and `stats` run under the role: a stranded payment is finished
    through the gateway. `purge` changes partitions of the key table: under the role it exits
    1 saying to run it as the tables' owner."""
    client = role_shop.test_client()
    with role_shop.app_context():
        _, api_key = create_org("recovering")
    order_id, key = stranded_payment(client, api_key, gateway_url, "fail_after")
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    runner = role_shop.test_cli_runner()
    recovered = runner.invoke(args=["idem", "recover"])
    assert recovered.exit_code == 0, recovered.output
    assert "Claimed 1: 1 completed" in recovered.output
    assert payment_statuses(db) == ["succeeded"]
    assert pay(client, api_key, order_id, key).status_code == 200
    for command in (["idem", "stuck"], ["idem", "stats"]):
        result = runner.invoke(args=command)
        assert result.exit_code == 0, (command, result.output)
    # The newest partition dropped by the owner: purge must make it again, which only the owner may.
    newest = db.execute(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'idempotency_keys'::regclass AND c.relname <> 'idempotency_keys_p0'"
        " ORDER BY c.relname DESC LIMIT 1"
    ).fetchone()
    if newest is not None:
        db.execute(f'ALTER TABLE idempotency_keys DETACH PARTITION "{newest[0]}"')
        db.execute(f'DROP TABLE "{newest[0]}"')
    purged = runner.invoke(args=["idem", "purge"])
    assert purged.exit_code == 1
    assert "only the tables' owner may do: run it as the role that runs 'flask idem migrate'" in purged.output


def test_orders_are_placed_by_the_role(role_shop: Flask, db: psycopg.Connection[Any]) -> None:
    """The shop's identity columns need no privilege on their sequences (a place_order smoke test)."""
    client = role_shop.test_client()
    with role_shop.app_context():
        _, api_key = create_org("identity")
    assert place_order(client, api_key) > 0


def test_receipts_relay_and_fulfilment_under_the_role(
    role_url: str, shop_config: dict[str, Any], gateway_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """A receipt link is minted and shown, and a paid order's fulfilment is published by `flask idem relay`
    and carried out by a Celery worker (its row, the receipt mailed), all under the role."""
    queue, sink = new_queue("flask-idem-privileges"), tmp_path / "mail"
    celery = {"broker_url": BROKER_URL, "task_default_queue": queue, "task_ignore_result": True}
    config = {**shop_config, "DATABASE_URL": role_url, "CELERY": celery, "MAIL_SINK": str(sink)}
    try:
        with app_factory(lambda: create_app(config)) as make:
            shop = make()
            client = shop.test_client()
            with shop.app_context():
                _, api_key = create_org("fulfilled")
            order_id = place_order(client, api_key)
            link = client.post(f"/orders/{order_id}/receipt-links", headers=headers(api_key, uuid.uuid4()))
            assert link.status_code == 201, link.json
            assert client.get(link.json["url"]).json["id"] == order_id
            assert pay(client, api_key, order_id, uuid.uuid4()).status_code == 201
            relayed = shop.test_cli_runner().invoke(args=["idem", "relay"])
            assert relayed.exit_code == 0, relayed.output
            assert relayed.output.startswith("Published 1, failed 0")
        env = {
            "FLASK_DATABASE_URL": role_url,
            "FLASK_CELERY__broker_url": BROKER_URL,
            "FLASK_CELERY__task_default_queue": queue,
            "FLASK_MAIL_SINK": str(sink),
        }
        with worker("example_app.worker", env, tmp_path / "worker.log", concurrency=1):
            wait_for(
                lambda: db.execute("SELECT status FROM fulfilments").fetchall() == [("sent",)], timeout=90
            )
    finally:
        delete_queue(queue)


@pytest.fixture
def role_hooks(role_url: str, app_role: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The webhook test application (a webhook route and an idempotent one) under the role."""
    db.execute(webhook_app.SCHEMA)
    role = sql.Identifier(app_role)
    db.execute(sql.SQL("GRANT SELECT, INSERT ON hook_effects TO {}").format(role))
    db.execute(sql.SQL("GRANT USAGE ON SEQUENCE hook_effects_id_seq TO {}").format(role))
    with app_factory(lambda: webhook_app.build_webhook_app(role_url)[0]) as make:
        yield make()


def test_a_lost_grant_is_a_retryable_503_naming_the_fix(
    role_hooks: Flask,
    app_role: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With SELECT on the tombstones revoked from the role, a request and a webhook delivery are each
    answered 503 problem+json with Retry-After and retryable true, not a 500; nothing is written; one
    ERROR line per route, not per request, names the table, the privileges and `migrate --grant`;
    once that has run, the same key and the same delivery go through."""
    db.execute(
        sql.SQL("REVOKE SELECT ON idempotency_keys_tombstones FROM {}").format(sql.Identifier(app_role))
    )
    client, key = role_hooks.test_client(), str(uuid.uuid4())
    body = webhook_app.event("evt_lost_grant")
    with caplog.at_level(logging.DEBUG, logger="flask_idem"):
        answers = [
            client.post("/notes", headers={"X-Org": "1", "Idempotency-Key": key}),
            client.post("/notes", headers={"X-Org": "1", "Idempotency-Key": key}),
            client.post("/hooks/plain", data=body, headers={**webhook_app.sign(body), "X-Org": "1"}),
        ]
    for answer in answers:
        assert (answer.status_code, answer.mimetype) == (503, "application/problem+json"), answer.json
        assert answer.json["type"] == "urn:flask-idem:problem:store-unavailable"
        assert answer.json["retryable"] is True and int(answer.headers["Retry-After"]) >= 1
    assert count(db, "idempotency_keys") == 0 and count(db, "hook_effects") == 0
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [line.split(":")[0] for line in told] == [f"Missing privilege in {e}" for e in ("note", "plain")]
    assert all(r.levelno == logging.ERROR for r in caplog.records if r.levelno >= logging.WARNING)
    line = told[0]
    assert "InsufficientPrivilege (SQLSTATE 42501)" in line
    assert (
        f"the role {app_role} lacks SELECT, INSERT, UPDATE, DELETE on table idempotency_keys_tombstones"
        in line
    )
    assert f"run 'flask idem migrate --grant {app_role}' as the tables' owner" in line
    assert "answered 503 until then" in line
    grant(app_role, direct_database_url)
    assert client.post("/notes", headers={"X-Org": "1", "Idempotency-Key": key}).status_code == 201
    delivered = client.post("/hooks/plain", data=body, headers={**webhook_app.sign(body), "X-Org": "1"})
    assert delivered.status_code == 200, delivered.json
    assert count(db, "hook_effects") == 1


def test_a_lost_grant_on_the_applications_table_names_its_grant(
    role_hooks: Flask, app_role: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A privilege lost on the handler's own table is a 503 too, and the log gives the GRANT statement
    for it (`migrate --grant` covers flask-idem's tables only); the key stays free."""
    db.execute(sql.SQL("REVOKE INSERT ON hook_effects FROM {}").format(sql.Identifier(app_role)))
    body = webhook_app.event("evt_own_table")
    with caplog.at_level(logging.WARNING, logger="flask_idem"):
        answer = role_hooks.test_client().post(
            "/hooks/plain", data=body, headers={**webhook_app.sign(body), "X-Org": "1"}
        )
    assert (answer.status_code, answer.json["retryable"]) == (503, True)
    assert count(db, "idempotency_keys") == 0 and count(db, "hook_effects") == 0
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "on table hook_effects (permission denied for table hook_effects)" in line
    statement = f"GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE hook_effects TO {app_role}"
    assert f"run '{statement}' as its owner" in line


def test_a_grant_lost_on_a_statement_sent_with_commit_is_named_too(
    role_hooks: Flask, app_role: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """INSERT on the key table revoked: the reservation, sent with COMMIT in one round trip, fails at
    COMMIT; the request is still a retryable 503 and the log still names the table and the command."""
    db.execute(sql.SQL("REVOKE INSERT ON idempotency_keys FROM {}").format(sql.Identifier(app_role)))
    with caplog.at_level(logging.WARNING, logger="flask_idem"):
        answer = role_hooks.test_client().post(
            "/notes", headers={"X-Org": "1", "Idempotency-Key": str(uuid.uuid4())}
        )
    assert (answer.status_code, answer.json["retryable"], answer.headers["Retry-After"]) == (503, True, "1")
    assert count(db, "idempotency_keys") == 0
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "lacks SELECT, INSERT, UPDATE, DELETE on table idempotency_keys (permission denied" in line
    assert f"'flask idem migrate --grant {app_role}'" in line


def test_each_kind_of_denial_names_its_grant(
    role_url: str, app_role: str, db: psycopg.Connection[Any]
) -> None:
    """PostgreSQL's own refusals, as the role meets them: a function without EXECUTE gets its GRANT
    statement; a schema without USAGE gets `migrate --grant` when it is the key table's (which that
    command covers), else its GRANT statement; any other error is no missing grant."""
    db.execute("CREATE FUNCTION grants_probe() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    db.execute("REVOKE EXECUTE ON FUNCTION grants_probe() FROM PUBLIC")
    db.execute("CREATE SCHEMA grants_probe_s")
    db.execute("CREATE TABLE grants_probe_s.t (id int)")
    try:
        denied = {}
        probes = [("function", "SELECT grants_probe()"), ("schema", "TABLE grants_probe_s.t")]
        with psycopg.connect(role_url, autocommit=True) as conn:
            for kind, statement in probes:
                with pytest.raises(psycopg.errors.InsufficientPrivilege) as raised:
                    conn.execute(statement)
                denied[kind] = raised.value
            with pytest.raises(psycopg.errors.UndefinedTable) as missing:
                conn.execute("TABLE no_such_table")
    finally:
        db.execute("DROP FUNCTION grants_probe()")
        db.execute("DROP SCHEMA grants_probe_s CASCADE")
    r = app_role
    assert _grants.missing_grant(denied["function"], r, key_table="idempotency_keys") == (
        f"the role {r} lacks EXECUTE on function grants_probe (permission denied for function"
        f" grants_probe): run 'GRANT EXECUTE ON FUNCTION grants_probe TO {r}' as its owner"
    )
    assert _grants.missing_grant(denied["schema"], r, key_table="grants_probe_s.keys") == (
        f"the role {r} lacks USAGE on schema grants_probe_s (permission denied for schema"
        f" grants_probe_s): run 'flask idem migrate --grant {r}' as the tables' owner"
    )
    assert f"run 'GRANT USAGE ON SCHEMA grants_probe_s TO {r}' as its owner" in str(
        _grants.missing_grant(denied["schema"], r, key_table="idempotency_keys")
    )
    assert _grants.missing_grant(missing.value, r) is None


def test_a_lost_grant_defers_a_job_naming_the_fix(
    role_url: str,
    app_role: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """With INSERT on the key table revoked, a job's delivery is deferred as a failed attempt (delivered
    again later), writes nothing, and the log names the table and `flask idem migrate --grant`."""
    db.execute(jobs_app.SCHEMA)
    role = sql.Identifier(app_role)
    db.execute(sql.SQL("GRANT SELECT, INSERT ON job_effects TO {}").format(role))
    db.execute(sql.SQL("REVOKE INSERT ON idempotency_keys FROM {}").format(role))
    app = jobs_app.build_jobs_app(
        role_url, broker_url=BROKER_URL, queue="unused", trace=str(tmp_path / "trace"), maildir=str(tmp_path)
    )
    delivery = _delivery.Delivery(1, uuid.uuid4(), (5,), {}, enqueued_at=time.time())
    try:
        with caplog.at_level(logging.WARNING, logger="flask_idem"):
            outcome = _delivery.run_delivery(
                app, jobs_app.jobs.tasks["jobs.add"], delivery, rng=random.Random(0)
            )
    finally:
        close_pool(app)
    assert isinstance(outcome, Defer) and outcome.failed and outcome.envelope.failures == 1
    assert count(db, "idempotency_keys") == 0 and count(db, "job_effects") == 0
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("Missing privilege in task jobs.add: InsufficientPrivilege (SQLSTATE 42501)")
    assert f"the role {app_role} lacks SELECT, INSERT, UPDATE, DELETE on table idempotency_keys " in line
    assert f"'flask idem migrate --grant {app_role}'" in line and "delivered again later" in line


test_receipts_relay_and_fulfilment_under_the_role = reduce(
    lambda test, mark: mark(test), broker_marks(), test_receipts_relay_and_fulfilment_under_the_role
)
