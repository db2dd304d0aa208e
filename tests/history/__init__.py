"""A history-checking stress test in the spirit of Jepsen.

Concurrent clients place and pay orders through the retry helper against the shop under gunicorn, with a
real gateway process and a PostgreSQL of its own, while a nemesis SIGKILLs shop workers, restarts
PostgreSQL (fast and immediate), makes the gateway answer late, fail before or after charging, or
drop the connection, makes it deliver its webhook events twice at once, out of order or wrongly signed
first, and disturbs the network between the shop and PostgreSQL (resets, a lost COMMIT
answer, a hold, connections silent for good as behind a hung pooler or a dead host). Afterwards the
checker (:mod:`.checker`) proves from the recorded history and the database that nothing was
duplicated, lost or changed. A short run is part of the test suite
(``tests/test_history.py``); a longer one is ``uv run python -m tests.history --duration 300``.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path

from .checker import Report, check, settle
from .cluster import running_cluster
from .jobs import broker_missing, check_fulfilment, jobs_nemesis, running_jobs, settle_jobs
from .partitions import CONFIG, INIT, rolling_partitions
from .workload import Op, client_loop, nemesis

__all__ = ["run"]


def run(
    workdir: Path,
    *,
    duration: float,
    clients: int,
    seed: int,
    fault_interval: float,
    max_faults: int,
    citus: bool = False,
    jobs: bool = True,
    partitions: bool = False,
) -> Report:
    """Run the workload with faults for ``duration`` seconds, then settle and check; return the report.

    With ``citus`` the database is a local Citus cluster, and PostgreSQL restarts hit its worker nodes.
    With ``jobs`` (and a broker answering), paid orders are fulfilled by Celery workers through the
    outbox, under a nemesis of their own (:mod:`.jobs`). With ``partitions`` the key table's partitions
    roll every second from its creation to the end of the check (:mod:`.partitions`).
    """
    report = Report()
    history: list[Op] = []
    lock = threading.Lock()
    if jobs and (missing := broker_missing()) is not None:
        report.notes.append(f"background jobs not checked: {missing}")
        jobs = False
    config, init = (CONFIG, INIT) if partitions else (None, None)
    with (
        running_cluster(workdir, seed=seed, citus=citus, config=config, init_config=init) as cluster,
        ExitStack() as stack,
    ):
        if partitions:
            stack.enter_context(rolling_partitions(cluster, report))
        workers = stack.enter_context(running_jobs(cluster, workdir)) if jobs else None
        stop_at = time.monotonic() + duration
        threads = [
            threading.Thread(target=client_loop, args=(cluster, seed * 100 + i, stop_at, history, lock))
            for i in range(clients)
        ]
        threads.append(threading.Thread(target=nemesis, args=(cluster, stop_at, fault_interval, max_faults)))
        if workers is not None:
            args = (cluster, workers, stop_at, fault_interval, max_faults)
            threads.append(threading.Thread(target=jobs_nemesis, args=args))
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + 120)  # each client's last operation is bounded by the helper's deadline
        settle(cluster, history, report)
        if workers is not None:
            settle_jobs(cluster, workers)
        check(cluster, history, report)
        if workers is not None:
            check_fulfilment(cluster, workers, report)
    return report
