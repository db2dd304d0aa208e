"""Receipt links (example_app/receipts.py): a secret in the answer, kept for retries encrypted."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from flask.testing import FlaskClient

from flask_idem.testing import Rows, check_replay

from ..support.helpers import headers


def new_order(client: FlaskClient, api_key: str) -> int:
    answer = client.post(
        "/orders", json={"amount": 990, "currency": "EUR"}, headers=headers(api_key, uuid.uuid4())
    )
    assert answer.status_code == 201 and answer.json is not None
    order_id: int = answer.json["id"]
    return order_id


def test_a_link_is_minted_once_and_its_secret_is_kept_encrypted(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any]
) -> None:
    """The first answer and its retry give the same link, which opens the receipt without the API key;
    the key table holds no trace of the token."""
    order_id = new_order(client, api_key)
    key = uuid.uuid4()
    first = client.post(f"/orders/{order_id}/receipt-links", headers=headers(api_key, key))
    assert first.status_code == 201, first.data
    assert first.json is not None
    url = first.json["url"]
    again = client.post(f"/orders/{order_id}/receipt-links", headers=headers(api_key, key))
    assert again.status_code == 200 and again.json == first.json
    token = url.rsplit("/", 1)[1]
    (document,) = db.execute(
        "SELECT response FROM idempotency_keys WHERE idem_key = %s", (key,)
    ).fetchone() or (None,)
    assert document is not None and "body_enc" in document
    assert token not in json.dumps(document)
    receipt = client.get(url)
    assert receipt.status_code == 200 and receipt.json is not None
    assert (receipt.json["id"], receipt.json["amount"]) == (order_id, 990)
    assert client.get(url[:-1] + ("A" if url[-1] != "A" else "B")).status_code == 404
    assert db.execute("SELECT count(*) FROM receipt_links").fetchone() == (1,)


def test_another_organisations_order_is_404(
    client: FlaskClient, make_org: Callable[[str], tuple[int, str]], api_key: str, db: psycopg.Connection[Any]
) -> None:
    """A link to an order of another organisation is not minted."""
    order_id = new_order(client, api_key)
    _, other = make_org("other")
    answer = client.post(f"/orders/{order_id}/receipt-links", headers=headers(other, uuid.uuid4()))
    assert answer.status_code == 404
    assert db.execute("SELECT count(*) FROM receipt_links").fetchone() == (0,)


def test_the_kit_passes_the_route(client: FlaskClient, api_key: str, db: psycopg.Connection[Any]) -> None:
    """check_replay: killed inside its transaction nothing stays, then one link, then its replay."""
    order_id = new_order(client, api_key)
    first, again = check_replay(
        client,
        "POST",
        f"/orders/{order_id}/receipt-links",
        headers=headers(api_key),
        effect=Rows(db, "receipt_links"),
    )
    assert (first.status_code, again.status_code) == (201, 200)
