"""Health checks: ``GET /health`` (the process answers) and ``GET /health/ready`` (its database does too).

Neither needs an API key. ``/health`` never touches the database, so it answers even while a silent
database holds some of the process's threads (see "Timeouts and failover" in the docs); ``/health/ready``
asks the database one question within one second (:meth:`flask_idem.Idempotency.deadline`) and answers
``503`` with ``Retry-After`` when it cannot, so that a load balancer stops sending traffic rather than
waiting on it. It also reports, in ``warnings``, a key table whose partitions run out soon
(:meth:`flask_idem.Idempotency.partition_warning`), and still answers ``200``: taking every server out of
the load balancer would not make partitions; ``flask idem purge`` does.
"""

from __future__ import annotations

from typing import Any

from .api import Blueprint
from .extensions import idem
from .schemas import Health

bp = Blueprint("health", __name__, description="Whether the shop and its database answer.")

#: Seconds of database time a readiness check may take.
READY_DEADLINE = 1.0


@bp.route("/health", methods=["GET"])
@bp.doc(security=[])
@bp.response(200, Health, description="The process answers.")
def health() -> dict[str, str]:
    """Liveness: the process answers, without asking the database"""
    return {"status": "ok"}


@bp.route("/health/ready", methods=["GET"])
@bp.doc(security=[])
@bp.response(200, Health, description="The process and its database answer.")
@bp.problems(500, 503)
def ready() -> dict[str, Any]:
    """Readiness: the database answers one question within a second"""
    with idem.deadline(READY_DEADLINE):
        with idem.pool.connection() as conn:
            conn.execute("SELECT 1")
        warning = idem.partition_warning()
    return {"status": "ok"} if warning is None else {"status": "ok", "warnings": [warning]}
