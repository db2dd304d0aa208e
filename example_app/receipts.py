"""Receipt links: ``POST /orders/<id>/receipt-links`` mints a link to an order's receipt that anyone who
holds it may open (``GET /receipts/<token>``), without the API key, e.g. to forward to an accountant.

The link's token is a secret shown once: the shop keeps only its SHA-256. The answer that carries it is
kept for retries encrypted (``store_response="encrypted"``, with ``IDEM_RESPONSE_KEYS``): a client whose
first answer was lost gets the same link again on a retry, and the key table holds ciphertext only. The
answer has no ``Location`` header on purpose: headers are stored in clear, and the link's only address is
the secret itself.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from pathlib import Path
from typing import Any

from flask import Flask, g, url_for
from werkzeug.exceptions import NotFound

from .api import Blueprint, path_id
from .auth import authenticate
from .db import fetch_one
from .extensions import idem
from .schemas import Order, ReceiptLink

__all__ = ["bp", "public", "response_keys"]

bp = Blueprint("receipts", __name__, description="Links to an order's receipt, minted once per key.")
bp.before_request(authenticate)

#: The receipt itself: no API key, the token in the path is the credential.
public = Blueprint("receipt_pages", __name__, description="A receipt, for whoever holds its link.")

_TOKEN = re.compile(r"[A-Za-z0-9_-]{32}")


def response_keys(app: Flask) -> list[str]:
    """``IDEM_RESPONSE_KEYS`` when the configuration has none: one key, created at random once in the
    instance folder (as ``SECRET_KEY`` is), so every worker process of the shop shares it."""
    from .web import _instance_secret

    secret = _instance_secret(Path(app.instance_path) / "response_key")
    return [base64.urlsafe_b64encode(bytes.fromhex(secret)).decode("ascii")]


@bp.route("/orders/<int:order_id>/receipt-links", methods=["POST"], parameters=[path_id("order_id")])
@idem.idempotent(store_response="encrypted")
@bp.response(201, ReceiptLink, description="Created. The url is shown here only.")
@bp.problems(401, 404, 422, 500)
def create_receipt_link(order_id: int) -> tuple[dict[str, Any], int]:
    """Mint a receipt link

    A retry with the same ``Idempotency-Key`` gets the same link again; a new key mints another.
    """
    token = secrets.token_urlsafe(24)
    link = fetch_one(
        "INSERT INTO receipt_links (org_id, order_id, token_sha)"
        " SELECT org_id, id, %s FROM orders WHERE org_id = %s AND id = %s"
        " RETURNING id, created_at",
        (hashlib.sha256(token.encode("ascii")).digest(), g.org_id, order_id),
        conn=idem.connection,
    )
    if link is None:
        raise NotFound("There is no such order.")
    url = url_for("receipt_pages.show_receipt", token=token)
    return {"id": link["id"], "order_id": order_id, "url": url, "created_at": link["created_at"]}, 201


_TOKEN_PARAMETER = {
    "in": "path",
    "name": "token",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{32}$"},
}


@public.route("/receipts/<token>", parameters=[_TOKEN_PARAMETER])
@public.doc(security=[])  # the token is the credential: no API key
@public.response(200, Order, description="OK.")
@public.problems(404, 500, 503)
def show_receipt(token: str) -> dict[str, Any]:
    """An order's receipt, for the holder of its link"""
    order = None
    if _TOKEN.fullmatch(token):
        order = fetch_one(
            "SELECT o.id, o.amount, o.currency, o.created_at"
            " FROM receipt_links AS r JOIN orders AS o ON o.org_id = r.org_id AND o.id = r.order_id"
            " WHERE r.token_sha = %s",
            (hashlib.sha256(token.encode("ascii")).digest(),),
        )
    if order is None:
        raise NotFound("There is no such receipt.")
    return order
