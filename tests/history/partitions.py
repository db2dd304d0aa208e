"""A key table whose partitions roll every second while the history runs.

With :data:`CONFIG` the shop's key table is partitioned by the second (``IDEM_PARTITION_INTERVAL=1``), so
that the retries of a key land in other partitions than its first attempt (made with :data:`INIT`), and
:func:`rolling_partitions` runs :func:`flask_idem._partitions.maintain` (what ``flask idem purge``
runs) in a loop for the whole run: partitions are made a second at a time and the passed ones detached
concurrently and dropped, under the faults (a run that a PostgreSQL restart breaks is counted, and the
next one finishes what it left, such as a detach left pending).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from flask_idem import _partitions

from .checker import Report
from .cluster import Cluster

__all__ = ["CONFIG", "INIT", "rolling_partitions"]

#: Keys kept long enough for the whole run, its settling and its replays (the checker replays every
#: acknowledged answer, byte for byte), in partitions of one second made twenty seconds ahead of that:
#: ten seconds of them, and a spare partition of ten more that each run replaces by a second of them
#: under load (ten seconds before a key can expire in it, past the five a detach may take); the
#: gateway's webhook events are kept as long (the key table's partitions must cover them).
CONFIG = {
    "IDEM_KEY_TTL": 90,
    "IDEM_PARTITION_INTERVAL": 1,
    "IDEM_PARTITION_AHEAD": 20,
    "GATEWAY_WEBHOOK_WINDOW": 90,
}

#: The key table is made with its first partition ending two seconds later (its horizon), so that the
#: partitions made after it pass, one a second, while the run goes on, and are dropped under load.
INIT = {"IDEM_KEY_TTL": 1, "IDEM_PARTITION_AHEAD": 1}

#: Seconds between two runs.
PAUSE = 0.5


@contextmanager
def rolling_partitions(cluster: Cluster, report: Report) -> Iterator[None]:
    """Run maintain on ``cluster``'s key table in a loop until the block ends; what it did goes to
    ``report`` (operations: partitions made and dropped, spare partitions replaced; notes: runs that
    failed, by error)."""
    stop = threading.Event()
    failed: Counter[str] = Counter()
    config = cluster.config

    def echo(line: str) -> None:
        if line.startswith("Replacing the spare partition"):
            report.operations["spare partition replaced"] += 1

    def once() -> None:
        done = _partitions.maintain(
            cluster.database_url,
            table="idempotency_keys",
            interval=float(config["IDEM_PARTITION_INTERVAL"]),
            horizon=float(config["IDEM_KEY_TTL"]) + float(config["IDEM_PARTITION_AHEAD"]),
            tombstone_ttl=30 * 24 * 3600.0,
            ahead=float(config["IDEM_PARTITION_AHEAD"]),  # a spare partition, replaced on most runs
            lock_timeout=2.0,
            echo=echo,
        )
        report.operations["partition made"] += len(done.created)
        report.operations["partition dropped"] += len(done.dropped)

    def roll() -> None:
        while not stop.wait(PAUSE):
            try:
                once()
            except psycopg.Error as e:  # PostgreSQL restarting: the next run goes on
                failed[type(e).__name__] += 1

    once()  # the partitions of the first keys, before any client starts
    roller = threading.Thread(target=roll, name="rolling partitions")
    roller.start()
    try:
        yield
    finally:
        stop.set()
        roller.join(120)
        report.notes.extend(f"maintain failed {n} time(s): {error}" for error, n in sorted(failed.items()))
