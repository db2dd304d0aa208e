"""Every error of the shop is ``application/problem+json`` (RFC 9457), with flask-idem's ``retryable``
member: rendered by :func:`flask_idem.errors.problem`, an error says it with a ``retryable`` attribute, or
its status does."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import psycopg
from flask import Flask, Response
from werkzeug.exceptions import HTTPException, UnprocessableEntity

from flask_idem.errors import PROBLEM_JSON, database_error, problem

__all__ = ["KeyAlreadyUsed", "ValidationFailed", "http_error", "problem_exception", "register"]


class ValidationFailed(UnprocessableEntity):
    """422 with the field errors of a request body, as marshmallow reports them."""

    def __init__(self, errors: dict[str, Any]) -> None:
        super().__init__("The request body is invalid; see 'errors' for each field.")
        self.errors = errors

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return json.dumps(
            {
                "type": "about:blank",
                "title": "Unprocessable Content",
                "status": self.code,
                "detail": self.description,
                "retryable": False,
                "errors": self.errors,
            }
        )

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return [("Content-Type", PROBLEM_JSON)]


class KeyAlreadyUsed(UnprocessableEntity):
    """422: an order (or payment) already exists for this key, made before the key's retention ended."""

    description = "An order was already created with this Idempotency-Key. A new order needs a new key."


E = TypeVar("E", bound=HTTPException)


def problem_exception(error: E, **members: Any) -> E:
    """Attach extension members (RFC 9457 section 3.2) to ``error``'s problem document."""
    error.problem_members = members  # type: ignore[attr-defined]
    return error


def http_error(e: HTTPException) -> Response:
    """``e`` as a problem document, with its extension members and a validation failure's errors."""
    if isinstance(e, ValidationFailed):
        return Response(e.get_body(), e.code, e.get_headers())
    response = problem(e)
    members = getattr(e, "problem_members", None)
    if members:
        response.set_data(json.dumps({**json.loads(response.get_data()), **members}))
    return response


def _db_error(e: psycopg.Error) -> Response:
    try:
        from .extensions import idem  # not at import: the gateway simulator shares this module

        retry_after = idem.settings.retry_after
    except RuntimeError:  # the gateway simulator shares these handlers, not the extension
        retry_after = 1
    return problem(database_error(e, retry_after=retry_after))


def register(app: Flask) -> None:
    """Render every HTTP error and every database error of ``app`` as problem+json."""
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(psycopg.Error, _db_error)
