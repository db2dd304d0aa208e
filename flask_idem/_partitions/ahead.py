"""Partitions made ahead, and the spare one that covers the rest of the horizon until it is needed.

Partitions are made ahead (``CREATE TABLE`` and ``ATTACH PARTITION``, which takes no lock writers wait
on) to cover the application's longest retention and ``IDEM_PARTITION_AHEAD``; a key whose expiry has
no partition cannot be written, so ``flask idem stats``, the metrics and the health check warn long
before (:class:`~.overview.Overview`). The statements are ``partitions.sql``'s.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from .clock import Ranges, aligned_after
from .retire import detach
from .tables import Maintenance, Partition, Tables, partitions

__all__ = ["attach", "make_ahead", "replace_spare"]


def make_ahead(run: Maintenance, parent: str, interval: float, ranges: Ranges) -> None:
    """Make partitions of ``parent`` until ``ranges.until``, after the last one, or from
    ``ranges.start`` (the interval that holds now) when there is none or the last one ended before it:
    no row can expire in the past, and a run after a long pause makes no partition only to drop it.

    Partitions of ``interval`` are made until ``ranges.near``, and one spare partition from there to
    ``ranges.until``. A spare that ``near`` has reached since, or that ends before ``until``, is replaced
    while it is empty (:func:`replace_spare`); one that holds a row, or that the present has come too
    near, stays as it is. Each is created on its own and then attached (:func:`attach`), after reading
    the partitions in the same transaction, under the migration's lock: two runs make each one once.
    """
    tables = run.tables
    prefix, fillfactor = ("_p", 80) if parent == tables.keys else ("_t", 100)

    def create(conn: psycopg.Connection[Any]) -> sql.Identifier | None:
        found = _gap(partitions(conn, parent), ranges)
        if found is None:
            return None
        lower, before = found
        upper = aligned_after(lower if lower < ranges.near else ranges.until, interval)
        if before is not None:
            upper = min(upper, before)
        name = tables.partition(prefix, lower)
        if run.runner.distributed:
            conn.execute(tables.sql("sequential"))
        attach(tables, conn, parent, name, (lower, upper), fillfactor=fillfactor)
        return name

    empty = run.runner.transaction(lambda conn: _spare(run, conn, parent, interval, ranges))
    if empty is not None:
        replace_spare(run, parent, empty)
    while (made := run.runner.transaction(create)) is not None:
        run.report.created.append(made.as_string(None))


def _gap(found: list[Partition], ranges: Ranges) -> tuple[datetime, datetime | None] | None:
    """Where the next partition starts among ``found`` (after the last one, or in a range a replacement
    left), and the lower bound of the partition after that range, if any; ``None`` when ``ranges`` are
    covered."""
    lower, before = ranges.start, None
    for part in found:
        if part.upper is None:  # an unbounded last partition: nothing to add after it
            return None
        if part.lower is not None and part.lower > lower and lower < ranges.until:
            before = part.lower
            break
        lower = max(lower, part.upper)
    return None if lower >= ranges.until else (lower, before)


def _spare(
    run: Maintenance, conn: psycopg.Connection[Any], parent: str, interval: float, ranges: Ranges
) -> Partition | None:
    """The spare partition of ``parent`` to replace now, if any (see :func:`make_ahead`): one whose
    replacement was left pending, or an empty one wider than ``interval`` that is no longer as this run
    would make it, while no row can be written into it before its detach is through: it begins more
    than ``ranges.reach``, and the detach's two waits (each under the lock timeout), after the
    present."""
    found = partitions(conn, parent)
    now = run.clock()
    for part in found:  # a replacement left pending: finished, and dropped or attached again
        if part.detaching and part.lower is not None and part.upper is not None and part.upper > now:
            return part
    last = found[-1] if found else None
    if last is None or last.lower is None or last.upper is None or last.detaching:
        return None
    if last.upper - last.lower <= timedelta(seconds=interval):
        return None
    if last.lower >= ranges.near and last.upper >= ranges.until:  # as this run would make it
        return None
    # Seconds a detach may take: its two waits, each under the lock timeout, and one more.
    detaching = timedelta(seconds=2 * run.runner.lock_timeout_ms / 1000 + 1)
    if last.lower <= now + ranges.reach + detaching:
        return None
    return None if _holds_rows(run.tables, conn, run.tables.qualified(last.name)) else last


def _holds_rows(tables: Tables, conn: psycopg.Connection[Any], name: sql.Identifier) -> bool:
    return conn.execute(tables.sql("holds_rows", partition=name)).fetchone() is not None


def attach(
    tables: Tables,
    conn: psycopg.Connection[Any],
    parent: str,
    name: sql.Identifier,
    span: tuple[datetime, datetime],
    *,
    fillfactor: int | None = None,
) -> None:
    """Attach table ``name`` to ``parent`` as its partition for ``span``, ``[lower, upper)``; with a
    ``fillfactor``, create it first as a table of its own: ``ATTACH PARTITION`` takes a lock on the
    parent that writers do not wait on (``CREATE TABLE ... PARTITION OF`` would take one they do), and
    finds the new table empty at once."""
    if fillfactor is not None:
        create = tables.sql(
            "create", partition=name, parent=sql.SQL(parent), fillfactor=sql.Literal(fillfactor)
        )
        conn.execute(create)
    bounds = {"lower": sql.Literal(span[0]), "upper": sql.Literal(span[1])}
    conn.execute(tables.sql("attach", parent=sql.SQL(parent), partition=name, **bounds))


def replace_spare(run: Maintenance, parent: str, part: Partition) -> None:
    """Detach the spare partition ``part``, found empty, without blocking anyone; drop it if it is still
    empty, or attach it again as it was (:doc:`/retention`). Meanwhile a row whose expiry falls in its
    range cannot be written (503, retried). A row written into it as the detach begins would be missed
    by every statement after until it is attached again: hence :func:`_spare`'s margin.

    The detach waits for older transactions under the lock timeout; one left pending is finished by the
    next run, before the present reaches its range. On Citus the detach is a plain, transactional one
    (:func:`.retire.drop`): the detach, the check and the drop are one transaction, so a spare found
    holding a row was never detached for any statement to miss."""
    name = run.tables.qualified(part.name)
    assert part.lower is not None and part.upper is not None
    span = (part.lower, part.upper)
    run.runner.echo(f"Replacing the spare partition {part.name} (empty) by partitions of the interval.")
    if run.runner.distributed:
        _replace_in_one(run, parent, name, part)
        return
    try:
        detach(run, parent, part, bounded=True)
    except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.UndefinedTable):  # another run's
        return
    except psycopg.errors.LockNotAvailable:
        run.runner.echo(f"The detach of {part.name} waits for older transactions: the next run finishes it.")
        return

    def drop_if_empty(conn: psycopg.Connection[Any]) -> bool:
        if _holds_rows(run.tables, conn, name):
            attach(run.tables, conn, parent, name, span)
            return False
        conn.execute(run.tables.sql("drop", partition=name))
        return True

    try:
        if run.runner.transaction(drop_if_empty):
            run.report.dropped.append(part.name)
        else:
            run.runner.echo(f"A row came into {part.name} meanwhile: attached again, and kept.")
    except psycopg.errors.UndefinedTable:  # dropped by another run
        return


class _Kept(Exception):
    """A spare partition found holding a row in the transaction that detached it: rolled back."""


def _replace_in_one(run: Maintenance, parent: str, name: sql.Identifier, part: Partition) -> None:
    """On Citus: detach the spare ``part``, check that it is empty and drop it, in one transaction (under
    the lock timeout, tried again), rolled back when a row is found in it."""
    run.runner.echo(
        f"Detaching {part.name} (Citus: a moment's lock on the key table, under the lock timeout)."
    )
    q = run.tables.sql

    def replace(conn: psycopg.Connection[Any]) -> None:
        conn.execute(q("detach", parent=sql.SQL(parent), partition=name))  # the plain one, on Citus
        if _holds_rows(run.tables, conn, name):
            raise _Kept
        conn.execute(q("drop", partition=name))

    try:
        run.runner.transaction(replace)
    except _Kept:
        run.runner.echo(f"A row came into {part.name}: left attached, and kept.")
        return
    except psycopg.errors.UndefinedTable:  # detached or dropped by another run
        return
    run.report.dropped.append(part.name)
