"""What runs around a decorated view: parse, fingerprint, reserve, run, store, commit, or short-circuit.

This module is also the one boundary where driver errors become HTTP errors: a :class:`psycopg.Error`
leaving a request goes through :func:`.errors.database_error`.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from flask import Request, Response, current_app, g, request
from psycopg.rows import TupleRow

from . import _steps, signals
from ._fingerprint import fingerprint
from ._keys import HEADER, parse_key
from ._policy import Fingerprint, Fingerprinted, RequestParts, describe_mismatch
from ._records import KeyedRequest, KeyRecord, Lease
from ._replay import StoreResponse, record_response, replay_response
from ._settings import OnMismatch, ScopeFunc, Settings
from ._state import IdemState
from ._transactions import in_transaction, render
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyError,
    KeyExpired,
    KeyInUse,
    KeyMismatch,
    MissingKey,
    NoScope,
    database_error,
)
from .flow import INTENT, Flow, Run, run_from_record

__all__ = ["SAFE_METHODS", "Current", "ViewOptions", "current", "handle"]

#: Methods that are passed through untouched: they must not change state, so retrying them is harmless.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

_CURRENT_ATTR = "_flask_idem_current"
_HEADER_ENVIRON = "HTTP_" + HEADER.upper().replace("-", "_")  # where the WSGI environ keeps it

#: Attribute of a decorated view that holds its :class:`ViewOptions` (read by flask_idem.openapi and
#: flask_idem.testing).
OPTIONS_ATTR = "_flask_idem"

logger = logging.getLogger("flask_idem")


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
    #: What counts as the same request; ``None``: the whole request (the default policy).
    fingerprint: Fingerprint | None = None
    #: What is kept of the route's answers for retries.
    store_response: StoreResponse = "full"

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
    """Answer one request to a decorated view, within its database time (``IDEM_DATABASE_DEADLINE``)."""
    req = request._get_current_object()  # type: ignore[attr-defined]  # one proxy lookup, not one per use
    if req.method in SAFE_METHODS:
        return current_app.make_response(view(*args, **kwargs))
    return _keyed(state, req, view, args, kwargs, options)  # within the request's database time


def _keyed(
    state: IdemState,
    req: Request,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: ViewOptions,
) -> Response:
    """Answer a write request to a decorated view: with its key, or refuse it (400), or without one."""
    if options.key_from is None:
        # The environ's one entry (a WSGI server joins a repeated header's values with commas, which
        # parse_key refuses), not request.headers.getlist, which walks the whole environ.
        value = req.environ.get(_HEADER_ENVIRON)
        key = parse_key(() if value is None else (value,))
    else:
        _whole_body(req)  # cached first: a key read from a form must not consume the body fingerprinted
        key = parse_key(options.key_from())
    keyed: KeyedRequest | None = None
    try:
        if key is None:
            required = state.settings.require_key if options.required is None else options.required
            if required or options.flow is not None:
                raise MissingKey()
            _ready(state)
            return in_transaction(
                state.source,
                lambda conn: current_app.make_response(_call_view(conn, None, None, view, args, kwargs)),
            )
        printed: _Printed | None = None
        if options.fingerprint is None:  # the default policy, as it always was: nothing more to do
            request_sha = fingerprint(
                method=req.method,
                path=req.path,
                query=req.query_string,
                mimetype=req.mimetype,
                body=_whole_body(req),
            )
        else:
            printed = _Printed.of(req, options.fingerprint)
            request_sha = printed.now.sha
        keyed = KeyedRequest(_org_id(options.scope), key, request_sha, req.method, req.path)
        _ready(state)
        attempt = _Attempt(view, args, kwargs, keyed, printed)
        if options.flow is None:
            return _atomic(state, options, attempt)
        return _multistep(state, options, options.flow, attempt)
    except psycopg.Error as e:
        error = database_error(e, retry_after=state.settings.retry_after, key_table=state.settings.table)
        if error.code == 503:
            signals.send(
                signals.store_unavailable,
                org_id=None if keyed is None else keyed.org_id,
                key=key,
                error=type(e).__name__,
                sqlstate=e.sqlstate,
            )
        raise error from None


def _ready(state: IdemState) -> None:
    """Check the key table's layout at the first write request (:meth:`.IdemState.check_layout`).

    A missing or unusable key table is the deployment's problem, not the client's, and it ends once the
    migration has run: the request is answered 503 with ``Retry-After`` (nothing was recorded; a retry
    with the same key is safe), and the error, with the command to run, goes to the log.
    """
    try:
        state.check_layout()
    except ConfigurationError as e:
        logger.error("%s Answered 503 until then.", e)
        raise DatabaseUnavailable(retry_after=state.settings.retry_after) from None


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One keyed write request to a decorated view: what to call, and whose key it carries."""

    view: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    request: KeyedRequest
    printed: _Printed | None = None

    def call(self, conn: psycopg.Connection[TupleRow]) -> Any:
        """Call the view on ``conn`` (:func:`_call_view`)."""
        return _call_view(conn, self.request.org_id, self.request.key, self.view, self.args, self.kwargs)

    def respond(
        self, state: IdemState, options: ViewOptions, conn: psycopg.Connection[TupleRow]
    ) -> tuple[Response, dict[str, Any] | None]:
        """Call the view on ``conn`` and make its response; with it, the document to store for a
        response under 500 (its body read while ``idem.connection`` is still there for a generator)."""
        keyed = self.request
        here = g._get_current_object()  # one proxy lookup, not two
        setattr(here, _CURRENT_ATTR, Current(conn, keyed.org_id, keyed.key))
        try:
            response = current_app.make_response(render(lambda: self.view(*self.args, **self.kwargs)))
            if response.status_code >= 500:
                return response, None
            return response, _record(state, options, response, self.printed)
        finally:
            delattr(here, _CURRENT_ATTR)


def _record(
    state: IdemState, options: ViewOptions, response: Response, printed: _Printed | None
) -> dict[str, Any]:
    """What is stored of ``response``, by the route's ``store_response`` and ``IDEM_MAX_RESPONSE_BYTES``."""
    settings = state.settings
    return record_response(
        response,
        settings.replay_headers,
        max_bytes=settings.max_response_bytes,
        store=options.store_response,
        codec=state.codec,
        request=None if printed is None else printed.stored(),
    )


@dataclass(frozen=True, slots=True)
class _Printed:
    """A request fingerprinted under its route's policy, kept to compare it under earlier policies."""

    policy: Fingerprint
    req: Request
    now: Fingerprinted

    @classmethod
    def of(cls, req: Request, policy: Fingerprint) -> _Printed:
        return cls(policy, req, policy.compute(_parts(req, policy)))

    def stored(self) -> dict[str, Any] | None:
        """What the stored response keeps of the request: the policy and a digest of each part."""
        if self.now.parts is None:
            return None
        return {"policy": self.policy.id, "parts": self.now.parts}

    def earlier(self, request_sha: bytes) -> bool:
        """Whether the request is the one first stored with ``request_sha`` under an earlier policy (each
        reads the headers and calls the function it names itself)."""
        return any(
            hmac.compare_digest(request_sha, policy.compute(_parts(self.req, policy)).sha)
            for policy in self.policy.previous
        )


def _parts(req: Request, policy: Fingerprint) -> RequestParts:
    """What ``policy`` reads of ``req``."""
    return RequestParts(
        method=req.method,
        path=req.path,
        query=req.query_string,
        mimetype=req.mimetype,
        body=_whole_body(req),
        headers={name: req.headers.getlist(name) for name in policy.header_names},
        custom=None if policy.custom is None else policy.custom(),
    )


def _same_request(record: KeyRecord, keyed: KeyedRequest, printed: _Printed | None) -> bool:
    """Whether a key's first request and this one are the same request, under the policy of the first."""
    if hmac.compare_digest(record.request_sha, keyed.request_sha):
        return True
    return printed is not None and printed.earlier(record.request_sha)


def _atomic(state: IdemState, options: ViewOptions, attempt: _Attempt) -> Response:
    """Reserve, run the view and store its response in one transaction."""
    keyed, settings = attempt.request, state.settings
    stored = False
    if options.store_response == "encrypted" and state.codec is None:
        raise ConfigurationError(
            f"{request.endpoint} keeps its answers encrypted (store_response='encrypted'), and"
            " IDEM_RESPONSE_KEYS is not set: make a key with 'flask idem new-response-key'."
        )

    def body(conn: psycopg.Connection[TupleRow]) -> Response | IdempotencyError:
        nonlocal stored
        found = state.store.reserve(conn, keyed, ttl=options.key_ttl(settings))
        if not found.reserved:
            return _answer_existing(state, options, found.record, attempt)
        signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=None)
        response, document = attempt.respond(state, options, conn)
        if document is not None:
            state.store.complete(conn, keyed, document)
            stored = True
        state.fire("view", conn)
        return response

    try:
        answer = in_transaction(state.source, body, batched=True)
    except psycopg.errors.UniqueViolation as e:
        if e.diag.table_name != settings.table.rpartition(".")[2]:
            raise
        # The key's row, written with COMMIT, met one committed meanwhile (under REPEATABLE READ, whose
        # snapshot predates the key's lock): nothing of this attempt was kept, and the next finds it.
        raise _in_flight(settings, keyed, _retention(options, settings)) from None
    if stored and isinstance(answer, Response):
        _steps.sent_stored(keyed.org_id, keyed.key, None, answer)
    return _raise_errors(answer)


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
            signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=flow.name)
            intent = attempt.call(conn)
            if not isinstance(intent, dict):  # the view answered at once, e.g. abort(404)
                response = current_app.make_response(intent)
                if response.status_code < 500:
                    state.store.complete(conn, lease, _record(state, options, response, attempt.printed))
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
            and _same_request(record, keyed, attempt.printed)
            and state.store.take_over(conn, lease)
        ):
            return run_from_record(
                flow, org_id=keyed.org_id, key=keyed.key, step=record.step, state=record.state
            )
        return _answer_existing(state, options, record, attempt)

    started = in_transaction(state.source, begin, batched=True)
    if not isinstance(started, Run):
        if stored and isinstance(started, Response):
            _steps.sent_stored(keyed.org_id, keyed.key, flow.name, started)
        return _raise_errors(started)
    if started.resumed:
        signals.send(
            signals.lease_taken_over,
            org_id=keyed.org_id,
            key=keyed.key,
            flow=flow.name,
            step=started.last_step,
        )
    stored_request = None if attempt.printed is None else attempt.printed.stored()
    return _steps.advance(state, flow, started, lease, retry_in=seconds, request=stored_request)


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
    """Call the view with its connection and key published on ``g``; return what it returned.

    ``g`` belongs to the application context, which an ``async def`` view's coroutine shares although it
    runs on another thread (:mod:`._async`).
    """
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
    state: IdemState, options: ViewOptions, record: KeyRecord | None, attempt: _Attempt
) -> Response | IdempotencyError:
    """The answer to a request whose key is already taken: the stored response, or the 409 or 422 to raise.

    The error is returned, not raised, so that the caller can end its transaction with a COMMIT: a
    ROLLBACK would make psycopg forget the connection's prepared statements, and nothing was written.
    """
    settings, keyed = state.settings, attempt.request
    retention = _retention(options, settings)
    replayed = signals.response_replayed
    if record is None:
        return _in_flight(settings, keyed, retention)
    if not _same_request(record, keyed, attempt.printed):
        on_mismatch = settings.on_mismatch if options.on_mismatch is None else options.on_mismatch
        if on_mismatch != "replay":
            signals.send(signals.mismatch_rejected, org_id=keyed.org_id, key=keyed.key)
            return _mismatch(attempt.printed, record, retention)
        replayed = signals.mismatch_replayed
    if record.response is None:
        return _in_flight(settings, keyed, retention)
    if record.stale:
        answer = _tombstone_answer(record.response, retention)
        status = answer.code if isinstance(answer, IdempotencyError) else answer.status_code
        signals.send(signals.tombstone_hit, org_id=keyed.org_id, key=keyed.key, status=status)
        return answer
    signals.send(replayed, org_id=keyed.org_id, key=keyed.key, status=record.response["status"])
    return replay_response(record.response, state.codec)


def _retention(options: ViewOptions, settings: Settings) -> dict[str, Any]:
    """The retention policy a 409, 410 or 422 carries."""
    return {
        "retention": {
            "response_seconds": options.key_ttl(settings),
            "tombstone_seconds": settings.tombstone_ttl,
        }
    }


def _mismatch(printed: _Printed | None, record: KeyRecord, retention: dict[str, Any]) -> KeyMismatch:
    """The 422, naming the parts of the request that differ when the route's policy can tell."""
    if printed is None:
        return KeyMismatch(members=retention)
    told = describe_mismatch(
        printed.policy, record.response, printed.now, lambda p: p.compute(_parts(printed.req, p))
    )
    if told is None:
        return KeyMismatch(printed.policy.mismatch_detail(), members=retention)
    detail, differs = told
    return KeyMismatch(detail, members={**retention, "differs": differs})


def _in_flight(settings: Settings, keyed: KeyedRequest, retention: dict[str, Any]) -> KeyInUse:
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
