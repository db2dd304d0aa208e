"""The time arithmetic of the partitions: their names' stamps, their aligned bounds, and the ranges a run
makes partitions over.

Nothing is written into a partition once its range has passed: rows expire from the moment their
statement runs (``statement_timestamp()``), and every retention is positive. Retiring waits one more
``grace`` (the partition interval, at most :data:`MAX_GRACE`) after the range passed, for statements that
began before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = [
    "MAX_GRACE",
    "Ranges",
    "aligned_after",
    "aligned_at",
    "duration",
    "grace",
    "stamp",
    "tombstone_interval",
]

#: The longest wait after a partition's range passed before it is retired.
MAX_GRACE = 60.0

#: How often ``flask idem purge`` is expected to run at least (the docs say daily).
_DAY = 86_400.0


def stamp(moment: datetime) -> str:
    """``moment`` as a partition's name ends with it (its lower bound, in UTC, to the second)."""
    return moment.astimezone(UTC).strftime("%Y%m%d%H%M%S")


def aligned_after(moment: datetime, interval: float) -> datetime:
    """The first multiple of ``interval`` seconds since the epoch after ``moment``."""
    seconds = moment.timestamp()
    return datetime.fromtimestamp((math.floor(seconds / interval) + 1) * interval, UTC)


def aligned_at(moment: datetime, interval: float) -> datetime:
    """The last multiple of ``interval`` seconds since the epoch at or before ``moment``."""
    return datetime.fromtimestamp(math.floor(moment.timestamp() / interval) * interval, UTC)


def grace(interval: float) -> timedelta:
    """How long after its range passed a partition of ``interval`` seconds is retired."""
    return timedelta(seconds=min(interval, MAX_GRACE))


@dataclass(frozen=True, slots=True)
class Ranges:
    """Where partitions of a table are made: from ``start`` (or the end of the last one) until
    ``until``, of the interval until ``near`` and one spare after it; ``reach`` is how far past the
    present a row written now may expire at most (the longest retention)."""

    start: datetime
    near: datetime
    until: datetime
    reach: timedelta

    @classmethod
    def of_keys(cls, moment: datetime, *, interval: float, horizon: float, ahead: float) -> Ranges:
        """The key table's, at ``moment``: partitions of ``interval`` from the one that holds it, and
        until ``horizon`` seconds after it (see :func:`flask_idem._partitions.maintain`)."""
        until = moment + timedelta(seconds=horizon)
        near = (
            moment + timedelta(seconds=horizon - ahead) + _before_next(interval, ahead)
            if ahead > 0
            else until
        )
        # A key written now expires within the retention.
        reach = timedelta(seconds=horizon - ahead)
        return cls(start=aligned_at(moment, interval), near=near, until=until, reach=reach)

    @classmethod
    def of_tombstones(
        cls, moment: datetime, *, interval: float, horizon: float, ahead: float, tombstone_ttl: float
    ) -> Ranges:
        """The tombstones', at ``moment``: tombstones of every partition retired now, and of the keys
        written until the horizon (those retired by the runs until the next one end before ``near``);
        one written now (of a partition retired now) ends within the tombstones' period."""
        until = moment + timedelta(seconds=horizon + tombstone_ttl)
        before_next = _before_next(interval, ahead)
        near = moment + timedelta(seconds=tombstone_ttl) + before_next if ahead > 0 else until
        start = aligned_at(moment, tombstone_interval(interval, tombstone_ttl))
        return cls(start=start, near=near, until=until, reach=timedelta(seconds=tombstone_ttl))


def tombstone_interval(interval: float, tombstone_ttl: float) -> float:
    """Seconds of ``expires_at`` one new partition of the tombstones covers: a quarter of
    ``tombstone_ttl`` when that is longer than the key table's ``interval``, so that few are live at
    once."""
    return max(interval, tombstone_ttl / 4)


def _before_next(interval: float, ahead: float) -> timedelta:
    """Until the next run (daily, or at half of ``ahead`` when that is sooner): keys written meanwhile
    expire up to the longest retention after."""
    return timedelta(seconds=max(interval, min(ahead / 2, _DAY)))


def duration(seconds: float) -> str:
    """``seconds`` for a person: "40 s", "12 min", "5.0 h", "3.2 days"."""
    seconds = abs(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
