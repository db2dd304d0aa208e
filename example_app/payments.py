"""The payments API: ``POST /payments`` (multi-step, idempotent) and ``GET /payments/<id>``.

Paying calls the gateway, so the route is a :class:`flask_idem.flow.Flow` of three steps:

1. the view (one short transaction with the key reservation): check the order, insert a ``pending``
   payment, return the intent;
2. ``charge``: call the gateway with no transaction open, under a key derived from the organisation and
   the idempotency key, so the gateway charges once however often we ask; when resumed after a crash,
   look the charge up first;
3. ``record``: one short transaction that records the outcome and answers 201, or 402 for a decline.
"""

from __future__ import annotations

from typing import Any

from flask import g, url_for
from werkzeug.exceptions import HTTPException, NotFound, UnprocessableEntity

from flask_idem.flow import Flow, Run

from . import fulfilment, gateway_client
from .api import LOCATION, Blueprint, path_id
from .auth import authenticate
from .db import fetch_one
from .extensions import idem
from .problems import KeyAlreadyUsed, problem_exception
from .schemas import Payment, PaymentIn

bp = Blueprint("payments", __name__, description="Payments through the gateway, charged once per key.")
bp.before_request(authenticate)

pay = Flow("shop.payments.create")


class OrderAlreadyPaid(UnprocessableEntity):
    """422: the order has a payment that succeeded or is still in progress."""

    description = "This order is already paid, or a payment for it is in progress."


class PaymentDeclined(HTTPException):
    """402: the gateway declined the charge. Stored and replayed like any client error."""

    code = 402
    description = "The payment was declined. Paying again needs another source and a new key."


class PaymentFailed(UnprocessableEntity):
    """422: the gateway refused the charge request itself."""

    description = "The payment gateway refused this payment."


@bp.post("/payments")
@idem.idempotent(flow=pay)
@bp.arguments(PaymentIn, example={"order_id": 1, "source": "tok_visa"})
@bp.alt_response(201, schema=Payment, description="Created.", headers=LOCATION, success=True)
@bp.problems(401, 402, 404, 413, 415, 422, 500)
def create_payment(data: dict[str, Any]) -> dict[str, Any]:
    """Pay an order through the gateway

    201 with the payment, 402 if declined, 404 for an order of another organisation. The answer is
    made by the flow's last step (:func:`record`); this view returns the intent.
    """
    conn = idem.connection
    order = conn.execute(
        "SELECT amount, currency FROM orders WHERE id = %s AND org_id = %s FOR UPDATE",
        (data["order_id"], g.org_id),
    ).fetchone()
    if order is None:
        raise NotFound("There is no such order.")
    # No arbiter: a conflict on the key, or on payments_one_live_per_order (the order is already paid
    # or being paid), inserts nothing. The order's row lock above keeps payments of one order in turn.
    row = conn.execute(
        "INSERT INTO payments (org_id, order_id, idempotency_key, amount, currency)"
        " VALUES (%s, %s, %s, %s, %s)"
        " ON CONFLICT DO NOTHING"
        " RETURNING id",
        (g.org_id, data["order_id"], idem.key, *order),
    ).fetchone()
    if row is None:
        used = conn.execute(
            "SELECT 1 FROM payments WHERE org_id = %s AND idempotency_key = %s", (g.org_id, idem.key)
        ).fetchone()
        raise (
            KeyAlreadyUsed("A payment was already made with this Idempotency-Key.")
            if used
            else OrderAlreadyPaid()
        )
    amount, currency = order
    return {
        "payment_id": row[0],
        "order_id": data["order_id"],
        "amount": amount,
        "currency": currency,
        "source": data["source"],
        # Built here, in the request: the finish step may run in the recovery job, which has none.
        "location": url_for("payments.get_payment", payment_id=row[0]),
    }


def find_charge(run: Run) -> dict[str, Any] | None:
    """The charge the gateway made for this request, if any (the resolver of :func:`charge`)."""
    return gateway_client.find_charge(run.derived_key("charge"))


@pay.call(resolve=find_charge)
def charge(run: Run) -> dict[str, Any]:
    """Charge the order's amount at the gateway, once per request whatever happens."""
    intent = run.intent
    return gateway_client.charge(
        key=run.derived_key("charge"),
        amount=intent["amount"],
        currency=intent["currency"],
        source=intent["source"],
        reference=f"{run.org_id}:{intent['payment_id']}",  # echoed in the gateway's events
    )


@pay.finish
def record(run: Run) -> tuple[dict[str, Any], int, dict[str, str]]:
    """Record the gateway's answer on the payment and answer the client.

    The gateway's ``payment.succeeded`` event (:mod:`.gateway_events`) may have recorded the success
    first; a payment moves out of ``pending`` once, whichever comes first (both say the same).
    """
    outcome = run.results["charge"]
    payment = fetch_one(
        "UPDATE payments SET status = CASE WHEN status = 'pending' THEN %s ELSE status END,"
        " gateway_charge_id = coalesce(gateway_charge_id, %s), updated_at = now()"
        " WHERE org_id = %s AND id = %s"
        " RETURNING id, order_id, amount, currency, status, gateway_charge_id",
        (outcome["status"], outcome["charge_id"], run.org_id, run.intent["payment_id"]),
        conn=run.connection,
    )
    assert payment is not None
    fulfilment.after_payment(run, outcome)  # the fulfilment task's message, in this transaction
    if outcome["status"] == "declined":
        raise problem_exception(PaymentDeclined(), payment_id=payment["id"])
    if outcome["status"] != "succeeded":
        raise problem_exception(PaymentFailed(), payment_id=payment["id"])
    return payment, 201, {"Location": run.intent["location"]}


@bp.route("/payments/<int:payment_id>", parameters=[path_id("payment_id")])
@bp.response(200, Payment, description="OK.")
@bp.problems(401, 404, 500, 503)
def get_payment(payment_id: int) -> dict[str, Any]:
    """One payment

    Another organisation's payment is 404.
    """
    payment = fetch_one(
        "SELECT id, order_id, amount, currency, status, gateway_charge_id FROM payments"
        " WHERE id = %s AND org_id = %s",
        (payment_id, g.org_id),
    )
    if payment is None:
        raise NotFound("There is no such payment.")
    return payment
