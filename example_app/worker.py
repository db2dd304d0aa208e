"""The shop's Celery worker: ``celery -A example_app.worker worker``.

The worker runs the shop's idempotent tasks (:mod:`example_app.fulfilment`) in the shop's Flask
application, configured as ``create_app()`` is (``FLASK_*`` environment variables, an embedded
PostgreSQL in the instance folder without ``FLASK_DATABASE_URL``).
"""

from __future__ import annotations

from celery import Celery

from . import create_app

__all__ = ["celery_app", "flask_app"]

#: The shop, whose application context every task runs in.
flask_app = create_app()

#: The Celery application the worker serves (``app.extensions["celery"]``).
celery_app: Celery = flask_app.extensions["celery"]
