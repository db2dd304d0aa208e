"""The shop plus a baseline route: ``POST /bench/orders`` is ``POST /orders`` without the decorator.

The baseline authenticates the same way (the shop's ``authenticate`` hook), validates with the same
``OrderIn`` schema, runs the same ``INSERT`` in one transaction on a pooled connection, and answers the
same 201 body and ``Location``. The only differences are the ones idempotency makes: no key row is
reserved, completed or looked up, and the order's ``idempotency_key`` is a fresh ``uuid4()``. Any
``Idempotency-Key`` header the client sends is ignored.

Served by ``gunicorn 'bench.app:create_app()'`` from the repository root.
"""

from __future__ import annotations

import uuid
from typing import Any

from flask import Blueprint, Flask, g, request, url_for

from example_app import create_app as create_shop
from example_app.auth import authenticate
from example_app.extensions import idem
from example_app.schemas import OrderIn, load

__all__ = ["create_app"]

bp = Blueprint("bench", __name__, url_prefix="/bench")
bp.before_request(authenticate)

_order_in = OrderIn()


@bp.post("/orders")
def create_order() -> tuple[dict[str, Any], int, dict[str, str]]:
    """The shop's order route, minus ``@idem.idempotent()``."""
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
    """``example_app.create_app(test_config)`` with the baseline blueprint registered."""
    app = create_shop(test_config)
    app.register_blueprint(bp)
    return app
