"""A sample application for the test kit: retry-safe routes, and one route per planted bug.

The outside party is a ledger of charges in its own table, written on its own autocommit connection, as
a payment provider's system would be: it deduplicates by the key it is given, and a call is never rolled
back with the request that made it.

Planted bugs, each one a route the kit must flag:

1. ``POST /bad/side-connection``: the view writes its order on a second connection, which commits on its
   own.
2. ``POST /bad/charge-in-view``: a flow whose view (the first, transactional step) calls the ledger.
3. ``POST /bad/random-key``: a flow whose call step gives the ledger a new key on every attempt.
4. ``POST /bad/body-scope``: the scope is read from the request body instead of the credentials.

``POST /async/orders`` and ``POST /async/payments`` are ``async def`` twins of ``POST /orders`` and
``POST /payments`` (every step of the flow async too), for the same checks. A request with an ``X-Hold``
header waits inside its transaction, before it writes, until the test that holds the advisory lock
:data:`HOLD_LOCK` lets it go: how tests against a served application (gunicorn) hold a request in flight.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import psycopg
from flask import Flask, request
from flask.views import MethodView

from flask_idem import Flow, Idempotency, Run

SCHEMA = """
CREATE TABLE IF NOT EXISTS kit_orders (
    id bigserial PRIMARY KEY, org_id bigint NOT NULL, idem_key uuid, amount integer NOT NULL
);
CREATE TABLE IF NOT EXISTS kit_payments (
    id bigserial PRIMARY KEY, org_id bigint NOT NULL, idem_key uuid NOT NULL, amount integer NOT NULL,
    status text NOT NULL DEFAULT 'pending', charge text
);
CREATE TABLE IF NOT EXISTS kit_charges (charge_key text PRIMARY KEY, amount integer NOT NULL);
"""

#: The advisory lock a request with ``X-Hold`` waits for, inside its transaction.
HOLD_LOCK = 2323


def org_from_credentials() -> int | None:
    """The organisation authenticated by the ``X-Org`` header (a stand-in for an API key)."""
    value = request.headers.get("X-Org")
    return int(value) if value else None


def org_from_body() -> int | None:
    """Planted bug 4: the organisation the client claims in the body."""
    return int(request.get_json()["org_id"])


class Ledger:
    """The outside party: charges recorded once per key, on a connection of its own."""

    def __init__(self, url: str) -> None:
        self.url = url

    def charge(self, key: str, amount: int) -> dict[str, Any]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO kit_charges (charge_key, amount) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (key, amount),
            )
        return {"charge": key}

    def find(self, key: str) -> dict[str, Any] | None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT charge_key FROM kit_charges WHERE charge_key = %s", (key,)).fetchone()
        return None if row is None else {"charge": row[0]}


def create_app(database_url: str) -> Flask:
    """The sample application on ``database_url`` (tables: :data:`SCHEMA`)."""
    app = Flask(__name__)
    app.config.from_prefixed_env()  # as a user's app would: FLASK_IDEM_* settings apply (PgBouncer mode)
    app.config.update(TESTING=True, IDEM_DATABASE_URL=database_url, IDEM_POOL_TIMEOUT=5.0)
    idem = Idempotency(app, scope=org_from_credentials)
    ledger = Ledger(database_url)

    def insert_order(conn: psycopg.Connection[Any], org_id: int | None) -> dict[str, Any]:
        if request.headers.get("X-Hold"):
            conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (HOLD_LOCK,))
        row = conn.execute(
            "INSERT INTO kit_orders (org_id, idem_key, amount) VALUES (%s, %s, %s) RETURNING id",
            (org_id, idem.key, request.get_json()["amount"]),
        ).fetchone()
        assert row is not None
        return {"id": row[0], "amount": request.get_json()["amount"]}

    @app.post("/orders")
    @idem.idempotent()
    def create_order() -> Any:
        return insert_order(idem.connection, org_from_credentials()), 201

    @app.post("/async/orders")
    @idem.idempotent()
    async def create_order_async() -> Any:
        await asyncio.sleep(0)
        order = insert_order(idem.connection, org_from_credentials())
        await asyncio.sleep(0.001)  # the transaction stays open across awaits
        return order, 201

    @app.post("/bad/side-connection")
    @idem.idempotent()
    def create_order_on_the_side() -> Any:
        with psycopg.connect(database_url, autocommit=True) as conn:  # planted bug 1
            return insert_order(conn, org_from_credentials()), 201

    @app.post("/bad/body-scope")
    @idem.idempotent(scope=org_from_body)  # planted bug 4
    def create_order_for_the_body() -> Any:
        return insert_order(idem.connection, org_from_credentials()), 201

    @app.post("/refunds")
    def refund() -> Any:  # not idempotent: the lint lists it
        return {}, 201

    class Notes(MethodView):
        @idem.idempotent()
        def post(self) -> Any:
            return {}, 201

        def delete(self) -> Any:  # not idempotent: the lint lists it
            return "", 204

    app.add_url_rule("/notes", view_func=Notes.as_view("notes"))

    def start_payment() -> dict[str, Any]:
        amount = request.get_json()["amount"]
        row = idem.connection.execute(
            "INSERT INTO kit_payments (org_id, idem_key, amount) VALUES (%s, %s, %s) RETURNING id",
            (org_from_credentials(), idem.key, amount),
        ).fetchone()
        assert row is not None
        return {"payment_id": row[0], "amount": amount}

    def finish_payment(run: Run) -> Any:
        charge = run.results.get("charge", run.intent.get("charge"))
        run.connection.execute(
            "UPDATE kit_payments SET status = 'paid', charge = %s WHERE id = %s",
            (charge["charge"], run.intent["payment_id"]),
        )
        return {"id": run.intent["payment_id"], "status": "paid"}, 201

    pay = Flow("kit.pay")

    @pay.step
    def authorise(run: Run) -> str:
        run.connection.execute(
            "UPDATE kit_payments SET status = 'charging' WHERE id = %s", (run.intent["payment_id"],)
        )
        return "charging"

    @pay.call(resolve=lambda run: ledger.find(run.derived_key("charge")))
    def charge(run: Run) -> dict[str, Any]:
        return ledger.charge(run.derived_key("charge"), run.intent["amount"])

    pay.finish(finish_payment)

    @app.post("/payments")
    @idem.idempotent(flow=pay)
    def create_payment() -> Any:
        return start_payment()

    pay_async = _async_flow(ledger, finish_payment)

    @app.post("/async/payments")
    @idem.idempotent(flow=pay_async)
    async def create_payment_async() -> Any:
        await asyncio.sleep(0)
        return start_payment()

    pay_in_view = Flow("kit.pay-in-view")
    pay_in_view.finish(finish_payment)

    @app.post("/bad/charge-in-view")
    @idem.idempotent(flow=pay_in_view)
    def create_payment_charging_in_view() -> Any:
        intent = start_payment()
        intent["charge"] = ledger.charge(str(idem.key), intent["amount"])  # planted bug 2
        return intent

    pay_random = Flow("kit.pay-random-key")

    @pay_random.call
    def charge_with_a_new_key(run: Run) -> dict[str, Any]:
        return {"charge": ledger.charge(str(uuid.uuid4()), run.intent["amount"])["charge"]}  # planted bug 3

    pay_random.finish(lambda run: finish_payment(_renamed(run, "charge_with_a_new_key")))

    @app.post("/bad/random-key")
    @idem.idempotent(flow=pay_random)
    def create_payment_with_random_key() -> Any:
        return start_payment()

    return app


def served() -> Flask:
    """The sample application on the database named by ``KIT_DATABASE_URL``, for gunicorn."""
    return create_app(os.environ["KIT_DATABASE_URL"])


def _async_flow(ledger: Ledger, finish_payment: Any) -> Flow:
    """The payment flow of ``POST /payments`` with every step ``async def``."""
    flow = Flow("kit.pay-async")

    @flow.step
    async def authorise(run: Run) -> str:
        await asyncio.sleep(0)
        run.connection.execute(
            "UPDATE kit_payments SET status = 'charging' WHERE id = %s", (run.intent["payment_id"],)
        )
        return "charging"

    async def find(run: Run) -> dict[str, Any] | None:
        await asyncio.sleep(0)
        return ledger.find(run.derived_key("charge"))

    @flow.call(resolve=find)
    async def charge(run: Run) -> dict[str, Any]:
        await asyncio.sleep(0)
        return ledger.charge(run.derived_key("charge"), run.intent["amount"])

    @flow.finish
    async def finish(run: Run) -> Any:
        await asyncio.sleep(0)
        return finish_payment(run)

    return flow


def _renamed(run: Run, step: str) -> Run:
    """``run`` with the result of ``step`` under the name ``charge``, as :func:`finish_payment` reads it."""
    run.results["charge"] = run.results[step]
    return run
