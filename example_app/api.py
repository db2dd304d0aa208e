"""The shop's API on flask-smorest, and its OpenAPI document, served at ``GET /openapi.json``.

The document is generated from the routes: their marshmallow schemas (:mod:`.schemas`), the errors each
route declares with :meth:`Blueprint.problems`, and flask-idem's contract for the idempotent routes
(:class:`flask_idem.openapi.IdempotencyPlugin`: the ``Idempotency-Key`` header, the ``200`` replay of a
``201``, the ``400``, ``409``, ``422`` and ``503`` problems). Every error is ``application/problem+json``
(RFC 9457): flask-smorest's own error handler is replaced by the shop's (:mod:`.problems`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import flask_smorest
from flask import Flask, Request, Response
from marshmallow import Schema, ValidationError
from webargs.flaskparser import FlaskParser
from werkzeug.exceptions import HTTPException

from flask_idem.errors import PROBLEM_JSON
from flask_idem.openapi import IdempotencyPlugin

from .problems import ValidationFailed, http_error
from .schemas import BIGINT_MAX, Problem

__all__ = ["LOCATION", "Api", "Blueprint", "path_id", "register"]

F = TypeVar("F", bound=Callable[..., Any])

_PROBLEMS = {
    401: "No valid API key: send 'Authorization: Bearer <API key>'.",
    402: "The gateway declined the charge. Stored: a retry with the same key gets this answer again.",
    404: "No such resource in the authenticated organisation.",
    413: "The body is larger than the shop accepts (MAX_CONTENT_LENGTH, 64 KiB by default).",
    415: "The body is not application/json.",
    422: (
        "The body is invalid (see 'errors'), the order is already paid, or the Idempotency-Key was"
        " already used for a different request."
    ),
    500: "The request failed. Nothing was recorded, unless the operation was referred to a person.",
    503: "Unavailable for now, or a gateway call's outcome is not known yet; retry with the same key.",
}

_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}}},
    503: {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "required": True,
            "schema": {"type": "integer"},
        }
    },
}


#: The ``Location`` header of a ``201``, for ``@bp.response(..., headers=LOCATION)``.
LOCATION = {"Location": {"schema": {"type": "string", "format": "uri-reference"}, "required": True}}


def path_id(name: str) -> dict[str, Any]:
    """The path parameter ``name``: an ``<int:...>`` id, documented up to the largest ``bigint``."""
    return {"in": "path", "name": name, "schema": {"type": "integer", "minimum": 1, "maximum": BIGINT_MAX}}


class _Parser(FlaskParser):
    """Request bodies as the shop always read them: ``request.get_json()`` (415 for a body that is not
    JSON), and a validation failure is the shop's 422 problem with the field errors."""

    def _raw_load_json(self, req: Request) -> Any:
        return req.get_json()

    def handle_error(
        self,
        error: ValidationError,
        req: Request,
        schema: Schema,
        *,
        error_status_code: int | None,
        error_headers: Any,
    ) -> NoReturn:
        messages: Any = error.messages
        raise ValidationFailed(messages["json"])


class Blueprint(flask_smorest.Blueprint):
    """A flask-smorest blueprint that parses with :class:`_Parser` and documents problems."""

    ARGUMENTS_PARSER = _Parser()

    def problems(self, *statuses: int) -> Callable[[F], F]:
        """Document that the view may answer each of ``statuses`` with a problem document."""

        def decorator(view: F) -> F:
            for status in statuses:
                view = self.alt_response(
                    status,
                    schema=Problem,
                    content_type=PROBLEM_JSON,
                    description=_PROBLEMS[status],
                    headers=_HEADERS.get(status),
                )(view)
            return view

        return decorator


class Api(flask_smorest.Api):
    """flask-smorest's ``Api`` whose errors are the shop's problem documents.

    Each route declares its own errors, so there is no catch-all ``default`` response. The error schema
    is :class:`.schemas.Problem`, registered when the ``Api`` is made, before any route: flask-idem's
    problem responses then refer to it too.
    """

    ERROR_SCHEMA = Problem
    DEFAULT_ERROR_RESPONSE_NAME = None

    def handle_http_exception(self, error: HTTPException) -> Response:
        return http_error(error)


def _anchored_pattern(self: Any, field: Any, **kwargs: Any) -> dict[str, Any]:
    """Patterns as ECMA-262 regexes: marshmallow's ``Regexp`` matches from the start, up to ``\\Z``."""
    pattern = kwargs["ret"].get("pattern")
    if pattern is None:
        return {}
    if pattern.endswith("\\Z"):
        pattern = pattern[:-2] + "$"
    return {"pattern": pattern if pattern.startswith("^") else "^" + pattern}


def register(app: Flask, *blueprints: Blueprint) -> Api:
    """Serve ``blueprints`` and the document at ``GET /openapi.json`` (no authentication: it describes,
    it reveals nothing)."""
    app.config.setdefault("OPENAPI_URL_PREFIX", "/")
    api = Api(
        app,
        spec_kwargs={
            "title": "flask-idem example shop",
            "version": "1.0.0",
            "openapi_version": "3.0.3",
            "info": {
                "description": (
                    "Orders and payments whose write requests are safe to retry: send the same"
                    " Idempotency-Key with every attempt of one operation."
                )
            },
            "security": [{"bearerAuth": []}],
            "extra_plugins": [IdempotencyPlugin(app)],
        },
    )
    api.ma_plugin.converter.add_attribute_function(_anchored_pattern)
    api.spec.components.security_scheme(
        "bearerAuth", {"type": "http", "scheme": "bearer", "description": "The organisation's API key."}
    )
    for blueprint in blueprints:
        api.register_blueprint(blueprint)
    return api
