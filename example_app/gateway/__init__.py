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
    from . import charges, faults
    from .store import Store

    app = Flask(__name__, instance_relative_config=True)
    app.config.from_mapping(
        CONNECT_OPTIONS={}, FAULTS_ENABLED=False, MAX_CONTENT_LENGTH=64 * 1024, PREPARE_THRESHOLD=5
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
    store = app.extensions["gateway"] = Store(pool)
    store.init_schema()
    problems.register(app)
    app.register_blueprint(charges.bp)
    if app.config["FAULTS_ENABLED"]:
        app.register_blueprint(faults.bp)
    return app
