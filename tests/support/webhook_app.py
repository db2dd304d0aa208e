"""A small application receiving webhook deliveries from a source signed with a plain HMAC.

Each handler writes one row of ``hook_effects`` on :attr:`Idempotency.connection`, so that the tests count
how often a handler ran. A delivery to ``/hooks/hold`` writes its row and then waits inside its
transaction for the advisory lock :data:`HOLD_LOCK`, which a test holds on its own connection: how a
handler is held in flight across processes (gunicorn).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import uuid
from typing import Any

from flask import Flask, current_app, request
from werkzeug.datastructures import Headers

from flask_idem import Idempotency, webhooks
from flask_idem.errors import WebhookRejected

SCHEMA = """
CREATE TABLE IF NOT EXISTS hook_effects (
    id bigserial PRIMARY KEY, source text NOT NULL, event_id text NOT NULL, tenant text
);
"""

SECRET = b"whsec_test_secret"

#: The advisory lock a delivery to ``/hooks/hold`` waits for, inside its transaction, after its write.
HOLD_LOCK = 3434

SIGNATURE = "X-Test-Signature"


def sign(body: bytes, secret: bytes = SECRET) -> dict[str, str]:
    """The headers of a delivery of ``body`` signed with ``secret``."""
    digest = hmac.new(secret, body, hashlib.sha256).hexdigest()
    return {SIGNATURE: digest, "Content-Type": "application/json"}


def event(event_id: str, **data: Any) -> bytes:
    """The body of a delivery of event ``event_id``."""
    return json.dumps({"id": event_id, **data}).encode()


def _verify(headers: Headers, body: bytes) -> None:
    given = headers.get(SIGNATURE)
    if not given:
        raise WebhookRejected("The delivery carries no signature.", check="signature")
    expected = hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(given, expected):
        raise WebhookRejected("The delivery's signature does not match its body.", check="signature")


def _event_id(headers: Headers, body: bytes) -> str:
    try:
        found = json.loads(body)["id"]
    except (ValueError, KeyError, TypeError):
        raise WebhookRejected("The delivery's body has no event id.", check="event-id") from None
    return str(found)


def source(name: str = "test", **options: Any) -> webhooks.Source:
    """A :func:`flask_idem.webhooks.generic` source checking :func:`sign`'s signature."""
    return webhooks.generic(name, verify=_verify, event_id=_event_id, **options)


def org_from_header() -> int | None:
    value = request.headers.get("X-Org")
    return int(value) if value else None


def build_webhook_app(database_url: str, **config: Any) -> tuple[Flask, Idempotency]:
    """The application: one webhook route per behaviour under test, and one idempotent route."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update({"IDEM_DATABASE_URL": database_url, "IDEM_POOL_TIMEOUT": 5.0, **config})
    idem = Idempotency(app, scope=org_from_header)
    test = source()

    def effect(tenant: str | None = None) -> int:
        received = idem.event
        row = idem.connection.execute(
            "INSERT INTO hook_effects (source, event_id, tenant) VALUES (%s, %s, %s) RETURNING id",
            (received.source, received.id, tenant),
        ).fetchone()
        assert row is not None
        return int(row[0])

    @app.post("/hooks/plain")
    @idem.webhook(test)
    def plain() -> Any:
        return {"effect": effect(), "run": str(uuid.uuid4())}

    @app.post("/hooks/raise")
    @idem.webhook(test)
    def raises() -> Any:
        effect()
        if current_app.config.get("FAIL", True):
            raise RuntimeError("the handler broke")
        return {"ok": True}

    @app.post("/hooks/500")
    @idem.webhook(test)
    def answers_500() -> Any:
        effect()
        if current_app.config.get("FAIL", True):
            return {"error": "try again"}, 503
        return {"ok": True}

    @app.post("/hooks/tenant/<tenant>")
    @idem.webhook(test, scope=lambda: request.view_args["tenant"] if request.view_args else None)
    def per_tenant(tenant: str) -> Any:
        return {"effect": effect(tenant)}

    @app.post("/hooks/hold")
    @idem.webhook(test)
    def hold() -> Any:
        row = effect()
        idem.connection.execute("SELECT pg_advisory_xact_lock(%s)", (HOLD_LOCK,))
        return {"effect": row}

    @app.post("/hooks/unprotected")
    def unprotected() -> Any:
        """A planted bug: a webhook route without @idem.webhook, writing on every delivery."""
        _verify(request.headers, request.get_data())
        with idem.pool.connection() as conn:
            conn.execute(
                "INSERT INTO hook_effects (source, event_id) VALUES ('test', %s)",
                (_event_id(request.headers, request.get_data()),),
            )
        return {"ok": True}

    @app.post("/notes")
    @idem.idempotent()
    def note() -> Any:
        return {"run": str(uuid.uuid4())}, 201

    return app, idem


def served() -> Flask:
    """The application for gunicorn, on the database of ``WEBHOOK_DATABASE_URL``."""
    return build_webhook_app(os.environ["WEBHOOK_DATABASE_URL"])[0]
