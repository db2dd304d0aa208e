"""The orders API: ``POST /orders`` (idempotent), ``GET /orders`` and ``GET /orders/<id>``."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from flask import g, url_for
from werkzeug.exceptions import NotFound

from .api import LOCATION, Blueprint, path_id
from .auth import authenticate
from .db import fetch_all, fetch_one
from .extensions import idem
from .problems import KeyAlreadyUsed
from .schemas import Order, OrderIn, OrderList

bp = Blueprint("orders", __name__, description="Orders, created once per Idempotency-Key.")
bp.before_request(authenticate)


def place_order(
    conn: psycopg.Connection[Any], key: uuid.UUID | None, data: dict[str, Any]
) -> tuple[dict[str, Any], int, dict[str, str]]:
    """Insert the order of ``data`` under ``key`` on ``conn``; the 201 answer with its ``Location``."""
    order = fetch_one(
        "INSERT INTO orders (org_id, idempotency_key, amount, currency)"
        " VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING"
        " RETURNING id, amount, currency, created_at",
        (g.org_id, key, data["amount"], data["currency"]),
        conn=conn,
    )
    if order is None:
        raise KeyAlreadyUsed()
    return order, 201, {"Location": url_for("orders.get_order", order_id=order["id"])}


@bp.post("/orders")
@idem.idempotent()
@bp.arguments(OrderIn, example={"amount": 1250, "currency": "EUR"})
@bp.response(201, Order, description="Created.", headers=LOCATION)
@bp.problems(401, 413, 415, 422, 500)
def create_order(data: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
    """Create an order

    A retry with the same ``Idempotency-Key`` gets the first answer again.
    """
    return place_order(idem.connection, idem.key, data)


@bp.route("/orders/<int:order_id>", parameters=[path_id("order_id")])
@bp.response(200, Order, description="OK.")
@bp.problems(401, 404, 500, 503)
def get_order(order_id: int) -> dict[str, Any]:
    """One order

    Another organisation's order is 404.
    """
    order = fetch_one(
        "SELECT id, amount, currency, created_at FROM orders WHERE id = %s AND org_id = %s",
        (order_id, g.org_id),
    )
    if order is None:
        raise NotFound("There is no such order.")
    return order


@bp.route("/orders", methods=["GET"])
@bp.response(200, OrderList, description="OK.")
@bp.problems(401, 500, 503)
def list_orders() -> dict[str, Any]:
    """The organisation's orders, oldest first"""
    orders = fetch_all(
        "SELECT id, amount, currency, created_at FROM orders WHERE org_id = %s ORDER BY id", (g.org_id,)
    )
    return {"orders": orders}
