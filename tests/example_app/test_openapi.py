"""The shop's generated OpenAPI document: valid OpenAPI 3, every route, the key header, errors as problems."""

from __future__ import annotations

from typing import Any

import pytest
from flask.testing import FlaskClient
from openapi_spec_validator import validate

from flask_idem.errors import PROBLEM_JSON

WRITES = ["/orders", "/payments", "/orders/{order_id}/receipt-links"]
READS = [
    "/orders",
    "/orders/{order_id}",
    "/payments/{payment_id}",
    "/receipts/{token}",
    "/health",
    "/health/ready",
]
OPERATIONS = [("post", path) for path in WRITES] + [("get", path) for path in READS]
OPERATION_IDS = [f"{method.upper()} {path}" for method, path in OPERATIONS]

#: The documented answers of each operation.
STATUSES = {
    ("post", "/orders"): {200, 201, 303, 400, 401, 409, 410, 413, 415, 422, 500, 503},
    ("post", "/payments"): {200, 201, 303, 400, 401, 402, 404, 409, 410, 413, 415, 422, 500, 503},
    ("get", "/orders"): {200, 401, 500, 503},
    ("get", "/orders/{order_id}"): {200, 401, 404, 500, 503},
    ("get", "/payments/{payment_id}"): {200, 401, 404, 500, 503},
    # No Location (it would be stored in clear), so no 303 for a late retry; 404: another org's order.
    ("post", "/orders/{order_id}/receipt-links"): {200, 201, 400, 401, 404, 409, 410, 422, 500, 503},
    ("get", "/receipts/{token}"): {200, 404, 500, 503},  # the token is the credential: no 401
    ("get", "/health"): {200},
    ("get", "/health/ready"): {200, 500, 503},
}


@pytest.fixture
def document(client: FlaskClient) -> dict[str, Any]:
    """The document as the shop serves it, to anyone."""
    response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.mimetype == "application/json"
    body: dict[str, Any] = response.json  # type: ignore[assignment]
    return body


def deref(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or the component its local ``$ref`` names."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target: Any = document
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    result: dict[str, Any] = target
    return result


def test_document_is_valid_openapi_3(document: dict[str, Any]) -> None:
    """The document passes the OpenAPI 3.0 validator."""
    assert document["openapi"].startswith("3.")
    validate(document)


def test_document_needs_no_api_key(client: FlaskClient) -> None:
    """GET /openapi.json answers without an Authorization header, while the API itself answers 401."""
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/orders").status_code == 401


def test_every_route_is_described(document: dict[str, Any]) -> None:
    """The paths and methods are exactly the shop's routes."""
    described = {
        (method, path)
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert described == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=OPERATION_IDS)
def test_statuses(document: dict[str, Any], method: str, path: str) -> None:
    """Each operation documents its successes and every error it can answer."""
    assert set(map(int, document["paths"][path][method]["responses"])) == STATUSES[method, path]


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=OPERATION_IDS)
def test_errors_are_problems(document: dict[str, Any], method: str, path: str) -> None:
    """Every error response is application/problem+json with the Problem schema."""
    for status, response in document["paths"][path][method]["responses"].items():
        if int(status) >= 400:
            assert list(response["content"]) == [PROBLEM_JSON], status
            assert response["content"][PROBLEM_JSON]["schema"] == {"$ref": "#/components/schemas/Problem"}
    problem = document["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "retryable"}
    assert problem["additionalProperties"] is True


@pytest.mark.parametrize("path", WRITES, ids=["orders", "payments", "receipt-links"])
def test_writes_require_a_uuid_key(document: dict[str, Any], path: str) -> None:
    """The POST routes require the Idempotency-Key header, a UUID."""
    parameters = [deref(document, p) for p in document["paths"][path]["post"]["parameters"]]
    (key,) = [p for p in parameters if p["name"] == "Idempotency-Key"]
    assert (key["in"], key["required"], key["schema"]) == (
        "header",
        True,
        {"type": "string", "format": "uuid"},
    )


@pytest.mark.parametrize("path", READS, ids=["orders", "order", "payment", "receipt", "health", "ready"])
def test_reads_take_no_key(document: dict[str, Any], path: str) -> None:
    """The GET routes have no Idempotency-Key parameter."""
    parameters = document["paths"][path].get("parameters", []) + document["paths"][path]["get"].get(
        "parameters", []
    )
    assert all(deref(document, p)["name"] != "Idempotency-Key" for p in parameters)


@pytest.mark.parametrize("path", WRITES, ids=["orders", "payments", "receipt-links"])
def test_replay_is_documented(document: dict[str, Any], path: str) -> None:
    """A POST documents the 200 replay of its 201: same body schema, and the Idempotent-Replayed header."""
    responses = document["paths"][path]["post"]["responses"]
    assert responses["200"]["content"] == responses["201"]["content"]
    replayed = deref(document, responses["200"]["headers"]["Idempotent-Replayed"])
    assert replayed["required"] is True
    assert replayed["schema"] == {"type": "string", "enum": ["true"]}
    assert "Idempotent-Replayed" not in responses["201"].get("headers", {})


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=OPERATION_IDS)
def test_retry_after_is_documented(document: dict[str, Any], method: str, path: str) -> None:
    """Every 409 and 503 carries a required Retry-After header."""
    for status, response in document["paths"][path][method]["responses"].items():
        if status in ("409", "503"):
            header = deref(document, response["headers"]["Retry-After"])
            assert header["required"] is True and header["schema"] == {"type": "integer"}


def test_bearer_authentication(document: dict[str, Any], client: FlaskClient) -> None:
    """The API key is an HTTP bearer scheme, required by every operation but the receipt a link opens and
    the health checks, which answer without one."""
    assert document["components"]["securitySchemes"]["bearerAuth"]["type"] == "http"
    assert document["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert document["security"] == [{"bearerAuth": []}]
    security = {
        path: op.get("security")
        for path, item in document["paths"].items()
        for method, op in item.items()
        if method != "parameters"
    }
    public = {"/receipts/{token}", "/health", "/health/ready"}
    assert {path for path, value in security.items() if value is not None} == public
    assert all(security[path] == [] for path in public)
    assert client.get("/health").status_code == client.get("/health/ready").status_code == 200


@pytest.mark.parametrize(
    ("name", "fields"),
    [("OrderIn", {"amount", "currency"}), ("PaymentIn", {"order_id", "source"})],
    ids=["order", "payment"],
)
def test_request_schemas_come_from_marshmallow(document: dict[str, Any], name: str, fields: set[str]) -> None:
    """The request bodies are the routes' marshmallow schemas: required fields only, anchored regexes."""
    schema = document["components"]["schemas"][name]
    assert set(schema["properties"]) == set(schema["required"]) == fields
    assert schema["additionalProperties"] is False
    for prop in schema["properties"].values():
        if "pattern" in prop:
            assert prop["pattern"].startswith("^") and prop["pattern"].endswith("$")
            assert "\\Z" not in prop["pattern"]


def test_payment_answer_has_no_source(document: dict[str, Any]) -> None:
    """The documented payment answer has no source field and allows none."""
    payment = document["components"]["schemas"]["Payment"]
    assert "source" not in payment["properties"]
    assert payment["additionalProperties"] is False


@pytest.mark.parametrize("path", WRITES, ids=["orders", "payments", "receipt-links"])
def test_writes_publish_the_idempotency_policy(document: dict[str, Any], path: str) -> None:
    """The plugin publishes each write's policy: a required key kept 24 hours; paying is multi-step."""
    policy = document["paths"][path]["post"]["x-idempotency"]
    assert (policy["required"], policy["keyRetentionSeconds"], policy["multiStep"]) == (
        True,
        86400,
        path == "/payments",
    )
    retryable = {entry["type"].rpartition(":")[2]: entry["retryable"] for entry in policy["problemTypes"]}
    assert retryable["key-in-use"] is retryable["store-unavailable"] is True
    assert not any(retryable[name] for name in ("missing-key", "invalid-key", "key-mismatch", "key-expired"))
    assert ("outcome-pending" in retryable) is (path == "/payments")
