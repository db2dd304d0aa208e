"""Running application code inside the extension's transactions, and storing what it answered.

Shared by the atomic path (:mod:`._view`) and the multi-step engine (:mod:`._engine`).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from flask import Response, current_app, has_request_context, request
from psycopg import pq
from werkzeug.exceptions import HTTPException

from .errors import DatabaseError

if TYPE_CHECKING:
    from .extension import Settings
    from .store import Connection, Store

__all__ = ["REPLAYED_HEADER", "in_transaction", "record_response", "render", "replay_response"]

logger = logging.getLogger("flask_idem")

#: Response header that marks a replayed response.
REPLAYED_HEADER = "Idempotent-Replayed"

T = TypeVar("T")


def in_transaction(store: Store, body: Callable[[Connection], T]) -> T:
    """Run ``body`` in one transaction on a pooled connection and commit, unless it fails.

    The transaction is rolled back instead when ``body`` raises, when it returns a 5xx response, and
    when application code inside it swallowed a database error (the transaction is then unusable, so
    whatever success it reports is false: :class:`.DatabaseError`). The result is returned only after
    COMMIT succeeded, so a client never hears "created" for writes that were rolled back.
    """
    with store.connection() as conn, conn.transaction() as tx:
        result = body(conn)
        if conn.info.transaction_status == pq.TransactionStatus.INERROR:
            logger.error(
                "Application code in %r went on after a database error inside its transaction;"
                " the transaction was rolled back.",
                request.endpoint if has_request_context() else "a command",
            )
            raise DatabaseError()
        if isinstance(result, Response) and result.status_code >= 500:
            raise psycopg.Rollback(tx)
    return result


def render(call: Callable[[], Any]) -> Any:
    """Call application code; a client-error exception it raises becomes its response.

    ``abort(404)`` and other 4xx exceptions are a view's normal way of answering, so they are rendered by
    the application's error handlers and stored like a returned 4xx. Server errors propagate.
    """
    try:
        return call()
    except HTTPException as e:
        if e.code is None or e.code >= 500:
            raise
        return current_app.make_response(current_app.handle_user_exception(e))


def record_response(response: Response, settings: Settings) -> dict[str, Any]:
    """The JSON document stored for a response: status, the headers worth replaying, and the body.

    The body is kept as text when it is UTF-8 without NUL characters (which ``jsonb`` cannot hold), and
    as base64 otherwise, so a replay is byte for byte the original. Streamed and file responses are
    read into memory first: an idempotent view's answer must fit in the key table.
    """
    response.direct_passthrough = False  # a file response (send_file) is read into memory to be kept
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
        text: str | None = data.decode("utf-8")
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
