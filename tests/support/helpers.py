"""Helpers the tests import: counting rows, request headers, waiting for a condition, the prepare threshold.

Fixtures live in ``conftest.py``; plain functions that tests call live here, so that no test imports a
conftest module.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from flask import Flask
from psycopg import sql

from flask_idem._state import get_state

from . import pgbouncer
from .servers import ROOT, free_port, gunicorn, wait_for, wait_for_http

__all__ = [
    "PREPARE_THRESHOLD",
    "ROOT",
    "app_factory",
    "age",
    "close_pool",
    "count",
    "free_port",
    "gunicorn",
    "headers",
    "wait_for",
    "wait_for_http",
]

#: psycopg's prepare_threshold for connections a test makes through the applications' URL.
PREPARE_THRESHOLD = None if pgbouncer.ENABLED else 5


def count(conn: psycopg.Connection[Any], table: str) -> int:
    """Rows in ``table``."""
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    assert row is not None
    return int(row[0])


def headers(api_key: str, key: uuid.UUID | str | None = None, **extra: str) -> dict[str, str]:
    """Request headers: the bearer API key and, when given, an Idempotency-Key."""
    result = {"Authorization": f"Bearer {api_key}", **extra}
    if key is not None:
        result["Idempotency-Key"] = str(key)
    return result


def close_pool(app: Flask) -> None:
    """Close the connection pool flask-idem opened for ``app`` in this process."""
    get_state(app).source.close()


@contextmanager
def app_factory(build: Callable[..., Flask]) -> Iterator[Callable[..., Flask]]:
    """``build`` (keyword configuration in, application out), remembering what it built: on exit, the
    flask-idem pool of every application it made is closed."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = build(**config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        close_pool(app)


def age(db: psycopg.Connection[Any], interval: str, table: str = "idempotency_keys") -> None:
    """Move every row of key table ``table`` ``interval`` into the past, as if that much time had gone by.

    The rows move to the first partition (``<table>_p0``, which takes every moment before its bound)
    while it is there; time passes for :func:`flask_idem._partitions.maintain` by its fake clock.
    """
    # In epoch seconds: Citus refuses a STABLE function (timestamptz - interval) on a column in an UPDATE.
    db.execute(
        sql.SQL(
            "UPDATE {} SET expires_at = to_timestamp("
            " extract(epoch FROM expires_at - 'epoch'::timestamptz) - extract(epoch FROM %s::interval))"
        ).format(sql.Identifier(*table.split("."))),
        (interval,),
    )
