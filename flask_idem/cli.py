"""The ``flask idem`` command group, added to the application by ``init_app``."""

from __future__ import annotations

import click
from flask import current_app
from flask.cli import AppGroup

from .store import Store

__all__ = ["idem_cli"]

idem_cli = AppGroup("idem", help="Manage the idempotency key table of flask-idem.")


def _store() -> Store:
    store: Store = current_app.extensions["idem"].store
    return store


@idem_cli.command("init-db")
def init_db() -> None:
    """Create the key table and its index if they do not exist (safe to run again)."""
    _store().init_schema()
    click.echo(f"Key table {current_app.extensions['idem'].settings.table} is ready.")


@idem_cli.command("purge")
@click.option(
    "--batch-size",
    default=1000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows deleted per transaction; smaller batches hold locks for less time.",
)
def purge(batch_size: int) -> None:
    """Delete finished keys whose retention period (IDEM_KEY_TTL) has passed.

    Rows still processing are never deleted. Prints how many rows were removed.
    """
    removed = _store().purge(batch_size=batch_size)
    click.echo(f"Purged {removed} expired key(s).")
