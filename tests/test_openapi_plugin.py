"""flask_idem.openapi: the idempotency contract in the OpenAPI document of a plain apispec app and of a
flask-smorest app, checked with openapi-spec-validator."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import flask_smorest
import marshmallow as ma
import pytest
from apispec import APISpec
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask
from flask.views import MethodView
from openapi_spec_validator import validate

from flask_idem import Fingerprint, Flow, Idempotency
from flask_idem.errors import PROBLEM_JSON, ConfigurationError
from flask_idem.openapi import PROBLEM_SCHEMA, IdempotencyPlugin

#: init_app only reads the URL; nothing here opens a connection.
UNUSED_DATABASE = "postgresql://127.0.0.1/flask_idem_openapi_unused"

CREATED = {
    "201": {"description": "Created.", "content": {"application/json": {"schema": {"type": "object"}}}}
}


def make_app(**config: Any) -> tuple[Flask, Idempotency]:
    app = Flask(__name__)
    app.config.update(IDEM_DATABASE_URL=UNUSED_DATABASE, **config)
    return app, Idempotency(app, scope=lambda: 1)


def key_parameter(operation: dict[str, Any]) -> dict[str, Any] | None:
    found = [p for p in operation.get("parameters", []) if p.get("name") == "Idempotency-Key"]
    assert len(found) <= 1
    return found[0] if found else None


def plain_document(app: Flask, idem: Idempotency) -> dict[str, Any]:
    """A plain apispec app: apispec-webframeworks' FlaskPlugin, views passed to ``spec.path``."""
    pay = Flow("test.openapi.pay")

    @app.route("/notes", methods=["GET", "POST"])
    @idem.idempotent()
    def notes() -> Any:
        raise AssertionError("never called")

    @app.put("/notes/<int:note_id>")
    @idem.idempotent(required=False, ttl=timedelta(hours=2))
    def replace_note(note_id: int) -> Any:
        raise AssertionError("never called")

    @app.post("/payments")
    @idem.idempotent(flow=pay)
    def pay_view() -> Any:
        raise AssertionError("never called")

    @app.post("/plain")
    def plain() -> Any:
        raise AssertionError("never called")

    @app.post("/form")
    @idem.idempotent(key_from=lambda: [])
    def form() -> Any:
        raise AssertionError("never called")

    spec = APISpec("Notes", "1.0", "3.0.3", plugins=[FlaskPlugin(), IdempotencyPlugin()])
    listed = {"200": {"description": "OK."}}
    # FlaskPlugin and IdempotencyPlugin both take the app from spec.path(app=...) or the app context.
    spec.path(view=notes, operations={"get": {"responses": listed}, "post": {"responses": CREATED}}, app=app)
    with app.app_context():
        note_id = {"name": "note_id", "in": "path", "required": True, "schema": {"type": "integer"}}
        replaced = {"200": {"description": "Replaced."}}
        spec.path(view=replace_note, operations={"put": {"parameters": [note_id], "responses": replaced}})
        spec.path(view=pay_view, operations={"post": {"responses": CREATED}})
        spec.path(view=plain, operations={"post": {"responses": CREATED}})
        spec.path(view=form, operations={"post": {"responses": CREATED}})
    document = spec.to_dict()
    validate(document)
    return document


def test_plain_apispec_app() -> None:
    """Decorated writes get the key, the replay, the problems and x-idempotency; nothing else changes."""
    app, idem = make_app()
    paths = plain_document(app, idem)["paths"]
    post = paths["/notes"]["post"]
    assert key_parameter(post) == {
        "name": "Idempotency-Key",
        "in": "header",
        "required": True,
        "description": key_parameter(post)["description"],  # type: ignore[index]
        "schema": {"type": "string", "format": "uuid"},
    }
    assert "kept for 1 day" in key_parameter(post)["description"]  # type: ignore[index]
    assert "remembered for 30 days" in key_parameter(post)["description"]  # type: ignore[index]
    assert set(post["responses"]) == {"200", "201", "400", "409", "410", "422", "503"}
    assert "query, media type or body" in post["responses"]["422"]["description"]
    assert post["responses"]["200"]["content"] == post["responses"]["201"]["content"]
    assert post["responses"]["200"]["headers"]["Idempotent-Replayed"]["required"] is True
    assert "headers" not in post["responses"]["201"]
    for status in ("400", "409", "410", "422", "503"):
        content = post["responses"][status]["content"]
        assert content == {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for status in ("409", "503"):
        assert post["responses"][status]["headers"]["Retry-After"]["required"] is True
    assert post["x-idempotency"] == {
        "header": "Idempotency-Key",
        "required": True,
        "keyRetentionSeconds": 86400,
        "tombstoneRetentionSeconds": 30 * 86400,
        "fingerprint": ["method", "path", "query", "media type", "body"],
        "onMismatch": "reject",
        "multiStep": False,
        "problemTypes": [
            {"type": "urn:flask-idem:problem:missing-key", "status": 400, "retryable": False},
            {"type": "urn:flask-idem:problem:invalid-key", "status": 400, "retryable": False},
            {"type": "urn:flask-idem:problem:invalid-body", "status": 400, "retryable": False},
            {"type": "urn:flask-idem:problem:key-in-use", "status": 409, "retryable": True},
            {"type": "urn:flask-idem:problem:key-expired", "status": 410, "retryable": False},
            {"type": "urn:flask-idem:problem:key-mismatch", "status": 422, "retryable": False},
            {"type": "urn:flask-idem:problem:store-unavailable", "status": 503, "retryable": True},
        ],
    }
    get = paths["/notes"]["get"]
    assert key_parameter(get) is None and "x-idempotency" not in get and set(get["responses"]) == {"200"}
    assert paths["/plain"]["post"] == {"responses": CREATED}
    form = paths["/form"]["post"]  # key_from=: the key is not a header
    assert key_parameter(form) is None and form["x-idempotency"]["header"] is None
    assert {"200", "409", "422"} <= set(form["responses"])


@pytest.mark.parametrize(
    "config",
    [{}, {"IDEM_REQUIRE_KEY": False, "IDEM_ON_MISMATCH": "replay", "IDEM_TOMBSTONE_TTL": 0}],
    ids=["defaults", "lenient"],
)
def test_problem_types_match_the_problem_responses(config: dict[str, Any]) -> None:
    """problemTypes names one documented problem response per status, and only those, with its retryable."""
    app, idem = make_app(**config)
    for path, item in plain_document(app, idem)["paths"].items():
        for method, operation in item.items():
            if "x-idempotency" not in operation:
                continue
            listed = operation["x-idempotency"]["problemTypes"]
            problems = {
                status
                for status, response in operation["responses"].items()
                if PROBLEM_JSON in response.get("content", {})
            }
            assert {str(entry["status"]) for entry in listed} == problems, (method, path)
            for entry in listed:
                assert entry["retryable"] is (entry["status"] in (409, 503))
            types = [entry["type"] for entry in listed]
            policy = operation["x-idempotency"]
            assert ("urn:flask-idem:problem:missing-key" in types) is policy["required"]
            assert ("urn:flask-idem:problem:outcome-pending" in types) is policy["multiStep"]


def test_problem_schema_documents_retryable() -> None:
    """The Problem schema requires the boolean retryable member."""
    assert "retryable" in PROBLEM_SCHEMA["required"]
    assert PROBLEM_SCHEMA["properties"]["retryable"]["type"] == "boolean"


def test_route_options_win_over_settings() -> None:
    """required=False and ttl= show on their route; a multi-step route requires the key regardless."""
    app, idem = make_app(IDEM_REQUIRE_KEY=False, IDEM_ON_MISMATCH="replay")
    paths = plain_document(app, idem)["paths"]
    put = paths["/notes/{note_id}"]["put"]
    assert key_parameter(put)["required"] is False  # type: ignore[index]
    assert put["x-idempotency"]["keyRetentionSeconds"] == 7200
    assert "kept for 2 hours" in key_parameter(put)["description"]  # type: ignore[index]
    assert put["responses"]["200"]["headers"]["Idempotent-Replayed"]["required"] is False
    assert "422" not in put["responses"]  # on_mismatch="replay": no mismatch error
    assert key_parameter(paths["/notes"]["post"])["required"] is False  # type: ignore[index]
    payment = paths["/payments"]["post"]
    assert key_parameter(payment)["required"] is True  # type: ignore[index]
    assert payment["x-idempotency"]["multiStep"] is True


def test_documented_answers_are_kept() -> None:
    """A response or key parameter the document already has is kept; a 409 gains Retry-After."""
    app, idem = make_app()

    @app.post("/notes")
    @idem.idempotent()
    def notes() -> Any:
        raise AssertionError("never called")

    spec = APISpec("Notes", "1.0", "3.0.3", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    spec.components.schema("Problem", {"type": "object", "properties": {"code": {"type": "string"}}})
    own = {"name": "Idempotency-Key", "in": "header", "required": True, "schema": {"type": "string"}}
    conflict = {"description": "Busy."}
    spec.path(
        view=notes,
        operations={"post": {"parameters": [own], "responses": {**CREATED, "409": conflict}}},
        app=app,
    )
    document = spec.to_dict()
    validate(document)
    post = document["paths"]["/notes"]["post"]
    assert post["parameters"] == [own]
    assert post["x-idempotency"]["required"] is True
    assert post["responses"]["409"]["description"] == "Busy."
    assert post["responses"]["409"]["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    assert document["components"]["schemas"]["Problem"]["properties"] == {"code": {"type": "string"}}


@pytest.mark.parametrize("tombstone_ttl", [3600, 0], ids=["tombstones", "no-tombstones"])
def test_late_retry_answers(tombstone_ttl: int) -> None:
    """While expired keys are remembered, a late retry is documented: 303 to a documented Location, else
    410; with IDEM_TOMBSTONE_TTL = 0, neither."""
    app, idem = make_app(IDEM_TOMBSTONE_TTL=tombstone_ttl)

    @app.post("/notes")
    @idem.idempotent()
    def notes() -> Any:
        raise AssertionError("never called")

    location = {"required": True, "schema": {"type": "string", "format": "uri-reference"}}
    created = {"201": {"description": "Created.", "headers": {"Location": location}}}
    spec = APISpec("Notes", "1.0", "3.0.3", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    spec.path(view=notes, app=app, operations={"post": {"responses": created}})
    document = spec.to_dict()
    validate(document)
    responses = document["paths"]["/notes"]["post"]["responses"]
    if tombstone_ttl:
        assert responses["303"]["headers"] == {"Location": location}
        assert "content" not in responses["303"]
        assert "410" in responses
    else:
        assert "303" not in responses and "410" not in responses
    assert document["paths"]["/notes"]["post"]["x-idempotency"]["tombstoneRetentionSeconds"] == tombstone_ttl


def test_problem_schema_is_registered_once() -> None:
    """Without a Problem of the user's, the plugin's RFC 9457 schema is registered, once."""
    app, idem = make_app()
    document = plain_document(app, idem)
    assert document["components"]["schemas"] == {"Problem": PROBLEM_SCHEMA}


def test_the_application_is_needed() -> None:
    """A user's own path registration: without an app (argument, app= or app context) the plugin says
    what to do; given one, it reads that application's routes and settings."""
    app, idem = make_app(IDEM_KEY_TTL=600)

    @app.post("/notes")
    @idem.idempotent()
    def notes() -> Any:
        raise AssertionError("never called")

    operations = {"post": {"responses": CREATED}}
    spec = APISpec("Notes", "1.0", "3.0.3", plugins=[IdempotencyPlugin()])
    with pytest.raises(ConfigurationError, match="needs the application"):
        spec.path(path="/notes", view=notes, operations=operations)
    spec = APISpec("Notes", "1.0", "3.0.3", plugins=[IdempotencyPlugin(app)])
    spec.path(path="/notes", view=notes, operations=operations)
    document = spec.to_dict()
    validate(document)
    assert document["paths"]["/notes"]["post"]["x-idempotency"]["keyRetentionSeconds"] == 600


def test_openapi_2_is_refused() -> None:
    """The plugin describes OpenAPI 3 documents only."""
    with pytest.raises(ConfigurationError, match="OpenAPI 3"):
        APISpec("Notes", "1.0", "2.0", plugins=[IdempotencyPlugin()])


class NoteIn(ma.Schema):
    body = ma.fields.String(required=True)


class Note(ma.Schema):
    id = ma.fields.Integer(required=True)
    body = ma.fields.String(required=True)


def test_flask_smorest_app() -> None:
    """flask-smorest: one argument to Api, for function views and MethodView methods alike."""
    app, idem = make_app(API_TITLE="Notes", API_VERSION="1.0", OPENAPI_VERSION="3.0.3")
    api = flask_smorest.Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})
    blp = flask_smorest.Blueprint("notes", __name__)

    @blp.route("/notes", methods=["POST"])
    @idem.idempotent()
    @blp.arguments(NoteIn)
    @blp.response(201, Note)
    def create(data: dict[str, Any]) -> Any:
        raise AssertionError("never called")

    @blp.route("/notes/<int:note_id>")
    class NoteView(MethodView):
        @blp.response(200, Note)
        def get(self, note_id: int) -> Any:
            raise AssertionError("never called")

        @idem.idempotent(required=False)
        @blp.arguments(NoteIn)
        @blp.response(200, Note)
        def put(self, data: dict[str, Any], note_id: int) -> Any:
            raise AssertionError("never called")

    api.register_blueprint(blp)
    document = api.spec.to_dict()
    validate(document)
    post = document["paths"]["/notes"]["post"]
    assert key_parameter(post)["required"] is True  # type: ignore[index]
    assert {"200", "201", "400", "409", "410", "422", "503"} <= set(post["responses"])
    assert post["responses"]["200"]["content"] == post["responses"]["201"]["content"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/NoteIn"
    }
    # flask-smorest documents its own 422 (a validation error): kept, as the plugin never overrides.
    assert post["responses"]["422"] == {"$ref": "#/components/responses/UNPROCESSABLE_ENTITY"}
    assert post["responses"]["409"]["content"][PROBLEM_JSON]["schema"] == {
        "$ref": "#/components/schemas/Problem"
    }
    item = document["paths"]["/notes/{note_id}"]
    assert key_parameter(item["put"])["required"] is False  # type: ignore[index]
    assert item["put"]["responses"]["200"]["headers"]["Idempotent-Replayed"]["required"] is False
    assert key_parameter(item["get"]) is None and "x-idempotency" not in item["get"]


def test_a_routes_policies_are_published() -> None:
    """A fingerprint policy shows what counts (x-idempotency, the key's description and the 422); a route
    that keeps only its Location documents the 303 a retry gets instead of a 200 replay."""
    app, idem = make_app()
    old = Fingerprint(exclude=["/client_ts"])
    policy = Fingerprint(exclude=["/client_ts", "/trace"], headers=["X-Currency"], previous=[old])

    @app.post("/orders")
    @idem.idempotent(fingerprint=policy)
    def orders() -> Any:
        raise AssertionError("never called")

    @app.post("/tokens")
    @idem.idempotent(store_response="location")
    def tokens() -> Any:
        raise AssertionError("never called")

    created = {"201": {**CREATED["201"], "headers": {"Location": {"schema": {"type": "string"}}}}}
    spec = APISpec("Shop", "1.0", "3.0.3", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    spec.path(view=orders, operations={"post": {"responses": CREATED}}, app=app)
    spec.path(view=tokens, operations={"post": {"responses": created}}, app=app)
    document = spec.to_dict()
    validate(document)
    post = document["paths"]["/orders"]["post"]
    counted = ["method", "path", "query", "media type", "body except /client_ts, /trace", "header X-Currency"]
    assert post["x-idempotency"]["fingerprint"] == counted
    assert post["x-idempotency"]["fingerprintPolicy"] == {
        "id": policy.id,
        "exclude": ["/client_ts", "/trace"],
        "headers": ["x-currency"],
        "previous": [old.id],
    }
    assert "storeResponse" not in post["x-idempotency"]
    assert "; ".join(counted) in key_parameter(post)["description"]  # type: ignore[index]
    assert "'differs' member" in post["responses"]["422"]["description"]
    token = document["paths"]["/tokens"]["post"]
    assert token["x-idempotency"]["storeResponse"] == "location"
    assert token["x-idempotency"]["fingerprint"] == ["method", "path", "query", "media type", "body"]
    assert "200" not in token["responses"]
    assert token["responses"]["303"]["headers"]["Location"] == {"schema": {"type": "string"}}
