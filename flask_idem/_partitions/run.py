"""One run of retention on the partitioned key table (``flask idem purge``): partitions made
ahead (:mod:`.ahead`), and those whose range has passed retired (:mod:`.retire`).

Every step runs as the owner of the tables (the role of ``flask idem migrate``), under the migration's
advisory lock, so that two runs, or a run and a migration, never work at once; all but the concurrent
detach, which cannot run in a transaction. Two runs at once both succeed: a partition is made after
the last one found under the lock, and a partition another run is retiring is left to it (a detach it
left pending, as when it was interrupted, is finished by the next run with ``DETACH ... FINALIZE``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from .. import _migrate
from .ahead import make_ahead
from .clock import Ranges, grace, tombstone_interval
from .retire import drop, retire
from .tables import Maintenance, RetentionReport, partitions

__all__ = ["maintain"]

logger = logging.getLogger("flask_idem")


def maintain(
    url: str,
    *,
    table: str,
    interval: float,
    horizon: float,
    tombstone_ttl: float,
    ahead: float = 0.0,
    lock_timeout: float = 2.0,
    connect_options: Any = None,
    now: Callable[[], datetime] | None = None,
    echo: Callable[[str], None] = logger.info,
) -> RetentionReport:
    """Retire the partitions whose range has passed and make partitions ahead, on a connection of its own
    to ``url`` (a role that owns the tables).

    :param interval: ``IDEM_PARTITION_INTERVAL``; tombstones' partitions cover a quarter of
        ``tombstone_ttl`` when that is longer, so that few are live at once.
    :param horizon: seconds from now that partitions are made ahead of (:meth:`.IdemState.horizon`).
    :param tombstone_ttl: ``IDEM_TOMBSTONE_TTL``; 0 keeps no tombstone.
    :param ahead: of ``horizon``, the seconds made ahead only in case runs stop (``IDEM_PARTITION_AHEAD``):
        partitions of ``interval`` are made until a day past the longest retention, and one spare
        partition covers the rest (:doc:`/retention`). 0 makes partitions of ``interval`` all the way.
    :param now: the clock, the database's ``now()`` by default; every comparison with the present, the
        statements' included, is with its reading, so that a test's fake clock works consistently.
    """
    with _migrate.connect(url, connect_options) as conn:
        run = Maintenance.on(conn, table, lock_timeout=lock_timeout, echo=echo, now=now)
        tables, moment = run.tables, run.clock()
        ranges = Ranges.of_keys(moment, interval=interval, horizon=horizon, ahead=ahead)
        make_ahead(run, tables.keys, interval, ranges)
        if tombstone_ttl > 0:
            ranges = Ranges.of_tombstones(
                moment, interval=interval, horizon=horizon, ahead=ahead, tombstone_ttl=tombstone_ttl
            )
            make_ahead(run, tables.tombstones, tombstone_interval(interval, tombstone_ttl), ranges)
        _retire_passed(run, interval=interval, tombstone_ttl=tombstone_ttl)
    return run.report


def _retire_passed(run: Maintenance, *, interval: float, tombstone_ttl: float) -> None:
    """Retire the key table's partitions whose range passed more than a grace ago, then drop the
    tombstones' whose range has passed."""
    tables, conn = run.tables, run.runner.conn
    for part in partitions(conn, tables.keys):
        at = run.clock()
        if part.upper is None or part.upper > at - grace(interval):
            continue
        try:
            if part.detaching or retire(run, part, tombstone_ttl=tombstone_ttl, interval=interval, now=at):
                drop(run, tables.keys, part)
        except psycopg.errors.UndefinedTable:  # another run retired it meanwhile
            continue
    for part in partitions(conn, tables.tombstones):
        if part.upper is not None and part.upper <= run.clock():
            try:
                drop(run, tables.tombstones, part)
            except psycopg.errors.UndefinedTable:
                continue
