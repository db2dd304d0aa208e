"""The first release's layout of the key table, kept as a fixture, and a look at a table's catalog.

``tests/support/first_release/`` holds, verbatim, the ``schema.sql`` and ``distributed.sql`` of the first
release (its ``distributed.sql`` with the reserve function's columns written out, as that release composed
them). :func:`create_first_release` runs them as that release's ``flask idem init-db`` did, for any table
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from flask_idem import _layout

__all__ = ["catalog", "check_distributed", "create_first_release", "drop", "layout_of"]

HERE = Path(__file__).parent / "first_release"


def create_first_release(url: str, table: str, *, distributed: bool = False) -> None:
    """Create ``table`` as the first release's ``init-db`` did (with ``--distributed`` on Citus)."""
    parts = table.split(".")
    names: dict[str, sql.Composable] = {
        "table": sql.Identifier(*parts),
        "expires_index": sql.Identifier(parts[-1] + "_expires_at_idx"),
        "lease_index": sql.Identifier(parts[-1] + "_lease_idx"),
        "attention_index": sql.Identifier(parts[-1] + "_attention_idx"),
    }
    ddl = sql.SQL((HERE / "schema.sql").read_text()).format(**names).as_bytes(None)
    if distributed:
        function = sql.Identifier(*parts[:-1], parts[-1] + "_reserve")
        qualified = sql.Identifier(*parts).as_string(None)
        signature = function.as_string(None) + (
            "(bigint, uuid, bytea, text, text, float8, bigint, text, uuid, float8, float8)"
        )
        more = sql.SQL((HERE / "distributed.sql").read_text()).format(
            table=sql.Identifier(*parts),
            table_name=sql.Literal(qualified),
            reserve=function,
            reserve_signature=sql.Literal(signature),
        )
        ddl = b"SET LOCAL citus.multi_shard_modify_mode TO 'sequential';\n" + ddl + more.as_bytes(None)
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute(ddl)


def drop(url: str, table: str) -> None:
    """Drop ``table`` (with its partitions), its outbox, its tombstones and its reserve functions, and the
    first partition an interrupted upgrade to layout 4 may have left, if they exist."""
    parts = table.split(".")
    with psycopg.connect(url, autocommit=True) as conn:
        for suffix in ("_outbox", "_tombstones", ""):
            conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*parts[:-1], parts[-1] + suffix))
            )
        conn.execute(
            sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(*parts[:-1], parts[-1] + "_p0"))
        )
        for suffix in ("_reserve", "_reserve4"):
            function = sql.Identifier(*parts[:-1], parts[-1] + suffix)
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
    """The layout recorded for ``table`` (1 for a table without flask-idem's comment)."""
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
