"""A key table of a test's own whose first partition's range has already passed.

The layout's first partition, ``<table>_p0``, takes every ``expires_at`` below ``now() + horizon``; a
negative horizon puts that bound in the past, so that a test
can write rows into a partition whose range has passed (``expires_at`` below the bound) without waiting
for the clock, and see what ``flask idem stats``, the metrics and ``flask idem purge`` make of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from flask_idem import _migrate, _partitions

from . import citus
from .layouts import drop

__all__ = ["INSERT", "drop_partitioned", "holding", "insert", "insert_completed", "passed_table"]

#: One row of the key table: org 1, a new key, a fingerprint, expired three hours ago, with the status,
#: response, flow, lease token and lease time, and flag given.
INSERT = (
    "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at, flow,"
    " lease_token, lease_expires_at, needs_attention) VALUES (1, gen_random_uuid(), sha256(%s::bytea),"
    " 'POST', '/notes', %s, %s, now() - interval '3 hours', %s, %s, now() + %s::interval, %s)"
)


def insert_completed(
    db: psycopg.Connection[Any], table: str, key: uuid.UUID, expires_at: datetime, *, org: int = 1
) -> None:
    """Write a completed row of ``key`` into ``table``, expiring at ``expires_at`` (not committed)."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
            " VALUES (%s, %s, sha256(%s::text::bytea), 'POST', '/orders', 'completed', '{{}}', %s)"
        ).format(sql.Identifier(table)),
        (org, key, str(key), expires_at),
    )


@contextmanager
def passed_table(url: str, table: str, *, passed: float = 7200.0) -> Iterator[str]:
    """Create ``table`` in the latest layout, its first partition's range ended ``passed`` seconds ago
    and no partition after it; drop it, its tombstones and its outbox afterwards."""
    drop_partitioned(url, table)
    _migrate.upgrade(url, table=table, distributed=citus.ENABLED, horizon=-passed)
    try:
        yield table
    finally:
        drop_partitioned(url, table)


def drop_partitioned(url: str, table: str) -> None:
    """Drop ``table`` (with its partitions), its compact tombstones, its outbox and reserve function."""
    drop(url, table)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table + "_tombstones")))


def insert(
    db: psycopg.Connection[Any],
    table: str,
    seed: str,
    *,
    status: str = "completed",
    response: str | None = '{"status": 201, "headers": [["Location", "/notes/1"]], "body": ""}',
    flow: str | None = None,
    flagged: bool = False,
) -> None:
    """Insert one row that expired three hours ago (into the passed first partition)."""
    lease = (uuid.uuid4(), "1 hour") if flow is not None else (None, None)
    db.execute(sql.SQL(INSERT).format(sql.Identifier(table)), (seed, status, response, flow, *lease, flagged))


def holding(db: psycopg.Connection[Any], table: str, expires_at: datetime) -> _partitions.Partition:
    """The partition of ``table`` whose range holds ``expires_at``: where a row that expires then is.

    Found by range, not by a row's ``tableoid``, which on Citus names the shard of the partition that
    holds the row (the worker's table), not the partition.
    """
    [part] = [
        part
        for part in _partitions.partitions(db, table)
        if (part.lower is None or part.lower <= expires_at)
        and (part.upper is None or expires_at < part.upper)
    ]
    return part
