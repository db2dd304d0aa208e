"""The gateway's webhook events, applied once: ``POST /webhooks/gateway``.

The gateway (:mod:`example_app.gateway.events`) posts ``payment.succeeded`` and ``payment.refunded`` at
least once, sometimes twice at the same moment, and not always in order. The route is an
``@idem.webhook``: a delivery is verified first (Standard Webhooks signatures), and each event id is
handled once, in one transaction with the payment's update; a redelivery gets the first answer.

The updates commute, so the order of arrival does not matter:

- ``payment.succeeded`` moves a ``pending`` payment to ``succeeded`` with the gateway's charge id, and
  nothing else (the payment flow's last step may have recorded it already: the first of the two wins,
  and both say the same);
- ``payment.refunded`` sets the payment's ``refunded_at`` once, whatever its status: a refund that
  arrives before its success is recorded, and the success arriving later still moves the payment from
  ``pending`` to ``succeeded`` and never clears the refund.

Each event handled writes one row to ``payment_events``, saying whether it moved the payment, so that a
duplicate application would show.
"""

from __future__ import annotations

from typing import Any

from flask import Flask

from flask_idem import webhooks

from .extensions import idem

__all__ = ["gateway_source", "init_app"]


def gateway_source(secret: str, window: float | None = None) -> webhooks.Source:
    """The gateway as a webhook source: it signs as Standard Webhooks says, with ``secret``
    (``whsec_`` and base64), and its events carry their id in ``webhook-id``, kept ``window`` seconds
    (the source's default, three days, when ``None``)."""
    if window is None:
        return webhooks.standard(secret, name="gateway")
    return webhooks.standard(secret, name="gateway", window=window)


def init_app(app: Flask) -> None:
    """Add ``POST /webhooks/gateway`` to ``app`` when ``GATEWAY_WEBHOOK_SECRET`` is set."""
    secret = app.config.get("GATEWAY_WEBHOOK_SECRET")
    if not secret or "gateway_events.gateway_webhook" in app.view_functions:
        return

    @idem.webhook(gateway_source(secret, app.config.get("GATEWAY_WEBHOOK_WINDOW")))
    def gateway_webhook() -> tuple[dict[str, Any], int]:
        event = idem.event.json()
        return apply(idem.event.id, event), 200

    app.add_url_rule("/webhooks/gateway", "gateway_events.gateway_webhook", gateway_webhook, methods=["POST"])


def apply(event_id: str, event: dict[str, Any]) -> dict[str, Any]:
    """Apply one event to its payment on the key's connection; what it did, as the answer's body."""
    try:
        kind, charge = event["type"], event["data"]["charge"]
        org_id, payment_id = (int(part) for part in str(charge["reference"]).split(":"))
    except (KeyError, TypeError, ValueError):
        return {"applied": False, "reason": "not an event of a shop payment"}
    conn = idem.connection
    if kind == "payment.succeeded":
        moved = conn.execute(
            "UPDATE payments SET status = 'succeeded', gateway_charge_id = %s, updated_at = now()"
            " WHERE org_id = %s AND id = %s AND status = 'pending'",
            (charge["id"], org_id, payment_id),
        ).rowcount
    elif kind == "payment.refunded":
        moved = conn.execute(
            "UPDATE payments SET refunded_at = now(), updated_at = now()"
            " WHERE org_id = %s AND id = %s AND refunded_at IS NULL",
            (org_id, payment_id),
        ).rowcount
    else:
        return {"applied": False, "reason": f"no use for {kind!r}"}
    conn.execute(
        "INSERT INTO payment_events (org_id, payment_id, event_id, type, moved) VALUES (%s, %s, %s, %s, %s)",
        (org_id, payment_id, event_id, kind, moved == 1),
    )
    return {"applied": True, "payment_id": payment_id, "moved": moved == 1}
