"""flask-idem's revisions in a scratch Flask-Migrate project: `flask db init`, `migrate`, `upgrade`; and in
a plain Alembic project (tests/support/plain_alembic, the files the upgrades page shows), run by the
``alembic`` command in a process of its own.

Each test builds a Flask-SQLAlchemy application with ``Idempotency(sqlalchemy=db)`` and the two lines of
the upgrades page, in a PostgreSQL schema of its own (the engine's ``search_path``), so that Alembic's
autogenerate sees that project's tables only; with ``FLASK_IDEM_TEST_CITUS=1``, in a database of its own
on the Citus cluster, where the revisions distribute flask-idem's tables. Flask-Migrate's commands run
in this process; its ``env.py`` reconfigures logging from ``alembic.ini``, which :func:`kept_logging`
undoes afterwards.
"""

from __future__ import annotations

import logging
import re
import subprocess
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask, g, request
from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy import URL, BigInteger, Identity, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idem import ConfigurationError, Idempotency, _layout, _migrate, errors
from flask_idem import alembic as idem_alembic

from .support import citus
from .support.alembic_project import PLAIN_ALEMBIC, alembic, plain_project
from .support.layouts import catalog, check_distributed, layout_of


@contextmanager
def kept_logging() -> Iterator[None]:
    """Undo what ``logging.config.fileConfig`` in Flask-Migrate's ``env.py`` does to this process."""
    manager = logging.root.manager
    loggers = [logging.root, *(lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    saved = [(lg, lg.level, lg.disabled, lg.propagate, list(lg.handlers)) for lg in loggers]
    try:
        yield
    finally:
        for lg, level, disabled, propagate, handlers in saved:
            lg.setLevel(level)
            lg.disabled, lg.propagate, lg.handlers = disabled, propagate, handlers
        known = {id(lg) for lg in loggers}
        for lg in list(manager.loggerDict.values()):
            if isinstance(lg, logging.Logger) and id(lg) not in known:
                lg.disabled = False  # made during the command: kept, never disabled


@pytest.fixture
def scratch(
    direct_database_url: str, db: psycopg.Connection[Any], citus_cluster: citus.Cluster | None
) -> Iterator[str]:
    """A conninfo whose ``search_path`` is a new, empty schema (dropped afterwards); on Citus, a new
    database of the cluster instead (a key table found through ``search_path`` is not supported there,
    see the upgrades page)."""
    name = f"scratch_{uuid.uuid4().hex[:8]}"
    if citus_cluster is not None:
        yield citus_cluster.create_database(name)
        citus_cluster.drop_database(name)
        return
    db.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield make_conninfo(direct_database_url, options=f"-c search_path={name}")
    db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


class Project:
    """A Flask-SQLAlchemy application with its Flask-Migrate folder, as a user's project would be."""

    def __init__(self, conninfo: str, directory: Path, *, with_idem: bool = True) -> None:
        class Base(DeclarativeBase):
            pass

        db = SQLAlchemy(model_class=Base)

        class Order(db.Model):  # type: ignore[name-defined, misc]
            __tablename__ = "orders"
            id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
            org_id: Mapped[int] = mapped_column(BigInteger)
            note: Mapped[str] = mapped_column(String)

        app = Flask(__name__)
        app.config.from_prefixed_env()  # as a user's app would: FLASK_IDEM_* settings apply
        app.config["SQLALCHEMY_DATABASE_URI"] = URL.create(
            "postgresql+psycopg", query=conninfo_to_dict(conninfo)
        )
        db.init_app(app)
        if with_idem:
            idem = Idempotency(app, scope=lambda: g.get("org_id"), sqlalchemy=db)
            # The two lines of the upgrades page.
            migrate = Migrate(app, db, directory=str(directory), **idem_alembic.MIGRATE_OPTIONS)
            migrate.configure(idem_alembic.configure)

            @app.post("/orders")
            @idem.idempotent()
            def create() -> Any:
                order = Order(org_id=g.org_id, note=request.get_json()["note"])
                db.session.add(order)
                db.session.flush()
                return {"id": order.id}, 201

            @app.before_request
            def authenticate() -> None:
                g.org_id = 1
        else:
            Migrate(app, db, directory=str(directory))
        self.app, self.db, self.directory = app, db, directory

    def flask_db(self, *args: str) -> Any:
        """``flask db ARGS``; the result (Flask-Migrate reports failures with exit status 1)."""
        with kept_logging(), warnings.catch_warnings():
            # Flask-Migrate's env.py tries Flask-SQLAlchemy 2's get_engine() first, then falls back.
            warnings.filterwarnings("ignore", "'get_engine' is deprecated", DeprecationWarning)
            return self.app.test_cli_runner().invoke(args=["db", *args])

    def revisions(self) -> list[Path]:
        return sorted((self.directory / "versions").glob("*.py"))

    def dispose(self) -> None:
        with self.app.app_context():
            self.db.engine.dispose()


@pytest.fixture
def projects(scratch: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Project] = []

    def make(**options: Any) -> Project:
        made.append(Project(scratch, tmp_path / "migrations", **options))
        return made[-1]

    yield make
    for project in made:
        project.dispose()


def post_order(project: Project, key: str, note: str = "a") -> Any:
    """``POST /orders`` on the project's route, with ``key``."""
    return project.app.test_client().post("/orders", json={"note": note}, headers={"Idempotency-Key": key})


def test_new_project(projects: Any, scratch: str) -> None:
    """init, upgrade (the key table), migrate (the application's table only, after flask-idem's newest
    revision, in the project's own folder), upgrade; an idempotent route works; autogenerate finds nothing."""
    project = projects()
    assert project.flask_db("init").exit_code == 0
    offline = project.flask_db("upgrade", "--sql")  # the SQL a DBA would run, printed, nothing run
    assert offline.exit_code == 0, offline.output
    assert 'CREATE TABLE IF NOT EXISTS "idempotency_keys"' in offline.output
    assert 'CREATE INDEX IF NOT EXISTS "idempotency_keys_due_idx"' in offline.output
    assert 'PARTITION OF "idempotency_keys"' in offline.output  # the first partition
    # The grants kept, in the printed SQL too: the roles remembered, then granted again.
    assert offline.output.index("set_config('flask_idem.roles'") < offline.output.index("DO $grants$")
    assert "%%" not in offline.output  # nothing doubled by the pyformat escaping of Flask-Migrate's env.py
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") is None
    assert project.flask_db("upgrade").exit_code == 0
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") == _layout.latest()

    result = project.flask_db("migrate", "-m", "orders")
    assert result.exit_code == 0, result.output
    [revision] = project.revisions()
    text = revision.read_text()
    assert "op.create_table('orders'" in text
    assert "idempotency_keys" not in text  # neither dropped nor altered
    assert f"down_revision = '{_layout.alembic_id(_layout.latest())}'" in text  # one chained history
    assert project.flask_db("upgrade").exit_code == 0
    if citus.ENABLED:
        with psycopg.connect(scratch) as conn:
            check_distributed(conn, "idempotency_keys")

    key = str(uuid.uuid4())
    first, again = post_order(project, key), post_order(project, key)
    assert first.status_code == 201
    assert (again.status_code, again.json) == (200, first.json)

    check = project.flask_db("check")
    assert check.exit_code == 0, check.output  # "No new upgrade operations detected."
    assert project.flask_db("migrate", "-m", "nothing").exit_code == 0
    assert len(project.revisions()) == 1  # no empty revision either


def test_upgrade_keeps_a_later_recorded_layout(projects: Any, scratch: str) -> None:
    """`flask db upgrade` over a key table that records a later layout (a newer flask-idem's, which lets
    this code run) applies the revisions, which change nothing, and keeps that layout's comment."""
    _migrate.upgrade(scratch, table="idempotency_keys", distributed=citus.ENABLED)
    newer = _layout.comment(_layout.latest() + 1, 1)
    with psycopg.connect(scratch, autocommit=True) as conn:
        conn.execute(sql.SQL("COMMENT ON TABLE idempotency_keys IS {}").format(sql.Literal(newer)))
    project = projects()
    assert project.flask_db("init").exit_code == 0
    result = project.flask_db("upgrade")
    assert result.exit_code == 0, result.output
    with psycopg.connect(scratch) as conn:
        assert conn.execute("SELECT obj_description('idempotency_keys'::regclass)").fetchone() == (newer,)
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (_layout.alembic_id(_layout.latest()),)
        ]


def test_project_with_revisions_of_its_own_merges_the_branches(projects: Any, scratch: str) -> None:
    """A project that had revisions before flask-idem sees two heads, a revision id of flask-idem's upgrades
    its tables alone, `flask db merge heads` joins them (in the project's folder), and `flask db upgrade`
    works as before."""
    before = projects(with_idem=False)
    assert before.flask_db("init").exit_code == 0
    assert before.flask_db("migrate", "-m", "orders").exit_code == 0
    assert before.flask_db("upgrade").exit_code == 0

    project = projects()
    two_heads = project.flask_db("upgrade")
    assert two_heads.exit_code == 1
    assert "Multiple head revisions are present" in two_heads.output
    assert project.flask_db("upgrade", _layout.alembic_id(1)).exit_code == 0  # flask-idem's tables alone
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") == 1
    merge = project.flask_db("merge", "heads", "-m", "flask-idem")
    assert merge.exit_code == 0, merge.output
    assert len(project.revisions()) == 2  # the merge is the project's
    assert project.flask_db("upgrade").exit_code == 0
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") == _layout.latest()
    assert project.flask_db("check").exit_code == 0


def test_messages_name_plain_flask_db_upgrade(
    db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each message that names a Flask-Migrate command names `flask db upgrade`, which the tests above run
    (the layout's messages, in a database that has an `alembic_version` table)."""
    with pytest.raises(psycopg.errors.UndefinedTable) as missing:
        db.execute("SELECT 1 FROM idempotency_keys_never_made")
    monkeypatch.setattr(_layout, "latest", lambda: 2)  # a table a layout behind the code's
    messages = [
        _layout.problem(_layout.Found(None), "idempotency_keys"),
        _layout.problem(_layout.Found(None, alembic=True), "idempotency_keys"),
        _layout.problem(_layout.Found(1, alembic=True), "idempotency_keys"),
        _layout.comment(_layout.latest(), 1),
        errors.missing_table_hint(missing.value, "idempotency_keys_never_made"),
    ]
    assert [re.findall(r"'flask db [^']*'", message or "") for message in messages] == [
        ["'flask db upgrade'"]
    ] * len(messages)


def test_include_object_leaves_only_flask_idem_tables_out() -> None:
    """The hook answers False for the key table, its partitions (and its comment-marked kin), True for
    the rest."""

    class Reflected:
        def __init__(self, comment: str | None, schema: str | None = None) -> None:
            self.comment, self.schema = comment, schema

    hook = idem_alembic.include_object
    assert hook(Reflected(None), "idempotency_keys", "table", True, None) is False
    assert hook(Reflected(None, "other"), "idempotency_keys", "table", True, None) is True
    assert hook(Reflected("flask-idem key table, layout 9"), "renamed", "table", True, None) is False
    assert hook(Reflected("orders of the shop"), "orders", "table", True, None) is True
    for partition in ("idempotency_keys_p0", "idempotency_keys_p20260101000000", "idempotency_keys_t2026"):
        assert hook(Reflected(None), partition, "table", True, None) is False
        assert hook(Reflected(None, "other"), partition, "table", True, None) is True
    assert hook(Reflected(None), "idempotency_keys_pending", "table", True, None) is True
    assert hook(Reflected(None), "idempotency_keys_expires_at_idx", "index", True, None) is True


def checked_app(conninfo: str) -> tuple[Flask, Idempotency]:
    """An application on ``conninfo`` whose layout check and idempotent route the test calls."""
    app = Flask(__name__)
    app.config.update(IDEM_DATABASE_URL=conninfo, IDEM_DISTRIBUTED=citus.ENABLED)
    idem = Idempotency(app, scope=lambda: 1)

    @app.post("/orders")
    @idem.idempotent()
    def create() -> Any:
        row = idem.connection.execute(
            "INSERT INTO orders (org_id, note) VALUES (1, %s) RETURNING id", (request.get_json()["note"],)
        ).fetchone()
        assert row is not None
        return {"id": row[0]}, 201

    return app, idem


def test_plain_alembic_project(scratch: str, tmp_path: Path) -> None:
    """An application without Flask-SQLAlchemy: `alembic revision` writes into the project's folder,
    after flask-idem's newest revision; `alembic upgrade heads` makes the key table in the latest layout
    and the application's table; then the application's layout check passes and a key replays."""
    project = plain_project(tmp_path / "project")
    app, idem = checked_app(scratch)
    with app.app_context(), pytest.raises(ConfigurationError, match="does not exist"):
        idem.check_layout()

    offline = alembic(project, scratch, "upgrade", "heads", "--sql")
    assert offline.returncode == 0, offline.stderr
    assert 'CREATE TABLE IF NOT EXISTS "idempotency_keys"' in offline.stdout

    made = alembic(project, scratch, "revision", "-m", "orders")
    assert made.returncode == 0, made.stderr
    [revision] = sorted((project / "migrations" / "versions").glob("*.py"))
    text = revision.read_text()
    assert (
        f"down_revision: Union[str, Sequence[str], None] = '{_layout.alembic_id(_layout.latest())}'" in text
    )
    create_orders = textwrap.indent(
        'op.execute("CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,'
        ' org_id bigint NOT NULL, note text NOT NULL)")',
        "    ",
    )
    upgrade = '    """Upgrade schema."""\n'
    revision.write_text(text.replace(upgrade, upgrade + create_orders + "\n", 1))

    upgraded = alembic(project, scratch, "upgrade", "heads")
    assert upgraded.returncode == 0, upgraded.stderr
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") == _layout.latest()
        if citus.ENABLED:
            check_distributed(conn, "idempotency_keys")
    with app.app_context():
        idem.check_layout()
    key = str(uuid.uuid4())
    client = app.test_client()
    try:
        first = client.post("/orders", json={"note": "a"}, headers={"Idempotency-Key": key})
        again = client.post("/orders", json={"note": "a"}, headers={"Idempotency-Key": key})
    finally:
        with app.app_context():
            idem.close()
    assert first.status_code == 201, first.json
    assert (again.status_code, again.json) == (200, first.json)

    current = alembic(project, scratch, "current")
    assert current.returncode == 0, current.stderr
    assert current.stdout.split() == [revision.stem.partition("_")[0], "(head)"]


def test_plain_alembic_without_flask_idem_revisions_is_refused(scratch: str, tmp_path: Path) -> None:
    """An alembic.ini that does not list flask_idem:migrations fails with what to add, and changes
    nothing, instead of upgrading the application's tables and leaving the key table missing."""
    ini = (PLAIN_ALEMBIC / "alembic.ini").read_text()
    ini = ini.replace(" flask_idem:migrations", "")
    assert "flask_idem" not in ini
    project = plain_project(tmp_path / "project", ini=ini)
    result = alembic(project, scratch, "upgrade", "heads")
    assert result.returncode != 0
    assert "add flask_idem:migrations to version_locations" in result.stderr, result.stderr
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") is None
        assert conn.execute("SELECT to_regclass('alembic_version')").fetchone() == (None,)


def without_moments(found: dict[str, Any]) -> dict[str, Any]:
    """A catalog with its timestamps (the first partition's bound) written as ``T0``."""
    return {
        name: [re.sub(r"'\d{4}-[^']+'", "T0", item) if isinstance(item, str) else item for item in value]
        if isinstance(value, list)
        else value
        for name, value in found.items()
    }


def test_offline_sql_run_by_psql_makes_the_layout(scratch: str, tmp_path: Path) -> None:
    """`alembic upgrade heads --sql` prints what a person runs with psql: one transaction, nothing built
    concurrently, nothing escaped for a driver. Run so, it makes the layout that `flask idem migrate`
    makes (same catalog of the key table, its first partition, its tombstones and its outbox), Alembic's
    history says flask-idem's revision, and a key is stored and replays."""
    project = plain_project(tmp_path / "project")
    offline = alembic(project, scratch, "upgrade", "heads", "--sql")
    assert offline.returncode == 0, offline.stderr
    lines = [line.strip() for line in offline.stdout.splitlines()]
    assert lines.count("BEGIN;") == 1 and lines.count("COMMIT;") == 1
    assert "CONCURRENTLY" not in offline.stdout and "%%" not in offline.stdout
    script = tmp_path / "upgrade.sql"
    script.write_text(offline.stdout)
    run = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", scratch, "-f", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr

    _migrate.upgrade(scratch, table="reference_keys", distributed=citus.ENABLED)
    with psycopg.connect(scratch, autocommit=True) as conn:
        assert layout_of(conn, "idempotency_keys") == _layout.latest()
        for suffix in ("", "_p0", "_tombstones", "_outbox"):
            made = without_moments(catalog(conn, "idempotency_keys" + suffix))
            assert made == without_moments(catalog(conn, "reference_keys" + suffix)), suffix
        conn.execute(
            "CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, org_id bigint NOT NULL,"
            " note text NOT NULL)"
        )
    current = alembic(project, scratch, "current")
    assert current.stdout.split() == [_layout.alembic_id(_layout.latest()), "(head)"], current.stderr
    app, idem = checked_app(scratch)
    key = str(uuid.uuid4())
    try:
        first = app.test_client().post("/orders", json={"note": "a"}, headers={"Idempotency-Key": key})
        replay = app.test_client().post("/orders", json={"note": "a"}, headers={"Idempotency-Key": key})
    finally:
        with app.app_context():
            idem.close()
    assert first.status_code == 201, first.json
    assert (replay.status_code, replay.json) == (200, first.json)


def test_downgrade_to_base_drops_the_tables(scratch: str, tmp_path: Path) -> None:
    """`alembic downgrade base` undoes flask-idem's revision: its tables and its reserve function are
    dropped, and `alembic upgrade heads` makes them again."""
    project = plain_project(tmp_path / "project")
    assert alembic(project, scratch, "upgrade", "heads").returncode == 0
    down = alembic(project, scratch, "downgrade", "base")
    assert down.returncode == 0, down.stderr
    with psycopg.connect(scratch) as conn:
        for suffix in ("", "_p0", "_tombstones", "_outbox"):
            found = conn.execute("SELECT to_regclass(%s)", ("idempotency_keys" + suffix,)).fetchone()
            assert found == (None,), suffix
    assert alembic(project, scratch, "upgrade", "heads").returncode == 0
    with psycopg.connect(scratch) as conn:
        assert layout_of(conn, "idempotency_keys") == _layout.latest()
