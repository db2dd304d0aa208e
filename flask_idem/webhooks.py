"""Inbound webhooks: a redelivered event is not a new event.

Providers deliver each event at least once. A view decorated with :meth:`Idempotency.webhook
<flask_idem.Idempotency.webhook>` handles each event once, in the transaction of its own writes. A
:class:`Source` says how to verify a delivery and which id it carries: the presets :func:`stripe`,
:func:`github`, :func:`shopify` and :func:`standard` (Standard Webhooks), or :func:`generic` with
callables of your own. See :doc:`/webhooks`. Every preset also takes ``name`` (:attr:`Source.name`) and
``window`` (:attr:`Source.window`), and accepts a delivery signed with any one of its secrets.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Sequence
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
    "github",
    "shopify",
    "standard",
    "stripe",
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
        return _json(self.body)


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


def github(
    secret: str | Sequence[str],
    *,
    name: str = "github",
    window: float | timedelta = DEFAULT_WINDOW,
) -> Source:
    """GitHub's webhooks: ``X-Hub-Signature-256`` is ``sha256=`` and the hex HMAC-SHA256 of the raw body
    under the webhook's secret, checked with :func:`hmac.compare_digest`; the event id is
    ``X-GitHub-Delivery`` (the same on a redelivery).

    GitHub signs no timestamp, so a captured delivery verifies whenever it is replayed: the event id,
    kept for ``window``, is what turns a replay away.

    :param secret: the webhook's secret, or a sequence of them while one is rotated.
    """
    keys = tuple(key.encode() for key in _secrets(secret, "github"))

    def verify(headers: Headers, body: bytes) -> str:
        header = _header(headers, "X-Hub-Signature-256")
        scheme, _, given = header.partition("=")
        if scheme != "sha256" or not given:
            raise WebhookRejected(
                "The X-Hub-Signature-256 header is not sha256=<hex digest>.", check="header"
            )
        _require_hmac(keys, body, _ascii(given), "X-Hub-Signature-256", lambda digest: digest.hex().encode())
        return require_event_id(headers.get("X-GitHub-Delivery"), "the X-GitHub-Delivery header")

    return Source(name, verify, parse_seconds("window", window))


def shopify(
    secret: str | Sequence[str],
    *,
    name: str = "shopify",
    window: float | timedelta = DEFAULT_WINDOW,
) -> Source:
    """Shopify's webhooks: ``X-Shopify-Hmac-Sha256`` is the base64 HMAC-SHA256 of the raw body under the
    app's client secret, checked with :func:`hmac.compare_digest`; the event id is
    ``X-Shopify-Webhook-Id`` (the same on a retry).

    Shopify signs no timestamp, so a captured delivery verifies whenever it is replayed: the event id,
    kept for ``window``, is what turns a replay away.

    :param secret: the app's client secret, or a sequence of them while one is rotated.
    """
    keys = tuple(key.encode() for key in _secrets(secret, "shopify"))

    def verify(headers: Headers, body: bytes) -> str:
        given = _ascii(_header(headers, "X-Shopify-Hmac-Sha256"))
        _require_hmac(keys, body, given, "X-Shopify-Hmac-Sha256", base64.b64encode)
        return require_event_id(headers.get("X-Shopify-Webhook-Id"), "the X-Shopify-Webhook-Id header")

    return Source(name, verify, parse_seconds("window", window))


def stripe(
    secret: str | Sequence[str],
    *,
    name: str = "stripe",
    tolerance: float | timedelta = 300,
    window: float | timedelta = DEFAULT_WINDOW,
) -> Source:
    """Stripe's webhooks, verified by Stripe's own library (the ``stripe`` extra:
    ``pip install "flask-idem[stripe]"``): ``Stripe-Signature`` is ``t=<timestamp>,v1=<signature>``, the
    hex HMAC-SHA256 of ``"{t}.{body}"`` under the endpoint's signing secret (``whsec_...``). The event id
    is the ``id`` of the event in the body (``evt_...``).

    A delivery whose timestamp is more than ``tolerance`` seconds old (a captured delivery replayed) or
    ahead of the clock is rejected with ``check="timestamp"``.

    :param secret: the endpoint's signing secret, or a sequence of them while one is rotated.
    :param tolerance: seconds a delivery's timestamp may be from the clock, either way (Stripe's default
        is five minutes).
    :raises ConfigurationError: the ``stripe`` library is not installed.
    """
    verify = _stripe_verify(_secrets(secret, "stripe"), parse_seconds("tolerance", tolerance))
    return Source(name, verify, parse_seconds("window", window))


def _stripe_verify(secrets: tuple[str, ...], tolerance: float) -> Callable[[Headers, bytes], str]:
    """The check of a delivery by Stripe's library, under any one of ``secrets`` (see :func:`stripe`)."""
    try:
        import stripe as library
    except ImportError:
        raise ConfigurationError(
            'webhooks.stripe() verifies with the stripe library: pip install "flask-idem[stripe]".'
        ) from None

    def verify(headers: Headers, body: bytes) -> str:
        header = _header(headers, "Stripe-Signature")
        fields = [item.partition("=") for item in header.split(",")]
        _check_timestamp(next((value for key, _, value in fields if key == "t"), None), tolerance)
        payload = _text(body)
        for candidate in secrets:
            try:
                # A tolerance of 0 leaves the timestamp to the check above, which also refuses one from
                # the future and names the check that failed.
                # stripe 8.0, the lowest version allowed, has no type hints on this method.
                library.WebhookSignature.verify_header(  # type: ignore[no-untyped-call, unused-ignore]
                    payload, header, candidate, 0
                )
            except library.SignatureVerificationError:
                continue
            found = _json(payload)
            return require_event_id(found.get("id") if isinstance(found, dict) else None, "the body's id")
        raise WebhookRejected(_NO_MATCH.format(header="Stripe-Signature"), check="signature")

    return verify


def standard(
    secret: str | Sequence[str],
    *,
    name: str = "standard",
    tolerance: float | timedelta = 300,
    window: float | timedelta = DEFAULT_WINDOW,
) -> Source:
    """`Standard Webhooks <https://www.standardwebhooks.com/>`__, verified by its reference library (the
    ``standardwebhooks`` extra: ``pip install "flask-idem[standardwebhooks]"``): ``webhook-signature`` is a
    space-separated list of ``v1,<base64>``, the HMAC-SHA256 of ``"{webhook-id}.{webhook-timestamp}.{body}"``
    under the secret (``whsec_`` and the key in base64). The event id is ``webhook-id``.

    A delivery whose ``webhook-timestamp`` is more than ``tolerance`` seconds from the clock, either way,
    is rejected with ``check="timestamp"``.

    :param secret: the endpoint's secret, or a sequence of them while one is rotated.
    :param tolerance: seconds a delivery's timestamp may be from the clock, at most 300: the library
        refuses a timestamp five minutes away itself, so a tolerance can narrow that, not widen it.
    :raises ConfigurationError: the ``standardwebhooks`` library is not installed, a secret is not a
        Standard Webhooks secret, or ``tolerance`` is over 300.
    """
    secrets = _secrets(secret, "standard")
    tolerance = parse_seconds("tolerance", tolerance)
    if tolerance > 300:
        raise ConfigurationError(
            "webhooks.standard(tolerance=...) is at most 300 seconds: the standardwebhooks library "
            "refuses a timestamp five minutes away itself."
        )
    return Source(name, _standard_verify(secrets, tolerance), parse_seconds("window", window))


def _standard_verify(secrets: tuple[str, ...], tolerance: float) -> Callable[[Headers, bytes], str]:
    """The check of a delivery by the Standard Webhooks reference library, under any one of ``secrets``
    (see :func:`standard`)."""
    try:
        from standardwebhooks.webhooks import Webhook, WebhookVerificationError
    except ImportError:
        raise ConfigurationError(
            "webhooks.standard() verifies with the standardwebhooks library: "
            'pip install "flask-idem[standardwebhooks]".'
        ) from None
    try:
        # An empty key is refused here: versions of the library before 1.1 accept it.
        if not all(_standard_key(candidate) for candidate in secrets):
            raise ValueError
        verifiers = tuple(Webhook(candidate) for candidate in secrets)
    except Exception:  # the library raises ValueError, RuntimeError or its own error, by version
        raise ConfigurationError(
            "webhooks.standard() needs Standard Webhooks secrets: whsec_ followed by the key in base64."
        ) from None

    def verify(headers: Headers, body: bytes) -> str:
        wanted = {
            key: _header(headers, key) for key in ("webhook-id", "webhook-timestamp", "webhook-signature")
        }
        _check_timestamp(wanted["webhook-timestamp"], tolerance)
        payload = _text(body)
        for verifier in verifiers:
            try:
                verifier.verify(payload, wanted)
            except json.JSONDecodeError:
                raise WebhookRejected(_NOT_JSON, check="body") from None
            except WebhookVerificationError as exc:
                if "timestamp" in str(exc).lower():  # the library's own check, at the edge of ours
                    raise WebhookRejected(_STALE, check="timestamp") from None
                continue
            except ValueError:  # a malformed signature in the list (versions before 1.1 raise it)
                continue
            return require_event_id(wanted["webhook-id"], "the webhook-id header")
        raise WebhookRejected(_NO_MATCH.format(header="webhook-signature"), check="signature")

    return verify


# The details of a rejection name the check and the header, never a secret or the signature expected.
_NO_MATCH = "The {header} header holds no signature of this body under the source's secret."
_NOT_JSON = "The delivery's body is not JSON."
_STALE = "The delivery's timestamp is outside the source's tolerance (a replayed or delayed delivery)."


def _secrets(secret: str | Sequence[str], preset: str) -> tuple[str, ...]:
    found = (secret,) if isinstance(secret, str) else tuple(secret)
    if not found or not all(isinstance(item, str) and item for item in found):
        raise ConfigurationError(
            f"webhooks.{preset}() needs a secret: a non-empty string, or a sequence of them while one "
            "is rotated."
        )
    return found


def _standard_key(secret: str) -> bytes:
    # As the library reads a secret: the base64 after whsec_, padding optional.
    return base64.b64decode(secret.removeprefix("whsec_") + "==")


def _require_hmac(
    keys: tuple[bytes, ...], body: bytes, given: bytes, header: str, encode: Callable[[bytes], bytes]
) -> None:
    """Refuse a delivery unless ``given`` (from ``header``) is the HMAC-SHA256 of ``body`` under one of
    ``keys``, written as ``encode`` writes a digest (hex for GitHub, base64 for Shopify)."""
    for key in keys:
        if hmac.compare_digest(encode(hmac.new(key, body, hashlib.sha256).digest()), given):
            return
    raise WebhookRejected(_NO_MATCH.format(header=header), check="signature")


def _header(headers: Headers, name: str) -> str:
    value = headers.get(name)
    if not value:
        raise WebhookRejected(f"The delivery has no {name} header.", check="header")
    return value


def _ascii(value: str) -> bytes:
    # hmac.compare_digest takes str of ASCII only; a header with other characters matches nothing.
    return value.encode("utf-8", "replace")


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise WebhookRejected("The delivery's body is not UTF-8 text.", check="body") from None


def _json(payload: str | bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        raise WebhookRejected(_NOT_JSON, check="body") from None


def _check_timestamp(value: str | None, tolerance: float) -> None:
    # Whole seconds since the epoch, as both providers send them; twelve digits reach the year 33658.
    if not value or len(value) > 12 or not (value.isascii() and value.isdigit()):
        raise WebhookRejected("The delivery carries no timestamp in whole seconds.", check="timestamp")
    if abs(time.time() - int(value)) > tolerance:
        raise WebhookRejected(_STALE, check="timestamp")
