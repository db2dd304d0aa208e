"""``flask --app example_app shop ...``: set the shop up and run it."""

from __future__ import annotations

import click
from flask import current_app
from flask.cli import AppGroup

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
def serve_command(host: str, port: int) -> None:
    """Set up the database, create a demo organisation and serve the shop."""
    init_db()
    _, api_key = create_org("demo")
    base = f"http://{host}:{port}"
    click.echo(
        f"Demo API key: {api_key}\n"
        f"Try:\n  curl -i -X POST {base}/orders -H 'Authorization: Bearer {api_key}'"
        " -H 'Content-Type: application/json'"
        f" -H \"Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')\""
        ' -d \'{"amount": 1250, "currency": "EUR"}\''
    )
    current_app.run(host=host, port=port, threaded=True, use_reloader=False)
