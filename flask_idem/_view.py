"""What runs around a decorated view: parse, fingerprint, reserve, run, store, commit, or short-circuit.

This module is also the one boundary where driver errors become HTTP errors: a :class:`psycopg.Error`
leaving a request goes through :func:`.errors.database_error`.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from flask import Request, Response, current_app, g, request
from psycopg.rows import TupleRow

from . import _engine, signals
from ._calls import in_transaction, render
from .errors import (
    ConfigurationError,
    IdempotencyError,
    KeyExpired,
    KeyInUse,
    KeyMismatch,
    MissingKey,
    NoScope,
    database_error,
)
from .fingerprint import fingerprint
from .flow import INTENT, Flow, Run, run_from_record
from .keys import HEADER, parse_key
from .replay import record_response, replay_response
from .settings import OnMismatch, ScopeFunc, Settings
from .state import IdemState
from .store import KeyedRequest, KeyRecord, Lease

__all__ = ["SAFE_METHODS", "Current", "ViewOptions", "current", "handle"]

#: Methods that are passed through untouched: they must not change state, so retrying them is harmless.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

_CURRENT_ATTR = "_flask_idem_current"


@dataclass(frozen=True, slots=True)
class Current:
    """What a running idempotent view can ask about its request (kept on :data:`flask.g`)."""

    connection: psycopg.Connection[TupleRow]
    org_id: int | None
    key: uuid.UUID | None


@dataclass(frozen=True, slots=True)
class ViewOptions:
    """The options of one decorated view; ``None`` means "the application's setting"."""

    scope: ScopeFunc
    required: bool | None
    on_mismatch: OnMismatch | None
    ttl: float | None
    flow: Flow | None = None
    key_from: Callable[[], Sequence[str]] | None = None

    def key_ttl(self, settings: Settings) -> float:
        """Seconds a key of this route is kept: the route's ``ttl``, or ``IDEM_KEY_TTL``."""
        return settings.key_ttl if self.ttl is None else self.ttl


def handle(
    state: IdemState,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: ViewOptions,
) -> Response:
    """Answer one request to a decorated view."""
    req = request._get_current_object()  # type: ignore[attr-defined]  # one proxy lookup, not one per use
    if req.method in SAFE_METHODS:
        return current_app.make_response(view(*args, **kwargs))
    if options.key_from is None:
        key = parse_key(req.headers.getlist(HEADER))
    else:
        _whole_body(req)  # cached first: a key read from a form must not consume the body fingerprinted
        key = parse_key(options.key_from())
    keyed: KeyedRequest | None = None
    try:
        if key is None:
            required = state.settings.require_key if options.required is None else options.required
            if required or options.flow is not None:
                raise MissingKey()
            return in_transaction(
                state.pool,
                lambda conn: current_app.make_response(_call_view(conn, None, None, view, args, kwargs)),
            )
        request_sha = fingerprint(
            method=req.method,
            path=req.path,
            query=req.query_string,
            mimetype=req.mimetype,
            body=_whole_body(req),
        )
        keyed = KeyedRequest(_org_id(options.scope), key, request_sha, req.method, req.path)
        attempt = _Attempt(view, args, kwargs, keyed)
        if options.flow is None:
            return _atomic(state, options, attempt)
        return _multistep(state, options, options.flow, attempt)
    except psycopg.Error as e:
        error = database_error(e, retry_after=state.settings.retry_after, key_table=state.settings.table)
        if error.code == 503 and signals.wanted(signals.store_unavailable):
            signals.send(
                signals.store_unavailable,
                org_id=None if keyed is None else keyed.org_id,
                key=key,
                error=type(e).__name__,
                sqlstate=e.sqlstate,
            )
        raise error from None


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One keyed write request to a decorated view: what to call, and whose key it carries."""

    view: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    request: KeyedRequest

    def call(self, conn: psycopg.Connection[TupleRow]) -> Any:
        """Call the view on ``conn`` (:func:`_call_view`)."""
        return _call_view(conn, self.request.org_id, self.request.key, self.view, self.args, self.kwargs)


def _atomic(state: IdemState, options: ViewOptions, attempt: _Attempt) -> Response:
    """Reserve, run the view and store its response in one transaction."""
    keyed, settings = attempt.request, state.settings
    stored = False

    def body(conn: psycopg.Connection[TupleRow]) -> Response | IdempotencyError:
        nonlocal stored
        found = state.store.reserve(conn, keyed, ttl=options.key_ttl(settings))
        if not found.reserved:
            return _answer_existing(settings, options, found.record, keyed)
        if signals.wanted(signals.key_reserved):
            signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=None)
        response = current_app.make_response(attempt.call(conn))
        if response.status_code < 500:
            state.store.complete(conn, keyed, record_response(response, settings.replay_headers))
            stored = True
        state.fire("view", conn)
        return response

    answer = in_transaction(state.pool, body, batched=True)
    if stored:
        _sent_stored(keyed, None, answer)
    return _raise_errors(answer)


def _sent_stored(keyed: KeyedRequest, flow: str | None, answer: Response | IdempotencyError | Run) -> None:
    """Send :data:`.signals.response_stored` for a response committed just now."""
    if isinstance(answer, Response) and signals.wanted(signals.response_stored):
        signals.send(
            signals.response_stored, org_id=keyed.org_id, key=keyed.key, flow=flow, status=answer.status_code
        )


def _raise_errors(answer: Response | IdempotencyError) -> Response:
    """Raise an error answer once its transaction has ended; pass a response through."""
    if isinstance(answer, IdempotencyError):
        raise answer
    return answer


def _multistep(state: IdemState, options: ViewOptions, flow: Flow, attempt: _Attempt) -> Response:
    """Reserve under a lease and record the intent in one short transaction, then advance step by step.

    A retry finding the request processing under an expired lease takes it over (one winner) and
    resumes it after its last finished step.
    """
    flow.check()
    settings, keyed = state.settings, attempt.request
    seconds = flow.lease_timeout or settings.lease_timeout
    lease = Lease(keyed.org_id, keyed.key, token=uuid.uuid4(), seconds=seconds)
    stored = False

    def begin(conn: psycopg.Connection[TupleRow]) -> Response | IdempotencyError | Run:
        nonlocal stored
        found = state.store.reserve(conn, keyed, ttl=options.key_ttl(settings), flow=flow.name, lease=lease)
        if found.reserved:
            if signals.wanted(signals.key_reserved):
                signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=flow.name)
            intent = attempt.call(conn)
            if not isinstance(intent, dict):  # the view answered at once, e.g. abort(404)
                response = current_app.make_response(intent)
                if response.status_code < 500:
                    state.store.complete(conn, lease, record_response(response, settings.replay_headers))
                    stored = True
                return response
            state.store.record_step(conn, lease, INTENT, intent)
            state.fire("view", conn)
            return Run(
                flow=flow.name, org_id=keyed.org_id, key=keyed.key, results={INTENT: intent}, last_step=INTENT
            )
        record = found.record
        if (
            record is not None
            and record.status == "processing"
            and record.flow == flow.name
            and not record.lease_live
            and hmac.compare_digest(record.request_sha, keyed.request_sha)
            and state.store.take_over(conn, lease)
        ):
            return run_from_record(
                flow, org_id=keyed.org_id, key=keyed.key, step=record.step, state=record.state
            )
        return _answer_existing(settings, options, record, keyed)

    started = in_transaction(state.pool, begin, batched=True)
    if not isinstance(started, Run):
        if stored:
            _sent_stored(keyed, flow.name, started)
        return _raise_errors(started)
    if started.resumed and signals.wanted(signals.lease_taken_over):
        signals.send(
            signals.lease_taken_over,
            org_id=keyed.org_id,
            key=keyed.key,
            flow=flow.name,
            step=started.last_step,
        )
    return _engine.advance(state, flow, started, lease, retry_in=seconds)


def _whole_body(req: Request) -> bytes:
    """The request body, refusing (413) one that only fits ``MAX_CONTENT_LENGTH`` because it was cut.

    Without a Content-Length (a chunked body), Werkzeug stops reading at the limit without a word; the
    fingerprint and the view would then see a truncated body. One byte more tells: reading past the
    limit raises 413.
    """
    body = req.get_data(cache=True)
    limit = req.max_content_length
    if limit is not None and req.content_length is None and len(body) >= limit:
        req.stream.read(1)
    return body


def _call_view(
    conn: psycopg.Connection[TupleRow],
    org_id: int | None,
    key: uuid.UUID | None,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Call the view with its connection and key published on ``g``; return what it returned."""
    setattr(g, _CURRENT_ATTR, Current(conn, org_id, key))
    try:
        return render(lambda: view(*args, **kwargs))
    finally:
        delattr(g, _CURRENT_ATTR)


def current() -> Current:
    """The state of the decorated view running now (see :attr:`Idempotency.connection`)."""
    found: Current | None = g.get(_CURRENT_ATTR)
    if found is None:
        raise RuntimeError(
            "idem.connection and idem.key are only available while an @idem.idempotent() view"
            " handles a write request. If this is such a view, check that @idem.idempotent() is placed"
            " below @app.post(...): above it, Flask registers the undecorated view. Elsewhere, borrow a"
            " connection with 'with idem.pool.connection() as conn:'."
        )
    return found


def _org_id(scope: ScopeFunc) -> int:
    org_id = scope()
    if org_id is None:
        raise NoScope()
    if type(org_id) is not int or not -(2**63) <= org_id < 2**63:
        raise ConfigurationError(
            "The idempotency scope must return an int organisation id that fits a bigint (or None), not"
            f" {'an out-of-range int' if type(org_id) is int else type(org_id).__name__}. Map UUID and"
            " text tenant ids with flask_idem.scope_id(): scope=lambda: scope_id(tenant_id)."
        )
    return org_id


def _answer_existing(
    settings: Settings, options: ViewOptions, record: KeyRecord | None, keyed: KeyedRequest
) -> Response | IdempotencyError:
    """The answer to a request whose key is already taken: the stored response, or the 409 or 422 to raise.

    The error is returned, not raised, so that the caller can end its transaction with a COMMIT: a
    ROLLBACK would make psycopg forget the connection's prepared statements, and nothing was written.
    """
    retention = {
        "retention": {
            "response_seconds": options.key_ttl(settings),
            "tombstone_seconds": settings.tombstone_ttl,
        }
    }
    replayed = signals.response_replayed
    if record is None:
        return _in_flight(settings, keyed, retention)
    if not hmac.compare_digest(record.request_sha, keyed.request_sha):
        on_mismatch = settings.on_mismatch if options.on_mismatch is None else options.on_mismatch
        if on_mismatch != "replay":
            if signals.wanted(signals.mismatch_rejected):
                signals.send(signals.mismatch_rejected, org_id=keyed.org_id, key=keyed.key)
            return KeyMismatch(members=retention)
        replayed = signals.mismatch_replayed
    if record.response is None:
        return _in_flight(settings, keyed, retention)
    if record.stale:
        answer = _tombstone_answer(record.response, retention)
        if signals.wanted(signals.tombstone_hit):
            status = answer.code if isinstance(answer, IdempotencyError) else answer.status_code
            signals.send(signals.tombstone_hit, org_id=keyed.org_id, key=keyed.key, status=status)
        return answer
    if signals.wanted(replayed):
        signals.send(replayed, org_id=keyed.org_id, key=keyed.key, status=record.response["status"])
    return replay_response(record.response)


def _in_flight(settings: Settings, keyed: KeyedRequest, retention: dict[str, Any]) -> KeyInUse:
    if signals.wanted(signals.key_in_flight):
        signals.send(signals.key_in_flight, org_id=keyed.org_id, key=keyed.key)
    return KeyInUse(retry_after=settings.retry_after, members=retention)


def _tombstone_answer(stored: Mapping[str, Any], retention: dict[str, Any]) -> Response | IdempotencyError:
    """The answer to a retry whose stored response expired: never a second run.

    ``303 See Other`` to the ``Location`` the first answer had ("the result of your request is over
    there"), or ``410 Gone`` when it had none.
    """
    for name, value in stored.get("headers", ()):
        if name.lower() == "location":
            return Response(status=303, headers={"Location": value})
    return KeyExpired(members=retention)
