"""``flask --app example_app shop ...``: set the shop up and run it."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import threading

import click
from flask import current_app
from flask.cli import AppGroup
from werkzeug.serving import run_simple

from flask_idem.recovery import run_forever
from flask_idem.relay import relay_forever

from . import gateway_events
from .auth import hash_api_key, new_api_key
from .db import init_db
from .extensions import idem

shop_cli = AppGroup("shop", help="The reference shop of flask-idem.")


@shop_cli.command("init-db")
def init_db_command() -> None:
    """Create the shop's tables and the idempotency key table (safe to run again)."""
    init_db()
    click.echo("Shop tables and the idempotency key table are ready.")


def create_org(name: str) -> tuple[int, str]:
    """Create an organisation; return its id and its API key (shown once, stored only as a hash)."""
    api_key = new_api_key()
    with idem.pool.connection() as conn:
        row = conn.execute(
            "INSERT INTO orgs (name, api_key_sha) VALUES (%s, %s) RETURNING id",
            (name, hash_api_key(api_key)),
        ).fetchone()
    assert row is not None
    return row[0], api_key


@shop_cli.command("create-org")
@click.argument("name")
def create_org_command(name: str) -> None:
    """Create an organisation NAME and print its API key, alone on the last line."""
    if not 1 <= len(name) <= 200:
        raise click.BadParameter("must be 1 to 200 characters", param_hint="NAME")
    org_id, api_key = create_org(name)
    click.echo(f"Created organisation {org_id} ({name}). Its API key, shown only now:")
    click.echo(api_key)


@shop_cli.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=5000, show_default=True, type=int)
@click.option("--gateway-port", default=5001, show_default=True, type=int)
def serve_command(host: str, port: int, gateway_port: int) -> None:
    """Set up the database, start the gateway simulator, a recovery worker, the outbox relay and a
    Celery worker, and serve the shop.

    The gateway runs as its own process on --gateway-port, with fault injection enabled, in the same
    database, and posts its webhook events to the shop's POST /webhooks/gateway; the recovery worker
    finishes stranded payments every few seconds; the relay publishes
    fulfilment tasks to RabbitMQ (CELERY["broker_url"]), and the Celery worker runs them, mailing
    receipts to the Maildir MAIL_SINK.
    """
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    init_db()
    _, api_key = create_org("demo")
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    app.config["GATEWAY_URL"] = gateway_url
    app.config["SHOP_DEMO_API_KEY"] = api_key  # offered on the sign-in page
    if not app.config.get("GATEWAY_WEBHOOK_SECRET"):  # a secret for this run, shared with the gateway
        app.config["GATEWAY_WEBHOOK_SECRET"] = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        gateway_events.init_app(app)
    env = {
        **os.environ,
        "FLASK_DATABASE_URL": app.config["IDEM_DATABASE_URL"],
        "FLASK_FAULTS_ENABLED": "true",
        "FLASK_GATEWAY_WEBHOOK_URL": f"http://127.0.0.1:{port}/webhooks/gateway",
        "FLASK_GATEWAY_WEBHOOK_SECRET": app.config["GATEWAY_WEBHOOK_SECRET"],
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "example_app.gateway", "run", "--port", str(gateway_port)],
        env=env,
    )
    stop = threading.Event()
    worker = threading.Thread(
        target=run_forever, args=(app,), kwargs={"interval": 5.0, "stop": stop}, daemon=True
    )
    worker.start()
    relay = threading.Thread(
        target=relay_forever, args=(app,), kwargs={"interval": 1.0, "stop": stop}, daemon=True
    )
    relay.start()
    celery_worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "example_app.worker", "worker", "--concurrency", "2"],
        env=env | {"FLASK_MAIL_SINK": app.config["MAIL_SINK"]},
    )
    base = f"http://{host}:{port}"
    click.echo(
        f"Shop: open {base} in a browser for the checkout\n"
        f"Gateway simulator: {gateway_url} (faults: POST {gateway_url}/_faults)\n"
        f"Receipts of paid orders: the Maildir {app.config['MAIL_SINK']} (a Celery worker mails them)\n"
        f"Demo API key: {api_key}\n"
        f"Place and pay an order:\n"
        f"  flask --app example_app shop buy --amount 1250 --currency EUR --api-key {api_key} --url {base}\n"
        f"or by hand:\n  curl -i -X POST {base}/orders -H 'Authorization: Bearer {api_key}'"
        " -H 'Content-Type: application/json'"
        f" -H \"Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')\""
        ' -d \'{"amount": 1250, "currency": "EUR"}\''
    )
    try:
        run_simple(host, port, app, threaded=True)
    finally:
        stop.set()
        for process in (gateway, celery_worker):
            process.terminate()
            process.wait(10)


@shop_cli.command("buy")
@click.option("--amount", required=True, type=click.IntRange(min=1), help="Amount in minor units (cents).")
@click.option("--currency", required=True, help="ISO 4217 code, e.g. EUR.")
@click.option("--api-key", required=True, help="The organisation's API key.")
@click.option("--url", default="http://127.0.0.1:5000", show_default=True, help="The shop's base URL.")
@click.option("--source", default="tok_visa", show_default=True, help="Payment token.")
@click.option(
    "--attempts", default=10, show_default=True, type=click.IntRange(min=1), help="Most attempts per step."
)
@click.option(
    "--deadline",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds allowed per step.",
)
def buy_command(
    amount: int, currency: str, api_key: str, url: str, source: str, attempts: int, deadline: float
) -> None:
    """Place an order and pay it through the retry helper, printing every attempt.

    Each operation keeps one Idempotency-Key across its attempts, so retries after timeouts, dropped
    connections or 503s can never make a second order or a second charge. Exits non-zero when either
    operation fails for good.
    """
    from flask_idem.client import AttemptInfo, CallFailed, IdempotentClient, RequestsTransport, RetryPolicy

    def report(info: AttemptInfo) -> None:
        outcome = str(info.status) if info.error is None else type(info.error).__name__
        wait = "-" if info.wait is None else f"{info.wait:.2f}s"
        click.echo(f"  attempt {info.number}: key={info.key} -> {outcome}, wait {wait}")

    policy = RetryPolicy(attempts=attempts, deadline=deadline, base=0.5, cap=5.0, attempt_timeout=15.0)
    client = IdempotentClient(RequestsTransport(), policy=policy, on_attempt=report)
    auth = {"Authorization": f"Bearer {api_key}"}
    base = url.rstrip("/")
    try:
        click.echo(f"POST {base}/orders")
        order = client.post(
            base + "/orders", json={"amount": amount, "currency": currency}, headers=auth
        ).json()
        click.echo(f"order {order['id']}: {order['amount']} {order['currency']}")
        click.echo(f"POST {base}/payments")
        payment = client.post(
            base + "/payments", json={"order_id": order["id"], "source": source}, headers=auth
        ).json()
    except CallFailed as e:
        detail = e.response.text if e.response is not None and hasattr(e.response, "text") else repr(e.error)
        click.echo(f"failed after {e.attempts} attempt(s) with key {e.key}: {e}\n{detail}", err=True)
        raise SystemExit(1) from None
    click.echo(f"payment {payment['id']}: {payment['status']}, gateway charge {payment['gateway_charge_id']}")
