"""The connection options of every connection the extension (and the gateway simulator) opens.

The pool's own connections are checked in ``tests/test_deadline.py``; here, the others: ``flask idem
migrate``'s, the connection every ``flask idem`` command first makes to check the database
(``_check_connection``), the prober's, and the gateway simulator's pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import psycopg
import pytest
from flask import Flask
from psycopg.conninfo import make_conninfo

from example_app.gateway import create_app as gateway_create_app
from flask_idem import DEFAULT_CONNECT_OPTIONS, _migrate, cli
from flask_idem._pool import ForkSafeConnectionPool
from flask_idem._state import get_state

#: IDEM_CONNECT_OPTIONS of the "settings" and "url" cases: one default changed, one removed, a timeout.
OPTIONS: dict[str, str | int | None] = {"keepalives_idle": None, "keepalives_count": 9, "connect_timeout": 8}


def migrate(app: Flask) -> dict[str, str]:
    settings = get_state(app).settings
    with _migrate.connect(settings.database_url, settings.connect_options) as conn:
        return conn.info.get_parameters()


def cli_check(app: Flask) -> dict[str, str]:
    with psycopg.connect(cli._check_conninfo(get_state(app).settings)) as conn:
        return conn.info.get_parameters()


def prober(app: Flask) -> dict[str, str]:
    source = get_state(app).source
    assert isinstance(source, ForkSafeConnectionPool)
    with source._prober._connection() as conn:
        return conn.info.get_parameters()


def gateway(url: str, options: Mapping[str, str | int | None]) -> dict[str, str]:
    app = gateway_create_app({"TESTING": True, "DATABASE_URL": url, "CONNECT_OPTIONS": dict(options)})
    store = app.extensions["gateway"]
    try:
        with store.pool.connection() as conn:
            return conn.info.get_parameters()
    finally:
        store.close()


CONNECTIONS: dict[str, Callable[[Flask], dict[str, str]] | None] = {
    "migrate": migrate,
    "cli check": cli_check,
    "prober": prober,
    "gateway": None,  # not an application of the extension: its own CONNECT_OPTIONS key
}


@pytest.mark.parametrize("connection", list(CONNECTIONS))
@pytest.mark.parametrize("case", ["defaults", "settings", "url"])
def test_every_connection_gets_the_connect_options(
    connection: str, case: str, database_url: str, make_app: Callable[..., Flask]
) -> None:
    """The connection has the default TCP options, IDEM_CONNECT_OPTIONS set through init_app (the
    gateway's CONNECT_OPTIONS) over them, and the URL's own values over both."""
    url = (
        make_conninfo(database_url, connect_timeout=7, tcp_user_timeout=1234)
        if case == "url"
        else database_url
    )
    options = {} if case == "defaults" else OPTIONS
    read = CONNECTIONS[connection]
    parameters = (
        gateway(url, options)
        if read is None
        else read(make_app(IDEM_DATABASE_URL=url, IDEM_CONNECT_OPTIONS=options))
    )
    expected: dict[str, str | None] = {name: str(value) for name, value in DEFAULT_CONNECT_OPTIONS.items()}
    if connection == "prober":
        expected["connect_timeout"] = "2"  # shorter than the pool's, unless the settings or URL set one
    if case != "defaults":
        expected.update({name: None if value is None else str(value) for name, value in OPTIONS.items()})
    if case == "url":
        expected.update(connect_timeout="7", tcp_user_timeout="1234")
    assert {name: parameters.get(name) for name in expected} == expected
