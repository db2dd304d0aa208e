"""A history-checking stress test in the spirit of Jepsen.

Concurrent clients place and pay orders through the retry helper against the shop under gunicorn, with a
real gateway process and a PostgreSQL of its own, while a nemesis SIGKILLs shop workers, restarts
PostgreSQL (fast and immediate), makes the gateway answer late, fail before or after charging, or
drop the connection, and disturbs the network between the shop and PostgreSQL (resets, a lost COMMIT
answer, a hold, connections silent for good as behind a hung pooler or a dead host). Afterwards the
checker (:mod:`.checker`) proves from the recorded history and the database that nothing was
duplicated, lost or changed. A short run is part of the test suite
(``tests/test_history.py``); a longer one is ``uv run python -m tests.history --duration 300``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .checker import Report, check, settle
from .cluster import running_cluster
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
) -> Report:
    """Run the workload with faults for ``duration`` seconds, then settle and check; return the report.

    With ``citus`` the database is a local Citus cluster, and PostgreSQL restarts hit its worker nodes.
    """
    report = Report()
    history: list[Op] = []
    lock = threading.Lock()
    with running_cluster(workdir, seed=seed, citus=citus) as cluster:
        stop_at = time.monotonic() + duration
        threads = [
            threading.Thread(target=client_loop, args=(cluster, seed * 100 + i, stop_at, history, lock))
            for i in range(clients)
        ]
        threads.append(threading.Thread(target=nemesis, args=(cluster, stop_at, fault_interval, max_faults)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + 120)  # each client's last operation is bounded by the helper's deadline
        settle(cluster, history, report)
        check(cluster, history, report)
    return report
