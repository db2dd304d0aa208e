"""Errors of the extension, each a Werkzeug HTTP exception rendered as ``application/problem+json``
(RFC 9457), so Flask renders it without help and an application can override the rendering with
``errorhandler``. Every body carries ``retryable`` (:doc:`/errors` lists every problem type), and never
the raw header value, the request body, SQL text, SQL parameters or connection settings.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

import psycopg
from flask import Response, has_request_context, request
from werkzeug.exceptions import (
    BadRequest,
    Conflict,
    Gone,
    HTTPException,
    InternalServerError,
    ServiceUnavailable,
    Unauthorized,
    UnprocessableEntity,
)
from werkzeug.http import HTTP_STATUS_CODES

from . import _grants

__all__ = [
    "PROBLEM_JSON",
    "ConfigurationError",
    "database_error",
    "DatabaseFailed",
    "DatabaseUnavailable",
    "IdempotencyError",
    "InvalidBody",
    "InvalidKey",
    "KeyExpired",
    "KeyInUse",
    "KeyMismatch",
    "MissingKey",
    "NoScope",
    "OperationFailed",
    "OutcomePending",
    "ResponseNotStored",
    "StoredResponseUnreadable",
    "WebhookRejected",
    "missing_table_hint",
    "problem",
    "store_unreachable",
]

#: The media type of every error body (RFC 9457).
PROBLEM_JSON = "application/problem+json"

_TYPE_PREFIX = "urn:flask-idem:problem:"

# Problems of other kinds (rendered by problem() as about:blank) are retryable by their status. Not 409
# (a conflict is resolved by changing the request; KeyInUse says it is retryable itself), nor 500.
_RETRYABLE_STATUSES = frozenset({408, 429, 502, 503, 504})


class ConfigurationError(RuntimeError):
    """The extension is set up wrongly: raised by ``init_app`` and the decorators, never because of
    anything a client sent. (A :class:`~flask_idem.flow.Flow` without a finish step is found at its
    first request, since its steps may be declared after the route.)"""


class IdempotencyError(HTTPException):
    """Base class of the HTTP errors the extension answers.

    :param detail: the human-readable explanation of this occurrence; the class's default when omitted.
    :param retry_after: seconds for the ``Retry-After`` header, for the errors a client should retry.
    """

    #: The ``type`` member of the problem body, a stable URI clients may branch on.
    problem_type: ClassVar[str] = "about:blank"
    #: The ``title`` member: a short summary that is the same for every occurrence.
    title: ClassVar[str] = "Idempotency error"
    #: Default ``detail`` member.
    default_detail: ClassVar[str] = ""
    #: The ``retryable`` member: whether the same request with the same key may get another answer later
    #: (after ``Retry-After``, when the error carries one). ``False`` means that a retry gets this answer
    #: again, or that only a change of the request or on the server helps.
    retryable: ClassVar[bool] = False
    #: Seconds for ``Retry-After`` (typed as Werkzeug's own attribute of the same name).
    retry_after: datetime | int | None

    def __init__(
        self,
        detail: str | None = None,
        *,
        retry_after: int | None = None,
        members: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(description=detail or self.default_detail)
        self.retry_after = retry_after
        #: Extension members of the problem body (RFC 9457, section 3.2), such as ``retention``.
        self.members: dict[str, Any] = dict(members or {})

    def to_dict(self) -> dict[str, Any]:
        """Return the problem details object of this error."""
        body: dict[str, Any] = {
            "type": self.problem_type,
            "title": self.title,
            "status": self.code,
            "detail": self.description,
            "retryable": self.retryable,
        }
        if isinstance(self.retry_after, int):
            body["retry_after"] = self.retry_after
        return {**self.members, **body}

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        """The problem details as JSON text (used by Werkzeug to render the exception)."""
        return json.dumps(self.to_dict())

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        """``Content-Type: application/problem+json`` and, when set, ``Retry-After``."""
        headers = [("Content-Type", PROBLEM_JSON)]
        if isinstance(self.retry_after, int):
            headers.append(("Retry-After", str(self.retry_after)))
        return headers


class MissingKey(IdempotencyError, BadRequest):
    """400: the route requires an ``Idempotency-Key`` header and the request has none."""

    problem_type = _TYPE_PREFIX + "missing-key"
    title = "Idempotency-Key header required"
    default_detail = (
        "This operation requires an Idempotency-Key header holding a UUID that the client generates "
        "once per operation and repeats on every retry."
    )


class InvalidKey(IdempotencyError, BadRequest):
    """400: the ``Idempotency-Key`` header is present but is not exactly one UUID."""

    problem_type = _TYPE_PREFIX + "invalid-key"
    title = "Invalid Idempotency-Key header"
    default_detail = "The Idempotency-Key header must be a UUID."


class InvalidBody(IdempotencyError, BadRequest):
    """400: the body claims to be JSON and is not, so it has no fingerprint."""

    problem_type = _TYPE_PREFIX + "invalid-body"
    title = "Malformed request body"
    default_detail = "The request body is not valid JSON."


class NoScope(IdempotencyError, Unauthorized):
    """401: the scope callable found no organisation for this request, so the key has no owner.

    The ``WWW-Authenticate`` challenge is :attr:`challenge`; set it on the class (or handle the error
    with ``errorhandler``) for an application that authenticates otherwise.
    """

    #: The ``WWW-Authenticate`` header value a 401 must carry (RFC 9110, section 11.6.1).
    challenge: ClassVar[str] = "Bearer"

    problem_type = _TYPE_PREFIX + "no-scope"
    title = "Authentication required"
    default_detail = "Idempotency keys belong to an authenticated client; this request has none."

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        """The problem's headers and the ``WWW-Authenticate`` challenge."""
        return [*super().get_headers(environ, scope), ("WWW-Authenticate", self.challenge)]


class KeyInUse(IdempotencyError, Conflict):
    """409: an earlier request with the same key is still being processed. Retry after a moment."""

    problem_type = _TYPE_PREFIX + "key-in-use"
    retryable = True
    title = "A request with this Idempotency-Key is in progress"
    default_detail = (
        "An earlier request with the same Idempotency-Key has not finished yet. Retry with the same key "
        "after the Retry-After delay to receive its result."
    )


class KeyMismatch(IdempotencyError, UnprocessableEntity):
    """422: the key was already used for a different request (another method, path, query or body)."""

    problem_type = _TYPE_PREFIX + "key-mismatch"
    title = "Idempotency-Key reused for a different request"
    default_detail = (
        "This Idempotency-Key was already used for a request with a different method, path, query or body. "
        "A retry must repeat the original request exactly; a new operation needs a new key."
    )


class KeyExpired(IdempotencyError, Gone):
    """410: the key's stored answer is past its retention period, and had no ``Location`` to send the
    client to (else the answer is ``303 See Other`` there). The operation will not be repeated."""

    problem_type = _TYPE_PREFIX + "key-expired"
    title = "The stored answer for this Idempotency-Key has expired"
    default_detail = (
        "The request first sent with this Idempotency-Key was carried out, and its answer is older than "
        "the retention period, so it is no longer kept. The operation will not be carried out again; a "
        "new operation needs a new key."
    )


class WebhookRejected(IdempotencyError, BadRequest):
    """400: a webhook delivery failed verification (signature, timestamp, or event id), before any
    database work; nothing was recorded. Raised by :meth:`flask_idem.webhooks.Event.json` in the handler,
    it is the handler's answer, kept like any other.

    :param check: which check failed (``signature``, ``timestamp``, ``event-id``, ``body``...), also in
        the problem body as ``check``. The detail never holds a secret or an expected signature.
    """

    problem_type = _TYPE_PREFIX + "webhook-rejected"
    title = "The webhook delivery was rejected"
    default_detail = "The delivery could not be verified; nothing was recorded."

    def __init__(self, detail: str | None = None, *, check: str) -> None:
        super().__init__(detail, members={"check": check})
        #: Which check failed.
        self.check = check


class DatabaseUnavailable(IdempotencyError, ServiceUnavailable):
    """503: the key store could not be reached or the transaction could not commit. Safe to retry."""

    problem_type = _TYPE_PREFIX + "store-unavailable"
    retryable = True
    title = "Service temporarily unavailable"
    default_detail = (
        "The request could not be completed now. Retry with the same Idempotency-Key after the "
        "Retry-After delay: the operation will not be carried out twice."
    )


class OutcomePending(IdempotencyError, ServiceUnavailable):
    """503: a call to an outside party ended without a known outcome. Retry with the same key: the
    request stays in progress, and a retry or the recovery job finds out what happened and finishes it."""

    problem_type = _TYPE_PREFIX + "outcome-pending"
    retryable = True
    title = "Outcome not known yet"
    default_detail = (
        "The request was accepted, but a call it depends on ended without a known outcome. Retry with "
        "the same Idempotency-Key after the Retry-After delay; it will not be carried out twice."
    )


class OperationFailed(IdempotencyError, InternalServerError):
    """500, stored: the request could not be completed within the recovery deadline and is flagged for a
    person (``flask idem stuck``). Retrying with the same key replays this answer."""

    problem_type = _TYPE_PREFIX + "operation-failed"
    title = "Operation failed"
    default_detail = (
        "The request could not be completed and has been referred to a person. Retrying with the same "
        "Idempotency-Key returns this answer again."
    )


class ResponseNotStored(IdempotencyError, InternalServerError):
    """500, not stored: the view's answer cannot be kept for retries, so the request was rolled back.

    Its body is over ``IDEM_MAX_RESPONSE_BYTES``, or a route that keeps only the ``Location`` of its
    answers gave none. Nothing was committed and the key stays free; a retry meets the same limit. For a
    multi-step route only the answering step is rolled back: the request stays in progress under its
    key, finished by a retry or the recovery job once the limit or the answer changes.
    """

    problem_type = _TYPE_PREFIX + "response-not-stored"
    title = "The answer could not be kept for retries"
    default_detail = (
        "The answer to this request cannot be kept for retries, so the request was not carried out."
    )


class StoredResponseUnreadable(IdempotencyError, InternalServerError):
    """500: the stored answer of this key is encrypted with a key that ``IDEM_RESPONSE_KEYS`` no longer
    holds. The operation was carried out and is not carried out again."""

    problem_type = _TYPE_PREFIX + "stored-response-unreadable"
    title = "The stored answer cannot be read"
    default_detail = (
        "The request first sent with this Idempotency-Key was carried out, but its stored answer cannot be"
        " read by the server now. It will not be carried out again."
    )


class DatabaseFailed(IdempotencyError, InternalServerError):
    """500: a database error that retrying will not fix; the transaction was rolled back."""

    problem_type = _TYPE_PREFIX + "database-error"
    title = "Internal server error"
    default_detail = "The request failed and nothing was recorded."


def problem(error: HTTPException) -> Response:
    """Render any Werkzeug HTTP exception as an ``application/problem+json`` response.

    Other exceptions than :class:`IdempotencyError` get ``"type": "about:blank"``, the reason phrase as
    title, and ``retryable`` from their own attribute, else from the status (408, 429, 502, 503, 504).
    Register it to make every error of an application a problem document::

        app.register_error_handler(HTTPException, flask_idem.errors.problem)
    """
    if isinstance(error, IdempotencyError):
        body = error.to_dict()
        headers = error.get_headers()
    else:
        code = error.code or 500
        body = {
            "type": "about:blank",
            "title": HTTP_STATUS_CODES.get(code, "Unknown Error"),
            "status": code,
            "detail": error.description,
            "retryable": _retryable(error, code),
        }
        headers = [(k, v) for k, v in error.get_headers() if k.lower() != "content-type"]
        headers.append(("Content-Type", PROBLEM_JSON))
    return Response(json.dumps(body), status=body["status"], headers=headers)


def _retryable(error: HTTPException, code: int) -> bool:
    """An application's exception may say whether it is retryable; else its status does."""
    said = getattr(error, "retryable", None)
    return said if isinstance(said, bool) else code in _RETRYABLE_STATUSES


_logger = logging.getLogger("flask_idem")

#: What psycopg says (and flask_idem._connection, in psycopg's words, for a batched transaction) when code
#: inside a transaction block commits or rolls back the connection: a message without values.
_REFUSED = re.compile(r"Explicit (commit|rollback)\(\) forbidden within a Transaction context")


def database_error(
    error: psycopg.Error, *, retry_after: int = 1, key_table: str | None = None
) -> IdempotencyError:
    """The HTTP error for a driver error: 503 when retrying may help (:func:`store_unreachable`), else 500.

    Logged by class and SQLSTATE only (PostgreSQL quotes row values in its message), or with the fix
    where one is known (:doc:`/errors`). Applications can route their own database errors through it::

        @app.errorhandler(psycopg.Error)
        def db_error(e):
            return flask_idem.errors.problem(flask_idem.errors.database_error(e))
    """
    where = (request.endpoint or request.path) if has_request_context() else "a command"
    if _refused(error, where):
        return DatabaseFailed()
    if isinstance(error, psycopg.errors.UndefinedTable):
        _logger.error(
            "Database error in %s: UndefinedTable, %s (SQLSTATE 42P01)%s; rolled back and answered 500.",
            where,
            error.diag.message_primary,
            missing_table_hint(error, key_table),
        )
        return DatabaseFailed()
    if not store_unreachable(error, key_table):
        _logger.error(
            "Database error in %s: %s (SQLSTATE %s); rolled back and answered 500.\n%s",
            where,
            type(error).__name__,
            error.sqlstate or "none",
            "".join(traceback.format_tb(error.__traceback__)),
        )
        return DatabaseFailed()
    if _no_partition(error, key_table):
        _logger.error(
            "Database error in %s: no partition of the key table %s covers the key's expiry (SQLSTATE"
            " 23514): partitions are made ahead by 'flask idem purge', which has not run in time. Run it"
            " now, as the tables' owner, and schedule it at least daily; it makes them IDEM_PARTITION_AHEAD"
            " past IDEM_KEY_TTL, which must also cover a route's longer ttl= or a webhook source's window."
            " Answered 503 until then.",
            where,
            key_table,
        )
    elif not _grants.report(error, where, "answered 503 until then", key_table=key_table):
        _logger.warning(
            "Database unavailable in %s: %s (SQLSTATE %s); answered 503.",
            where,
            type(error).__name__,
            error.sqlstate or "none",
        )
    return DatabaseUnavailable(retry_after=retry_after)


def _refused(error: psycopg.Error, where: str) -> bool:
    """Whether ``error`` is a ``commit()`` or ``rollback()`` refused inside the extension's transaction
    (psycopg's ``ProgrammingError``, no SQLSTATE); logged as such, with why."""
    refused = _REFUSED.match(str(error)) if type(error) is psycopg.ProgrammingError else None
    if refused is not None:
        _logger.error(
            "Database error in %s: the view's own %s() on idem.connection was refused: the key record"
            " and the view's writes commit together, when the view returns, or not at all. Remove the"
            " call; raise an exception or abort() to fail the request, and use a nested"
            " 'with conn.transaction():' for a savepoint. Rolled back and answered 500.\n%s",
            where,
            refused.group(1),
            "".join(traceback.format_tb(error.__traceback__)),
        )
    return refused is not None


def store_unreachable(error: psycopg.Error, key_table: str | None = None) -> bool:
    """Whether ``error`` means that the database is out of reach for now, so that the same work may
    succeed later: a lost or refused connection, a pool timeout, a key's expiry that no partition of
    ``key_table`` covers yet, or a privilege the role lacks. Every door answers it alike: a ``503``, a
    task's retry, the recovery job's next pass."""
    return (
        isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))
        or _no_partition(error, key_table)
        or _grants.denied(error)
    )


def _no_partition(error: psycopg.Error, key_table: str | None) -> bool:
    """Whether ``error`` refused a row of the key table ``key_table`` whose ``expires_at`` no partition
    covers: the deployment's problem, over once partitions are made; nothing was recorded."""
    return (
        key_table is not None
        and isinstance(error, psycopg.errors.CheckViolation)
        and error.diag.table_name == key_table.rsplit(".", 1)[-1]
        and (error.diag.message_primary or "").startswith("no partition of relation")
    )


def missing_table_hint(error: psycopg.errors.UndefinedTable, key_table: str | None) -> str:
    """``". Create the key table ..."`` when ``error`` is about the key table ``key_table``, else ``""``."""
    if key_table is None or f'"{key_table.rsplit(".", 1)[-1]}"' not in (error.diag.message_primary or ""):
        return ""
    return (
        f". The key table {key_table} does not exist: create it with 'flask idem init-db'"
        " (or idem.create_table(), or 'flask db upgrade' with Flask-Migrate)"
    )
