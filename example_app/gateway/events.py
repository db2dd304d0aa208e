"""Webhook events: the gateway tells the shop of each charge that succeeded and each refund, at least once.

An event is written to the outbox table ``gateway_events`` in the transaction of the charge or refund it
tells of, so that none is lost when the process dies. A sender thread in each gateway process claims due
events and posts them to ``GATEWAY_WEBHOOK_URL``, signed as Standard Webhooks says (headers
``webhook-id``, ``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">`` keyed with the base64-decoded ``GATEWAY_WEBHOOK_SECRET`` after its
``whsec_`` prefix). Any answer but a 2xx, a timeout or a connection error is a failed attempt: the event
is due again after a capped exponential backoff with full jitter, until ``GATEWAY_WEBHOOK_ATTEMPTS``
attempts were made, when it is abandoned. So the receiver sees each event at least once, sometimes more,
and not always in order.

Three faults of ``/_faults`` (:mod:`.faults`) are taken by the next events rather than by charge requests:

``webhook_duplicate``
    the first attempt is sent twice at the same moment, on two connections.
``webhook_reorder``
    the event is held back until a later event was delivered (5 s at most), so that it arrives after it.
``webhook_fail_first``
    the first attempt carries a wrong signature, which the receiver refuses; the retry is right.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from .store import Event, Store

__all__ = ["Sender", "sign"]

logger = logging.getLogger(__name__)


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of Standard Webhooks for one delivery."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{event_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class Sender:
    """A thread that delivers the outbox's events to ``url``; :meth:`stop` ends it.

    :param attempts: attempts per event before it is abandoned.
    :param base: the backoff's first ceiling, seconds; it doubles with each failed attempt up to ``cap``,
        and the wait is drawn uniformly below it (full jitter).
    :param timeout: seconds one attempt may take.
    :param poll: seconds between looks at an empty outbox.
    """

    def __init__(
        self,
        store: Store,
        *,
        url: str,
        secret: str,
        attempts: int = 8,
        base: float = 0.5,
        cap: float = 30.0,
        timeout: float = 5.0,
        poll: float = 0.1,
    ) -> None:
        self.store, self.url, self.secret = store, url, secret
        self.attempts, self.base, self.cap, self.timeout, self.poll = attempts, base, cap, timeout, poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._rng = random.Random()

    def start(self) -> None:
        """Start the thread (once; each gunicorn worker creates the app, and so its own sender)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gateway-webhooks", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, letting the attempt under way finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        with requests.Session() as session, ThreadPoolExecutor(2) as twins:
            while not self._stop.is_set():
                try:
                    events = self.store.claim_events(10)
                except Exception:  # the database restarting, say: look again later
                    logger.warning("Cannot read the webhook outbox.", exc_info=True)
                    events = []
                if not events:
                    self._stop.wait(self.poll)
                    continue
                for event in events:
                    self._deliver(session, twins, event)

    def _deliver(self, session: requests.Session, twins: ThreadPoolExecutor, event: Event) -> None:
        first = event.attempts == 0
        wrong = first and event.fault == "webhook_fail_first"
        if first and event.fault == "webhook_duplicate":
            # Two sessions: one connection each, so both deliveries are in flight at once.
            with requests.Session() as other:
                results = list(twins.map(lambda s: self._post(s, event, wrong), (session, other)))
            delivered = any(results)
        else:
            delivered = self._post(session, event, wrong)
        try:
            if delivered:
                self.store.event_delivered(event)
            elif event.attempts + 1 >= self.attempts:
                logger.error("Webhook event %s abandoned after %d attempts.", event.event_id, self.attempts)
                self.store.event_failed(event, retry_in=None)
            else:
                ceiling = min(self.cap, self.base * 2**event.attempts)
                self.store.event_failed(event, retry_in=self._rng.uniform(0, ceiling))
        except Exception:  # the claim lapses and the event is delivered again: at least once
            logger.warning("Cannot record the attempt of webhook event %s.", event.event_id, exc_info=True)

    def _post(self, session: requests.Session, event: Event, wrong: bool) -> bool:
        """One attempt; whether the receiver answered 2xx."""
        body = event.body.encode()
        timestamp = int(time.time())
        signature = sign(self.secret, event.event_id, timestamp, body)
        if wrong:
            signature = "v1," + base64.b64encode(b"\0" * 32).decode()
        headers: dict[str, Any] = {
            "Content-Type": "application/json",
            "webhook-id": event.event_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature,
        }
        try:
            response = session.post(self.url, data=body, headers=headers, timeout=self.timeout)
        except requests.RequestException as e:
            logger.info("Webhook event %s: %s", event.event_id, type(e).__name__)
            return False
        logger.info("Webhook event %s: %s", event.event_id, response.status_code)
        return 200 <= response.status_code < 300
