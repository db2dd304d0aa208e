"""A new user's usual mistakes fail loudly, with the fix in the message, at startup where possible."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Blueprint, Flask
from psycopg.conninfo import make_conninfo

from flask_idem import ConfigurationError, Idempotency, OutcomeUnknown, scope_id
from flask_idem._settings import Settings
from flask_idem.errors import database_error

from .support.flow_app import Ledger, build_flow_app
from .support.helpers import close_pool, count
from .support.notes_app import build_app, post

KEY = {"Idempotency-Key": "5f1e6a3c-2b7d-4c8e-9a01-3d4f5e6a7b8c"}


def new_app(**config: Any) -> Flask:
    app = Flask(__name__)
    app.config.update(config)
    return app


# -- @idem.idempotent() above the route decorator -------------------------------------------------------


def test_decorator_above_the_route_fails_at_import(database_url: str) -> None:
    """On an initialised app the misplaced decorator is refused when it is applied, naming the fix."""
    app = new_app(IDEM_DATABASE_URL=database_url)
    idem = Idempotency(app, scope=lambda: 1)

    def create() -> Any:
        return {}, 201

    with pytest.raises(ConfigurationError, match=r"below @app\.post.*outermost") as found:
        idem.idempotent()(app.post("/orders")(create))
    assert "create" in str(found.value)


def test_decorator_above_a_blueprint_route_fails_every_request(database_url: str, db: Any) -> None:
    """Blueprints are registered later: the first request finds the unprotected view and refuses to serve."""
    idem = Idempotency(scope=lambda: 1)
    bp = Blueprint("shop", __name__)

    @idem.idempotent()
    @bp.post("/orders")
    def create() -> Any:
        idem.connection.execute("INSERT INTO notes (org_id, body) VALUES (1, 'x')")
        return {}, 201

    @bp.post("/fine")
    @idem.idempotent()
    def fine() -> Any:
        return {}, 201

    app = new_app(IDEM_DATABASE_URL=database_url, TESTING=True)
    idem.init_app(app)
    app.register_blueprint(bp)
    try:
        client = app.test_client()
        for path in ("/orders", "/fine"):
            with pytest.raises(ConfigurationError, match=r"tests\.test_mistakes\..*create.*below @app\.post"):
                client.post(path, headers=KEY)
    finally:
        close_pool(app)
    assert count(db, "notes") == 0


def test_connection_outside_a_view_names_the_likely_cause(database_url: str) -> None:
    """idem.connection in an undecorated view says the decorator may be above the route decorator."""
    app = new_app(IDEM_DATABASE_URL=database_url)
    idem = Idempotency(app, scope=lambda: 1)
    with app.test_request_context(method="POST"), pytest.raises(RuntimeError, match=r"below @app\.post"):
        _ = idem.connection


def test_a_correct_app_passes_the_check(make_app: Any, db: Any) -> None:
    """The placement check leaves correctly decorated routes alone (the notes app has a dozen)."""
    app = make_app()
    assert post(app, "/notes", uuid.uuid4(), {"body": "a"}).status_code == 201


# -- a decorated route that only reads ----------------------------------------------------------------


def test_a_get_only_route_is_named_in_a_warning(
    database_url: str, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """@idem.idempotent() under @bp.get does nothing (reads pass through): the first request logs a
    warning naming that endpoint, and only that one; routes with a write method are not named."""
    idem = Idempotency(scope=lambda: 1)
    bp = Blueprint("shop", __name__)

    @bp.get("/orders")
    @idem.idempotent()
    def list_orders() -> Any:
        return {"orders": []}

    @bp.route("/orders/<int:id>", methods=["GET", "PUT"])
    @idem.idempotent()
    def order(id: int) -> Any:  # noqa: A002 (the route's variable)
        return {"id": id}

    @bp.post("/orders")
    @idem.idempotent()
    def create() -> Any:
        return {}, 201

    app = new_app(IDEM_DATABASE_URL=database_url, MAX_CONTENT_LENGTH=1024)
    idem.init_app(app)
    app.register_blueprint(bp)
    try:
        with caplog.at_level(logging.WARNING, "flask_idem"):
            assert app.test_client().get("/orders").status_code == 200
            assert app.test_client().get("/orders").status_code == 200
    finally:
        close_pool(app)
    [warning] = [r for r in caplog.records if "does nothing" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert "'shop.list_orders'" in message and "GET" in message
    assert "shop.order" not in message and "shop.create" not in message


# -- commit() or rollback() inside the view ------------------------------------------------------------


@pytest.mark.parametrize("action", ["commit", "rollback"])
def test_the_views_own_commit_is_named_in_the_log(
    database_url: str, db: Any, caplog: pytest.LogCaptureFixture, action: str
) -> None:
    """idem.connection.commit() (or rollback()) in a view is a 500 whose log says that the view's own
    commit was refused and why, not a bare "ProgrammingError (SQLSTATE none)"; nothing is committed."""
    app = new_app(IDEM_DATABASE_URL=database_url, MAX_CONTENT_LENGTH=1024)
    idem = Idempotency(app, scope=lambda: 1)

    @app.post("/notes")
    @idem.idempotent()
    def create() -> Any:
        idem.connection.execute("INSERT INTO notes (org_id, body) VALUES (1, 'x')")
        getattr(idem.connection, action)()
        return {}, 201

    try:
        with caplog.at_level(logging.ERROR, "flask_idem"):
            answer = app.test_client().post("/notes", json={}, headers=KEY)
    finally:
        close_pool(app)
    assert answer.status_code == 500 and answer.content_type == "application/problem+json"
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert f"in create: the view's own {action}() on idem.connection was refused" in message, message
    assert "commit together" in message and "SQLSTATE none" not in message
    assert "getattr(idem.connection, action)()" in message  # the frames point at the line
    assert count(db, "notes") == 0
    assert count(db, "idempotency_keys") == 0


def test_psycopgs_own_refusal_is_named_too(
    direct_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg's own refusal inside ``with conn.transaction():`` (the path of transactions that are not
    batched) is reported the same way by database_error."""
    with psycopg.connect(direct_database_url) as conn, conn.transaction():
        with pytest.raises(psycopg.ProgrammingError) as refused:
            conn.commit()
    with caplog.at_level(logging.ERROR, "flask_idem"):
        database_error(refused.value)
    [record] = caplog.records
    assert "the view's own commit() on idem.connection was refused" in record.getMessage()


# -- MAX_CONTENT_LENGTH ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "warned"), [(None, True), (64 * 1024, False)], ids=["unset", "set"])
def test_init_app_warns_when_max_content_length_is_unset(
    database_url: str, caplog: pytest.LogCaptureFixture, limit: int | None, warned: bool
) -> None:
    """Without MAX_CONTENT_LENGTH every keyed body, however large, is read and fingerprinted: init_app
    logs a warning that names the setting; with it, nothing is logged."""
    app = new_app(IDEM_DATABASE_URL=database_url, MAX_CONTENT_LENGTH=limit)
    with caplog.at_level(logging.WARNING, "flask_idem"):
        Idempotency(app, scope=lambda: 1)
    found = [r for r in caplog.records if "MAX_CONTENT_LENGTH" in r.getMessage()]
    assert len(found) == (1 if warned else 0), [r.getMessage() for r in caplog.records]
    if warned:
        assert found[0].levelno == logging.WARNING


# -- IDEM_DATABASE_URL ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://shop:s3cret@db/shop", "not a 'mysql' URL"),
        ("postgresql+psycopg://shop:s3cret@db/shop", "sqlalchemy=db"),
        ("localhost/app", "not a PostgreSQL connection string"),
        ("postgres:/oops", "not a PostgreSQL connection string"),
        ("shop:s3cret@db/shop", "not a PostgreSQL connection string"),
    ],
    ids=["mysql", "sqlalchemy-url", "no-scheme", "one-slash", "no-scheme-password"],
)
def test_malformed_database_url_is_refused_by_init_app(url: str, message: str) -> None:
    """A URL that is not PostgreSQL's is refused at startup, never echoing it (it may hold a password)."""
    with pytest.raises(ConfigurationError, match=message) as found:
        Idempotency(new_app(IDEM_DATABASE_URL=url), scope=lambda: 1)
    assert "s3cret" not in str(found.value)


@pytest.mark.parametrize(
    "url",
    ["postgresql://shop@db/shop", "postgres://db/shop", "host=db dbname=shop user=shop", "dbname=shop"],
    ids=["postgresql", "postgres", "key-value", "dbname-only"],
)
def test_postgresql_urls_and_key_value_strings_are_accepted(url: str) -> None:
    assert Settings.from_config({"IDEM_DATABASE_URL": url}).database_url == url


# -- the CLI and the missing key table ------------------------------------------------------------------


def cli_app(url: str) -> Iterator[Flask]:
    app = new_app(IDEM_DATABASE_URL=url, IDEM_POOL_TIMEOUT=0.5)
    Idempotency(app, scope=lambda: 1)
    yield app
    close_pool(app)


def test_cli_prints_the_servers_reason_for_a_missing_database(
    server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`flask idem init-db` on a database that does not exist says so in one message, no password, no pool."""
    url = make_conninfo(server_url, dbname="no_such_db_for_idem", password="s3cr3t-pw")
    for app in cli_app(url):
        result = app.test_cli_runner().invoke(args=["idem", "init-db"])
    assert result.exit_code == 1
    assert "cannot connect to the database: " in result.output
    assert 'database "no_such_db_for_idem" does not exist' in result.output
    assert "s3cr3t" not in result.output
    assert "PoolTimeout" not in result.output
    assert "error connecting in 'flask-idem'" not in caplog.text  # the pool never tried


def test_missing_key_table_names_the_table_and_the_fix(
    direct_database_url: str, db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With IDEM_TABLE naming a table nobody created, a write request is answered 503 (never 500) and
    the log and the CLI name the table and `init-db`; the check is not cached, so the application serves
    as soon as the table exists."""
    app, _ = build_app(direct_database_url, IDEM_TABLE="missing_keys")
    try:
        with caplog.at_level(logging.ERROR, "flask_idem"):
            answer = post(app, "/notes", uuid.uuid4(), {"body": "a"})
        purge = app.test_cli_runner().invoke(args=["idem", "purge"])
        assert app.test_cli_runner().invoke(args=["idem", "init-db"]).exit_code == 0
        later = post(app, "/notes", uuid.uuid4(), {"body": "b"})
    finally:
        close_pool(app)
        db.execute("DROP TABLE IF EXISTS missing_keys")
        db.execute("DROP FUNCTION IF EXISTS missing_keys_reserve")
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "1"
    assert answer.json["type"] == "urn:flask-idem:problem:store-unavailable"
    assert "The key table missing_keys does not exist. Create it with 'flask idem init-db'" in caplog.text
    assert purge.exit_code == 1
    assert "Create it with 'flask idem init-db'" in purge.output
    assert later.status_code == 201


# -- call steps: a bug is not an unknown outcome -------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "level", "logged", "last_error"),
    [
        (
            OutcomeUnknown,
            "WARNING",
            "Outcome of step 'post' of notes.transfer unknown: the ledger is down",
            "OutcomeUnknown",
        ),
        (
            AttributeError,
            "ERROR",
            "Step 'post' of notes.transfer failed with AttributeError: the ledger is down. This is not"
            " OutcomeUnknown, so it may be a bug in the step",
            "AttributeError (error in step)",
        ),
    ],
    ids=["outcome-unknown", "bug"],
)
def test_call_step_failures_are_told_apart_in_the_log(
    database_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    error: type[Exception],
    level: str,
    logged: str,
    last_error: str,
) -> None:
    """OutcomeUnknown is a warning with its message; another exception an error with message and traceback."""
    ledger = Ledger()
    ledger.fail_next = error
    app = build_flow_app(database_url, ledger)
    try:
        with caplog.at_level(logging.WARNING, "flask_idem"):
            answer = post(app, "/transfers", uuid.uuid4(), {"amount": 5})
    finally:
        close_pool(app)
    assert answer.status_code == 503
    record = next(r for r in caplog.records if "'post' of notes.transfer" in r.getMessage())
    assert record.levelname == level
    assert logged in record.getMessage()
    assert (record.exc_info is not None) == (error is AttributeError)
    assert db.execute("SELECT last_error FROM idempotency_keys").fetchone() == (last_error,)


# -- scopes that are not integers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scope", [lambda: uuid.UUID(int=7), lambda: "org-1", lambda: 2**63], ids=["uuid", "str", "too-big"]
)
def test_wrong_scope_type_names_the_helper(database_url: str, db: Any, scope: Any) -> None:
    """A scope returning a UUID or text is a server mistake with a clear message, pointing at scope_id()."""
    app = new_app(IDEM_DATABASE_URL=database_url, TESTING=True)
    idem = Idempotency(app, scope=scope)

    @app.post("/x")
    @idem.idempotent()
    def view() -> str:
        return "ok"

    try:
        with pytest.raises(ConfigurationError, match=r"flask_idem\.scope_id\(\)"):
            app.test_client().post("/x", headers=KEY)
    finally:
        close_pool(app)


def test_scope_id_maps_uuid_and_text_tenants(make_app: Any, db: psycopg.Connection[Any]) -> None:
    """scope_id is stable, fits a bigint, keeps ints, and tells tenants apart; keys then work per tenant."""
    tenant = uuid.UUID("0b5e8a52-8d8c-4c41-9d7b-5f0a2f1c3e11")
    mapped = scope_id(tenant)
    assert mapped == scope_id(uuid.UUID(str(tenant)))
    assert 0 <= mapped < 2**63
    assert scope_id("acme") != scope_id("acme-2") != mapped
    assert scope_id(str(tenant)) != mapped  # text and UUID forms are different tenants
    assert scope_id(42) == 42
    with pytest.raises(TypeError):
        scope_id(True)
    # Stored keys are found through it: the mapping must never change between releases.
    assert (mapped, scope_id("acme")) == (2914375747700694966, 930889384820029549)
    assert len({scope_id(uuid.UUID(int=i)) for i in range(10_000)}) == 10_000
    # Two tenants that share a key keep two operations.
    app = make_app()
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}, **{"X-Org": str(scope_id("left"))}).status_code == 201
    assert post(app, "/notes", key, {"body": "b"}, **{"X-Org": str(scope_id("right"))}).status_code == 201
    assert count(db, "notes") == 2
