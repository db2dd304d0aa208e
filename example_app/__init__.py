"""The reference shop of flask-idem: organisations, orders, and (later) payments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Flask

__all__ = ["create_app"]


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """Create the shop.

    Configuration comes from ``FLASK_*`` environment variables (``FLASK_DATABASE_URL`` and so on, see
    :meth:`flask.Config.from_prefixed_env`), then from ``test_config``. Without a database URL, an embedded
    PostgreSQL is started with its data in the instance folder.
    """
    from celery import Celery

    from . import (
        api,
        db,
        fulfilment,
        gateway_events,
        health,
        metrics,
        orders,
        payments,
        problems,
        receipts,
        web,
    )
    from .cli import shop_cli
    from .extensions import idem, jobs

    app = Flask(__name__, instance_relative_config=True)
    app.config.from_mapping(
        # Bodies are small JSON documents; anything larger is refused (413) before any database work.
        MAX_CONTENT_LENGTH=64 * 1024,
        # The payment gateway simulator (example_app.gateway), and how long one call to it may take.
        # Keep the timeout well under IDEM_LEASE_TIMEOUT (30 s by default).
        GATEWAY_URL="http://127.0.0.1:5001",
        GATEWAY_TIMEOUT=10.0,
        # The gateway's webhook events (example_app.gateway_events): the secret they are signed with, the
        # same as the gateway's ("whsec_" and base64). Without it there is no POST /webhooks/gateway.
        GATEWAY_WEBHOOK_SECRET=None,
        # Seconds an event id is kept (a redelivery within it gets the first answer); None: three days.
        GATEWAY_WEBHOOK_WINDOW=None,
        # GET /metrics and the counters behind it (example_app.metrics).
        METRICS=True,
        # Celery's settings (FLASK_CELERY__broker_url=... overrides one): the broker the relay publishes
        # fulfilment tasks to and the workers take them from (example_app.fulfilment).
        CELERY={
            "broker_url": "amqp://guest:guest@127.0.0.1:5672//",
            "task_default_queue": "shop",
            "task_ignore_result": True,
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
        },
    )
    app.config.from_prefixed_env()
    if test_config is not None:
        app.config.update(test_config)
    if not app.config.get("IDEM_DATABASE_URL"):
        app.config["IDEM_DATABASE_URL"] = db.database_url(app)
    if not app.config.get("IDEM_RESPONSE_KEYS"):  # receipt links are kept encrypted (example_app/receipts.py)
        app.config["IDEM_RESPONSE_KEYS"] = receipts.response_keys(app)

    app.config.setdefault("MAIL_SINK", str(Path(app.instance_path) / "mail"))  # receipts (a Maildir)

    idem.init_app(app)
    celery_app = Celery(app.import_name, set_as_current=False)
    celery_app.config_from_object(app.config["CELERY"])
    jobs.init_app(app, celery_app)
    assert fulfilment.fulfil.name == "shop.fulfil"  # the task is defined (imported) with the app
    problems.register(app)
    api.register(app, orders.bp, payments.bp, receipts.bp, receipts.public, health.bp)
    web.init_app(app)  # the checkout pages (example_app/web.py)
    gateway_events.init_app(app)  # POST /webhooks/gateway
    metrics.register(app)
    app.cli.add_command(shop_cli)
    return app
