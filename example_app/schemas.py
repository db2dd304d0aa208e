"""Request and response schemas of the shop (marshmallow)."""

from __future__ import annotations

import re
from typing import Any

from marshmallow import Schema, ValidationError, fields, validate

__all__ = ["OrderIn", "StrictInteger", "not_a_card_number"]

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


class OrderIn(Schema):
    """``POST /orders``: an amount in minor units (cents) and an ISO 4217 currency code."""

    amount = StrictInteger(required=True, validate=validate.Range(min=1, max=BIGINT_MAX))
    currency = fields.String(
        required=True,
        validate=validate.Regexp(r"[A-Z]{3}\Z", error="Must be three uppercase letters."),
    )


def load(schema: Schema, data: Any) -> dict[str, Any]:
    """Validate ``data`` with ``schema``; a failure becomes a 422 problem with the field errors."""
    from .problems import ValidationFailed

    try:
        result: dict[str, Any] = schema.load(data)
    except ValidationError as e:
        raise ValidationFailed(e.normalized_messages()) from None  # type: ignore[no-untyped-call]
    return result
