"""The shop's own commands: init-db and create-org."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Flask

from ..support.helpers import headers


def test_init_db_is_idempotent(app: Flask) -> None:
    """`shop init-db` can run twice."""
    runner = app.test_cli_runner()
    for _ in range(2):
        result = runner.invoke(args=["shop", "init-db"])
        assert result.exit_code == 0, result.output


def test_create_org_prints_a_working_key_last(app: Flask, db: psycopg.Connection[Any]) -> None:
    """`shop create-org NAME` prints the API key alone on its last line, and the key authenticates."""
    result = app.test_cli_runner().invoke(args=["shop", "create-org", "Acme Ltd"])
    assert result.exit_code == 0, result.output
    api_key = result.output.strip().splitlines()[-1]
    assert " " not in api_key and len(api_key) >= 40
    assert db.execute("SELECT name FROM orgs").fetchall() == [("Acme Ltd",)]
    assert app.test_client().get("/orders", headers=headers(api_key)).status_code == 200
    row = db.execute("SELECT api_key_sha FROM orgs").fetchone()
    assert row is not None and api_key.encode() not in bytes(row[0])  # only a hash is kept


def test_create_org_refuses_a_bad_name(app: Flask, db: psycopg.Connection[Any]) -> None:
    """An over-long organisation name is a usage error, not a traceback."""
    result = app.test_cli_runner().invoke(args=["shop", "create-org", "x" * 201])
    assert result.exit_code == 2
    assert "1 to 200 characters" in result.output
