"""Schemathesis against the shop's own OpenAPI document: no server errors, every answer as documented.

Schemathesis's pytest integration (``from_fixture`` and ``parametrize``) reads a private attribute that
pytest 9.2 no longer has, so each operation's Hypothesis strategy is driven here with ``given`` instead.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from example_app.cli import create_org

from ..support.shop_actions import place_order

OPERATIONS = [
    ("POST", "/orders"),
    ("GET", "/orders"),
    ("GET", "/orders/{order_id}"),
    ("POST", "/payments"),
    ("GET", "/payments/{payment_id}"),
    ("POST", "/orders/{order_id}/receipt-links"),
    ("GET", "/receipts/{token}"),
]

#: Every built-in check but one. "Schema-valid request rejected" also fires for the shop's 422s on business
#: grounds (an order already paid), so it is replaced below by the narrower promise that a schema-valid body
#: never fails validation.
EXCLUDED = [schemathesis.checks.positive_data_acceptance]

CANONICAL_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


@pytest.fixture
def shop_key(shop: Flask) -> str:
    """The API key of an organisation whose first order (id 1, the document's example) is there to pay."""
    with shop.app_context():
        key = create_org("schemathesis")[1]
    assert place_order(shop.test_client(), key, 500) == 1
    return key


def _fresh_key(case: Any) -> None:
    """A generated UUID key becomes a fresh one, so cases never replay each other; others stay as made."""
    value = (case.headers or {}).get("Idempotency-Key")
    if isinstance(value, str) and CANONICAL_UUID.fullmatch(value):
        case.headers["Idempotency-Key"] = str(uuid.uuid4())


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_shop_conforms(shop: Flask, shop_key: str, method: str, path: str, mode: GenerationMode) -> None:
    """Every generated request gets a documented status, content type, headers and body, never a 5xx."""
    operation = schemathesis.openapi.from_wsgi("/openapi.json", shop)[path][method]
    # Always the organisation's key, so that negative cases reach the body and the Idempotency-Key
    # (hostile/test_shop.py::test_odd_authorization_headers covers wrong credentials).
    auth = {"Authorization": f"Bearer {shop_key}"}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(case: Any) -> None:
        _fresh_key(case)
        response = case.call_and_validate(headers=auth, excluded_checks=EXCLUDED)
        if mode.is_positive and response.status_code == 422:
            assert "errors" not in response.json(), response.json()

    check()


@pytest.mark.parametrize("path", ["/orders", "/payments"], ids=["orders", "payments"])
def test_document_examples_succeed(shop: Flask, shop_key: str, path: str) -> None:
    """The request example of each POST in the document, sent as it is, succeeds (order 1 gets paid)."""
    schema = schemathesis.openapi.from_wsgi("/openapi.json", shop)
    examples = schema.get_strategies_from_examples(schema[path]["POST"])
    assert examples

    @given(case=examples[0])
    @settings(max_examples=1, deadline=None, database=None)
    def send(case: Any) -> None:
        case.headers = {**(case.headers or {}), "Idempotency-Key": str(uuid.uuid4())}
        response = case.call_and_validate(headers={"Authorization": f"Bearer {shop_key}"})
        assert response.status_code == 201, response.text

    send()
