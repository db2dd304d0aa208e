"""The shop's orders and payments through flask-idem's own test kit, as a user would check their routes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from example_app import create_app
from example_app.cli import create_org
from flask_idem.testing import (
    Rows,
    check_in_flight,
    check_mismatch,
    check_replay,
    check_scope,
    crash_between_steps,
    hammer,
    unprotected_routes,
)

from ..support.helpers import close_pool, headers

pytestmark = pytest.mark.slow

ORDER = {"amount": 1250, "currency": "EUR"}


@pytest.fixture
def orders(db: psycopg.Connection[Any]) -> Rows:
    return Rows(db, "orders")


def auth(app: Flask, name: str) -> dict[str, str]:
    """The Authorization header of a new organisation of ``app``."""
    with app.app_context():
        return headers(create_org(name)[1])


def test_only_the_session_routes_lack_the_decorator(app: Flask) -> None:
    """The lint lists sign-in and sign-out (they only set the session cookie); every buying route is not."""
    assert unprotected_routes(app) == ["POST /sign-in (web.sign_in)", "POST /sign-out (web.sign_out)"]


def test_orders_replay_once_even_after_a_crash(app: Flask, orders: Rows) -> None:
    """POST /orders: a killed attempt leaves no order; the retry creates one; the next is a replay."""
    first, again = check_replay(app, "POST", "/orders", json=ORDER, headers=auth(app, "acme"), effect=orders)
    assert first.status_code == 201 and first.headers["Location"] == again.headers["Location"]


def test_orders_refuse_a_changed_body(app: Flask, orders: Rows) -> None:
    """POST /orders with a reused key and another amount: 422, no order."""
    changed = {**ORDER, "amount": 1}
    check_mismatch(
        app, "POST", "/orders", json=ORDER, changed=changed, headers=auth(app, "acme"), effect=orders
    )


def test_orders_in_flight_duplicate_gets_409(app: Flask, orders: Rows) -> None:
    """POST /orders held inside its transaction: the duplicate is told 409 with Retry-After."""
    check_in_flight(app, "POST", "/orders", json=ORDER, headers=auth(app, "acme"), effect=orders)


def test_orders_keys_belong_to_the_organisation(app: Flask, orders: Rows) -> None:
    """Two organisations, one key: two orders, each organisation replayed its own."""
    first, other = check_scope(
        app,
        "POST",
        "/orders",
        json=ORDER,
        headers=auth(app, "acme"),
        other_headers=auth(app, "umbrella"),
        effect=orders,
    )
    assert first.json["id"] != other.json["id"]  # type: ignore[index]


def test_orders_hammered_with_one_key(app: Flask, orders: Rows) -> None:
    """Eight threads, one key: one order; every answer 201, 200 or 409."""
    hammer(app, "POST", "/orders", json=ORDER, headers=auth(app, "acme"), effect=orders)


@pytest.fixture
def shop(shop_config: dict[str, Any]) -> Iterator[Flask]:
    """The shop paying through the test gateway."""
    app = create_app(shop_config)
    yield app
    close_pool(app)


@pytest.fixture
def order_maker(shop: Flask) -> Callable[[dict[str, str]], Callable[[], dict[str, Any]]]:
    """For an organisation's headers: a function that places a new order and returns a body paying it."""

    def for_org(auth_headers: dict[str, str]) -> Callable[[], dict[str, Any]]:
        def pay_a_new_order() -> dict[str, Any]:
            placed = shop.test_client().post(
                "/orders", json=ORDER, headers={**auth_headers, "Idempotency-Key": str(uuid.uuid4())}
            )
            assert placed.status_code == 201
            return {"order_id": placed.json["id"], "source": "tok_visa"}  # type: ignore[index]

        return pay_a_new_order

    return for_org


def test_payments_survive_a_crash_after_each_step(
    shop: Flask, db: psycopg.Connection[Any], order_maker: Callable[..., Callable[[], dict[str, Any]]]
) -> None:
    """POST /payments killed in its view, after the charge and in the record step: one charge each time."""
    payer = auth(shop, "payer")
    points = crash_between_steps(
        shop,
        "POST",
        "/payments",
        json=order_maker(payer),
        headers=payer,
        outside=Rows(db, "gateway_charges"),
        effect=Rows(db, "payments", where="status = 'succeeded'"),
    )
    assert points == ["view", "charge", "finish"]


def test_payments_replay_and_in_flight(
    shop: Flask, db: psycopg.Connection[Any], order_maker: Callable[..., Callable[[], dict[str, Any]]]
) -> None:
    """POST /payments: replayed once paid; a duplicate held in the view's transaction gets 409."""
    payer = auth(shop, "payer")
    succeeded = Rows(db, "payments", where="status = 'succeeded'")
    pay = order_maker(payer)
    check_replay(shop, "POST", "/payments", json=pay(), headers=payer, effect=succeeded)
    check_in_flight(shop, "POST", "/payments", json=pay(), headers=payer, effect=succeeded)
    hammer(
        shop, "POST", "/payments", json=pay(), headers=payer, effect=Rows(db, "gateway_charges"), threads=4
    )
