"""gunicorn settings for the shop with Prometheus metrics: ``gunicorn -c example_app/gunicorn_conf.py``.

prometheus-client's multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory
before gunicorn starts (from the shell or the service manager, so that every worker inherits it).
When a worker exits, its live gauges are dropped; its counters stay in the directory and keep counting
in the sums, as they should.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import multiprocess


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn hook, in the master: a worker has exited."""
    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
