"""The charges API: ``POST /charges`` makes one charge per ``Idempotency-Key``, a refund, and two lookups."""

from __future__ import annotations

import json
import re
from typing import Any

from flask import Blueprint, Response, request
from werkzeug.exceptions import BadRequest, NotFound, UnprocessableEntity

from flask_idem.errors import PROBLEM_JSON

from ..schemas import load
from . import faults
from .schemas import ChargeIn
from .store import Charge, current_store

__all__ = ["bp"]

bp = Blueprint("charges", __name__)

#: Any printable ASCII text up to 255 characters: callers derive keys as they like.
_KEY = re.compile(r"[ -~]{1,255}\Z")


class KeyReused(UnprocessableEntity):
    """422: the key already made a charge with a different amount, currency or source."""

    description = (
        "This Idempotency-Key was already used for a charge with a different amount, currency or "
        "source. A retry must repeat the original request; a new charge needs a new key."
    )


_charge_in = ChargeIn()


def _idempotency_key() -> str:
    key = request.headers.get("Idempotency-Key")
    if not key:
        raise BadRequest("POST /charges requires an Idempotency-Key header.")
    if not _KEY.match(key):
        raise BadRequest("The Idempotency-Key must be 1 to 255 printable ASCII characters.")
    return key


def _declined(charge: Charge) -> Response:
    body = {
        "type": "urn:example-gateway:problem:card-declined",
        "title": "Card declined",
        "status": 402,
        "detail": "The issuer declined this charge; a retry with this key gets the same answer.",
        "retryable": False,
        "charge_id": charge.id,
    }
    return Response(json.dumps(body), status=402, content_type=PROBLEM_JSON)


@bp.post("/charges")
def create_charge() -> Response | tuple[dict[str, Any], int]:
    """Charge a source once per key: 201 the first time, 200 with the same charge on a repeat.

    A source ending in ``decline`` makes a declined charge, answered 402 every time.
    """
    key = _idempotency_key()
    data = load(_charge_in, request.get_json())
    fault = faults.before_charge()
    status = "declined" if data["source"].endswith("decline") else "succeeded"
    charge, created = current_store().charge(key=key, status=status, **data)
    if (charge.amount, charge.currency, charge.source) != (
        data["amount"],
        data["currency"],
        data["source"],
    ):
        raise KeyReused()
    dropped = faults.after_charge(fault)
    if dropped is not None:
        return dropped
    if charge.status == "declined":
        return _declined(charge)
    return charge.to_dict(), 201 if created else 200


class NotRefundable(UnprocessableEntity):
    """422: only a charge that succeeded can be refunded."""

    description = "Only a charge that succeeded can be refunded."


@bp.post("/charges/<charge_id>/refund")
def refund_charge(charge_id: str) -> dict[str, Any]:
    """Refund a succeeded charge in full: 200 with the charge, the same on a repeat (one refund, one
    ``payment.refunded`` event); 404 for no such charge, 422 for a declined one."""
    charge, _ = current_store().refund(charge_id)
    if charge is None:
        raise NotFound("There is no such charge.")
    if charge.refunded_at is None:
        raise NotRefundable()
    return charge.to_dict()


@bp.get("/charges/by-key/<path:key>")
def charge_by_key(key: str) -> dict[str, Any]:
    """The charge made with ``key``; 404 when that key made none."""
    charge = current_store().charge_by_key(key)
    if charge is None:
        raise NotFound("No charge was made with this Idempotency-Key.")
    return charge.to_dict()


@bp.get("/charges")
def list_charges() -> dict[str, Any]:
    """Every charge with its key and amount, oldest first (a simulator has no secrets to keep)."""
    return {"charges": [charge.to_dict() for charge in current_store().charges()]}
