"""API-key authentication: ``Authorization: Bearer <key>`` names the organisation of a request."""

from __future__ import annotations

import hashlib
import re
import secrets

from flask import g, request
from werkzeug.datastructures import WWWAuthenticate
from werkzeug.exceptions import Unauthorized

from .extensions import idem

__all__ = ["authenticate", "hash_api_key", "new_api_key"]

_BEARER = re.compile(r"Bearer ([A-Za-z0-9_\-]{20,128})")


def new_api_key() -> str:
    """A new random API key (43 URL-safe characters)."""
    return secrets.token_urlsafe(32)


def hash_api_key(api_key: str) -> bytes:
    """What the database keeps of an API key: its SHA-256."""
    return hashlib.sha256(api_key.encode("ascii")).digest()


def authenticate() -> None:
    """``before_request`` hook of the API: set ``g.org_id`` from the API key, or answer 401.

    Runs before any view, so an unknown or revoked key never reaches the idempotency key table.
    """
    match = _BEARER.fullmatch(request.headers.get("Authorization", ""))
    if match is None:
        raise Unauthorized("Send 'Authorization: Bearer <API key>'.", www_authenticate=_CHALLENGE)
    with idem.pool.connection() as conn:
        row = conn.execute(
            "SELECT id FROM orgs WHERE api_key_sha = %s AND revoked_at IS NULL",
            (hash_api_key(match[1]),),
        ).fetchone()
    if row is None:
        raise Unauthorized("The API key is unknown or revoked.", www_authenticate=_CHALLENGE)
    g.org_id = row[0]


_CHALLENGE = WWWAuthenticate("bearer", {"realm": "shop"})
