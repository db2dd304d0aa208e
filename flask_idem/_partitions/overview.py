"""The partitions of a key table and of its tombstones as the catalog has them, for ``flask idem stats``,
the metrics and the health check: catalog queries only, whatever the number of keys."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from .clock import duration
from .tables import Partition, Tables, partitions, plain

__all__ = ["Overview", "overview"]


@dataclass(frozen=True, slots=True)
class Overview:
    """The partitions of a partitioned key table and of its tombstones, as the catalog has them, and
    the database's clock: what ``flask idem stats``, the metrics and :meth:`Idempotency.partition_warning
    <flask_idem.Idempotency.partition_warning>` read."""

    #: The key table's name, as configured (``IDEM_TABLE``).
    table: str
    #: Oldest range first.
    keys: list[Partition]
    tombstones: list[Partition]
    #: ``now()`` of the database: partitions are ranges of its clock.
    now: datetime

    @property
    def newest_end(self) -> datetime | None:
        """The upper bound of the key table's newest partition: no key can expire at or after it.
        ``None`` when the newest is unbounded (or there is none)."""
        return self.keys[-1].upper if self.keys else None

    def passed(self, partitions: list[Partition]) -> list[Partition]:
        """Those of ``partitions`` whose range has passed: ``flask idem purge`` retires them."""
        return [p for p in partitions if p.upper is not None and p.upper <= self.now]

    def warning(self, *, horizon: float, ahead: float) -> str | None:
        """A sentence when the key table's partitions run out soon, else ``None``.

        It starts when the newest partition ends less than half of ``ahead`` past the longest retention
        (``horizon - ahead``): purge has not run for about half of ``IDEM_PARTITION_AHEAD``.

        :param horizon: the application's :meth:`~flask_idem._state.IdemState.horizon`.
        :param ahead: ``IDEM_PARTITION_AHEAD``.
        """
        retention = horizon - ahead
        if not self.keys:
            return (
                f"The key table {self.table} has no partition: no key can be written. Run"
                " 'flask idem purge' as the tables' owner now (it makes partitions ahead), and daily."
            )
        end = self.newest_end
        if end is None or end >= self.now + timedelta(seconds=horizon - ahead / 2):
            return None
        left = (end - self.now).total_seconds()
        if left < retention:
            what = (
                f"less than the longest retention ({duration(retention)}): requests whose key would"
                " expire after it fail now"
            )
        else:
            what = (
                f"less than the longest retention ({duration(retention)}) and half of"
                f" IDEM_PARTITION_AHEAD ({duration(ahead / 2)})"
            )
        when = "passed" if left <= 0 else f"is {duration(left)} from now"
        stamp = end.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"The newest partition of the key table {self.table} ends at {stamp} UTC, which {when}:"
            f" {what}. Run 'flask idem purge' as the tables' owner (it makes partitions ahead), and run"
            " it daily."
        )


def overview(conn: psycopg.Connection[Any], table: str) -> Overview:
    """The partitions of ``table`` (``IDEM_TABLE``) and of its tombstones. Catalog queries only, whatever
    the number of keys: cheap enough for every scrape of the metrics."""
    tables = Tables(table)
    row = conn.execute(plain("now")).fetchone()
    assert row is not None  # one row, always
    (now,) = row
    return Overview(table, partitions(conn, tables.keys), partitions(conn, tables.tombstones), now)
