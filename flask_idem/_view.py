"""What runs around a decorated view: parse, fingerprint, reserve, run, store, commit, or short-circuit.

This module is also the one boundary where driver errors become HTTP errors: a :class:`psycopg.Error`
leaving the transaction goes through :func:`.errors.database_error`.
"""

from __future__ import annotations

import base64
import hmac
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from flask import Response, current_app, g, request
from psycopg import pq
from werkzeug.exceptions import HTTPException

from .errors import DatabaseError, KeyInUse, KeyMismatch, MissingKey, NoScope, database_error
from .fingerprint import fingerprint
from .keys import HEADER, parse_key

if TYPE_CHECKING:
    from .extension import Settings, _State
    from .store import Connection, KeyRecord

__all__ = ["REPLAYED_HEADER", "SAFE_METHODS", "ViewOptions", "handle"]

logger = logging.getLogger("flask_idem")

#: Methods that are passed through untouched: they must not change state, so retrying them is harmless.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

#: Response header that marks a replayed response.
REPLAYED_HEADER = "Idempotent-Replayed"

_CURRENT_ATTR = "_flask_idem_current"

ScopeFunc = Callable[[], "int | None"]


@dataclass(frozen=True, slots=True)
class Current:
    """What a running idempotent view can ask about its request (kept on :data:`flask.g`)."""

    connection: Connection
    org_id: int | None
    key: uuid.UUID | None


@dataclass(frozen=True, slots=True)
class ViewOptions:
    """The options of one decorated view; ``None`` means "the application's setting"."""

    scope: ScopeFunc
    required: bool | None
    on_mismatch: str | None
    ttl: float | None


def handle(
    state: _State,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: ViewOptions,
) -> Response:
    """Answer one request to a decorated view."""
    settings = state.settings
    if request.method in SAFE_METHODS:
        return current_app.make_response(view(*args, **kwargs))
    key = parse_key(request.headers.getlist(HEADER))
    if key is None:
        required = settings.require_key if options.required is None else options.required
        if required:
            raise MissingKey()
        return _guarded(state, lambda conn: _run_view(Current(conn, None, None), view, args, kwargs))
    request_sha = fingerprint(
        method=request.method,
        path=request.path,
        query=request.query_string,
        mimetype=request.mimetype,
        body=request.get_data(cache=True),
    )
    org_id = _org_id(options.scope)

    def atomic(conn: Connection) -> Response:
        found = state.store.reserve(
            conn,
            org_id=org_id,
            key=key,
            request_sha=request_sha,
            method=request.method,
            path=request.path,
            ttl=settings.key_ttl if options.ttl is None else options.ttl,
        )
        if not found.reserved:
            return _answer_existing(settings, options, found.record, request_sha)
        response = _run_view(Current(conn, org_id, key), view, args, kwargs)
        if response.status_code < 500:
            state.store.complete(conn, org_id=org_id, key=key, response=record_response(response, settings))
        return response

    return _guarded(state, atomic)


def _guarded(state: _State, body: Callable[[Connection], Response]) -> Response:
    """Run ``body`` in one transaction on a pooled connection; commit unless it fails or answers 5xx.

    The response is returned only after COMMIT succeeded: a client never hears "created" for writes that
    were rolled back.
    """
    try:
        with state.store.connection() as conn:
            with conn.transaction() as tx:
                response = body(conn)
                if conn.info.transaction_status == pq.TransactionStatus.INERROR:
                    logger.error(
                        "The view %r returned a response after a database error inside its"
                        " transaction; the transaction was rolled back.",
                        request.endpoint,
                    )
                    raise DatabaseError()
                if response.status_code >= 500:
                    raise psycopg.Rollback(tx)
            return response
    except psycopg.Error as e:
        raise database_error(e, retry_after=state.settings.retry_after) from None


def _run_view(
    running: Current, view: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Response:
    """Call the view with its connection and key published on ``g``; 4xx exceptions become responses.

    ``abort(404)`` and other client-error exceptions are a view's normal way of answering, so they are
    rendered by the application's error handlers and stored like a returned 4xx. Server errors propagate
    and roll the transaction back.
    """
    setattr(g, _CURRENT_ATTR, running)
    try:
        rv = view(*args, **kwargs)
    except HTTPException as e:
        if e.code is None or e.code >= 500:
            raise
        rv = current_app.handle_user_exception(e)
    finally:
        delattr(g, _CURRENT_ATTR)
    return current_app.make_response(rv)


def current() -> Current:
    """The state of the decorated view running now (see :attr:`Idempotency.connection`)."""
    found: Current | None = g.get(_CURRENT_ATTR)
    if found is None:
        raise RuntimeError(
            "idem.connection and idem.key are only available while an @idem.idempotent() view"
            " handles a write request. Elsewhere, borrow a connection with"
            " 'with idem.pool.connection() as conn:'."
        )
    return found


def _org_id(scope: ScopeFunc) -> int:
    org_id = scope()
    if org_id is None:
        raise NoScope()
    if type(org_id) is not int or not -(2**63) <= org_id < 2**63:
        raise TypeError(f"The idempotency scope must return a bigint organisation id, not {org_id!r}")
    return org_id


def _answer_existing(
    settings: Settings, options: ViewOptions, record: KeyRecord | None, request_sha: bytes
) -> Response:
    """The answer to a request whose key is already taken: 409, 422 or the stored response."""
    if record is None or record.response is None:
        raise KeyInUse(retry_after=settings.retry_after)
    if not hmac.compare_digest(record.request_sha, request_sha):
        on_mismatch = settings.on_mismatch if options.on_mismatch is None else options.on_mismatch
        if on_mismatch != "replay":
            raise KeyMismatch()
    return replay_response(record.response)


def record_response(response: Response, settings: Settings) -> dict[str, Any]:
    """The JSON document stored for a response: status, the headers worth replaying, and the body.

    The body is kept as text when it is UTF-8 without NUL characters (which ``jsonb`` cannot hold), and
    as base64 otherwise, so a replay is byte for byte the original.
    """
    data = response.get_data()
    record: dict[str, Any] = {
        "status": response.status_code,
        "headers": [
            [name, value]
            for name, value in response.headers.items()
            if name.lower() in settings.replay_headers
        ],
    }
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        record["body_b64"] = base64.b64encode(data).decode("ascii")
    else:
        record["body"] = text
    return record


def replay_response(record: Mapping[str, Any]) -> Response:
    """Rebuild a stored response, marked with ``Idempotent-Replayed: true``.

    A stored 201 is replayed as 200: the resource was created by the first request, not by this one.
    """
    body = record["body"].encode("utf-8") if "body" in record else base64.b64decode(record["body_b64"])
    status = 200 if record["status"] == 201 else record["status"]
    response = Response(body, status=status, headers=[tuple(h) for h in record["headers"]])
    response.headers[REPLAYED_HEADER] = "true"
    return response
