"""flask-idem's tables in an Alembic or Flask-Migrate project.

flask-idem ships its revisions as an Alembic branch of their own, labelled ``flask_idem``, in the package
directory :data:`VERSION_LOCATION`; the same files are what ``flask idem migrate`` runs. A Flask-Migrate
project adds two lines::

    from flask_idem import alembic as idem_alembic

    migrate = Migrate(app, db, **idem_alembic.MIGRATE_OPTIONS)
    migrate.configure(idem_alembic.configure)

The first keeps autogenerate away from flask-idem's tables (:func:`include_object`) and writes the
application's new revisions into its own ``versions`` folder (:func:`process_revision_directives`); the
second adds flask-idem's folder to ``version_locations`` (:func:`configure`). ``flask db upgrade`` then
creates and upgrades the key table with the application's tables. The upgrades page of the documentation
tells the whole story, with the case of two heads after a flask-idem release that adds a revision.

An application without Flask-SQLAlchemy (plain psycopg, as in the quickstart) uses Alembic itself: its
``alembic.ini`` lists ``flask_idem:migrations`` in ``version_locations``, and its ``env.py`` calls
:func:`run_migrations` inside the application's context, which connects to :data:`IDEM_DATABASE_URL`.

Alembic is imported by the functions that use it: importing this module needs none.
"""

from __future__ import annotations

import logging
import os
import re
import time
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from . import _layout
from ._layout import Revision
from ._timeouts import DEFAULT_CONNECT_OPTIONS, with_connect_options
from .errors import ConfigurationError

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

__all__ = [
    "BRANCH",
    "MIGRATE_OPTIONS",
    "VERSION_LOCATION",
    "configure",
    "include_object",
    "process_revision_directives",
    "run_downgrade",
    "run_migrations",
    "run_upgrade",
]

logger = logging.getLogger("flask_idem")

#: The branch label of flask-idem's revisions. The application's revisions follow them, and so carry it
#: too; ``flask db upgrade flask_idem_0002`` (a revision's id) upgrades flask-idem's tables alone.
BRANCH = "flask_idem"

#: The folder of flask-idem's revisions, for Alembic's ``version_locations``.
VERSION_LOCATION = str(files(__package__).joinpath("migrations"))

_ALEMBIC_TABLE_ATTR = "flask_idem.table"

#: Records a revision's layout in the key table's comment unless that layout or a later one is recorded
#: already (by ``flask idem migrate`` or a newer flask-idem, whose layout is kept), as ``migrate`` does;
#: in SQL, so that ``flask db upgrade --sql`` prints it too. It reads the comment as ``_layout.read`` does.
_RECORD = r"""
DO $record$
BEGIN
    IF coalesce(substring(obj_description({table_literal}::regclass, 'pg_class')
                          FROM '^flask-idem key table, layout (\d+) \(code of layout \d+ and later')::int,
                0) < {layout} THEN
        COMMENT ON TABLE {table} IS {comment};
    END IF;
END
$record$
"""


def include_object(object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:  # noqa: A002 (Alembic's argument name)
    """Alembic's ``include_object`` hook: leave flask-idem's tables out of autogenerate.

    Without it, autogenerate finds the key table in the database and not in the application's metadata,
    and proposes to drop it. Left out, it is neither dropped nor compared: flask-idem's own revisions
    create and change it. A table counts as flask-idem's when it is one of its layout's tables for the
    application's :data:`IDEM_TABLE` (read from the Flask application in context, by default
    ``idempotency_keys``) or a partition of the key table or of its tombstones (``<table>_p0``, and those
    ``flask idem purge`` makes, ``<table>_p<moment>`` and ``<table>_t<moment>``), or when its comment says
    so.

    Chain it with a hook of your own: ``lambda *a: idem_alembic.include_object(*a) and mine(*a)``.
    """
    if type_ != "table" or name is None:
        return True
    table = _target()[0]
    schema = getattr(object, "schema", None)
    if (schema, name) in _layout.tables(table):
        return False
    parts = table.split(".")
    if schema == (parts[0] if len(parts) == 2 else None) and re.fullmatch(
        re.escape(parts[-1]) + r"_[pt]\d+", name
    ):
        return False
    comment = getattr(object, "comment", None) if reflected else None
    return not (comment or "").startswith("flask-idem")


def process_revision_directives(context: MigrationContext, revision: Any, directives: list[Any]) -> None:
    """Alembic's ``process_revision_directives`` hook for the application's new revisions.

    Alembic writes a new revision into the folder of the revision it follows; the application's first
    revision follows flask-idem's newest, whose folder is inside the installed package. This hook
    writes it into the application's own ``versions`` folder instead (the first of ``version_locations``
    that is not flask-idem's). Like Flask-Migrate's own hook, which it replaces, it drops an
    autogenerated revision that changes nothing.
    """
    config = context.config
    if config is None:
        return
    if (
        getattr(config.cmd_opts, "autogenerate", False)
        and directives
        and directives[0].upgrade_ops.is_empty()
    ):
        directives[:] = []
        return
    ours = os.path.realpath(VERSION_LOCATION)
    own = [path for path in _locations(config) if os.path.realpath(path) != ours]
    for directive in directives:
        if directive.version_path is None and own:
            directive.version_path = own[0]


#: The keyword arguments of ``Migrate(app, db, **MIGRATE_OPTIONS)`` (Flask-Migrate passes them to
#: Alembic's ``context.configure``).
MIGRATE_OPTIONS: dict[str, Any] = {
    "include_object": include_object,
    "process_revision_directives": process_revision_directives,
}


def run_migrations(url: str | None = None, *, target_metadata: Any = None, **options: Any) -> None:
    """Run the migrations of a plain Alembic project: the body of its ``env.py``.

    For an application that talks to PostgreSQL through flask-idem's psycopg connections, without
    Flask-SQLAlchemy or Flask-Migrate. Call it inside the application's context, so that it connects
    to the application's :data:`IDEM_DATABASE_URL` (with :data:`IDEM_CONNECT_OPTIONS`) and upgrades the
    key table named by :data:`IDEM_TABLE`::

        from flask_idem import alembic as idem_alembic
        from myapp import create_app

        with create_app().app_context():
            idem_alembic.run_migrations()

    Online, it connects through SQLAlchemy's psycopg 3 dialect, configures Alembic's context with
    :func:`include_object` and :func:`process_revision_directives`, and runs the migrations in Alembic's
    transaction. Offline (``alembic upgrade --sql``), it prints PostgreSQL's statements without
    connecting. The project's ``alembic.ini`` must list ``flask_idem:migrations`` in
    ``version_locations`` (Alembic reads that before ``env.py`` runs); the upgrades page shows one.

    :param url: the database, a PostgreSQL URL or libpq string, for an ``env.py`` without a Flask
        application (``os.environ["DATABASE_URL"]``); default: the current application's
        :data:`IDEM_DATABASE_URL`.
    :param target_metadata: the application's SQLAlchemy ``MetaData``, for autogenerate, if it has one.
    :param options: more keyword arguments for Alembic's ``context.configure``; they override the
        defaults, ``include_object`` included (chain :func:`include_object` into a hook of your own).
    :raises ConfigurationError: with no ``url`` outside an application that uses flask-idem, or when
        flask-idem's revisions are not in ``version_locations``.
    """
    from alembic import context

    _check_locations(context.script)
    conninfo, connect_options = _database(url)
    settings: dict[str, Any] = {
        "target_metadata": target_metadata,
        "include_object": include_object,
        "process_revision_directives": process_revision_directives,
        **options,
    }
    if context.is_offline_mode():
        # Named parameters, as Alembic's own env.py template has them: SQL printed for a person is not
        # escaped for a driver's pyformat (no percent sign doubled).
        context.configure(
            dialect_name="postgresql", literal_binds=True, dialect_opts={"paramstyle": "named"}, **settings
        )
        with context.begin_transaction():
            context.run_migrations()
        return

    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    conninfo = with_connect_options(conninfo, {**DEFAULT_CONNECT_OPTIONS, **connect_options})
    # The connection string goes to psycopg alone: SQLAlchemy's URL would need its own driver prefix
    # and escaping, and a libpq key=value string is no URL at all. It prepares nothing, as flask idem
    # migrate's connection: a migration runs few statements, and behind PgBouncer (before 1.21) a
    # prepared statement would meet other clients' of the same name on a shared server connection.
    engine = create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(conninfo, prepare_threshold=None),
        poolclass=NullPool,
    )
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **settings)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


def _database(url: str | None) -> tuple[str, dict[str, str | int | None]]:
    """The connection string and libpq options :func:`run_migrations` connects with."""
    if url is not None:
        return url, {}
    from flask import current_app, has_app_context

    from ._state import EXTENSION_NAME

    state = current_app.extensions.get(EXTENSION_NAME) if has_app_context() else None
    if state is None:
        raise ConfigurationError(
            "run_migrations() needs the database: call it inside the application's context"
            " (with create_app().app_context(): ...), where flask-idem's IDEM_DATABASE_URL is known,"
            " or pass url=..."
        )
    settings = state.settings
    return settings.database_url, dict(settings.connect_options)


def _check_locations(script: Any) -> None:
    """Refuse to run when flask-idem's revisions are not among the project's: an upgrade would apply the
    application's revisions and leave the key table missing without a word."""
    from alembic.util import CommandError

    try:
        script.get_revision(_FIRST_REVISION)
    except CommandError:  # ResolutionError: not among the revisions Alembic found
        raise ConfigurationError(
            "flask-idem's revisions are not in this Alembic project: add flask_idem:migrations to"
            " version_locations in alembic.ini (with path_separator = space, for example"
            " 'version_locations = %(here)s/migrations/versions flask_idem:migrations')."
        ) from None


#: The first of flask-idem's revisions, which every layout's chain starts from.
_FIRST_REVISION = "flask_idem_0001"


def configure(config: Config) -> Config:
    """Add flask-idem's revisions to ``version_locations`` (for Flask-Migrate's ``migrate.configure``).

    The application's ``versions`` folder stays first. ``revision_environment`` is turned on, so that
    :func:`process_revision_directives` also sees revisions made without autogenerate.
    """
    locations = _locations(config)
    if os.path.realpath(VERSION_LOCATION) not in {os.path.realpath(path) for path in locations}:
        locations.append(VERSION_LOCATION)
    separator = config.get_main_option("path_separator") or config.get_main_option("version_path_separator")
    if separator is None:
        config.set_main_option("path_separator", "os")
        joined = os.pathsep.join(locations)
    else:
        joined = {"space": " ", "newline": "\n", "os": os.pathsep}.get(separator, separator).join(locations)
    config.set_main_option("version_locations", joined.replace("%", "%%"))
    config.set_main_option("revision_environment", "true")
    return config


def _locations(config: Config) -> list[str]:
    """``version_locations`` of ``config``, or the default folder ``versions`` of its script location."""
    found = config.get_version_locations_list()
    if found:
        return list(found)
    script = config.get_main_option("script_location") or "migrations"
    return [os.path.join(script, "versions")]


def _target() -> tuple[str, bool, float, float]:
    """The key table, whether it is distributed, the lock timeout and the upgrade's horizon: from the
    Flask application in context when there is one (Flask-Migrate), otherwise Alembic's
    ``config.attributes`` or defaults."""
    from flask import current_app, has_app_context

    from ._migrate import DEFAULT_HORIZON

    if has_app_context():
        from ._state import EXTENSION_NAME

        state = current_app.extensions.get(EXTENSION_NAME)
        if state is not None:
            settings = state.settings
            return (
                settings.table,
                settings.distributed,
                settings.migration_lock_timeout,
                state.horizon(),
            )
    try:
        from alembic import context

        attributes = context.config.attributes
    except Exception:  # outside an Alembic run (no context), or no Alembic
        attributes = {}
    return str(attributes.get(_ALEMBIC_TABLE_ATTR, "idempotency_keys")), False, 2.0, DEFAULT_HORIZON


def _execute(statement: sql.Composable) -> None:
    from alembic import op
    from sqlalchemy import text

    # SQLAlchemy's text() reads :name as a parameter; the DDL has none (only casts such as ::regclass).
    op.execute(text(statement.as_string(None).replace(":", "\\:")))


def _begin(lock_timeout: float, table: str) -> None:
    """The settings and the advisory lock of flask idem migrate's transactions, in Alembic's."""
    _execute(
        sql.SQL("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = {}").format(
            sql.Literal(f"{max(1, round(lock_timeout * 1000))}ms")
        )
    )
    _execute(sql.SQL("SELECT pg_advisory_xact_lock({})").format(sql.Literal(_layout.lock_key(table))))


def run_upgrade(revision: Revision) -> None:
    """Apply ``revision`` inside Alembic's migration (its ``upgrade()``).

    The same statements and transactions as ``flask idem migrate``, under the same short
    ``lock_timeout``: the revision's DDL in Alembic's transaction; its indexes built concurrently in
    Alembic's ``autocommit_block()``, which commits the transaction before and begins a new one after;
    each of its ``after`` steps in a transaction of its own (an empty ``autocommit_block()`` commits
    between them), the last one recording the layout and committed at once, so that the lock it took is
    not held through the revisions that follow. Online, a statement whose lock was not had in time (or
    that a deadlock broke) is rolled back to a savepoint and tried again after a pause, as ``flask idem
    migrate`` tries its transactions again; every statement is safe to run twice, so an upgrade that
    still fails may simply be run again. Each of those transactions keeps the application's grants
    (:func:`flask_idem._layout.kept_grants`), in the printed SQL too.
    """
    from alembic import context, op

    table, distributed, lock_timeout, horizon = _target()
    names = {**_layout.names(table), "horizon": sql.Literal(horizon)}
    # Every transaction of the revision keeps the application's grants, as migrate's do.
    remember, restore = _layout.kept_grants(table, revision.layout)

    def begin() -> None:
        _begin(lock_timeout, table)
        _execute(remember)

    def commit() -> None:
        _execute(restore)
        with op.get_context().autocommit_block():  # commits Alembic's transaction and begins one after
            pass
        begin()

    begin()
    # A layout recorded already (by flask idem migrate, or a newer flask-idem) has this revision's
    # tables and statements: they are not run again, as migrate runs them only for a layout it lacks.
    # Run again they could change what a later layout made (an index it dropped, built anew; on Citus,
    # a text of several statements sent to the nodes).
    # Offline nothing is read: every statement is printed, each safe to run twice.
    recorded = not context.is_offline_mode() and _recorded(table) >= revision.layout
    if revision.sql and not recorded:
        _retried(sql.SQL(revision.sql).format(**names))
    if revision.indexes:
        _execute(restore)  # the first index's autocommit_block() commits the revision's DDL
    for index in revision.indexes:
        name = names[f"{index.name}_qualified"].as_string(None)
        if not context.is_offline_mode():
            # A valid index is kept (Citus would mark it invalid while going over the shards again); one
            # left invalid by a failed build is dropped and built again.
            found = (
                op.get_bind()
                .exec_driver_sql(
                    "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%(name)s)::oid",
                    {"name": name},
                )
                .scalar()
            )
            if found is True:
                continue
            if found is False:
                with op.get_context().autocommit_block():
                    qualified = names[f"{index.name}_qualified"]
                    _execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(qualified))
        with op.get_context().autocommit_block():
            create = sql.SQL(index.create() + " {} ").format(names[index.name])
            _execute(create + sql.SQL(index.definition).format(**names))
    if revision.indexes:
        begin()
    for number, step in enumerate(revision.after, start=1):
        if not recorded:
            _retried(sql.SQL(step).format(**names))
        if number < len(revision.after):
            commit()
    if distributed and revision.distributed_sql and not recorded:
        _execute(sql.SQL("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'"))
        _execute(sql.SQL(revision.distributed_sql).format(**names))
    record = sql.SQL(_RECORD).format(
        **names, layout=sql.Literal(revision.layout), comment=sql.Literal(revision.comment())
    )
    _execute(record)
    _execute(restore)
    if revision.after:
        with op.get_context().autocommit_block():
            pass
        _begin(lock_timeout, table)


def _recorded(table: str) -> int:
    """The layout recorded on ``table`` in Alembic's transaction (0: no key table yet), as
    :func:`flask_idem._layout.read` reads it."""
    from alembic import op

    conn = op.get_bind().connection.driver_connection  # the psycopg connection, in its transaction
    assert conn is not None
    return _layout.read(conn, table).layout or 0


def _retried(statement: sql.Composable) -> None:
    """Run ``statement`` in a savepoint, tried again after a growing pause with jitter while it fails for
    a lock not had within the lock timeout, or a deadlock (up to :data:`flask_idem._migrate.ATTEMPTS`
    times); offline, print it."""
    from alembic import context, op
    from sqlalchemy.exc import OperationalError

    from ._migrate import ATTEMPTS, pause

    if context.is_offline_mode():
        _execute(statement)
        return
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with op.get_bind().begin_nested():  # rolled back to the savepoint, its locks let go
                _execute(statement)
            return
        except OperationalError as e:
            lock = isinstance(e.orig, (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected))
            if not lock or attempt == ATTEMPTS:
                raise
            wait = pause(attempt)
            logger.info(
                "%s: a lock was not free in time; trying again in %.1f s.", type(e.orig).__name__, wait
            )
            time.sleep(wait)


def run_downgrade(revision: Revision) -> None:
    """Undo ``revision`` inside Alembic's migration (its ``downgrade()``): its indexes are dropped
    concurrently, then its ``downgrade_sql`` runs and the layout before it is recorded."""
    from alembic import op

    table, _, lock_timeout, _ = _target()
    names = _layout.names(table)
    for index in revision.indexes:
        with op.get_context().autocommit_block():
            _execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(names[f"{index.name}_qualified"]))
    _begin(lock_timeout, table)
    if revision.downgrade_sql:
        _execute(sql.SQL(revision.downgrade_sql).format(**names))
    if revision.layout > 1:
        before = _layout.revisions()[revision.layout - 2]
        _execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(names["table"], sql.Literal(before.comment())))
