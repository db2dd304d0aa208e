"""Checked by mypy, never run: the test kit's API reads well to a type checker, as the docs use it."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from flask_idem.testing import (
    Effect,
    NotRetrySafe,
    Rows,
    check_in_flight,
    check_mismatch,
    check_replay,
    check_scope,
    crash_between_steps,
    hammer,
    unprotected_routes,
)


def checks(app: Flask, client: FlaskClient, db: psycopg.Connection[Any]) -> None:
    orders: Effect = Rows(db, "orders", where="org_id = %s", params=[1])
    first, again = check_replay(client, "POST", "/orders", json={"amount": 1}, effect=orders)
    changed: TestResponse = check_mismatch(app, "POST", "/orders", json={}, changed={"a": 1}, effect=orders)
    held, duplicate = check_in_flight(app, "POST", "/orders", effect=orders, headers={"X-Org": "1"})
    ours, theirs = check_scope(app, "POST", "/o", effect=orders, headers={}, other_headers={"X-Org": "2"})
    answers: list[TestResponse] = hammer(app, "POST", "/orders", effect=lambda: 0, threads=4)
    points: list[str] = crash_between_steps(
        app, "POST", "/payments", json=lambda: {"order_id": 1}, outside=orders, effect=None
    )
    routes: list[str] = unprotected_routes(app)
    error: AssertionError = NotRetrySafe("message")
    del first, again, changed, held, duplicate, ours, theirs, answers, points, routes, error
