"""One key table's partitioned tables: their names and statements, their partitions as the catalog lists
them, and one run's work on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from .. import _layout, _migrate
from .._sqlfile import SqlFile
from .clock import stamp

__all__ = ["RETIRED", "Partition", "RetentionReport", "Maintenance", "Tables", "partitions"]

#: The statements, in named blocks.
FILE = "_partitions/partitions.sql"

#: What marks a partition whose tombstones are written (a run that stopped before dropping it leaves it
#: so, and the next run writes none twice).
RETIRED = "flask-idem: tombstones written"


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of the key table or of its tombstones."""

    name: str
    #: Its range of ``expires_at``: ``[lower, upper)``; ``lower`` is ``None`` for the first partition
    #: (``_p0``, from ``MINVALUE``).
    lower: datetime | None
    upper: datetime | None
    #: Whether a ``DETACH ... CONCURRENTLY`` of it was interrupted (it is finished by the next run).
    detaching: bool
    #: Rows as the statistics estimate them, and bytes on disk with indexes and TOAST.
    rows: int
    bytes: int


class Tables:
    """The names of one key table's partitioned tables, and the statements on their partitions
    (``partitions.sql``; on Citus, ``distributed``, its Citus blocks)."""

    def __init__(self, table: str, *, distributed: bool = False) -> None:
        self.names = _layout.names(table)
        parts = table.split(".")
        self.schema, self.base = parts[:-1], parts[-1]
        #: The key table and its tombstones, as ``to_regclass`` reads them (and as SQL).
        self.keys = self.names["table"].as_string(None)
        self.tombstones = self.names["tombstones_qualified"].as_string(None)
        self.sql = SqlFile(
            FILE,
            {
                "table": self.names["table"],
                "tombstones": self.names["tombstones_qualified"],
                "retired": sql.Literal(RETIRED),
            },
            distributed=distributed,
        )

    def partition(self, prefix: str, lower: datetime) -> sql.Identifier:
        """The name of a new partition whose range starts at ``lower`` (``prefix``: ``_p`` for the key
        table's, ``_t`` for the tombstones')."""
        return sql.Identifier(*self.schema, f"{self.base}{prefix}{stamp(lower)}")

    def qualified(self, name: str) -> sql.Identifier:
        """Partition ``name`` in the key table's schema."""
        return sql.Identifier(*self.schema, name)


def partitions(conn: psycopg.Connection[Any], parent: str) -> list[Partition]:
    """The partitions of ``parent`` (a name as ``to_regclass`` reads it), oldest range first."""
    with conn.cursor() as cursor:
        return [Partition(*row) for row in cursor.execute(plain("list"), {"parent": parent})]


def plain(block: str) -> bytes:
    """Statement ``block`` of ``partitions.sql`` that names no table (the same on Citus)."""
    return SqlFile(FILE, {}, distributed=False)(block)


@dataclass
class RetentionReport:
    """What :func:`~flask_idem._partitions.maintain` did."""

    #: Partitions dropped, of the key table and of the tombstones.
    dropped: list[str] = field(default_factory=list)
    #: Partitions made ahead.
    created: list[str] = field(default_factory=list)
    #: Partitions past their range kept, with why.
    kept: list[tuple[str, str]] = field(default_factory=list)
    #: Compact tombstones written, and rows flagged for a person moved to a live partition.
    tombstoned: int = 0
    moved: int = 0


@dataclass
class Maintenance:
    """One run of :func:`~flask_idem._partitions.maintain`: its steps (the migration's, on one
    connection, each transaction under its advisory lock and lock timeout), the tables' names and
    statements, its clock, and what it did."""

    runner: _migrate._Runner
    tables: Tables
    #: Every comparison with the present is with its reading (see :func:`~flask_idem._partitions.maintain`).
    clock: Callable[[], datetime]
    report: RetentionReport = field(default_factory=RetentionReport)

    @classmethod
    def on(
        cls,
        conn: psycopg.Connection[Any],
        table: str,
        *,
        lock_timeout: float,
        echo: Callable[[str], None],
        now: Callable[[], datetime] | None,
    ) -> Maintenance:
        """A run on ``conn`` (an autocommit connection of the migration's): with the Citus blocks when
        the key table is distributed, and the database's clock unless ``now`` is given."""
        tables = Tables(table)
        runner = _migrate._Runner(conn, table, tables.names, lock_timeout, echo)
        citus = conn.execute(plain("citus_installed")).fetchone() == (True,)
        runner.distributed = citus and runner.is_distributed()
        if runner.distributed:
            tables = Tables(table, distributed=True)
        clock = now or (lambda: conn.execute(plain("now")).fetchone()[0])  # type: ignore[index]
        return cls(runner, tables, clock)

    def run(self, block: str, **names: sql.Composable) -> None:
        """Statement ``block`` in a transaction of its own (see :meth:`_migrate._Runner.transaction`)."""
        statement = self.tables.sql(block, **names)
        self.runner.transaction(lambda conn: conn.execute(statement))
