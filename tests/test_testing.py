"""The test kit (flask_idem.testing) passes retry-safe routes and flags each planted bug in plain words."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem.testing import (
    NotRetrySafe,
    Rows,
    check_in_flight,
    check_mismatch,
    check_replay,
    check_scope,
    check_webhook_redelivery,
    crash_between_steps,
    hammer,
    unprotected_routes,
)

from .support.helpers import close_pool
from .support.testkit_app import SCHEMA, create_app
from .support.webhook_app import SCHEMA as HOOK_SCHEMA
from .support.webhook_app import build_webhook_app, event, sign

ORG_1, ORG_2 = {"X-Org": "1"}, {"X-Org": "2"}
ORDER = {"amount": 1250}


@pytest.fixture(scope="session")
def kit_database(database_url: str, direct_database_url: str) -> str:
    """This worker's database with the sample application's tables."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(SCHEMA)
    return database_url


@pytest.fixture
def kit_app(kit_database: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The sample application of tests/testkit_app.py."""
    kit_app = create_app(kit_database)
    yield kit_app
    close_pool(kit_app)


@pytest.fixture
def orders(db: psycopg.Connection[Any]) -> Rows:
    return Rows(db, "kit_orders")


@pytest.fixture
def charges(db: psycopg.Connection[Any]) -> Rows:
    return Rows(db, "kit_charges")


@pytest.fixture
def paid(db: psycopg.Connection[Any]) -> Rows:
    return Rows(db, "kit_payments", where="status = 'paid'")


@pytest.mark.parametrize("path", ["/orders", "/async/orders"], ids=["sync", "async"])
def test_a_retry_safe_route_passes_every_check(kit_app: Flask, orders: Rows, path: str) -> None:
    """The sample's POST /orders, and its async def twin, pass replay, mismatch, in-flight, scope and
    hammer checks."""
    first, again = check_replay(kit_app, "POST", path, json=ORDER, headers=ORG_1, effect=orders)
    assert (first.status_code, again.status_code) == (201, 200)
    assert (
        check_mismatch(
            kit_app, "POST", path, json=ORDER, changed={"amount": 1}, headers=ORG_1, effect=orders
        ).status_code
        == 422
    )
    held, duplicate = check_in_flight(kit_app, "POST", path, json=ORDER, headers=ORG_1, effect=orders)
    assert (held.status_code, duplicate.status_code) == (201, 409)
    check_scope(kit_app, "POST", path, json=ORDER, headers=ORG_1, other_headers=ORG_2, effect=orders)
    statuses = {
        r.status_code for r in hammer(kit_app, "POST", path, json=ORDER, headers=ORG_1, effect=orders)
    }
    assert statuses <= {201, 200, 409} and 201 in statuses
    assert orders() == 1 + 1 + 1 + 2 + 1  # one per check, two for the scope check


@pytest.mark.parametrize("path", ["/payments", "/async/payments"], ids=["sync", "async"])
def test_a_retry_safe_flow_survives_a_crash_after_each_step(
    kit_app: Flask, charges: Rows, paid: Rows, path: str
) -> None:
    """POST /payments, killed in its view and after each step (database, call, finish), charges once; so
    does its twin whose view and steps are all async def."""
    points = crash_between_steps(
        kit_app, "POST", path, json=ORDER, headers=ORG_1, outside=charges, effect=paid
    )
    assert points == ["view", "authorise", "charge", "finish"]
    assert charges() == paid() == 5  # the run without a crash, then one per point


def test_planted_bug_1_a_view_writing_on_a_second_connection(kit_app: Flask, orders: Rows) -> None:
    """A view that inserts on its own autocommit connection is caught: the killed attempt left a row."""
    with pytest.raises(NotRetrySafe, match="does the view write outside idem.connection") as caught:
        check_replay(kit_app, "POST", "/bad/side-connection", json=ORDER, headers=ORG_1, effect=orders)
    assert "killed before its COMMIT, yet the rows in kit_orders changed from 0 to 1" in str(caught.value)


def test_planted_bug_2_a_flow_calling_outside_in_its_view(kit_app: Flask, charges: Rows, paid: Rows) -> None:
    """A flow whose view calls the ledger is caught when the view's transaction is rolled back."""
    with pytest.raises(NotRetrySafe, match="the view is the flow's first, transactional step") as caught:
        crash_between_steps(
            kit_app, "POST", "/bad/charge-in-view", json=ORDER, headers=ORG_1, outside=charges, effect=paid
        )
    assert "the outside party saw 1 call(s)" in str(caught.value)


def test_planted_bug_3_an_outside_call_without_a_derived_key(
    kit_app: Flask, charges: Rows, paid: Rows
) -> None:
    """A call step that gives the ledger a new key per attempt is caught: two charges after a crash."""
    with pytest.raises(
        NotRetrySafe, match=r"must give the outside party a key from run\.derived_key\(\)"
    ) as e:
        crash_between_steps(
            kit_app, "POST", "/bad/random-key", json=ORDER, headers=ORG_1, outside=charges, effect=paid
        )
    assert "killed after 'charge_with_a_new_key' and then finished made 2 call(s)" in str(e.value)


def test_planted_bug_4_a_scope_from_the_request_body(kit_app: Flask, orders: Rows) -> None:
    """A scope read from the body lets a second organisation get the first one's stored answer."""
    body = {**ORDER, "org_id": 1}
    with pytest.raises(NotRetrySafe, match="got the first organisation's stored answer"):
        check_scope(
            kit_app, "POST", "/bad/body-scope", json=body, headers=ORG_1, other_headers=ORG_2, effect=orders
        )
    assert orders() == 1


def test_the_lint_lists_unsafe_routes_without_the_decorator(kit_app: Flask) -> None:
    """POST /refunds and the class-based view's DELETE are listed; the decorated routes and POST are not."""
    assert unprotected_routes(kit_app) == ["DELETE /notes (notes)", "POST /refunds (refund)"]


def test_an_undecorated_route_fails_the_checks(kit_app: Flask, orders: Rows) -> None:
    """check_replay, check_in_flight and hammer on a route without @idem.idempotent() say so."""
    with pytest.raises(NotRetrySafe, match=r"never reached flask-idem's transaction: is the view decorated"):
        check_replay(kit_app, "POST", "/refunds", json=ORDER, headers=ORG_1, effect=orders)
    with pytest.raises(NotRetrySafe, match="is the view decorated"):
        check_in_flight(kit_app, "POST", "/refunds", json=ORDER, headers=ORG_1, effect=orders)
    with pytest.raises(NotRetrySafe, match="8 of 8 concurrent requests .* answered as first requests"):
        hammer(kit_app, "POST", "/refunds", json=ORDER, headers=ORG_1, effect=orders)


def test_an_effect_that_counts_nothing_is_refused(kit_app: Flask, charges: Rows) -> None:
    """A check whose effect does not move on a 201 fails instead of passing vacuously."""
    with pytest.raises(NotRetrySafe, match=r"changed by 0 \(expected 1\): the effect must count"):
        check_replay(kit_app, "POST", "/orders", json=ORDER, headers=ORG_1, effect=charges)


def test_an_atomic_route_is_not_a_flow(kit_app: Flask, charges: Rows) -> None:
    """crash_between_steps on an atomic route says to use check_replay."""
    with pytest.raises(NotRetrySafe, match="is not a multi-step route"):
        crash_between_steps(kit_app, "POST", "/orders", json=ORDER, headers=ORG_1, outside=charges)


def test_the_failure_is_an_assertion_error() -> None:
    """pytest shows NotRetrySafe as a failed assertion, with its message."""
    assert issubclass(NotRetrySafe, AssertionError)


@pytest.fixture
def hook_app(database_url: str, direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The webhook application of tests/support/webhook_app.py."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(HOOK_SCHEMA)
    app = build_webhook_app(database_url, IDEM_POOL_MAX_SIZE=10)[0]
    yield app
    close_pool(app)


def new_event() -> bytes:
    return event(str(uuid.uuid4()))


def test_a_webhook_route_passes_the_redelivery_check(hook_app: Flask, db: psycopg.Connection[Any]) -> None:
    """check_webhook_redelivery passes an @idem.webhook route: one effect per event, every answer 2xx or
    409."""
    answers = check_webhook_redelivery(
        hook_app, "/hooks/plain", sign=sign, body=new_event, effect=Rows(db, "hook_effects")
    )
    assert len(answers) == 3 + 8
    assert Rows(db, "hook_effects")() == 2


def test_an_unprotected_webhook_route_fails_the_redelivery_check(
    hook_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A webhook route without @idem.webhook that writes on every delivery fails, saying so in plain words."""
    with pytest.raises(
        NotRetrySafe,
        match=r"delivering one event 3 times to POST /hooks/unprotected changed the rows in hook_effects by 3"
        r" \(expected 1, however often it is delivered\): is the view decorated with @idem.webhook",
    ):
        check_webhook_redelivery(
            hook_app, "/hooks/unprotected", sign=sign, body=new_event, effect=Rows(db, "hook_effects")
        )


def test_the_redelivery_check_needs_a_delivery_the_route_accepts(
    hook_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A sign() that the source refuses is reported as such, not as a route that is not redelivery-safe."""
    refused = r"answered 400 .*do sign\(body\)'s headers pass the route's source"
    with pytest.raises(NotRetrySafe, match=refused):
        check_webhook_redelivery(
            hook_app,
            "/hooks/plain",
            sign=lambda body: {"X-Test-Signature": "0"},
            body=new_event,
            effect=Rows(db, "hook_effects"),
        )
