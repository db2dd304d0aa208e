"""Request and response schemas of the shop (marshmallow): what the routes validate and answer, and what
the OpenAPI document says about both."""

from __future__ import annotations

import re
from typing import Any

from marshmallow import INCLUDE, Schema, ValidationError, fields, validate

__all__ = [
    "BIGINT_MAX",
    "Order",
    "OrderIn",
    "OrderList",
    "Payment",
    "PaymentIn",
    "Problem",
    "StrictInteger",
    "currency_code",
    "load",
    "not_a_card_number",
    "positive_bigint",
]

BIGINT_MAX = 2**63 - 1

#: Twelve or more digits, maybe grouped by spaces or dashes: what a card number looks like.
_CARD_NUMBER = re.compile(r"\d(?:[ -]?\d){11}")


def not_a_card_number(value: str) -> None:
    """Refuse a value that holds a card number; the message never repeats the value."""
    if _CARD_NUMBER.search(value):
        raise ValidationError("Must be a payment token such as tok_visa, never a card number.")


class StrictInteger(fields.Integer):
    """An integer that must arrive as a JSON integer: not a string, a float, or ``true``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(strict=True, **kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if isinstance(value, bool):
            raise self.make_error("invalid")
        result: int = super()._deserialize(value, attr, data, **kwargs)
        return result


def currency_code() -> fields.String:
    """A required ISO 4217 currency code: three uppercase letters."""
    return fields.String(
        required=True,
        validate=validate.Regexp(r"[A-Z]{3}\Z", error="Must be three uppercase letters."),
        metadata={"description": "ISO 4217 code."},
    )


def positive_bigint(**metadata: Any) -> StrictInteger:
    """A required JSON integer from 1 to the largest PostgreSQL ``bigint``."""
    return StrictInteger(required=True, validate=validate.Range(min=1, max=BIGINT_MAX), metadata=metadata)


# -- requests ----------------------------------------------------------------------------------------------


class OrderIn(Schema):
    """``POST /orders``: an amount in minor units (cents) and an ISO 4217 currency code."""

    amount = positive_bigint(description="In minor units (cents).")
    currency = currency_code()


class PaymentIn(Schema):
    """``POST /payments``: which order to pay, with which payment token."""

    order_id = positive_bigint()
    source = fields.String(
        required=True,
        validate=[
            validate.Regexp(r"tok_[A-Za-z0-9_]{1,60}\Z", error="Must be a payment token such as tok_visa."),
            not_a_card_number,
        ],
    )


# -- answers -----------------------------------------------------------------------------------------------


class Order(Schema):
    """An order as the API answers it."""

    id = fields.Integer(required=True)
    amount = fields.Integer(required=True, metadata={"description": "In minor units (cents)."})
    currency = fields.String(required=True, metadata={"description": "ISO 4217 code."})
    created_at = fields.DateTime(required=True)


class OrderList(Schema):
    """The organisation's orders, oldest first."""

    orders = fields.List(fields.Nested(Order), required=True)


class ReceiptLink(Schema):
    """A receipt link as minted: its url holds the secret token, shown in this answer only."""

    id = fields.Integer(required=True)
    order_id = fields.Integer(required=True)
    url = fields.String(required=True, metadata={"description": "GET it, without the API key."})
    created_at = fields.DateTime(required=True)


class Payment(Schema):
    """A payment as the API answers it. It never carries the payment source."""

    id = fields.Integer(required=True)
    order_id = fields.Integer(required=True)
    amount = fields.Integer(required=True)
    currency = fields.String(required=True)
    status = fields.String(
        required=True, validate=validate.OneOf(["pending", "succeeded", "declined", "failed"])
    )
    gateway_charge_id = fields.String(required=True, allow_none=True)


class Health(Schema):
    """Whether the shop (and, for readiness, its database) answers."""

    status = fields.String(required=True, validate=validate.OneOf(["ok"]))
    warnings = fields.List(
        fields.String(),
        metadata={"description": "Readiness: what needs a person soon, such as partitions running out."},
    )


class Problem(Schema):
    """An RFC 9457 problem document; extension members (``errors``, ``retry_after``...) may follow."""

    class Meta:
        unknown = INCLUDE

    type = fields.String(required=True, metadata={"description": "A URI: about:blank or urn:..."})
    title = fields.String(required=True)
    status = fields.Integer(required=True, validate=validate.Range(min=400, max=599))
    detail = fields.String()
    retryable = fields.Boolean(
        required=True,
        metadata={"description": "Whether the same request with the same key may get another answer later."},
    )
    errors = fields.Dict(metadata={"description": "422 validation errors: messages by field name."})
    retry_after = fields.Integer(metadata={"description": "Seconds, as in the Retry-After header."})
    payment_id = fields.Integer(metadata={"description": "402 and payment failures: the payment recorded."})
    retention = fields.Dict(metadata={"description": "409, 410 and 422: how long keys are kept, in seconds."})


def load(schema: Schema, data: Any) -> dict[str, Any]:
    """Validate ``data`` with ``schema``; a failure becomes a 422 problem with the field errors.

    The shop's routes get this from :class:`.api.Blueprint`'s ``arguments``; the gateway calls it.
    """
    from .problems import ValidationFailed

    try:
        result: dict[str, Any] = schema.load(data)
    except ValidationError as e:
        raise ValidationFailed(e.normalized_messages()) from None  # type: ignore[no-untyped-call]
    return result
