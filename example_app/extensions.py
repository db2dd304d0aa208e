"""The shop's extension instances, created without an application (app factory pattern)."""

from __future__ import annotations

from flask import g

from flask_idem import Idempotency
from flask_idem.celery import CeleryJobs
from flask_idem.metrics import Metrics


def current_org_id() -> int | None:
    """The organisation authenticated for this request (set by :func:`.auth.authenticate`).

    This is flask-idem's scope: keys belong to the organisation of the API key, never to anything the
    request body says.
    """
    org_id: int | None = g.get("org_id")
    return org_id


idem = Idempotency(scope=current_org_id)

#: The shop's idempotent background tasks (:mod:`example_app.fulfilment`), run by Celery workers.
jobs = CeleryJobs(idem)

#: The Prometheus metrics of flask-idem (``GET /metrics``, :mod:`example_app.metrics`).
metrics = Metrics()
