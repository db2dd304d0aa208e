"""With FLASK_IDEM_TEST_PGBOUNCER=1: the applications' traffic really goes through PgBouncer."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .support import pgbouncer
from .support.helpers import count, headers

pytestmark = pytest.mark.skipif(not pgbouncer.ENABLED, reason="runs only with FLASK_IDEM_TEST_PGBOUNCER=1")


def transactions_through_pgbouncer(app_server_url: str, dbname: str) -> int:
    with psycopg.connect(make_conninfo(app_server_url, dbname="pgbouncer"), autocommit=True) as admin:
        cursor = admin.execute("SHOW STATS")
        columns = [c.name for c in cursor.description or ()]
        for row in cursor.fetchall():
            stats = dict(zip(columns, row, strict=True))
            if stats["database"] == dbname:
                return int(stats["total_xact_count"])
    return 0


def test_shop_traffic_goes_through_pgbouncer(
    app_server_url: str, database_url: str, client: Any, api_key: str, app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Orders placed through the shop are transactions PgBouncer counted, and replays work there too."""
    dbname = conninfo_to_dict(database_url)["dbname"]
    before = transactions_through_pgbouncer(app_server_url, dbname)
    key = uuid.uuid4()
    for _ in range(10):  # more runs than psycopg's default prepare threshold
        response = client.post(
            "/orders", json={"amount": 5, "currency": "EUR"}, headers=headers(api_key, key)
        )
        assert response.status_code in (200, 201)
    assert count(db, "orders") == 1
    assert transactions_through_pgbouncer(app_server_url, dbname) >= before + 10
