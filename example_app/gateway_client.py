"""The shop's side of the payment gateway: charge, and look a charge up by its key.

Every answer is sorted into three kinds, because the payment flow treats them differently:

- a definite outcome (201/200: succeeded, 402: declined): returned as a dict and recorded;
- a definite refusal of the request itself (any other 4xx): returned with status ``"failed"``;
- anything else (timeout, connection error, 5xx, a dropped connection): :class:`OutcomeUnknown`,
  because the charge may or may not have been made.

The gateway's address is ``GATEWAY_URL`` and the time allowed for one call is ``GATEWAY_TIMEOUT``
(seconds), both from the shop's configuration. The timeout must stay well under ``IDEM_LEASE_TIMEOUT``.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

import requests
from flask import current_app

from flask_idem.flow import OutcomeUnknown

__all__ = ["charge", "find_charge"]

_local = threading.local()


def _session() -> requests.Session:
    """One session per thread: connections are reused, and never shared between threads."""
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _url(path: str) -> str:
    return str(current_app.config["GATEWAY_URL"]).rstrip("/") + path


def _timeout() -> float:
    return float(current_app.config["GATEWAY_TIMEOUT"])


def _outcome(response: requests.Response) -> dict[str, Any]:
    body = response.json()
    if response.status_code in (200, 201):
        return {"status": body["status"], "charge_id": body["id"]}
    if response.status_code == 402:
        return {"status": "declined", "charge_id": body.get("charge_id")}
    return {"status": "failed", "charge_id": None, "gateway_status": response.status_code}


def charge(
    *, key: str, amount: int, currency: str, source: str, reference: str | None = None
) -> dict[str, Any]:
    """Ask the gateway to charge ``source`` once for ``key``; a repeat with the same key charges nothing.

    ``reference`` comes back in the gateway's webhook events about the charge.
    """
    body: dict[str, Any] = {"amount": amount, "currency": currency, "source": source}
    if reference is not None:
        body["reference"] = reference
    try:
        response = _session().post(
            _url("/charges"),
            json=body,
            headers={"Idempotency-Key": key},
            timeout=_timeout(),
        )
    except requests.RequestException as e:
        raise OutcomeUnknown(f"gateway call failed: {type(e).__name__}") from e
    if response.status_code >= 500:
        raise OutcomeUnknown(f"gateway answered {response.status_code}")
    return _outcome(response)


def find_charge(key: str) -> dict[str, Any] | None:
    """The outcome of the charge the gateway made for ``key``, or ``None`` if it made none."""
    try:
        response = _session().get(_url("/charges/by-key/" + quote(key, safe="")), timeout=_timeout())
    except requests.RequestException as e:
        raise OutcomeUnknown(f"gateway lookup failed: {type(e).__name__}") from e
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise OutcomeUnknown(f"gateway lookup answered {response.status_code}")
    body = response.json()
    return {"status": body["status"], "charge_id": body["id"]}
