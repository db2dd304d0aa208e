"""The key table's layout: its numbered versions, what each revision changes, and which one a database has.

Every change to flask-idem's tables is one *revision*: a file in :mod:`flask_idem.migrations` that holds
its DDL as SQL and is, at the same time, an Alembic revision on the ``flask_idem`` branch. ``flask idem
migrate`` (:mod:`._migrate`) and ``flask db upgrade`` (:mod:`flask_idem.alembic`) run the very same
statements; this module loads them and names the objects they create after ``IDEM_TABLE``.

The layout a database has is recorded in the key table's comment, written by the transaction that
finishes each revision: ``flask-idem key table, layout 2 (code of layout 1 and later runs on it) ...``.
The second number says which code may use the table: a revision that only adds (an index, a nullable
column) lets the code of earlier layouts go on serving while it is applied and after, which is what an
upgrade under traffic needs. This code runs on its own layout (:func:`latest`) and on a newer one that
says so: the tables are upgraded first, then the code that needs them is deployed. A revision that changes
what the statements must do says ``compatible_from`` = its own number: the code that knows it is deployed
first (it answers 503 until the tables are upgraded), since a running process checks the layout once.

Whatever a revision creates or replaces keeps the application's privileges: every transaction of a
revision gives the roles that could read and write the key table before it the grants of every revision
up to it (:func:`kept_grants`), and :func:`revisions` refuses a revision whose new tables its grants do
not name.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from ._sqlfile import blocks
from .errors import ConfigurationError

__all__ = [
    "COLUMNS",
    "Found",
    "Index",
    "Revision",
    "add",
    "comment",
    "kept_grants",
    "latest",
    "lock_key",
    "names",
    "problem",
    "drift",
    "read",
    "revisions",
    "upgrade_command",
    "warnings",
]

#: The key table's columns that the code uses, and what ``ADD COLUMN`` puts back when one was dropped by
#: hand. The layout check compares them with the table's (:func:`drift`); a test compares them with a
#: freshly made table, so that a revision that changes the key table's columns changes them here too.
COLUMNS: Mapping[str, str] = {
    "org_id": "bigint NOT NULL",
    "idem_key": "uuid NOT NULL",
    "request_sha": "bytea NOT NULL CHECK (octet_length(request_sha) = 32)",
    "method": "text",
    "path": "text",
    "status": "text NOT NULL DEFAULT 'processing' CHECK (status IN ('processing', 'completed', 'failed'))",
    "response": "jsonb",
    "created_at": "timestamptz NOT NULL DEFAULT now()",
    "expires_at": "timestamptz NOT NULL",
    "flow": "text",
    "step": "text",
    "state": "jsonb NOT NULL DEFAULT '{}'",
    "lease_token": "uuid",
    "lease_expires_at": "timestamptz",
    "attempts": "integer NOT NULL DEFAULT 0",
    "next_attempt_at": "timestamptz",
    "last_error": "text",
    "needs_attention": "boolean NOT NULL DEFAULT false",
    "task": "text",
}

#: The key table's indexes written in a revision's DDL (later revisions may list theirs in
#: :attr:`Revision.indexes`).
_PLAIN_INDEX_RE = re.compile(r"CREATE INDEX IF NOT EXISTS \{(\w+)\} (ON \{table\} [^;]+);")

#: The comment that records the layout, and how it is read back.
_COMMENT = (
    "flask-idem key table, layout {layout} (code of layout {compatible_from} and later runs on it)."
    " Upgraded by 'flask idem migrate' or 'flask db upgrade'; keep this comment."
)
_COMMENT_RE = re.compile(r"^flask-idem key table, layout (\d+) \(code of layout (\d+) and later")

#: What a migration's advisory locks are derived from (with the table's name).
_LOCK_SALT = b"flask-idem/migrate"


@dataclass(frozen=True, slots=True)
class Index:
    """An index on a table that exists before its revision, built with ``CREATE INDEX CONCURRENTLY``.

    It is built outside the revision's transaction, so that writers are never held up while it is built
    (a plain ``CREATE INDEX`` would block every write to the table until it finishes). PostgreSQL builds
    no index concurrently on a partitioned table (the key table, its tombstones): such a table's new index
    has to be built partition by partition, which this class does not do yet.

    :param name: the key of its name in :attr:`Revision.names`.
    :param definition: what follows ``CREATE INDEX CONCURRENTLY IF NOT EXISTS <name>``: ``ON {table}
        (...) WHERE ...``, with the names of :func:`names` in braces.
    """

    name: str
    definition: LiteralString
    #: ``CREATE UNIQUE INDEX CONCURRENTLY``.
    unique: bool = False

    def create(self) -> LiteralString:
        """The statement's head, up to the index's name."""
        return (
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS"
            if self.unique
            else ("CREATE INDEX CONCURRENTLY IF NOT EXISTS")
        )


@dataclass(frozen=True, slots=True)
class Revision:
    """One version of flask-idem's layout: the statements that make it out of the one before.

    Placeholders in braces are the names of :func:`names`: ``{table}`` and ``{table_literal}``, and for
    each entry ``key`` of :attr:`names` (of this revision or an earlier one) ``{key}`` (the bare name,
    for ``CREATE INDEX``), ``{key_qualified}`` (in the key table's schema) and ``{key_literal}`` (that as
    a string, for ``regclass`` and Citus' functions).

    Rules for a revision that changes a table that exists already (every revision but the first): add
    indexes through :attr:`indexes`, never in :attr:`sql`; add columns nullable or with a constant
    default (no table rewrite); make every statement safe to run twice (``IF NOT EXISTS``). See the
    upgrades page of the documentation.
    """

    #: Its number, counted from 1.
    layout: int
    #: The oldest layout whose code still runs correctly on this one.
    compatible_from: int
    #: One line for people: what it changes and why.
    summary: str
    #: Names of the objects it creates, as suffixes of the key table's name (``"_due_idx"``).
    names: Mapping[str, str] = field(default_factory=dict)
    #: Tables among those names (for the grants and for Alembic's autogenerate to leave alone).
    tables: tuple[str, ...] = ()
    #: DDL run in one transaction, under a short ``lock_timeout`` retried until it gets its locks.
    sql: LiteralString = ""
    #: Indexes built concurrently after that transaction, each checked valid before the layout is recorded.
    indexes: tuple[Index, ...] = ()
    #: DDL run after the indexes, each its own transaction (retried as :attr:`sql` is); the last one
    #: records the layout. ``{horizon}`` is the seconds ahead of now that keys may expire while the
    #: revision runs (the longest retention, and the time partitions are made ahead).
    after: tuple[LiteralString, ...] = ()
    #: On Citus (``IDEM_DISTRIBUTED``) only: run after every revision's :attr:`sql`, in one transaction.
    distributed_sql: LiteralString = ""
    #: What the application's role needs on this revision's objects, with ``{role}`` for the role.
    grants: LiteralString = ""
    #: Undoes :attr:`sql` (its indexes are dropped concurrently before): for Alembic's downgrade.
    downgrade_sql: LiteralString = ""

    def comment(self) -> str:
        """The key table's comment once this revision is applied."""
        return comment(self.layout, self.compatible_from)


def comment(layout: int, compatible_from: int) -> str:
    """The comment that records ``layout`` on the key table."""
    return _COMMENT.format(layout=layout, compatible_from=compatible_from)


#: Revisions from outside :mod:`flask_idem.migrations`, taken by :func:`add`, with their Alembic ids.
_ADDED: list[tuple[Revision, str, str | None]] = []

#: A table made by a revision's DDL (its name's key), unless it is a partition.
_CREATE_TABLE_RE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?\{(\w+?)(?:_qualified)?\}(?! PARTITION OF)")


def add(revision: Revision, ident: str, down: str | None) -> None:
    """Take ``revision``, a revision file's ``REVISION`` with its Alembic ``revision`` (``ident``) and
    ``down_revision``, as a layout after those of :mod:`flask_idem.migrations`, once per layout.

    For the test suite, which proves the machinery for future layouts on a layout of its own that no
    release has and no wheel ships (``tests/support/second_layout/``); a released flask-idem calls it
    nowhere. The file adds itself when it is imported: by Alembic from ``version_locations``, or by an
    application that stands for the newer release. Checked with the others by :func:`revisions`.
    """
    if all(added.layout != revision.layout for added, _, _ in _ADDED):
        _ADDED.append((revision, ident, down))
        revisions.cache_clear()


@functools.cache
def revisions() -> tuple[Revision, ...]:
    """Every revision of :mod:`flask_idem.migrations` (and those of :func:`add`), in order; checked to
    be numbered 1, 2, 3... and each to grant what it makes (:func:`_check`).

    :raises RuntimeError: when a revision file is malformed (a packaging mistake, not a user's).
    """
    from . import migrations

    found: list[tuple[Revision, str, Any]] = []
    for info in pkgutil.iter_modules(migrations.__path__):
        module = importlib.import_module(f"{migrations.__name__}.{info.name}")
        revision = getattr(module, "REVISION", None)
        if not isinstance(revision, Revision):
            raise RuntimeError(f"flask_idem.migrations.{info.name} has no REVISION.")
        found.append((revision, module.revision, module.down_revision))
    found += _ADDED
    found.sort(key=lambda entry: entry[0].layout)
    for number, (revision, ident, down) in enumerate(found, start=1):
        expected_down = None if number == 1 else alembic_id(number - 1)
        if revision.layout != number or ident != alembic_id(number) or down != expected_down:
            raise RuntimeError(
                f"flask_idem.migrations: revision of layout {revision.layout} is out of order."
            )
        if not 1 <= revision.compatible_from <= number:
            raise RuntimeError(f"flask_idem.migrations: layout {number} has a wrong compatible_from.")
        _check(revision)
    return tuple(revision for revision, _, _ in found)


def _check(revision: Revision) -> None:
    """Refuse a revision that could leave the application's role without its privileges: a table its
    DDL makes that is not among its :attr:`~Revision.tables`, a table of those its
    :attr:`~Revision.grants` do not name, or a function dropped (``CREATE OR REPLACE`` keeps a function's
    privileges; a function made anew is executable by ``PUBLIC`` only).

    :raises RuntimeError: naming the revision and what it lacks.
    """
    ddl = " ".join((revision.sql, *revision.after, revision.distributed_sql))
    made = {key for key in _CREATE_TABLE_RE.findall(ddl) if key != "table"}
    lacking = sorted(made - set(revision.tables)) + [
        key for key in revision.tables if "{" + key + "_qualified}" not in revision.grants
    ]
    if lacking or "DROP FUNCTION" in ddl.upper():
        raise RuntimeError(
            f"Layout {revision.layout}: every table it makes must be in its tables and its grants"
            f" ({', '.join(lacking) or 'a function dropped'}); replace functions with CREATE OR REPLACE."
        )


def alembic_id(layout: int) -> str:
    """The Alembic revision id of ``layout``."""
    return f"flask_idem_{layout:04d}"


def latest() -> int:
    """The newest layout this code knows, the one ``flask idem migrate`` makes."""
    return revisions()[-1].layout


def names(table: str) -> dict[str, sql.Composable]:
    """The names the revisions' statements use, for the key table ``table`` (``IDEM_TABLE``)."""
    parts = table.split(".")
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}")
    schema, base = parts[:-1], parts[-1]
    qualified = sql.Identifier(*parts)
    found: dict[str, sql.Composable] = {
        "table": qualified,
        "table_literal": sql.Literal(qualified.as_string(None)),
    }
    for revision in revisions():
        for key, suffix in revision.names.items():
            found[key] = sql.Identifier(base + suffix)
            found[f"{key}_name"] = sql.Literal(base + suffix)
            found[f"{key}_qualified"] = full = sql.Identifier(*schema, base + suffix)
            found[f"{key}_literal"] = sql.Literal(full.as_string(None))
    return found


def tables(table: str) -> list[tuple[str | None, str]]:
    """Every table of flask-idem's layout for the key table ``table``, as ``(schema, name)`` pairs."""
    parts = table.split(".")
    schema = parts[0] if len(parts) == 2 else None
    found = [(schema, parts[-1])]
    for revision in revisions():
        found += [(schema, parts[-1] + revision.names[key]) for key in revision.tables]
    return found


def kept_grants(table: str, layout: int) -> tuple[sql.Composed, sql.Composed]:
    """The first and the last statement of every transaction of revision ``layout`` (``_layout.sql``):
    the first remembers the roles that may read and write the key table ``table`` as it is; the last
    gives each of them the grants of every revision up to ``layout``, on what the transaction made.

    The grants rule of the upgrades page: the machinery keeps the application's privileges on every
    table a revision creates or replaces, so that no revision can forget them.
    """
    known = names(table)
    grants = " ".join(
        sql.SQL(revision.grants).format(**known, role=sql.SQL("{role}")).as_string(None)
        for revision in revisions()[:layout]
        if revision.grants
    )
    statements = blocks("_layout.sql", distributed=False)[1]
    remember = sql.SQL(statements["remember"]).format(**known)
    restore = sql.SQL(statements["restore"]).format(grants=sql.Literal(grants))
    return remember, restore


def lock_key(table: str) -> int:
    """The advisory lock id that serialises migrations of ``table`` (transaction-scoped, PgBouncer-safe)."""
    digest = hashlib.blake2b(table.encode("utf-8"), digest_size=8, key=_LOCK_SALT).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Found:
    """What a database holds: the key table's layout (``None`` without a key table), and the oldest
    layout whose code may use it; what the key table has (``None``: not read); and whether the database
    is upgraded by Alembic (it has an ``alembic_version`` table in the search path)."""

    layout: int | None
    compatible_from: int = 1
    #: The key table's columns.
    columns: frozenset[str] | None = None
    #: The names of the key table's indexes.
    indexes: frozenset[str] | None = None
    #: Whether a valid unique index on ``(org_id, idem_key, expires_at)`` exists, which every
    #: reservation's ``ON CONFLICT`` needs.
    unique_key: bool = True
    alembic: bool = False


#: The key table (in its schema, or the first of the search path that has it, as ``to_regclass`` finds
#: it), its comment, its columns and indexes, and whether an ``alembic_version`` table is in the search
#: path. Read from the catalog's tables with the statement's snapshot, not through ``to_regclass``, whose
#: lookup goes through the backend's catalog cache: a migration that waited on the advisory lock for
#: another to create the table would still find it missing there. On Citus the coordinator's catalog has
#: the distributed table's columns and indexes.
_READ = """
SELECT c.oid IS NOT NULL AS present, obj_description(c.oid, 'pg_class') AS comment,
    ARRAY(
        SELECT a.attname::text FROM pg_catalog.pg_attribute AS a
        WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    ) AS columns,
    ARRAY(
        SELECT x.relname::text FROM pg_catalog.pg_index AS i
            JOIN pg_catalog.pg_class AS x ON x.oid = i.indexrelid
        WHERE i.indrelid = c.oid
    ) AS indexes,
    EXISTS (
        SELECT FROM pg_catalog.pg_index AS i
        WHERE i.indrelid = c.oid AND i.indisunique AND i.indisvalid AND i.indpred IS NULL
            AND i.indexprs IS NULL
            AND ARRAY(
                SELECT a.attname::text FROM pg_catalog.pg_attribute AS a
                WHERE a.attrelid = c.oid AND a.attnum = ANY (i.indkey::int2[]) ORDER BY 1
            ) = ARRAY['expires_at', 'idem_key', 'org_id']
    ) AS unique_key,
    to_regclass('alembic_version') IS NOT NULL AS alembic
FROM (SELECT) AS one LEFT JOIN LATERAL (
    SELECT c.oid FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.relname = %(name)s
        AND (n.nspname = %(schema)s OR %(schema)s IS NULL AND n.nspname = ANY (current_schemas(true)))
    ORDER BY array_position(current_schemas(true), n.nspname) LIMIT 1
) AS c ON true
"""


def read(conn: psycopg.Connection[Any], table: str) -> Found:
    """The layout of ``table`` on ``conn``, and what the table has: one catalog query, which any role
    may run."""
    parts = table.split(".")
    schema = parts[0] if len(parts) == 2 else None
    row = conn.execute(_READ, {"name": parts[-1], "schema": schema}).fetchone()
    assert row is not None
    present, text, columns, indexes, unique_key, alembic = row
    if not present:
        return Found(None, alembic=alembic)
    match = _COMMENT_RE.match(text or "")
    # Without the comment (a table made by hand): taken for the first layout, and checked for drift.
    layout, compatible_from = (1, 1) if match is None else (int(match[1]), int(match[2]))
    return Found(
        layout,
        compatible_from,
        columns=frozenset(columns),
        indexes=frozenset(indexes),
        unique_key=unique_key,
        alembic=alembic,
    )


def upgrade_command(found: Found) -> str:
    """The command that upgrades the tables, in the words of the path the project uses: Alembic's when
    the database has an ``alembic_version`` table (``flask idem migrate`` would leave it behind), else
    flask-idem's own."""
    if found.alembic:
        return "'flask db upgrade' (Flask-Migrate) or 'alembic upgrade heads' (Alembic)"
    return "'flask idem migrate'"


def problem(found: Found, table: str) -> str | None:
    """Why this code cannot run on ``found``, with the command that fixes it; ``None`` when it can."""
    newest = latest()
    if found.layout is None:
        if found.alembic:
            create = "'flask db upgrade' (Flask-Migrate) or 'alembic upgrade heads' (Alembic)"
        else:
            create = (
                "'flask idem init-db' (or 'flask db upgrade' with Flask-Migrate, 'alembic upgrade heads'"
                " with Alembic)"
            )
        return (
            f"The key table {table} does not exist. Create it with {create}, as a role that may create"
            " tables."
        )
    if found.layout < newest:
        # Online when every revision to apply lets the code of the table's layout go on serving.
        changing = [
            r.layout for r in revisions() if r.layout > found.layout and r.compatible_from > found.layout
        ]
        head = f"The key table {table} has layout {found.layout}; this flask-idem runs on layout {newest}."
        if not changing:
            return (
                f"{head} Upgrade it with {upgrade_command(found)} (online: the code of layout"
                f" {found.layout} serves meanwhile), then deploy this code."
            )
        # Code first: a process of the older code checks the layout once, and would go on running its
        # statements on a layout that changes what they must do.
        return (
            f"{head} Upgrade it with {upgrade_command(found)} once no process of the code of layout"
            f" {found.layout} runs any more: layout {changing[0]} changes what the statements must do."
        )
    if found.layout > newest and found.compatible_from > newest:
        return (
            f"The key table {table} has layout {found.layout}, made by a newer flask-idem, and needs the"
            f" code of layout {found.compatible_from} or later; this flask-idem knows layouts up to"
            f" {newest}. Deploy the newer flask-idem."
        )
    return drift(found, table)


def drift(found: Found, table: str) -> str | None:
    """What the key table lacks of the columns and the unique key its layout says it has and every
    statement uses (dropped by hand), with the statements that put them back; ``None`` when nothing.

    Not a layout's matter, so no migration restores it: the layout recorded is intact.
    """
    if found.columns is None:
        return None
    wanted = COLUMNS
    missing = [name for name in wanted if name not in found.columns]
    if not missing and found.unique_key:
        return None
    target = sql.Identifier(*table.split(".")).as_string(None)
    lacks = [f"column(s) {', '.join(missing)}"] if missing else []
    fixes = [f"ALTER TABLE {target} ADD COLUMN IF NOT EXISTS {name} {wanted[name]};" for name in missing]
    if not found.unique_key:
        # A partition's unique index of these columns, if any, is taken over.
        constraint = sql.Identifier(table.split(".")[-1] + "_key").as_string(None)
        lacks.append("its unique key (org_id, idem_key, expires_at)")
        fixes.append(
            f"ALTER TABLE {target} ADD CONSTRAINT {constraint} UNIQUE (org_id, idem_key, expires_at);"
        )
    return (
        f"The key table {table} lacks {' and '.join(lacks)}, which this flask-idem uses; its layout"
        f" ({found.layout}) says it has them, so the table was changed by hand and no migration puts them"
        f" back. Restore them as the table's owner: {' '.join(fixes)}"
    )


def warnings(found: Found, table: str) -> list[str]:
    """What the code runs on but should be told once: indexes of the key table's layout that are missing
    (its statements run without them, more slowly)."""
    if found.layout is None or found.indexes is None:
        return []
    wanted, base = names(table), table.split(".")[-1]
    # A partitioned table's index cannot be built concurrently: built at once, on every partition, each
    # one's writers waiting while its part is built.
    builds = [
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ").format(wanted[key]) + sql.SQL(definition).format(**wanted)
        for key, suffix, definition in _key_table_indexes(min(found.layout, latest()))
        if base + suffix not in found.indexes
    ]
    if not builds:
        return []
    statements = " ".join(build.as_string(None) + ";" for build in builds)
    return [
        f"The key table {table} lacks indexes of its layout ({found.layout}), dropped by hand; it serves"
        " without them, more slowly. Build them again as the table's owner (writes to each partition"
        f" wait while its part is built): {statements}"
    ]


def _key_table_indexes(layout: int) -> list[tuple[str, str, LiteralString]]:
    """The indexes of the key table up to ``layout``: the key of each one's name in :func:`names`, its
    suffix, and its definition (as :attr:`Index.definition`)."""
    found: list[tuple[str, str, LiteralString]] = []
    suffixes: dict[str, str] = {}
    for revision in revisions()[:layout]:
        suffixes.update(revision.names)
        for match in _PLAIN_INDEX_RE.finditer(" ".join((revision.sql, *revision.after))):
            definition: LiteralString = match[2]  # cut from a LiteralString
            found.append((match[1], suffixes[match[1]], definition))
        found += [
            (index.name, suffixes[index.name], index.definition)
            for index in revision.indexes
            if index.definition.startswith("ON {table} ")
        ]
    return found


def check(found: Found, table: str) -> None:
    """Raise :class:`ConfigurationError` with :func:`problem` when this code cannot run on ``found``."""
    message = problem(found, table)
    if message is not None:
        raise ConfigurationError(message)
