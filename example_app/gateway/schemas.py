"""Request schemas of the gateway simulator (marshmallow)."""

from __future__ import annotations

from marshmallow import Schema, fields, validate

from ..schemas import StrictInteger, currency_code, not_a_card_number, positive_bigint

__all__ = ["MODES", "WEBHOOK_MODES", "ChargeIn", "FaultIn"]

#: The faults of webhook deliveries (see :mod:`.events`), taken by the next events, not by charge requests.
WEBHOOK_MODES = ("webhook_duplicate", "webhook_reorder", "webhook_fail_first")

#: The fault modes, in the order a charge request meets them (see :mod:`.faults`).
MODES = ("delay", "fail_before", "fail_after", "drop_after") + WEBHOOK_MODES


class ChargeIn(Schema):
    """``POST /charges``: an amount in minor units, an ISO 4217 currency and a payment token."""

    amount = positive_bigint()
    currency = currency_code()
    source = fields.String(
        required=True,
        validate=[
            validate.Regexp(
                r"[!-~]{1,255}\Z",
                error="Must be a payment token: 1 to 255 printable ASCII characters, no spaces.",
            ),
            not_a_card_number,
        ],
    )
    #: The caller's reference, echoed in the charge's webhook events (the shop sends "org:payment").
    reference = fields.String(
        load_default=None, validate=validate.Regexp(r"[ -~]{1,255}\Z", error="1 to 255 printable ASCII.")
    )


class FaultIn(Schema):
    """``POST /_faults``: a mode, how many charge requests it affects, and an optional delay."""

    mode = fields.String(required=True, validate=validate.OneOf(MODES))
    count = StrictInteger(required=True, validate=validate.Range(min=1, max=10_000))
    # Under gunicorn's default 30 s worker timeout a longer sleep would kill the worker.
    delay = fields.Float(load_default=0.0, validate=validate.Range(min=0, max=25))
