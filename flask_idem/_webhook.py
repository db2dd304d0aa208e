"""The webhook door of the key protocol: verify a delivery, then handle its event once.

A delivery is verified on its raw body before any database work. Its event id is the key, scoped to the
source, and the handler runs in the key's transaction (:func:`._protocol.atomic`): "handled" and
"recorded" commit together, and a handler that raises rolls both back and answers ``500``, so that the
provider delivers it again.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from flask import Request, Response, current_app, g, request
from psycopg.rows import TupleRow

from . import _protocol, signals
from ._http import call_view, database_failure, final_response, published, ready
from ._records import Final, KeyedRequest
from ._replay import record_response, replay_response
from ._state import IdemState
from .errors import KeyInUse, KeyMismatch, WebhookRejected
from .webhooks import Event, Source

__all__ = ["EVENT_ATTR", "OPTIONS_ATTR", "WebhookOptions", "current_event", "event_key", "handle"]

logger = logging.getLogger("flask_idem")

#: Attribute of a decorated webhook view that holds its :class:`WebhookOptions`.
OPTIONS_ATTR = "_flask_idem_webhook"

#: Where the running handler's :class:`~flask_idem.webhooks.Event` is kept on :data:`flask.g`.
EVENT_ATTR = "_flask_idem_event"

#: The namespace of the keys derived from event ids (UUID version 5 of the source and the id).
_NAMESPACE = uuid.UUID("7c3f6c0e-6d0e-4b8e-9d55-6a7b0f1c2d3e")


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    """The options of one decorated webhook view."""

    source: Source
    #: Which of the application's tenants the delivery is for (an account, an endpoint), when one
    #: source's event ids are unique per tenant only; ``None``: the source's ids are unique.
    scope: Callable[[], str | int | None] | None = None


def event_key(source: Source, event_id: str) -> uuid.UUID:
    """The key table's key of ``event_id`` of ``source``: the same on every delivery of the event."""
    return uuid.uuid5(_NAMESPACE, f"{source.name}\x00{event_id}")


def handle(
    state: IdemState,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: WebhookOptions,
) -> Response:
    """Answer one delivery to a decorated webhook view."""
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    source = options.source
    body = req.get_data(cache=True)
    try:
        event_id = source.verify(req.headers, body)
    except WebhookRejected as e:
        signals.send(signals.webhook_rejected, org_id=None, key=None, source=source.name, check=e.check)
        raise
    tenant = None if options.scope is None else options.scope()
    keyed = KeyedRequest(
        source.org_id(tenant),
        event_key(source, event_id),
        hashlib.sha256(body).digest(),
        req.method,
        req.path,
    )
    about = {"source": source.name, "event_id": event_id}
    signals.send_for(signals.webhook_verified, keyed, **about)
    event = Event(source.name, event_id, body)
    try:
        ready(state)
        outcome = _protocol.atomic(
            state,
            _protocol.Claim(keyed, source.window, reported=_reported),
            lambda conn: _run(state, conn, keyed, event, view, args, kwargs),
        )
    except psycopg.Error as e:
        raise database_failure(state, e, keyed.org_id, keyed.key) from None
    if isinstance(outcome, Final):
        if not outcome.failed:
            signals.send_for(signals.webhook_handled, keyed, status=outcome.status, **about)
        return outcome.value
    answer = _answer_existing(state, outcome)
    status = answer.code if isinstance(answer, (KeyInUse, KeyMismatch)) else answer.status_code
    signals.send_for(signals.webhook_duplicate, keyed, status=status, **about)
    if isinstance(answer, (KeyInUse, KeyMismatch)):
        raise answer
    return answer


def _run(
    state: IdemState,
    conn: psycopg.Connection[TupleRow],
    keyed: KeyedRequest,
    event: Event,
    view: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Final[Response]:
    """Run the handler on the key's connection, with its event on ``g``; its answer, stored unless 5xx."""
    here = g._get_current_object()
    setattr(here, EVENT_ATTR, event)
    try:
        response = current_app.make_response(call_view(conn, keyed.org_id, keyed.key, view, args, kwargs))
    finally:
        delattr(here, EVENT_ATTR)
    if response.status_code >= 500:
        return final_response(response, None)
    settings = state.settings
    document = record_response(response, settings.replay_headers, max_bytes=settings.max_response_bytes)
    return final_response(response, document)


def _reported(outcome: _protocol.Replay | _protocol.Tombstone) -> int | None:
    """The status the signals report: a replay's stored one; for a tombstone the ``200`` its sender is
    answered (:func:`_answer_existing`)."""
    if isinstance(outcome, _protocol.Tombstone):
        return 200
    status: int | None = outcome.document.get("status")
    return status


def _answer_existing(state: IdemState, outcome: _protocol.Existing) -> Response | KeyInUse | KeyMismatch:
    """What a provider is answered for an event already taken.

    - handled: the first delivery's answer again (a 2xx: the provider stops);
    - handled longer ago than the source's window: ``200`` with no body; never ``410``, which Standard
      Webhooks senders take as "disable this endpoint";
    - still being handled: ``409`` with ``Retry-After``, which every provider retries later (any answer
      but a 2xx is a failed delivery to Stripe, GitHub's redelivery, Shopify and Standard Webhooks);
    - the same event id with another body: ``422`` (a sender's bug, or a replayed id).
    """
    if isinstance(outcome, _protocol.Replay):
        return replay_response(outcome.document, state.codec)
    if isinstance(outcome, _protocol.Tombstone):
        return Response(status=200)
    if isinstance(outcome, _protocol.Mismatch):
        return KeyMismatch("This event id was delivered before with another body; it is not handled again.")
    return KeyInUse(
        "This event is being handled by an earlier delivery; deliver it again later.",
        retry_after=state.settings.retry_after,
    )


def current_event() -> Event:
    """The event of the webhook handler running now (:attr:`Idempotency.event`)."""
    found: Event = published(
        EVENT_ATTR,
        "idem.event is only available while an @idem.webhook(...) view handles a delivery; check that"
        " @idem.webhook(...) is placed below @app.post(...).",
    )
    return found
