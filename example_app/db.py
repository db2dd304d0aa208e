"""Where the shop's database is, and its tables.

With ``DATABASE_URL`` set (``FLASK_DATABASE_URL`` in the environment) the shop uses that server. Without
it, the shop starts an embedded PostgreSQL (:mod:`.embedded`) with its data in the instance folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from flask import Flask
from psycopg import sql
from psycopg.rows import dict_row

from .embedded import embedded_url
from .extensions import idem

__all__ = ["database_url", "fetch_all", "fetch_one", "init_db"]


def database_url(app: Flask) -> str:
    """The configured database URL, or the URL of an embedded server started for ``app``."""
    url = app.config.get("DATABASE_URL")
    if url:
        return str(url)
    return embedded_url(Path(app.instance_path) / "pgdata")


def init_db() -> None:
    """Create flask-idem's key table and the shop's tables (safe to run twice).

    With ``IDEM_DISTRIBUTED`` the tables are distributed on Citus (``distributed.sql``): orders and
    payments by ``org_id``, co-located with the key table, and ``orgs`` as a reference table.
    """
    idem.create_table()
    ddl = files(__package__).joinpath("schema.sql").read_bytes()
    settings = idem.settings
    if settings.distributed:
        distributed = sql.SQL(files(__package__).joinpath("distributed.sql").read_text("utf-8"))
        ddl = (
            b"SET LOCAL citus.multi_shard_modify_mode TO 'sequential';\n"
            + ddl
            + distributed.format(key_table=sql.Literal(settings.table)).as_bytes(None)
        )
    with idem.pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('example_app.init_db'))")
        conn.execute(ddl)


def fetch_one(
    query: LiteralString, params: Sequence[Any], *, conn: psycopg.Connection[Any] | None = None
) -> dict[str, Any] | None:
    """The first row of ``query`` as a ``dict`` of its columns, or ``None``.

    :param conn: where to run it, such as :attr:`flask_idem.Idempotency.connection` inside an idempotent
        view; by default a connection of the pool, outside any transaction of the view's.
    """
    if conn is not None:
        return conn.cursor(row_factory=dict_row).execute(query, params).fetchone()
    with idem.pool.connection() as pooled:
        return pooled.cursor(row_factory=dict_row).execute(query, params).fetchone()


def fetch_all(query: LiteralString, params: Sequence[Any]) -> list[dict[str, Any]]:
    """Every row of ``query`` as a ``dict`` of its columns, on a connection of the pool."""
    with idem.pool.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(query, params).fetchall()
