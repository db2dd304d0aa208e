"""The checkout in a real browser: double clicks, reloads, dropped connections and dead workers buy once.

Each test drives Debian's Chromium against the shop under gunicorn (two workers) paying through the
gateway simulator, asserts on the database (one order, one payment, one charge), checks that no key ever
appeared in a URL or in the shop's log, and saves a screenshot of the page's final state.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from playwright.sync_api import Browser, Page, Request, Route, expect
from playwright.sync_api import Error as PlaywrightError

from ..example_app.test_payments import add_fault, charges, payment_statuses
from ..support.helpers import count
from .conftest import SCREENSHOTS

pytestmark = pytest.mark.slow

#: Long enough for the page's own retries after a killed worker or a dropped gateway connection.
SLOW = 60_000


@dataclass
class Shop:
    """A browser tab on the live shop, and what it sent."""

    base: str
    master: subprocess.Popen[bytes]
    api_key: str
    page: Page
    log: Path
    requests: list[Request] = field(default_factory=list)

    def posts(self, path: str) -> list[Request]:
        """The POST requests the page sent to ``path`` (a regular expression over the URL's path)."""
        return [
            r
            for r in self.requests
            if r.method == "POST" and re.fullmatch(path, r.url.removeprefix(self.base))
        ]

    def keys(self, path: str) -> set[str]:
        """The distinct Idempotency-Key headers of those requests."""
        return {r.headers.get("idempotency-key", "") for r in self.posts(path)}


def sign_in(shop: Shop) -> None:
    page = shop.page
    page.goto(shop.base + "/")
    page.fill("#api_key", shop.api_key)
    page.click("form[data-sign-in] button.primary")
    expect(page.get_by_role("heading", name="Checkout")).to_be_visible()


def place_order(shop: Shop, amount: str = "12.50") -> int:
    page = shop.page
    page.fill("#amount", amount)
    page.click("#place-order")
    page.wait_for_url(re.compile(r".*/checkout/\d+$"))
    return int(page.url.rsplit("/", 1)[1])


def snapshot(shop: Shop, name: str) -> None:
    """A screenshot of the page as it is now, beside the final ones (the docs show some of these)."""
    shop.page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


def no_secrets_leaked(shop: Shop) -> None:
    """No URL the browser asked for, and no line of the shop's log, holds the API key or a key it sent."""
    secrets = {shop.api_key} | {k for r in shop.requests if (k := r.headers.get("idempotency-key"))}
    urls = [r.url for r in shop.requests]
    log = shop.log.read_text(errors="replace")
    for secret in secrets:
        assert not [u for u in urls if secret in u]
        assert secret not in log


@pytest.fixture
def shop(
    browser: Browser,
    live_shop: tuple[str, subprocess.Popen[bytes]],
    make_org: Callable[[str], tuple[int, str]],
    tmp_path: Path,
    screenshot_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Shop]:
    """A fresh browser context on the live shop, signed out; a screenshot of its final state afterwards."""
    base, master = live_shop
    javascript = getattr(request, "param", True)
    context = browser.new_context(java_script_enabled=javascript)
    context.set_default_timeout(20_000)
    page = context.new_page()
    shop = Shop(base, master, make_org("browser")[1], page, tmp_path / "gunicorn.log")
    page.on("request", lambda r: shop.requests.append(r))
    yield shop
    page.unroute_all(behavior="ignoreErrors")
    page.screenshot(path=screenshot_path, full_page=True)
    context.close()


def test_double_click_on_pay_charges_once(shop: Shop, gateway_url: str, db: psycopg.Connection[Any]) -> None:
    """Two clicks on "Pay" within milliseconds send the same key twice: one order, one payment, one charge."""
    sign_in(shop)
    snapshot(shop, "checkout")
    order_id = place_order(shop)
    expect(shop.page.locator("#status")).to_contain_text(f"Order {order_id} placed: 12.50 EUR")
    add_fault(gateway_url, "delay", delay=1.0)  # the first click is still at the bank when the second lands
    shop.page.click("#pay", click_count=2, delay=5)
    expect(shop.page.locator("#payment-state")).to_have_text("Paid. Thank you!", timeout=SLOW)
    assert len(shop.posts("/payments")) >= 2  # the second click resends; a 409 is retried
    assert len(shop.keys("/payments")) == 1
    assert count(db, "orders") == 1
    assert payment_statuses(db) == ["succeeded"]
    assert len(charges(gateway_url)) == 1
    no_secrets_leaked(shop)


def test_reload_during_place_order_then_try_again(shop: Shop, db: psycopg.Connection[Any]) -> None:
    """The order is made, its answer is lost; after a reload, "Try again" shows the replayed order."""
    sign_in(shop)
    made: list[int] = []

    def lose_the_answer(route: Route) -> None:
        if made:
            route.continue_()
        else:  # the shop places the order; the page never hears of it
            made.append(route.fetch().status)

    shop.page.route("**/orders", lose_the_answer)
    shop.page.fill("#amount", "42.00")
    shop.page.click("#place-order")
    deadline = time.monotonic() + 30
    while not made:
        assert time.monotonic() < deadline, "the page never sent its order"
        shop.page.wait_for_timeout(20)
    assert made == [201]
    shop.page.reload()
    pending = shop.page.locator("[data-pending-for=order]")
    expect(pending).to_contain_text("We did not hear back about your order of 42.00 EUR.")
    snapshot(shop, "checkout-no-answer")
    pending.get_by_role("button", name="Try again").click()
    shop.page.wait_for_url(re.compile(r".*/checkout/\d+$"))
    expect(shop.page.locator("#status")).to_contain_text("was already placed; here it is")
    assert len(shop.posts("/orders")) == 2
    assert len(shop.keys("/orders")) == 1
    rows = db.execute("SELECT id, amount FROM orders").fetchall()
    assert rows == [(int(shop.page.url.rsplit("/", 1)[1]), 4200)]
    no_secrets_leaked(shop)


def test_declined_then_paid_with_a_new_key(shop: Shop, gateway_url: str, db: psycopg.Connection[Any]) -> None:
    """A decline is a final answer; paying again with another card is a new operation with a new key."""
    sign_in(shop)
    place_order(shop)
    shop.page.check("input[value=tok_card_decline]")
    shop.page.click("#pay")
    expect(shop.page.locator("#status")).to_contain_text("Your card was declined. Nothing was charged.")
    expect(shop.page.locator("#payment-state")).to_have_text("Your card was declined. Nothing was charged.")
    shop.page.check("input[value=tok_mastercard]")
    shop.page.click("#pay")
    expect(shop.page.locator("#payment-state")).to_have_text("Paid. Thank you!")
    assert len(shop.posts("/payments")) == 2
    assert len(shop.keys("/payments")) == 2
    assert payment_statuses(db) == ["declined", "succeeded"]
    assert [c["status"] for c in charges(gateway_url)] == ["declined", "succeeded"]
    shop.page.click("text=Orders")
    expect(shop.page.locator("tbody tr")).to_have_count(1)
    expect(shop.page.locator("tbody")).to_contain_text("paid")
    no_secrets_leaked(shop)


def test_gateway_drops_the_connection(shop: Shop, gateway_url: str, db: psycopg.Connection[Any]) -> None:
    """The gateway charges, then drops the shop's connection: the page retries with its key; one charge."""
    sign_in(shop)
    place_order(shop)
    add_fault(gateway_url, "drop_after")
    shop.page.click("#pay")
    expect(shop.page.locator("#payment-state")).to_have_text("Paid. Thank you!", timeout=SLOW)
    assert len(shop.posts("/payments")) >= 2  # the first attempt's outcome was unknown (503)
    assert len(shop.keys("/payments")) == 1
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]
    no_secrets_leaked(shop)


def test_shop_worker_killed_mid_payment(shop: Shop, gateway_url: str, db: psycopg.Connection[Any]) -> None:
    """The shop's workers are SIGKILLed after the gateway charged: the page retries; one charge."""
    sign_in(shop)
    place_order(shop)
    add_fault(gateway_url, "delay", delay=8.0)  # charge at once, answer 8 s later
    shop.page.click("#pay")
    deadline = time.monotonic() + 15
    while not charges(gateway_url):
        assert time.monotonic() < deadline, "the gateway was never called"
        shop.page.wait_for_timeout(50)
    for worker in psutil.Process(shop.master.pid).children():
        os.kill(worker.pid, signal.SIGKILL)
    expect(shop.page.locator("#payment-state")).to_have_text("Paid. Thank you!", timeout=SLOW)
    # The page retries; Chromium itself may also resend a POST that a reset connection cut off.
    assert shop.keys("/payments") == {shop.posts("/payments")[0].headers["idempotency-key"]}
    assert len(charges(gateway_url)) == 1
    assert payment_statuses(db) == ["succeeded"]
    no_secrets_leaked(shop)


def test_offline_during_place_order(shop: Shop, db: psycopg.Connection[Any]) -> None:
    """The connection goes down while the order is placed; back online, the page converges on one order."""
    sign_in(shop)
    context = shop.page.context
    lost: list[int] = []

    def go_offline(route: Route) -> None:
        if lost:
            route.continue_()
            return
        lost.append(route.fetch().status)  # placed, and then the network is gone
        context.set_offline(True)
        route.abort("internetdisconnected")

    shop.page.route("**/orders", go_offline)
    shop.page.click("#place-order")
    expect(shop.page.locator("#status")).to_contain_text("You are offline")
    assert lost == [201]
    context.set_offline(False)
    shop.page.wait_for_url(re.compile(r".*/checkout/\d+$"))
    expect(shop.page.locator("#status")).to_contain_text("was already placed; here it is")
    assert len(shop.keys("/orders")) == 1
    assert count(db, "orders") == 1
    no_secrets_leaked(shop)


@pytest.mark.parametrize("shop", [False], ids=["no-javascript"], indirect=True)
def test_form_double_submit_without_javascript(
    shop: Shop, gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """JavaScript off, "Place order" and "Pay" each clicked again before the answer: one order, one charge."""
    page = shop.page
    sign_in(shop)
    made: list[int] = []

    def hold_the_first(route: Route) -> None:
        if made:
            route.continue_()
        else:  # the shop places the order; its answer is still on the way when the second click lands
            made.append(route.fetch(max_redirects=0).status)

    page.route("**/checkout", hold_the_first)
    page.fill("#amount", "7.25")
    click_twice(page, "#place-order", lambda: bool(made))
    assert made == [303]
    settle(page)
    page.unroute_all(behavior="ignoreErrors")
    assert len(shop.posts("/checkout")) == 2
    assert len({r.post_data for r in shop.posts("/checkout")}) == 1  # the same hidden key both times
    add_fault(gateway_url, "delay", delay=1.5)  # the first payment is at the bank when the second click lands
    click_twice(page, "#pay", lambda: bool(shop.posts(r"/checkout/\d+/pay")))
    settle(page, until="Paid. Thank you!")
    expect(page.locator("#payment-state")).to_have_text("Paid. Thank you!")
    pays = shop.posts(r"/checkout/\d+/pay")
    assert len(pays) >= 2
    assert len({r.post_data for r in pays}) == 1
    assert count(db, "orders") == 1
    assert payment_statuses(db) == ["succeeded"]
    assert len(charges(gateway_url)) == 1
    no_secrets_leaked(shop)


def click_twice(page: Page, selector: str, sent: Callable[[], bool]) -> None:
    """Click, and click the same spot again once the first request is ``sent`` and before its answer."""
    box = page.locator(selector).bounding_box()
    assert box is not None
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.click(x, y)  # mouse input: nothing waits for the navigation it starts
    deadline = time.monotonic() + 30
    while not sent():
        assert time.monotonic() < deadline, "the first click's request was never sent"
        page.wait_for_timeout(20)
    page.wait_for_timeout(100)
    page.mouse.click(x, y)


def settle(page: Page, until: str | None = None) -> None:
    """Wait for the order page; press "Check again" while the shop says it is still working on the form.

    :param until: also wait for the order page's payment state to read this. Right after a click the
        page shown may still be the order page the click left, while the browser navigates away from it.
    """
    state = page.locator("#payment-state" if until is None else f"#payment-state:text-is('{until}')")
    for _ in range(60):
        try:
            page.wait_for_load_state()
            if state.count():
                return
            if page.locator("#check-again").count():
                page.wait_for_timeout(1000)
                page.click("#check-again")
            else:
                page.wait_for_timeout(250)
        except PlaywrightError:  # the page navigated away while it was being looked at: look again
            page.wait_for_timeout(100)
    raise AssertionError(
        f"never reached the order page{'' if until is None else ' saying ' + until}: {page.url}"
    )
