"""The shop plus baseline routes: ``POST /bench/orders`` is ``POST /orders`` without the decorator.

``POST /bench/orders`` has the decorators of the shop's route (:func:`example_app.orders.create_order`)
but ``@idem.idempotent()`` (:func:`order_route`): the same webargs parsing of
:class:`~example_app.schemas.OrderIn`, the same marshmallow dump of :class:`~example_app.schemas.Order`,
the same problems, authentication and ``INSERT`` (:func:`example_app.orders.place_order`, with dict
rows), in one transaction on a pooled connection. The only differences are the ones idempotency makes: no
key row is reserved, completed or looked up, and the order's ``idempotency_key`` is a fresh ``uuid4()``.
Any ``Idempotency-Key`` header the client sends is ignored.

``POST /bench/floor`` and ``POST /bench/floor-batched`` are that baseline plus two statements that do
nothing: the least any idempotency layer that short-circuits retries must add (their docstrings say why).
``POST /bench/orders-plain`` is the hand-written baseline of earlier sessions (a plain Flask route that
loads the body by hand and answers a dict built from a tuple row), kept as a row of its own: how much the
shop's framework (flask-smorest, webargs, marshmallow) costs by itself.

Served by ``gunicorn 'bench.app:create_app()'`` from the repository root.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Blueprint as FlaskBlueprint
from flask import Flask, g, request, url_for

from example_app import create_app as create_shop
from example_app.api import LOCATION, Blueprint
from example_app.auth import authenticate
from example_app.extensions import idem
from example_app.orders import place_order
from example_app.schemas import Order, OrderIn, load
from flask_idem._pool import batched
from flask_idem._state import get_state
from flask_idem._wire import Statement

__all__ = ["create_app"]

bp = Blueprint("bench", __name__, url_prefix="/bench")
bp.before_request(authenticate)
plain = FlaskBlueprint("bench_plain", __name__, url_prefix="/bench")
plain.before_request(authenticate)

_NO_OP = Statement.from_query(b"SELECT 1")


def _no_op(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SELECT 1")


Answer = tuple[dict[str, Any], int, dict[str, str]]


def order_route(rule: str, body: Callable[[dict[str, Any]], Answer]) -> None:
    """Register ``body`` at ``POST /bench<rule>`` with the decorators of the shop's ``POST /orders``
    (:func:`example_app.orders.create_order`), in the same order, less ``@idem.idempotent()``.

    Keep the two in step: the baseline must differ from the shop's route by that decorator only.
    """
    view: Any = bp.problems(401, 413, 415, 422, 500)(body)
    view = bp.response(201, Order, description="Created.", headers=LOCATION)(view)
    view = bp.arguments(OrderIn, example={"amount": 1250, "currency": "EUR"})(view)
    bp.post(rule)(view)


def _pooled(
    before: Callable[[psycopg.Connection[Any]], None], after: Callable[[psycopg.Connection[Any]], None]
) -> Callable[[dict[str, Any]], Answer]:
    """The shop's order body on a pooled connection in one transaction, with ``before`` and ``after``
    run in it around the ``INSERT``."""

    def body(data: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
        with idem.pool.connection() as conn, conn.transaction():
            before(conn)
            answer = place_order(conn, uuid.uuid4(), data)
            after(conn)
        return answer

    return body


def baseline_order(data: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
    """The shop's order route, minus ``@idem.idempotent()``."""
    return _pooled(lambda conn: None, lambda conn: None)(data)


def floor_order(data: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
    """The baseline plus two statements that do nothing: one before the ``INSERT``, one after it.

    Any idempotency layer that answers a retry without running the view must ask the database something
    before the view, and must write the response after it, inside the same transaction. This route pays
    for exactly those two round trips and nothing else, so its throughput bounds what such a layer can
    reach with psycopg on this machine.
    """
    return _pooled(_no_op, _no_op)(data)


def floor_batched_order(data: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
    """Like ``/bench/floor``, with the two statements sent in batches with ``BEGIN`` and ``COMMIT``.

    A batched transaction (:class:`flask_idem._pool.Batched`, as a decorated route's) sends the statement
    before the ``INSERT`` together with ``BEGIN``, and the one after it together with ``COMMIT``: the
    round trips of the baseline, two statements more.
    """
    with get_state().source.transaction(batched=True) as conn:
        transaction = batched(conn)
        assert transaction is not None
        transaction.begin(_NO_OP, {})
        answer = place_order(conn, uuid.uuid4(), data)
        transaction.defer(_NO_OP, {})
    return answer


order_route("/orders", baseline_order)
order_route("/floor", floor_order)
order_route("/floor-batched", floor_batched_order)

_order_in = OrderIn()


@plain.post("/orders-plain")
def create_order_plain() -> tuple[dict[str, Any], int, dict[str, str]]:
    """The hand-written baseline: the body loaded by hand, a tuple row, a dict built from it."""
    data = load(_order_in, request.get_json())
    with idem.pool.connection() as conn, conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (org_id, idempotency_key, amount, currency)"
            " VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (org_id, idempotency_key) DO NOTHING"
            " RETURNING id, amount, currency, created_at",
            (g.org_id, uuid.uuid4(), data["amount"], data["currency"]),
        ).fetchone()
    assert row is not None  # a fresh uuid4 never conflicts
    order_id, amount, currency, created_at = row
    order = {"id": order_id, "amount": amount, "currency": currency, "created_at": created_at.isoformat()}
    return order, 201, {"Location": url_for("orders.get_order", order_id=order_id)}


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """``example_app.create_app(test_config)`` with the baseline blueprints registered.

    ``FLASK_IDEM_BENCH_SWITCH_INTERVAL`` sets Python's thread switch interval in each worker
    (``bench/inflight.py``).
    """
    interval = os.environ.get("FLASK_IDEM_BENCH_SWITCH_INTERVAL")
    if interval:
        sys.setswitchinterval(float(interval))
    app = create_shop(test_config)
    app.register_blueprint(bp)
    app.register_blueprint(plain)
    return app
