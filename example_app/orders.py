"""The orders API: ``POST /orders`` (idempotent), ``GET /orders`` and ``GET /orders/<id>``."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, g, request, url_for
from werkzeug.exceptions import NotFound

from .auth import authenticate
from .extensions import idem
from .problems import KeyAlreadyUsed
from .schemas import OrderIn, load

bp = Blueprint("orders", __name__)
bp.before_request(authenticate)

_order_in = OrderIn()


def _order(row: tuple[Any, ...]) -> dict[str, Any]:
    order_id, amount, currency, created_at = row
    return {
        "id": order_id,
        "amount": amount,
        "currency": currency,
        "created_at": created_at.isoformat(),
    }


@bp.post("/orders")
@idem.idempotent()
def create_order() -> tuple[dict[str, Any], int, dict[str, str]]:
    """Create an order. A retry with the same ``Idempotency-Key`` gets the first answer again."""
    data = load(_order_in, request.get_json())
    row = idem.connection.execute(
        "INSERT INTO orders (org_id, idempotency_key, amount, currency)"
        " VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING"
        " RETURNING id, amount, currency, created_at",
        (g.org_id, idem.key, data["amount"], data["currency"]),
    ).fetchone()
    if row is None:
        raise KeyAlreadyUsed()
    order = _order(row)
    return order, 201, {"Location": url_for(".get_order", order_id=order["id"])}


@bp.get("/orders/<int:order_id>")
def get_order(order_id: int) -> dict[str, Any]:
    """One order of the authenticated organisation; another organisation's order is 404."""
    with idem.pool.connection() as conn:
        row = conn.execute(
            "SELECT id, amount, currency, created_at FROM orders WHERE id = %s AND org_id = %s",
            (order_id, g.org_id),
        ).fetchone()
    if row is None:
        raise NotFound("There is no such order.")
    return _order(row)


@bp.get("/orders")
def list_orders() -> dict[str, Any]:
    """The authenticated organisation's orders, oldest first."""
    with idem.pool.connection() as conn:
        rows = conn.execute(
            "SELECT id, amount, currency, created_at FROM orders WHERE org_id = %s ORDER BY id", (g.org_id,)
        ).fetchall()
    return {"orders": [_order(row) for row in rows]}
