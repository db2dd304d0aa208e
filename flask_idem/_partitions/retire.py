"""Retiring the partitions whose range has passed: compact tombstones written, then detached and dropped.

A passed partition holds only keys past their retention (:mod:`.clock`). A moment's ``SHARE`` lock waits
for every transaction still writing to it and lets go at once (an ``UPDATE`` of the key table locks every
partition: holding it longer would hold up every multi-step request); a partition that still holds a
request in progress is kept for a later run. Then, in a transaction that blocks no one, the compact
tombstones of its finished keys are written and the partition marked done (a run stopped before the drop
writes none twice), and rows flagged for a person move to a live partition in the same transaction, so
that no statement sees the key missing. Last, ``DETACH PARTITION ... CONCURRENTLY`` (a plain ``DETACH``
or ``DROP`` would wait on every open transaction and hold up every request behind it) and ``DROP TABLE``.
Tombstone partitions go the same way (:doc:`/retention`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from .tables import RETIRED, Maintenance, Partition

__all__ = ["detach", "drop", "retire"]


def retire(
    run: Maintenance, part: Partition, *, tombstone_ttl: float, interval: float, now: datetime
) -> bool:
    """Step 1 of retiring ``part``; whether it may be detached and dropped now.

    ``now`` is the run's clock, not the statements' ``now()``: which tombstones are still live, and how
    far ahead a flagged row moves, are measured against the moment that retires the partition (under a
    fake clock as well, whose partitions are the ones made ahead).
    """
    q, name = run.tables.sql, run.tables.qualified(part.name)

    def settled(conn: psycopg.Connection[Any]) -> int:
        # The SHARE lock is let go at once: an UPDATE of the key table locks every partition, so holding
        # it would hold up every multi-step request while the tombstones are written.
        if run.runner.distributed:
            _wait_for_writers(run, conn, name)
        else:
            conn.execute(q("settle", partition=name))
        busy = conn.execute(q("in_progress", partition=name)).fetchone()
        return busy[0] if busy is not None else 0

    def work(conn: psycopg.Connection[Any]) -> tuple[int, int]:
        written = 0
        marked = conn.execute(q("marked"), {"partition": name.as_string(None)}).fetchone()
        if tombstone_ttl > 0 and marked != (RETIRED,):
            written = conn.execute(
                q("tombstones", partition=name), {"tomb": tombstone_ttl, "now": now}
            ).rowcount
        conn.execute(q("mark", partition=name))
        moved = conn.execute(
            q("move", partition=name), {"keep": 2 * interval, "after": part.upper, "now": now}
        ).rowcount
        return written, moved

    try:
        busy = run.runner.transaction(settled)
        if busy:
            run.report.kept.append((part.name, f"{busy} multi-step request(s) still in progress"))
            return False
        done = run.runner.transaction(work)
    except psycopg.errors.UndefinedTable:  # another run retired and dropped it meanwhile
        return False
    run.report.tombstoned += done[0]
    run.report.moved += done[1]
    return True


def _wait_for_writers(run: Maintenance, conn: psycopg.Connection[Any], name: sql.Identifier) -> None:
    """On Citus: wait for every transaction still writing to partition ``name``.

    ``LOCK TABLE`` on a distributed table locks its table on each node (the coordinator's, and the
    workers' copies of its metadata), not its shards, where the rows are written: it would not wait for
    a request that inserted a row there through its delegated reserve function. Each shard is locked in
    ``SHARE`` mode instead, in a transaction of its own on its node (Citus's manual propagation,
    ``run_command_on_placements``), and let go at once: the same moment's lock as on PostgreSQL.

    :raises psycopg.errors.LockNotAvailable: when a shard's lock was not had within the lock timeout
        (the caller's transaction is tried again).
    """
    q = run.tables.sql
    command = q("barrier", timeout=sql.Literal(f"{run.runner.lock_timeout_ms}ms")).decode()
    shown = name.as_string(None)
    placed = conn.execute(q("placements"), {"partition": shown, "command": command})
    failed = [(shard, result) for shard, success, result in placed if not success]
    if any("lock timeout" in (result or "") for _, result in failed):
        raise psycopg.errors.LockNotAvailable(f"a shard of {shown} is busy: {failed}")
    if failed:
        raise RuntimeError(f"Locking the shards of {shown} failed: {failed}")


def detach(run: Maintenance, parent: str, part: Partition, *, bounded: bool = False) -> None:
    """Detach ``part`` from ``parent``, concurrently but on Citus (see :func:`drop`), or finish its
    interrupted detach.

    :param bounded: the concurrent detach waits for older transactions no longer than the lock timeout
        (then it is left pending, and :class:`psycopg.errors.LockNotAvailable` raised); by default as
        long as they last, as nothing waits behind it.
    """
    runner, q = run.runner, run.tables.sql
    names = {"parent": sql.SQL(parent), "partition": run.tables.qualified(part.name)}
    if runner.distributed:
        runner.echo(
            f"Detaching {part.name} (Citus: a moment's lock on the key table, under the lock timeout)."
        )
        run.run("detach", **names)
    elif part.detaching:
        run.run("finalize", **names)
    else:
        runner.echo(f"Detaching {part.name} (concurrently: requests go on meanwhile).")
        if bounded:  # outside a transaction: for the session, until the detach is through
            runner.conn.execute(q("bound", timeout=runner.lock_timeout))
        try:
            runner.conn.execute(q("detach", **names))
        finally:
            if bounded:
                runner.conn.execute(q("unbound"))


def drop(run: Maintenance, parent: str, part: Partition) -> None:
    """Detach ``part`` from ``parent`` without blocking anyone, then drop it.

    Another run may be at it too: a partition that is no partition any more (detached, or dropped) is
    dropped if it is still there, and one whose detach another run has begun is left to that run.

    On Citus, ``DETACH PARTITION ... CONCURRENTLY`` is refused on a distributed table ("currently
    unsupported", Citus 13; citusdata/citus#5264), and so is ``FINALIZE``. The nearest safe thing is a
    plain ``DETACH PARTITION`` in a transaction of its own under the migration's short lock timeout,
    which the nodes apply too (``citus.propagate_set_commands``), tried again after a pause: it changes
    the catalog only, but holds up the requests behind it for at most the lock timeout per try.
    """
    try:
        detach(run, parent, part)
    except psycopg.errors.ObjectNotInPrerequisiteState:  # "already pending detach": another run's
        run.runner.echo(f"{part.name} is being detached by another run; left to it.")
        return
    except psycopg.errors.UndefinedTable:  # "is not a partition", "does not exist": detached already
        pass

    try:
        run.run("drop", partition=run.tables.qualified(part.name))
    except psycopg.errors.UndefinedTable:  # dropped by another run
        return
    run.report.dropped.append(part.name)
