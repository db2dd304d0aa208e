"""Inbound webhooks: a redelivered event is not a new event.

Providers deliver each event **at least once**: they retry on any answer but a 2xx and on timeouts, and
sometimes deliver one event twice at once. A view decorated with :meth:`Idempotency.webhook
<flask_idem.Idempotency.webhook>` handles each event once, in the transaction of its own writes::

    from flask_idem import webhooks

    gateway = webhooks.standard(os.environ["GATEWAY_WEBHOOK_SECRET"], name="gateway")

    @app.post("/webhooks/gateway")
    @idem.webhook(gateway)
    def gateway_event():
        event = idem.event.json()
        idem.connection.execute("UPDATE orders SET paid = true WHERE id = %s", (event["order"],))
        return "", 204

A :class:`Source` says how to verify a delivery and which id it carries: the presets :func:`stripe`,
:func:`github`, :func:`shopify` and :func:`standard` (Standard Webhooks), or :func:`generic` with
callables of your own. See :doc:`/webhooks`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from werkzeug.datastructures import Headers

from ._scopes import scope_id
from ._settings import parse_seconds
from .errors import ConfigurationError, WebhookRejected

__all__ = [
    "DEFAULT_WINDOW",
    "Event",
    "Source",
    "WebhookRejected",
    "generic",
]

#: How long a source's event ids are kept by default: three days, Stripe's longest retry schedule (and
#: longer than GitHub's, Shopify's and Standard Webhooks' suggested ones).
DEFAULT_WINDOW = 3 * 24 * 3600.0

#: ``verify(headers, body)``: check a delivery's signature (and timestamp) on its raw body and return the
#: event's id; raise :class:`WebhookRejected` naming the check that failed. ``headers`` are the request's
#: (Werkzeug's :class:`~werkzeug.datastructures.Headers`: ``headers.get(name)`` ignores case).
Verify = Callable[[Headers, bytes], str]


@dataclass(frozen=True, slots=True)
class Event:
    """One verified delivery of an event, as the decorated view sees it (:attr:`Idempotency.event
    <flask_idem.Idempotency.event>`)."""

    #: The source's name (:attr:`Source.name`).
    source: str
    #: The provider's id of the event: the same on every delivery of it.
    id: str
    #: The raw body, byte for byte as signed.
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON.

        :raises WebhookRejected: the body is not JSON.
        """
        try:
            return json.loads(self.body)
        except ValueError:
            raise WebhookRejected("The delivery's body is not JSON.", check="body") from None


@dataclass(frozen=True, slots=True)
class Source:
    """Where deliveries come from: how to verify one and read its event id, and for how long its event
    ids are kept.

    :param name: names the source; event ids are unique per source, not per organisation (the sender is
        not one of your organisations). Two sources of one provider (two Stripe accounts, say) need two
        names, or a ``scope`` on the route (:meth:`Idempotency.webhook
        <flask_idem.Idempotency.webhook>`).
    :param verify: checks a delivery and returns its event id (:data:`Verify`).
    :param window: seconds (or a ``timedelta``) an event id is kept: a redelivery within it is answered
        with the first delivery's answer; after it, with ``200`` and nothing run. Cover the provider's
        longest retry schedule.
    """

    name: str
    verify: Verify = field(repr=False)
    window: float = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigurationError("A webhook source needs a name (a non-empty string).")
        object.__setattr__(self, "window", parse_seconds("window", self.window))

    def org_id(self, tenant: str | int | None = None) -> int:
        """The key table's organisation id of this source's events (of ``tenant``'s, when a route
        scopes them): a negative ``bigint``, so that it never meets an organisation id of the
        application's own (:func:`flask_idem.scope_id` gives non-negative ones)."""
        name = self.name if tenant is None else f"{self.name}\x00{tenant}"
        return -scope_id("flask-idem/webhook\x00" + name) - 1


def generic(
    name: str,
    *,
    verify: Callable[[Headers, bytes], None],
    event_id: Callable[[Headers, bytes], str],
    window: float | timedelta = DEFAULT_WINDOW,
) -> Source:
    """A source of your own: ``verify(headers, body)`` raises :class:`WebhookRejected` for a delivery
    that must not be handled, and ``event_id(headers, body)`` returns the delivery's event id (a
    non-empty string, at most 255 characters)."""

    def checked(headers: Headers, body: bytes) -> str:
        verify(headers, body)
        found = event_id(headers, body)
        return require_event_id(found, "the event id function")

    return Source(name, checked, parse_seconds("window", window))


def require_event_id(found: Any, where: str) -> str:
    """``found`` if it is a usable event id (a non-empty string of at most 255 characters).

    :raises WebhookRejected: otherwise, naming ``where`` it came from.
    """
    if not isinstance(found, str) or not found or len(found) > 255:
        raise WebhookRejected(f"The delivery carries no usable event id ({where}).", check="event-id")
    return found
