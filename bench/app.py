"""The shop plus a baseline route: ``POST /bench/orders`` is ``POST /orders`` without the decorator.

The baseline authenticates the same way (the shop's ``authenticate`` hook), validates with the same
``OrderIn`` schema, runs the same ``INSERT`` in one transaction on a pooled connection, and answers the
same 201 body and ``Location``. The only differences are the ones idempotency makes: no key row is
reserved, completed or looked up, and the order's ``idempotency_key`` is a fresh ``uuid4()``. Any
``Idempotency-Key`` header the client sends is ignored.

``POST /bench/floor`` and ``POST /bench/floor-batched`` are the baseline plus two statements that do
nothing: the least any idempotency layer that short-circuits retries must add (their docstrings say why).

Served by ``gunicorn 'bench.app:create_app()'`` from the repository root.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Blueprint, Flask, g, request, url_for

from example_app import create_app as create_shop
from example_app.auth import authenticate
from example_app.extensions import idem
from example_app.schemas import OrderIn, load
from flask_idem._pool import PooledConnection, batched
from flask_idem._state import get_state
from flask_idem._wire import Statement

__all__ = ["create_app"]

bp = Blueprint("bench", __name__, url_prefix="/bench")
bp.before_request(authenticate)

_order_in = OrderIn()


@bp.post("/orders")
def create_order() -> tuple[dict[str, Any], int, dict[str, str]]:
    """The shop's order route, minus ``@idem.idempotent()``."""
    return _create_order(lambda conn: None, lambda conn: None)


@bp.post("/floor")
def floor() -> tuple[dict[str, Any], int, dict[str, str]]:
    """The baseline plus two statements that do nothing: one before the ``INSERT``, one after it.

    Any idempotency layer that answers a retry without running the view must ask the database something
    before the view, and must write the response after it, inside the same transaction. This route pays
    for exactly those two round trips and nothing else, so its throughput bounds what such a layer can
    reach with psycopg on this machine.
    """
    return _create_order(_no_op, _no_op)


@bp.post("/floor-batched")
def floor_batched() -> tuple[dict[str, Any], int, dict[str, str]]:
    """Like ``/bench/floor``, with the two statements sent in batches with ``BEGIN`` and ``COMMIT``.

    A batched transaction (:class:`flask_idem._pool.Batched`, as a decorated route's) sends the statement
    before the ``INSERT`` together with ``BEGIN``, and the one after it together with ``COMMIT``: the
    round trips of the baseline, two statements more.
    """
    data = load(_order_in, request.get_json())
    with get_state().source.transaction(batched=True) as conn:
        transaction = batched(conn)
        assert transaction is not None
        transaction.begin(_NO_OP, {})
        row = _insert(conn, data)
        transaction.defer(_NO_OP, {})
    return _answer(row)


_NO_OP = Statement.from_query(b"SELECT 1")


def _create_order(
    before: Callable[[PooledConnection], None], after: Callable[[PooledConnection], None]
) -> tuple[dict[str, Any], int, dict[str, str]]:
    data = load(_order_in, request.get_json())
    with idem.pool.connection() as conn, conn.transaction():
        before(conn)
        row = _insert(conn, data)
        after(conn)
    return _answer(row)


def _no_op(conn: PooledConnection) -> None:
    conn.execute("SELECT 1")


def _insert(conn: psycopg.Connection[tuple[Any, ...]], data: dict[str, Any]) -> tuple[Any, ...]:
    row = conn.execute(
        "INSERT INTO orders (org_id, idempotency_key, amount, currency)"
        " VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING"
        " RETURNING id, amount, currency, created_at",
        (g.org_id, uuid.uuid4(), data["amount"], data["currency"]),
    ).fetchone()
    assert row is not None  # a fresh uuid4 never conflicts
    return row


def _answer(row: tuple[Any, ...]) -> tuple[dict[str, Any], int, dict[str, str]]:
    order_id, amount, currency, created_at = row
    order = {"id": order_id, "amount": amount, "currency": currency, "created_at": created_at.isoformat()}
    return order, 201, {"Location": url_for("orders.get_order", order_id=order_id)}


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """``example_app.create_app(test_config)`` with the baseline blueprint registered."""
    app = create_shop(test_config)
    app.register_blueprint(bp)
    return app
