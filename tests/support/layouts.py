"""Helpers on flask-idem's tables in tests: dropping them, and a look at a table's catalog."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from flask_idem import _layout

__all__ = ["catalog", "check_distributed", "drop", "layout_of"]


def drop(url: str, table: str) -> None:
    """Drop ``table`` (with its partitions), its outbox, its tombstones and its reserve function, if they
    exist."""
    parts = table.split(".")
    with psycopg.connect(url, autocommit=True) as conn:
        for suffix in ("_outbox", "_tombstones", ""):
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*parts[:-1], parts[-1] + suffix))
            )
        function = sql.Identifier(*parts[:-1], parts[-1] + "_reserve")
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}").format(function))


def check_distributed(conn: psycopg.Connection[Any], table: str) -> None:
    """Assert that ``table`` and its outbox are Citus distributed tables, by ``org_id``, co-located."""
    found = conn.execute(
        "SELECT logicalrelid::regclass::text, partmethod, column_to_column_name(logicalrelid, partkey),"
        " colocationid FROM pg_dist_partition WHERE logicalrelid IN (%s::regclass, %s::regclass)",
        (table, table + "_outbox"),
    ).fetchall()
    assert sorted(row[:3] for row in found) == [(table, "h", "org_id"), (table + "_outbox", "h", "org_id")]
    assert len({row[3] for row in found}) == 1, found  # one colocation group: a key and its messages together


def layout_of(conn: psycopg.Connection[Any], table: str) -> int | None:
    """The layout recorded for ``table``."""
    return _layout.read(conn, table).layout


def catalog(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    """What PostgreSQL knows of ``table``'s shape, with its name written as ``T``: columns, constraints,
    indexes, storage options and comment."""
    oid = conn.execute("SELECT %s::regclass::oid", (table,)).fetchone()[0]  # type: ignore[index]
    base = table.split(".")[-1]

    def named(text: str | None) -> str | None:
        return None if text is None else text.replace(base, "T")

    columns = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull, pg_get_expr(adbin, adrelid)"
        " FROM pg_attribute LEFT JOIN pg_attrdef ON adrelid = attrelid AND adnum = attnum"
        " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (oid,),
    ).fetchall()
    constraints = sorted(
        named(row[0])
        for row in conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s", (oid,)
        )
    )
    indexes = sorted(
        named(row[0])
        for row in conn.execute(
            "SELECT pg_get_indexdef(indexrelid) || CASE WHEN indisvalid THEN '' ELSE ' INVALID' END"
            " FROM pg_index WHERE indrelid = %s",
            (oid,),
        )
    )
    options, comment = conn.execute(
        "SELECT reloptions, obj_description(oid, 'pg_class') FROM pg_class WHERE oid = %s", (oid,)
    ).fetchone()  # type: ignore[misc]
    return {
        "columns": columns,
        "constraints": constraints,
        "indexes": indexes,
        "options": options,
        "comment": comment,
    }
