"""``GET /metrics``: the shop's Prometheus metrics (:mod:`flask_idem.metrics`).

Unauthenticated, like most scrape targets: serve it on a private network, or put it behind the
proxy's access rules. Under gunicorn, set ``PROMETHEUS_MULTIPROC_DIR`` and start with
``-c example_app/gunicorn_conf.py`` so that every worker's counts are summed.
"""

from __future__ import annotations

from flask import Blueprint, Flask, Response

from .extensions import metrics

__all__ = ["bp", "register"]

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def scrape() -> Response:
    """The metrics of every worker, and the key table's state read now."""
    return metrics.response()


def register(app: Flask) -> None:
    """Count ``app``'s idempotency outcomes and serve ``/metrics``, unless ``METRICS`` is false."""
    if app.config.get("METRICS", True):
        metrics.init_app(app)
        app.register_blueprint(bp)
