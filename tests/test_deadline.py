"""Deadlines on the database: connection options, the watchdog, a request's budget, the prober, fail-fast.

A silent connection is made with the fault proxy (:mod:`tests.support.faultproxy`): ``silence("hung")`` leaves
every open connection acknowledged by the kernel and answered by nobody.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.conninfo import make_conninfo
from psycopg_pool import PoolTimeout

from flask_idem import (
    DEFAULT_CONNECT_OPTIONS,
    ConfigurationError,
    DeadlineExceeded,
    Idempotency,
    _deadline,
    _probe,
)
from flask_idem._pool import FAIL_FAST_TIMEOUT, ForkSafeConnectionPool
from flask_idem._settings import Settings
from flask_idem._state import get_state

from .support import pgbouncer
from .support.faultproxy import FaultProxy, running_proxy
from .support.helpers import PREPARE_THRESHOLD
from .support.servers import free_port, wait_for

#: Slack over an expected time for a busy machine, in seconds.
SLACK = 3.0

direct_only = pytest.mark.skipif(
    pgbouncer.ENABLED, reason="behind PgBouncer the client does not know its server process"
)


@pytest.fixture
def proxy(database_url: str) -> Iterator[FaultProxy]:
    """A fault proxy in front of the database server; a silenced connection's server side is closed after
    15 s, so that a test whose mechanism is missing fails instead of hanging."""
    with running_proxy(database_url, release_after=15.0) as proxy:
        yield proxy


def make_pool(url: str, **options: Any) -> ForkSafeConnectionPool:
    return ForkSafeConnectionPool(url, prepare_threshold=PREPARE_THRESHOLD, **options)


def test_connections_get_the_default_timeouts(database_url: str) -> None:
    """Every connection of the pool has the connect timeout, keepalives and TCP user timeout."""
    pool = make_pool(database_url)
    try:
        with pool.connection() as conn:
            parameters = conn.info.get_parameters()
    finally:
        pool.close()
    for name, value in DEFAULT_CONNECT_OPTIONS.items():
        assert parameters.get(name) == str(value), name


def test_url_and_settings_win_over_the_defaults(database_url: str) -> None:
    """Values in the URL are kept; IDEM_CONNECT_OPTIONS overrides a default, and None removes one."""
    url = make_conninfo(database_url, connect_timeout=7, tcp_user_timeout=1234)
    pool = make_pool(url, connect_options={"keepalives_idle": None, "keepalives_count": 9})
    try:
        with pool.connection() as conn:
            parameters = conn.info.get_parameters()
    finally:
        pool.close()
    assert (parameters["connect_timeout"], parameters["tcp_user_timeout"]) == ("7", "1234")
    assert parameters["keepalives_count"] == "9"
    assert "keepalives_idle" not in parameters


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"connect_timout": 5}, 'invalid connection option "connect_timout"'),
        ({"connect_timeout": True}, "must be a dict of libpq connection parameters"),
        ("connect_timeout=5", "must be a dict of libpq connection parameters"),
    ],
    ids=["misspelt", "bool", "string"],
)
def test_bad_connect_options_are_refused(value: Any, message: str) -> None:
    """IDEM_CONNECT_OPTIONS is checked at init_app: a misspelt parameter is named."""
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_config({"IDEM_DATABASE_URL": "postgresql://x/y", "IDEM_CONNECT_OPTIONS": value})


@pytest.mark.parametrize("value", [0, -1, "10"], ids=["zero", "negative", "string"])
def test_bad_deadlines_are_refused(value: Any) -> None:
    """IDEM_DATABASE_DEADLINE is a positive number of seconds, or None."""
    with pytest.raises(ConfigurationError, match="IDEM_DATABASE_DEADLINE"):
        Settings.from_config({"IDEM_DATABASE_URL": "postgresql://x/y", "IDEM_DATABASE_DEADLINE": value})
    settings = Settings.from_config({"IDEM_DATABASE_URL": "postgresql://x/y", "IDEM_DATABASE_DEADLINE": None})
    assert settings.database_deadline is None


@direct_only
def test_the_server_gets_the_deadline_where_it_has_no_timeouts(database_url: str) -> None:
    """On a direct connection the server ends a statement, and a transaction left idle, at the deadline;
    a timeout the server already has (here from the URL's options) is kept."""
    pool = make_pool(database_url, deadline=7.5)
    kept = make_pool(make_conninfo(database_url, options="-c statement_timeout=2500"), deadline=7.5)
    try:
        with pool.connection() as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("7500ms",)
            assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("7500ms",)
        with kept.connection() as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("2500ms",)
            assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("7500ms",)
    finally:
        pool.close()
        kept.close()


def test_a_silent_connection_is_cut_at_its_deadline(
    proxy: FaultProxy, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement on a connection that went silent (the peer ACKs, nothing answers) ends at the deadline
    with DeadlineExceeded, and the connection is not lent again."""
    monkeypatch.setattr(_probe, "PROBE_AFTER", 3600.0)  # the watchdog alone
    pool = make_pool(proxy.conninfo(database_url), deadline=2.0)
    try:
        with pool.connection() as conn:
            conn.execute("SELECT 1")
        with (
            pytest.raises(DeadlineExceeded, match="no answer within its deadline of 2.0 s"),
            pool.connection() as conn,
        ):
            proxy.silence("hung")
            started = time.monotonic()
            conn.execute("SELECT 1")
        assert time.monotonic() - started < 2.0 + SLACK
        with pool.connection() as fresh:
            assert fresh is not conn and fresh.execute("SELECT 2").fetchone() == (2,)
    finally:
        pool.close()


def test_without_a_deadline_nothing_is_armed(database_url: str) -> None:
    """IDEM_DATABASE_DEADLINE = None: connections are lent without a deadline and the server keeps its
    own timeouts."""
    pool = make_pool(database_url, deadline=None)
    try:
        with pool.connection() as conn:
            assert conn._idem_armed is None
            assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
    finally:
        pool.close()


def test_a_request_shares_one_budget(database_url: str) -> None:
    """Within a budget, the time of every connection borrowed counts: once it is spent, the connection
    held is cut and the next borrow fails at once."""
    pool = make_pool(database_url, deadline=30.0)
    try:
        with _deadline.budget(1.0):
            with pytest.raises(DeadlineExceeded, match="deadline of 1.0 s"), pool.connection() as conn:
                conn.execute("SELECT 1")
                time.sleep(1.5)
                conn.execute("SELECT 1")
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="is spent"), pool.connection():
                pass
            assert time.monotonic() - started < 0.5
    finally:
        pool.close()


def test_a_budget_inside_another_spends_from_it() -> None:
    """A budget opened inside another gets at most what is left of it and charges it what it spends;
    ``math.inf`` (no deadline) stands apart."""
    with _deadline.budget(10.0):
        _deadline.spend(4.0)
        with _deadline.budget(30.0):
            assert _deadline.seconds_left(None) == 6.0
            _deadline.spend(1.0)
        assert _deadline.seconds_left(None) == 5.0
        with _deadline.budget(math.inf):
            assert _deadline.seconds_left(None) == math.inf
            _deadline.spend(100.0)
        assert _deadline.seconds_left(None) == 5.0


def test_what_before_request_waits_counts_in_the_request_deadline(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The deadline is the whole request's: database time spent in a ``before_request`` function (the
    shop's authentication, say) counts with the view's, so 1.2 s there and 1.2 s in the view are cut at
    the 2 s deadline (503), not served after 2.4 s."""
    app = Flask(__name__)
    app.config.update(IDEM_DATABASE_URL=database_url, IDEM_DATABASE_DEADLINE=2.0, IDEM_POOL_TIMEOUT=5.0)
    idem = Idempotency(app, scope=lambda: 1)

    @app.before_request
    def authenticate() -> None:
        with idem.pool.connection() as conn:
            conn.execute("SELECT pg_sleep(1.2)")

    @app.post("/slow")
    @idem.idempotent()
    def slow() -> Any:
        idem.connection.execute("SELECT pg_sleep(1.2)")
        return {"ok": True}, 201

    try:
        started = time.monotonic()
        answer = app.test_client().post("/slow", headers={"Idempotency-Key": str(uuid.uuid4())})
        waited = time.monotonic() - started
    finally:
        get_state(app).source.close()
    assert answer.status_code == 503, answer.data
    assert answer.headers["Retry-After"]
    assert waited < 2.0 + SLACK / 3, waited


@direct_only
def test_the_prober_cuts_a_silent_connection_and_ends_its_transaction(
    proxy: FaultProxy, database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Long before the deadline, the prober learns from the server that it is not working for a connection
    that waits for an answer: the connection is cut, and its server process, which held the
    transaction's lock, is ended."""
    pool = make_pool(proxy.conninfo(database_url), deadline=60.0)
    try:
        with (
            pytest.raises(DeadlineExceeded, match="its server process was 'idle in transaction'"),
            pool.connection() as conn,
        ):
            conn.execute("BEGIN")
            conn.execute("SELECT pg_advisory_xact_lock(4242)")
            pid = conn.info.backend_pid
            proxy.silence("hung")
            started = time.monotonic()
            conn.execute("SELECT 1")
        waited = time.monotonic() - started
        assert waited < _probe.PROBE_AFTER + 2 * _probe.PROBE_INTERVAL + 2 * SLACK, waited
        wait_for(
            lambda: (
                db.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() == (0,)
            ),
            10,
            0.1,
            message="the silent connection's server process was not ended",
        )
        assert db.execute("SELECT pg_try_advisory_lock(4242), pg_advisory_unlock(4242)").fetchone() == (
            True,
            True,
        )
    finally:
        pool.close()


def test_the_prober_leaves_a_slow_statement_alone(database_url: str) -> None:
    """A statement the server is working on is not cut, however long it waits, before the deadline."""
    pool = make_pool(database_url, deadline=60.0)
    try:
        with pool.connection() as conn:
            conn.execute("SELECT pg_sleep(%s)", (_probe.PROBE_AFTER + 3 * _probe.PROBE_INTERVAL,))
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        pool.close()


def test_requests_fail_fast_while_the_database_cannot_be_reached() -> None:
    """Once opening a connection failed, a request waits for one only briefly, not IDEM_POOL_TIMEOUT."""
    pool = make_pool(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing", timeout=3.0)
    try:
        with pytest.raises(PoolTimeout), pool.connection():  # it finds out
            pass
        assert pool.failing
        with pytest.raises(PoolTimeout, match=f"after {FAIL_FAST_TIMEOUT:.2f} sec"), pool.connection():
            pass
    finally:
        pool.close()
