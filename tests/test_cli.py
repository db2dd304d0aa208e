"""The ``flask idem`` commands."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Flask

from flask_idem import Idempotency

from .helpers import close_pool


def test_init_db_is_idempotent(app: Flask) -> None:
    """`flask idem init-db` can run twice."""
    runner = app.test_cli_runner()
    for _ in range(2):
        result = runner.invoke(args=["idem", "init-db"])
        assert result.exit_code == 0
        assert "idempotency_keys is ready" in result.output


def test_purge_reports_its_count(app: Flask, db: psycopg.Connection[Any]) -> None:
    """`flask idem purge` prints how many keys it removed and how many it turned into tombstones."""
    result = app.test_cli_runner().invoke(args=["idem", "purge", "--batch-size", "10"])
    assert result.exit_code == 0
    assert result.output.strip() == "Purged 0 expired key(s); 0 turned into tombstones."


def test_recover_and_stuck_with_nothing_to_do(app: Flask) -> None:
    """With no stranded requests, recover and stuck say so."""
    runner = app.test_cli_runner()
    assert "Claimed 0" in runner.invoke(args=["idem", "recover"]).output
    assert runner.invoke(args=["idem", "stuck"]).output.strip() == "0 row(s)."


def test_unreachable_database_is_one_clean_message() -> None:
    """A command that cannot reach the database says why in libpq's words, without the password."""
    app = Flask(__name__)
    app.config.update(
        IDEM_DATABASE_URL="postgresql://idem:s3cr3t-pw@127.0.0.1:1/secretdb?connect_timeout=1",
        IDEM_POOL_TIMEOUT=0.5,
    )
    Idempotency(app, scope=lambda: 1)
    try:
        result = app.test_cli_runner().invoke(args=["idem", "init-db"])
    finally:
        close_pool(app)
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot connect to the database: ")
    assert "port 1 failed: Connection refused" in result.output
    assert "s3cr3t" not in result.output
