"""The checkout pages with Flask's test client: forms without JavaScript, CSRF, headers, no keys leaked."""

from __future__ import annotations

import logging
import re
import stat
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from example_app.web import SECURITY_HEADERS, _instance_secret
from flask_idem.errors import PROBLEM_JSON

from ..support.helpers import count
from ..support.shop_actions import add_fault, charges, fulfilments_enqueued, paid, payment_statuses

HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@pytest.fixture
def shop(make_shop: Callable[..., Flask]) -> Flask:
    """The shop of tests/example_app/conftest.py, with a session secret, no demo key, and a gateway that may
    take up to 5 s."""
    return make_shop(GATEWAY_TIMEOUT=5.0, SECRET_KEY="test", SHOP_DEMO_API_KEY=None)


def field(page: TestResponse, name: str) -> str:
    """The value of the (first) form field ``name`` on a page."""
    match = re.search(rf'name="{name}" value="([^"]*)"', page.get_data(as_text=True))
    assert match is not None, f"no field {name}"
    return match[1]


def signed_in(shop: Flask, api_key: str) -> FlaskClient:
    """A test client (a browser without JavaScript) signed in with ``api_key``."""
    client = shop.test_client()
    front = client.get("/", headers=HTML)
    answer = client.post(
        "/sign-in", data={"csrf_token": field(front, "csrf_token"), "api_key": api_key}, headers=HTML
    )
    assert answer.status_code == 303, answer.data
    return client


def order_from_the_form(client: FlaskClient, amount: str, currency: str) -> tuple[TestResponse, ...]:
    """Submit the front page's checkout form: the front page, the answer (303), and the order's page."""
    front = client.get("/", headers=HTML)
    order = client.post(
        "/checkout",
        data={
            "csrf_token": field(front, "csrf_token"),
            "idempotency_key": field(front, "idempotency_key"),
            "amount": amount,
            "currency": currency,
        },
    )
    return front, order, client.get(order.headers["Location"], headers=HTML)


def test_front_page_offers_sign_in_with_the_demo_key(shop: Flask, org: tuple[int, str]) -> None:
    """Signed out, / is the sign-in page, offering the demo key that `shop serve` configured."""
    shop.config["SHOP_DEMO_API_KEY"] = org[1]
    page = shop.test_client().get("/", headers=HTML)
    assert page.status_code == 200
    assert page.mimetype == "text/html"
    assert "Sign in as the demo organisation" in page.get_data(as_text=True)
    assert field(page, "api_key") == org[1]


@pytest.mark.parametrize("path", ["/", "/static/shop.js", "/static/shop.css"], ids=["page", "js", "css"])
def test_security_headers(shop: Flask, path: str) -> None:
    """Pages and their static files forbid inline scripts and framing, sniffing and referrers."""
    response = shop.test_client().get(path)
    assert response.status_code == 200
    for name, value in SECURITY_HEADERS.items():
        assert response.headers[name] == value
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert response.headers["X-Frame-Options"] == "DENY"
    response.close()


def test_pages_have_no_inline_script_or_style(shop: Flask, org: tuple[int, str]) -> None:
    """Every script is a file of the shop's own: the CSP would block anything inline."""
    client = signed_in(shop, org[1])
    for path in ("/", "/account/orders"):
        html = client.get(path, headers=HTML).get_data(as_text=True)
        assert re.findall(r"<script[^>]*>", html) == ['<script src="/static/shop.js" defer>']
        assert "<style" not in html and " style=" not in html and " on" + "click=" not in html


def test_api_answers_keep_their_own_headers(shop: Flask, org: tuple[int, str]) -> None:
    """The JSON API is not the front end: no page headers on its answers."""
    response = shop.test_client().get("/orders", headers={"Authorization": f"Bearer {org[1]}"})
    assert response.status_code == 200
    assert "Content-Security-Policy" not in response.headers


def test_sign_in_sets_a_strict_session_cookie(shop: Flask, org: tuple[int, str]) -> None:
    """The session cookie is HttpOnly and SameSite=Lax, and holds no API key."""
    client = shop.test_client()
    front = client.get("/", headers=HTML)
    answer = client.post("/sign-in", data={"csrf_token": field(front, "csrf_token"), "api_key": org[1]})
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/"
    cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    assert org[1] not in cookie
    assert "Checkout" in client.get("/", headers=HTML).get_data(as_text=True)


def test_unknown_api_key_is_refused(shop: Flask, org: tuple[int, str]) -> None:
    """A wrong API key: 401 and the sign-in page again, with a message."""
    client = shop.test_client()
    front = client.get("/", headers=HTML)
    answer = client.post(
        "/sign-in", data={"csrf_token": field(front, "csrf_token"), "api_key": "x" * 43}, headers=HTML
    )
    assert answer.status_code == 401
    assert "unknown or revoked" in answer.get_data(as_text=True)


@pytest.mark.parametrize("token", [None, "", "forged"], ids=["missing", "empty", "forged"])
def test_form_posts_need_the_session_csrf_token(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any], token: str | None
) -> None:
    """A form post without this session's CSRF token is 403, before any key or order is written."""
    client = signed_in(shop, org[1])
    data = {"amount": "12.50", "currency": "EUR", "idempotency_key": str(uuid.uuid4())}
    if token is not None:
        data["csrf_token"] = token
    answer = client.post("/checkout", data=data, headers=HTML)
    assert answer.status_code == 403
    assert answer.mimetype == "text/html"
    assert (count(db, "orders"), count(db, "idempotency_keys")) == (0, 0)


def test_another_sessions_token_is_refused(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any]
) -> None:
    """A token from another browser's session does not work in this one (what a forged form would carry)."""
    mine, theirs = signed_in(shop, org[1]), signed_in(shop, org[1])
    form = mine.get("/", headers=HTML)
    data = {"csrf_token": field(form, "csrf_token"), "idempotency_key": field(form, "idempotency_key")}
    answer = theirs.post("/checkout", data={**data, "amount": "1", "currency": "EUR"})
    assert answer.status_code == 403
    assert count(db, "orders") == 0


def test_form_errors_for_api_clients_are_problem_json(shop: Flask) -> None:
    """A client that asks for JSON gets application/problem+json from the front end's routes too."""
    answer = shop.test_client().post("/checkout", data={}, headers={"Accept": "application/json"})
    assert answer.status_code == 403
    assert answer.mimetype == PROBLEM_JSON


def test_checkout_form_submitted_twice_places_one_order(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any]
) -> None:
    """Without JavaScript, the same form posted twice: one order, and both answers lead to it."""
    client = signed_in(shop, org[1])
    form = client.get("/", headers=HTML)
    data = {
        "csrf_token": field(form, "csrf_token"),
        "idempotency_key": field(form, "idempotency_key"),
        "amount": "12.50",
        "currency": "EUR",
    }
    first = client.post("/checkout", data=data, headers=HTML)
    second = client.post("/checkout", data=data, headers=HTML)
    assert first.status_code == second.status_code == 303
    assert second.headers["Idempotent-Replayed"] == "true"
    assert first.headers["Location"] == second.headers["Location"]
    rows = db.execute("SELECT id, amount, currency, idempotency_key FROM orders").fetchall()
    assert [(r[1], r[2], str(r[3])) for r in rows] == [(1250, "EUR", data["idempotency_key"])]
    assert first.headers["Location"] == f"/checkout/{rows[0][0]}"
    page = client.get(first.headers["Location"], headers=HTML).get_data(as_text=True)
    assert "12.50 EUR" in page and "Not paid yet." in page


def test_each_rendered_form_has_a_new_key(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any]
) -> None:
    """A new operation gets a new key: two renderings, two keys, two orders."""
    client = signed_in(shop, org[1])
    for _ in range(2):
        form = client.get("/", headers=HTML)
        data = {"csrf_token": field(form, "csrf_token"), "idempotency_key": field(form, "idempotency_key")}
        assert client.post("/checkout", data={**data, "amount": "5", "currency": "USD"}).status_code == 303
    assert count(db, "orders") == 2


@pytest.mark.parametrize("amount", ["", "abc", "0", "1.234", "-3"])
def test_invalid_amount_is_a_422_page(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any], amount: str
) -> None:
    """An amount the form's own checks would refuse: 422 with a message, no order."""
    client = signed_in(shop, org[1])
    form = client.get("/", headers=HTML)
    data = {"csrf_token": field(form, "csrf_token"), "idempotency_key": field(form, "idempotency_key")}
    answer = client.post("/checkout", data={**data, "amount": amount, "currency": "EUR"}, headers=HTML)
    assert answer.status_code == 422
    assert "amount" in answer.get_data(as_text=True)
    assert count(db, "orders") == 0


def test_pay_form_in_flight_then_check_again(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """The pay form posted again while the first is at the bank: 409 with the same form; then one charge,
    and one fulfilment message in the outbox."""
    client = signed_in(shop, org[1])
    order = client.post(
        "/checkout",
        data={
            "csrf_token": field(client.get("/", headers=HTML), "csrf_token"),
            "idempotency_key": str(uuid.uuid4()),
            "amount": "20",
            "currency": "EUR",
        },
    )
    order_url = order.headers["Location"]
    page = client.get(order_url, headers=HTML)
    data = {
        "csrf_token": field(page, "csrf_token"),
        "idempotency_key": field(page, "idempotency_key"),
        "source": "tok_visa",
    }
    add_fault(gateway_url, "delay", delay=1.5)
    first: dict[str, TestResponse] = {}
    thread = threading.Thread(
        target=lambda: first.setdefault("r", signed_copy(client).post(order_url + "/pay", data=data))
    )
    thread.start()
    while payment_statuses(db) != ["pending"]:
        pass
    busy = client.post(order_url + "/pay", data=data, headers=HTML)
    assert busy.status_code == 409
    assert "Retry-After" in busy.headers
    assert field(busy, "idempotency_key") == data["idempotency_key"]  # "Check again" resends the same key
    thread.join(30)
    assert first["r"].status_code == 303
    again = client.post(order_url + "/pay", data=data, headers=HTML)
    assert again.status_code == 303
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]
    assert fulfilments_enqueued(db) == [(org[0], "shop.fulfil", *paid(db))]
    assert "Paid. Thank you!" in client.get(order_url, headers=HTML).get_data(as_text=True)


def signed_copy(client: FlaskClient) -> FlaskClient:
    """Another test client with the same cookies (the same browser, another connection)."""
    other = client.application.test_client()
    for cookie in client._cookies.values():
        other.set_cookie(cookie.key, cookie.value, domain=cookie.domain)
    return other


def test_declined_card_without_javascript(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """The declining test card: the order page says so, and the form is offered again with a new key."""
    client = signed_in(shop, org[1])
    front, order, page = order_from_the_form(client, "9.99", "GBP")
    token = field(front, "csrf_token")
    key = field(page, "idempotency_key")
    paid = client.post(
        order.headers["Location"] + "/pay",
        data={"csrf_token": token, "idempotency_key": key, "source": "tok_card_decline"},
    )
    assert paid.status_code == 303
    after = client.get(order.headers["Location"], headers=HTML)
    assert "Your card was declined. Nothing was charged." in after.get_data(as_text=True)
    assert field(after, "idempotency_key") != key
    assert payment_statuses(db) == ["declined"]
    assert fulfilments_enqueued(db) == []


def test_orders_page_lists_each_order_once_and_flags(
    shop: Flask, org: tuple[int, str], db: psycopg.Connection[Any]
) -> None:
    """Orders once each with their latest payment; a payment flagged by recovery is called out."""
    org_id = org[0]
    ids = [
        db.execute(
            "INSERT INTO orders (org_id, idempotency_key, amount, currency)"
            " VALUES (%s, %s, %s, 'EUR') RETURNING id",
            (org_id, uuid.uuid4(), amount),
        ).fetchone()[0]  # type: ignore[index]
        for amount in (100, 200, 300)
    ]
    stuck = uuid.uuid4()
    for order_id, status, key in [
        (ids[0], "declined", uuid.uuid4()),
        (ids[0], "succeeded", uuid.uuid4()),
        (ids[1], "pending", stuck),
    ]:
        db.execute(
            "INSERT INTO payments (org_id, order_id, idempotency_key, amount, currency, status)"
            " VALUES (%s, %s, %s, 1, 'EUR', %s)",
            (org_id, order_id, key, status),
        )
    db.execute(
        "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response,"
        " expires_at, needs_attention) VALUES (%s, %s, %s, 'POST', '/payments', 'failed', '{}', now(), true)",
        (org_id, stuck, b"\0" * 32),
    )
    html = signed_in(shop, org[1]).get("/account/orders", headers=HTML).get_data(as_text=True)
    rows = re.findall(r'<a href="/checkout/(\d+)">', html)
    assert rows == [str(i) for i in reversed(ids)]
    assert "1 payment needs a person" in html and f"order {ids[1]}" in html
    assert re.search(rf'/checkout/{ids[0]}">.*?badge-succeeded">paid<', html, re.DOTALL)
    assert html.count("needs a person</span>") == 1


@pytest.mark.parametrize("path", ["/checkout/1", "/account/orders"])
def test_pages_need_a_signed_in_session(shop: Flask, path: str) -> None:
    """Signed out, the order pages lead back to the sign-in page."""
    answer = shop.test_client().get(path, headers=HTML)
    assert answer.status_code == 303
    assert answer.headers["Location"] == "/"


def test_no_key_in_urls_or_logs(
    shop: Flask, org: tuple[int, str], gateway_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A purchase without JavaScript: no API key or idempotency key in any URL or log line."""
    caplog.set_level(logging.DEBUG)
    client = signed_in(shop, org[1])
    secrets = {org[1]}
    urls: list[str] = []
    front, order, page = order_from_the_form(client, "3", "EUR")
    secrets.add(field(front, "idempotency_key"))
    token = field(front, "csrf_token")
    secrets.add(field(page, "idempotency_key"))
    paid = client.post(
        order.headers["Location"] + "/pay",
        data={"csrf_token": token, "idempotency_key": field(page, "idempotency_key"), "source": "tok_visa"},
    )
    for response in (order, paid):
        urls.append(response.headers["Location"])
    for html in (front, page, client.get("/account/orders", headers=HTML)):
        urls += re.findall(r'(?:href|action|src)="([^"]*)"', html.get_data(as_text=True))
    assert urls
    for secret in secrets:
        assert not [u for u in urls if secret in u]
        assert secret not in caplog.text


def test_instance_secret_is_made_once(tmp_path: Path) -> None:
    """Without SECRET_KEY, one random secret is written to the instance folder, readable by its owner only."""
    path = tmp_path / "instance" / "secret_key"
    first = _instance_secret(path)
    assert len(first) == 64
    assert _instance_secret(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(path.parent.iterdir()) == [path]


def test_pay_form_with_unknown_outcome_is_finished_by_recovery(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """Gateway fails after charging: a 503 page with the same form; recovery finishes, and enqueues the
    fulfilment; a resend replays."""
    client = signed_in(shop, org[1])
    front, order, page = order_from_the_form(client, "4", "EUR")
    token = field(front, "csrf_token")
    data = {"csrf_token": token, "idempotency_key": field(page, "idempotency_key"), "source": "tok_visa"}
    add_fault(gateway_url, "fail_after")
    unknown = client.post(order.headers["Location"] + "/pay", data=data, headers=HTML)
    assert unknown.status_code == 503
    assert field(unknown, "idempotency_key") == data["idempotency_key"]
    assert payment_statuses(db) == ["pending"]
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now() WHERE status = 'processing'")
    result = shop.test_cli_runner().invoke(args=["idem", "recover"])
    assert "Claimed 1: 1 completed" in result.output, result.output
    again = client.post(order.headers["Location"] + "/pay", data=data, headers=HTML)
    assert (again.status_code, again.headers["Idempotent-Replayed"]) == (303, "true")
    assert again.headers["Location"] == order.headers["Location"]
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]
    assert fulfilments_enqueued(db) == [(org[0], "shop.fulfil", *paid(db))]
