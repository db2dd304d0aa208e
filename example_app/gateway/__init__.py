"""A payment gateway simulator: the outside party that the shop's payments call.

It is its own Flask application, run as its own process::

    flask --app example_app.gateway run --port 5001
    gunicorn -w 2 -b 127.0.0.1:5001 'example_app.gateway:create_app()'

Configuration, from ``FLASK_*`` environment variables or ``test_config``:

``DATABASE_URL``
    the PostgreSQL database of the gateway's tables (``gateway_charges``, ``gateway_faults``),
    which it creates when it starts. Without it, the embedded PostgreSQL of the instance folder,
    as for the shop.
``CONNECT_OPTIONS``
    libpq connection parameters over flask-idem's defaults for the gateway's connections
    (:data:`flask_idem.DEFAULT_CONNECT_OPTIONS`), as ``IDEM_CONNECT_OPTIONS`` is for the shop's: a
    dict, e.g. ``FLASK_CONNECT_OPTIONS='{"connect_timeout": 10}'``; ``null`` removes a default, and the
    URL's own parameters win over both. Default ``{}``.
``FAULTS_ENABLED``
    ``true`` enables fault injection at ``/_faults`` (see :mod:`example_app.gateway.faults`).
    Default false.
``GATEWAY_WEBHOOK_URL``
    where the gateway posts its webhook events (``payment.succeeded``, ``payment.refunded``; see
    :mod:`example_app.gateway.events`), e.g. ``http://127.0.0.1:5000/webhooks/gateway``. Without it the
    gateway writes and sends no events.
``GATEWAY_WEBHOOK_SECRET``
    the Standard Webhooks secret (``whsec_`` and base64) the events are signed with; the shop's
    setting of the same name must be the same. Required with ``GATEWAY_WEBHOOK_URL``.
``GATEWAY_WEBHOOK_ATTEMPTS``, ``_BACKOFF``, ``_BACKOFF_CAP``, ``_TIMEOUT``
    attempts per event before it is abandoned (default 8); the backoff's first ceiling and its cap in
    seconds (0.5 and 30); the seconds one attempt may take (5).
``PREPARE_THRESHOLD``
    psycopg's ``prepare_threshold`` for the gateway's connections; ``null`` turns server-side prepared
    statements off (PgBouncer in transaction mode before 1.21). Default 5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Flask

from flask_idem import ForkSafeConnectionPool

__all__ = ["create_app"]


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """Create the gateway and its tables.

    Configuration comes from ``FLASK_*`` environment variables (see
    :meth:`flask.Config.from_prefixed_env`), then from ``test_config``.
    """
    from .. import problems
    from ..embedded import embedded_url
    from . import charges, events, faults
    from .store import Store

    app = Flask(__name__, instance_relative_config=True)
    app.config.from_mapping(
        CONNECT_OPTIONS={},
        FAULTS_ENABLED=False,
        MAX_CONTENT_LENGTH=64 * 1024,
        PREPARE_THRESHOLD=5,
        GATEWAY_WEBHOOK_URL=None,
        GATEWAY_WEBHOOK_SECRET=None,
        GATEWAY_WEBHOOK_ATTEMPTS=8,
        GATEWAY_WEBHOOK_BACKOFF=0.5,
        GATEWAY_WEBHOOK_BACKOFF_CAP=30.0,
        GATEWAY_WEBHOOK_TIMEOUT=5.0,
    )
    app.config.from_prefixed_env()
    if test_config is not None:
        app.config.update(test_config)
    if not app.config.get("DATABASE_URL"):
        app.config["DATABASE_URL"] = embedded_url(Path(app.instance_path) / "pgdata")

    pool = ForkSafeConnectionPool(
        app.config["DATABASE_URL"],
        name="gateway",
        prepare_threshold=app.config["PREPARE_THRESHOLD"],
        connect_options=app.config["CONNECT_OPTIONS"],
    )
    url = app.config["GATEWAY_WEBHOOK_URL"]
    store = app.extensions["gateway"] = Store(pool, events=bool(url))
    store.init_schema()
    if url:
        if not app.config["GATEWAY_WEBHOOK_SECRET"]:
            raise RuntimeError("GATEWAY_WEBHOOK_URL needs GATEWAY_WEBHOOK_SECRET to sign the events with.")
        sender = app.extensions["gateway_events"] = events.Sender(
            store,
            url=url,
            secret=app.config["GATEWAY_WEBHOOK_SECRET"],
            attempts=int(app.config["GATEWAY_WEBHOOK_ATTEMPTS"]),
            base=float(app.config["GATEWAY_WEBHOOK_BACKOFF"]),
            cap=float(app.config["GATEWAY_WEBHOOK_BACKOFF_CAP"]),
            timeout=float(app.config["GATEWAY_WEBHOOK_TIMEOUT"]),
        )
        sender.start()
    problems.register(app)
    app.register_blueprint(charges.bp)
    if app.config["FAULTS_ENABLED"]:
        app.register_blueprint(faults.bp)
    return app
