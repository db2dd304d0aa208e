"""The request door of the key protocol: what runs around a decorated view (parse, fingerprint,
reserve, run, store, commit, or short-circuit), and what a request is answered for each outcome.

A :class:`psycopg.Error` leaving a request goes through the HTTP doors' one boundary
(:func:`._http.database_failure`).
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

from . import _protocol, _steps
from ._fingerprint import fingerprint
from ._http import (
    CURRENT_ATTR,
    Current,
    ResponseDoor,
    call_view,
    database_failure,
    final_response,
    ready,
    render,
)
from ._keys import HEADER, parse_key
from ._policy import Fingerprint, Fingerprinted, RequestParts, describe_mismatch
from ._records import Final, KeyedRequest, KeyRecord, Lease
from ._replay import StoreResponse, record_response, replay_response
from ._settings import VIEW_OPTIONS_ATTR, OnMismatch, ScopeFunc, Settings
from ._state import IdemState
from ._transactions import in_transaction
from .errors import (
    ConfigurationError,
    KeyExpired,
    KeyInUse,
    KeyMismatch,
    MissingKey,
    NoScope,
    OutcomePending,
)
from .flow import Flow, Run

__all__ = ["SAFE_METHODS", "ViewOptions", "handle"]

#: Methods that are passed through untouched: they must not change state, so retrying them is harmless.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

_HEADER_ENVIRON = "HTTP_" + HEADER.upper().replace("-", "_")  # where the WSGI environ keeps it

#: Attribute of a decorated view that holds its :class:`ViewOptions` (read by flask_idem.openapi and
#: flask_idem.testing).
OPTIONS_ATTR = VIEW_OPTIONS_ATTR


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
    """Answer one request to a decorated view: a write with its key, or refused (400), or without one."""
    req = request._get_current_object()  # type: ignore[attr-defined]  # one proxy lookup, not one per use
    if req.method in SAFE_METHODS:
        return current_app.make_response(view(*args, **kwargs))
    key = _request_key(req, options)
    keyed: KeyedRequest | None = None
    try:
        if key is None:
            required = state.settings.require_key if options.required is None else options.required
            if required or options.flow is not None:
                raise MissingKey()
            ready(state)
            return in_transaction(
                state.source,
                lambda conn: final_response(
                    current_app.make_response(call_view(conn, None, None, view, args, kwargs)), None
                ),
            ).value
        printed: _PolicyPrint | None = None
        if options.fingerprint is None:  # the default policy, as it always was: nothing more to do
            request_sha = fingerprint(
                method=req.method,
                path=req.path,
                query=req.query_string,
                mimetype=req.mimetype,
                body=_whole_body(req),
            )
        else:
            printed = _PolicyPrint.of(req, options.fingerprint)
            request_sha = printed.now.sha
        keyed = KeyedRequest(_org_id(options.scope), key, request_sha, req.method, req.path)
        ready(state)
        attempt = _Attempt(view, args, kwargs, keyed, printed)
        if options.flow is None:
            return _atomic(state, options, attempt)
        return _multistep(state, options, options.flow, attempt)
    except psycopg.Error as e:
        raise database_failure(state, e, None if keyed is None else keyed.org_id, key) from None


def _request_key(req: Request, options: ViewOptions) -> uuid.UUID | None:
    """The request's key, from the header or the route's ``key_from``; :class:`InvalidKey` refused."""
    if options.key_from is None:
        # The environ's one entry (a WSGI server joins a repeated header's values with commas, which
        # parse_key refuses), not request.headers.getlist, which walks the whole environ.
        value = req.environ.get(_HEADER_ENVIRON)
        return parse_key(() if value is None else (value,))
    _whole_body(req)  # cached first: a key read from a form must not consume the body fingerprinted
    return parse_key(options.key_from())


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One keyed write request to a decorated view: what to call, and whose key it carries."""

    view: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    request: KeyedRequest
    printed: _PolicyPrint | None = None

    def call(self, conn: psycopg.Connection[TupleRow]) -> Any:
        """Call the view on ``conn`` (:func:`call_view`)."""
        return call_view(conn, self.request.org_id, self.request.key, self.view, self.args, self.kwargs)

    def respond(
        self, state: IdemState, options: ViewOptions, conn: psycopg.Connection[TupleRow]
    ) -> tuple[Response, dict[str, Any] | None]:
        """Call the view on ``conn`` and make its response; with it, the document to store for a
        response under 500 (its body read while ``idem.connection`` is still there for a generator)."""
        keyed = self.request
        here = g._get_current_object()  # one proxy lookup, not two
        setattr(here, CURRENT_ATTR, Current(conn, keyed.org_id, keyed.key))
        try:
            response = current_app.make_response(render(lambda: self.view(*self.args, **self.kwargs)))
            if response.status_code >= 500:
                return response, None
            return response, _record(state, options, response, self.printed)
        finally:
            delattr(here, CURRENT_ATTR)


def _record(
    state: IdemState, options: ViewOptions, response: Response, printed: _PolicyPrint | None
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
class _PolicyPrint:
    """A request fingerprinted under its route's policy, kept to compare it under earlier policies."""

    policy: Fingerprint
    req: Request
    now: Fingerprinted

    @classmethod
    def of(cls, req: Request, policy: Fingerprint) -> _PolicyPrint:
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


def _claim(options: ViewOptions, settings: Settings, attempt: _Attempt) -> _protocol.Claim:
    """The protocol's claim of a keyed request, under the route's ttl, mismatch rule and policy."""
    on_mismatch = settings.on_mismatch if options.on_mismatch is None else options.on_mismatch
    printed = attempt.printed
    return _protocol.Claim(
        attempt.request,
        options.key_ttl(settings),
        replay_mismatch=on_mismatch == "replay",
        earlier=None if printed is None or not printed.policy.previous else printed.earlier,
        reported=_reported,
    )


def _reported(outcome: _protocol.Replay | _protocol.Tombstone) -> int | None:
    """The status the signals report: a replay's stored one; a tombstone's ``303`` (to the first
    answer's ``Location``) or ``410``, as :func:`_answer_existing` answers it."""
    if isinstance(outcome, _protocol.Tombstone):
        return 410 if outcome.location is None else 303
    status: int | None = outcome.document.get("status")
    return status


def _atomic(state: IdemState, options: ViewOptions, attempt: _Attempt) -> Response:
    """Reserve, run the view and store its response in one transaction."""
    if options.store_response == "encrypted" and state.codec is None:
        raise ConfigurationError(
            f"{request.endpoint} keeps its answers encrypted (store_response='encrypted'), and"
            " IDEM_RESPONSE_KEYS is not set: make a key with 'flask idem new-response-key'."
        )

    def work(conn: psycopg.Connection[TupleRow]) -> Final[Response]:
        response, document = attempt.respond(state, options, conn)
        return final_response(response, document)

    outcome = _protocol.atomic(state, _claim(options, state.settings, attempt), work)
    if isinstance(outcome, Final):
        return outcome.value
    return _answer_existing(state, options, outcome, attempt)


def _multistep(state: IdemState, options: ViewOptions, flow: Flow, attempt: _Attempt) -> Response:
    """Reserve under a lease (or take a stranded run over) and record the intent in one short
    transaction, then advance step by step."""
    settings, keyed = state.settings, attempt.request
    seconds = _protocol.lease_seconds(settings, flow)
    lease = Lease(keyed.org_id, keyed.key, token=uuid.uuid4(), seconds=seconds)

    def start(conn: psycopg.Connection[TupleRow]) -> Mapping[str, Any] | Final[Response]:
        intent = attempt.call(conn)
        if isinstance(intent, dict):
            return intent
        response = current_app.make_response(intent)  # the view answered at once, e.g. abort(404)
        if response.status_code >= 500:
            return final_response(response, None)
        return final_response(response, _record(state, options, response, attempt.printed))

    try:
        started = _protocol.begin(state, _claim(options, settings, attempt), flow, lease, start)
        if isinstance(started, Final):
            return started.value
        if not isinstance(started, Run):
            return _answer_existing(state, options, started, attempt)
        stored_request = None if attempt.printed is None else attempt.printed.stored()
        final = _steps.advance(
            state, flow, started, lease, ResponseDoor(settings, stored_request), retry_in=seconds
        )
    except _protocol.LeaseLost:
        raise KeyInUse(retry_after=settings.retry_after) from None
    except _protocol.Pending:
        raise OutcomePending(retry_after=settings.retry_after) from None
    return final.value


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
    state: IdemState, options: ViewOptions, outcome: _protocol.Existing, attempt: _Attempt
) -> Response:
    """The answer to a request whose key is already taken: the stored response, or the error (409,
    410, 422) raised."""
    settings = state.settings
    if isinstance(outcome, _protocol.Replay):
        return replay_response(outcome.document, state.codec)
    if isinstance(outcome, _protocol.Tombstone):
        if outcome.location is not None:
            return Response(status=303, headers={"Location": outcome.location})
        raise KeyExpired(members=_retention(options, settings))
    if isinstance(outcome, _protocol.Mismatch):
        raise _mismatch(attempt.printed, outcome.record, _retention(options, settings))
    raise KeyInUse(retry_after=settings.retry_after, members=_retention(options, settings))


def _retention(options: ViewOptions, settings: Settings) -> dict[str, Any]:
    """The retention policy a 409, 410 or 422 carries."""
    return {
        "retention": {
            "response_seconds": options.key_ttl(settings),
            "tombstone_seconds": settings.tombstone_ttl,
        }
    }


def _mismatch(printed: _PolicyPrint | None, record: KeyRecord, retention: dict[str, Any]) -> KeyMismatch:
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
