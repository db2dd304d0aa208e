"""What the HTTP doors of the key protocol share: the request door (:mod:`._view`), the webhook door
(:mod:`._webhook`), and the recovery door (:mod:`.recovery`) where it finishes a request's run.

Among them the one boundary where a driver error leaving an HTTP door becomes an HTTP error
(:func:`database_failure`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from flask import Response, current_app, g
from psycopg.rows import TupleRow
from werkzeug.exceptions import HTTPException

from . import _protocol
from ._records import Final
from ._replay import record_response
from ._settings import Settings
from ._state import IdemState
from ._transactions import entering_app_code
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyError,
    ResponseNotStored,
    database_error,
)

__all__ = [
    "CURRENT_ATTR",
    "Current",
    "ResponseDoor",
    "call_view",
    "current",
    "database_failure",
    "final_response",
    "handled_in_request",
    "published",
    "ready",
    "render",
]

logger = logging.getLogger("flask_idem")

CURRENT_ATTR = "_flask_idem_current"

#: How a door makes a client error that application code raised into its answer: a request's by the
#: application's error handlers (:func:`handled_in_request`), the recovery job's by the application's own.
ErrorHandler = Callable[[HTTPException], Any]

#: The detail of the 500 when a flow's answer is over ``IDEM_MAX_RESPONSE_BYTES``: unlike an atomic
#: request's, the earlier steps stand (an outside call may have been made) and the request stays open.
_FLOW_NOT_STORED = (
    "This request was started and its earlier steps were carried out (a call to another service may have"
    " been made), but its answer is larger than the server keeps for retries, so the last step was undone"
    " and the request is not finished. Do not send it again under a new Idempotency-Key: that would carry"
    " the operation out a second time. A retry with the same key does not repeat the finished steps, but"
    " meets the same server-side limit until the server is changed; until then the server keeps trying to"
    " finish it, and after its recovery deadline marks it failed for a person to look at."
)


@dataclass(frozen=True, slots=True)
class Current:
    """What a running idempotent view can ask about its request (kept on :data:`flask.g`)."""

    connection: psycopg.Connection[TupleRow]
    org_id: int | None
    key: uuid.UUID | None


def handled_in_request(error: HTTPException) -> Any:
    """``error`` as the application's error handlers answer it in the current request."""
    return current_app.handle_user_exception(error)


def render(call: Callable[[], Any], handle: ErrorHandler = handled_in_request) -> Any:
    """Call application code; a client-error exception it raises becomes its answer (``handle``'s).

    ``abort(404)`` and other 4xx exceptions are a view's normal way of answering, so they are rendered by
    the application's error handlers and stored like a returned 4xx. Server errors propagate.
    """
    entering_app_code()
    try:
        return call()
    except HTTPException as e:
        if e.code is None or e.code >= 500:
            raise
        return current_app.make_response(handle(e))


def call_view(
    conn: psycopg.Connection[TupleRow],
    org_id: int | None,
    key: uuid.UUID | None,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Call the view with its connection and key published on ``g``; return what it returned.

    ``g`` belongs to the application context, which an ``async def`` view's coroutine shares although it
    runs on another thread (:mod:`._async`).
    """
    setattr(g, CURRENT_ATTR, Current(conn, org_id, key))
    try:
        return render(lambda: view(*args, **kwargs))
    finally:
        delattr(g, CURRENT_ATTR)


def published(attr: str, missing: str) -> Any:
    """What the HTTP door running now published on :data:`flask.g` under ``attr``.

    :raises RuntimeError: with ``missing``, when no such door runs.
    """
    found = g.get(attr)
    if found is None:
        raise RuntimeError(missing)
    return found


def current() -> Current:
    """The state of the decorated view running now (see :attr:`Idempotency.connection`)."""
    found: Current = published(
        CURRENT_ATTR,
        "idem.connection and idem.key are only available while an @idem.idempotent() view handles a"
        " write request. If this is such a view, check that @idem.idempotent() is placed below"
        " @app.post(...): above it, Flask registers the undecorated view. Elsewhere, borrow a"
        " connection with 'with idem.pool.connection() as conn:'.",
    )
    return found


def final_response(response: Response, document: dict[str, Any] | None) -> Final[Response]:
    """A response as the protocol's final answer: a 5xx is a failure (rolled back, not stored)."""
    status = response.status_code
    return Final(response, document, status, failed=status >= 500)


@dataclass(frozen=True, slots=True)
class ResponseDoor:
    """What a multi-step request's finish makes of its answer (:class:`._steps.Door`): a response, stored
    as the key's answer unless it is a 5xx. The request door's, and the recovery door's for the requests
    it finishes (with the application's own error handlers: it has no request)."""

    settings: Settings
    #: What the route's fingerprint policy keeps of the request (its part digests), stored with the
    #: answer; ``None`` for the default policy and for the recovery job, which has no request.
    request: Mapping[str, Any] | None = None
    #: How a client error that a step raises becomes the answer.
    handle: ErrorHandler = handled_in_request

    def finish(self, call: Callable[[], Any]) -> Final[Response]:
        return self._final(current_app.make_response(render(call, self.handle)))

    def refused(self, error: Exception) -> Final[Response] | None:
        """A database step's 4xx ends the request with that answer (rendered by the error handlers)."""
        if not isinstance(error, HTTPException) or error.code is None or error.code >= 500:
            return None
        return self._final(current_app.make_response(self.handle(error)))

    def failure(self, final: Final[Response]) -> str:
        """A 5xx answer, recorded as ``HTTP <status>``."""
        return f"HTTP {final.status}"

    def _final(self, response: Response) -> Final[Response]:
        if response.status_code >= 500:
            return final_response(response, None)
        settings = self.settings
        try:
            document = record_response(
                response, settings.replay_headers, max_bytes=settings.max_response_bytes, request=self.request
            )
        except ResponseNotStored as e:
            logger.warning(
                "That answer is a multi-step request's: only its last step was rolled back; the steps"
                " before it stand, and the request stays in progress until the limit or the answer"
                " changes or its recovery deadline passes."
            )
            raise ResponseNotStored(_FLOW_NOT_STORED) from e
        return final_response(response, document)


def ready(state: IdemState) -> None:
    """Check the key table's layout at the first write request (:meth:`.IdemState.check_layout`): an
    unusable one is the deployment's problem, over once the migration has run, so the request is
    answered 503 (nothing was recorded) and the command to run goes to the log."""
    try:
        state.check_layout()
    except ConfigurationError as e:
        logger.error("%s Answered 503 until then.", e)
        raise DatabaseUnavailable(retry_after=state.settings.retry_after) from None


def database_failure(
    state: IdemState, error: psycopg.Error, org_id: int | None, key: uuid.UUID | None
) -> IdempotencyError:
    """The HTTP error for a driver error leaving an HTTP door (:func:`.errors.database_error`), with
    :data:`.signals.store_unavailable` sent when the key table is out of reach."""
    settings = state.settings
    answer = database_error(error, retry_after=settings.retry_after, key_table=settings.table)
    _protocol.unavailable(state, error, org_id, key)
    return answer
