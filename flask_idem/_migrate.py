"""Creating and upgrading flask-idem's tables in place, while the application serves.

:func:`upgrade` runs the revisions of :mod:`flask_idem.migrations` that a database lacks, each in turn, on a
connection of its own (never the application's pool, whose connections carry the application's timeouts).
That connection has no ``statement_timeout`` (building an index takes as long as it takes) and no
``lock_timeout`` outside the revisions' transactions. Each revision is applied in three steps:

1. one transaction with its DDL, under ``SET LOCAL lock_timeout`` (``IDEM_MIGRATION_LOCK_TIMEOUT``, 2 s):
   a statement that needs a strong lock (an ``ALTER TABLE`` needs ``ACCESS EXCLUSIVE``, if only for an
   instant) waits at most that long behind a running transaction, and so holds up the requests queued
   behind it at most that long. It then gives up, and the whole transaction is tried again after a pause
   with jitter, up to :data:`ATTEMPTS` times (the usual practice for DDL on a busy table);
2. its indexes, built with ``CREATE INDEX CONCURRENTLY``, which takes no lock that writers wait on, and
   cannot run inside a transaction block: each is its own statement, between two transactions;
3. one transaction that checks those indexes are valid and records the layout in the key table's comment.

Every one of those transactions keeps the application's privileges: it starts by reading the roles that
may read and write the key table and ends by giving them the grants of every revision up to it
(:func:`._layout.kept_grants`), so that what it created or replaced commits with its grants.

A revision is thus "in a transaction" where PostgreSQL allows one: its DDL commits at once or not at
all, and its layout is recorded only once everything it built is in place. Interrupted between those
steps, it leaves objects of the new layout that the old code ignores, under the old layout's comment;
running ``migrate`` again finishes the work, since every statement is safe to run twice (``IF NOT
EXISTS``), and an index left invalid by an interrupted build is dropped and built again.

Two migrations at once (two deployments starting together) serialise on a transaction-scoped advisory
lock per key table, taken by every transaction above (session locks would not survive PgBouncer's
transaction pooling), and each re-reads the layout under it; concurrent index builds of one table wait
for one another in PostgreSQL itself, and the later one finds the index there.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from . import _layout
from ._layout import Found, Index, Revision
from ._retry import backoff
from ._timeouts import DEFAULT_CONNECT_OPTIONS, with_connect_options

__all__ = ["ATTEMPTS", "Report", "connect", "grant", "pause", "pending", "upgrade"]

logger = logging.getLogger("flask_idem")

T = TypeVar("T")

#: Tries of one transaction whose locks could not be had within the lock timeout.
ATTEMPTS = 30
#: The upgrade's ``horizon`` when the application's is not known: the default retention
#: (``IDEM_KEY_TTL``) and the default time partitions are made ahead (``IDEM_PARTITION_AHEAD``).
DEFAULT_HORIZON = 8 * 24 * 3600.0
#: Tries of one revision whose concurrent index build failed (left an invalid index).
_BUILD_ATTEMPTS = 5
#: The pause between tries grows from this to :data:`_MAX_PAUSE` seconds, drawn with equal jitter (from
#: half the ceiling to all of it): a retry waits for a lock to be let go, so none comes back at once.
_FIRST_PAUSE = 0.1
_MAX_PAUSE = 5.0
_RNG = random.Random()

#: Session settings of the migration's connection: no timeout for statements (index builds) or for locks
#: outside its transactions (an index build waits for older transactions without blocking anyone).
_SESSION = "-c statement_timeout=0 -c lock_timeout=0"

#: Whether another session is building index %(name)s right now (a migration's build, which runs as the
#: same role and so shows its query; on Citus the build's locks are on the workers, not here). A unique
#: index's build too: missed, the other migration would try to drop it while it is built.
_BUILDING = (
    "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND state = 'active'"
    " AND datname = current_database() AND query ~* '^CREATE (UNIQUE )?INDEX CONCURRENTLY '"
    " AND strpos(query, %(name)s) > 0)"
)
#: Seconds between two looks at another migration's index build.
_BUILD_POLL = 0.2

_VALID = "SELECT coalesce((SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)::oid), false)"
_INVALID = "SELECT EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass(%s)::oid AND NOT indisvalid)"


@dataclass
class Report:
    """What :func:`upgrade` found and did."""

    #: The layout before (``None``: there was no key table), and after.
    before: Found
    after: int = 0
    #: The layouts this call applied (another process may have applied the others meanwhile).
    applied: list[int] = field(default_factory=list)
    #: Transactions that gave up waiting for a lock and were tried again.
    lock_retries: int = 0
    #: The layout read once done, which says whether this code can run on the table (a newer
    #: flask-idem's layout is left as it is, and may not let it).
    found: Found = field(default_factory=lambda: Found(None))


_CONNECT: dict[str, Any] = {
    "autocommit": True,
    "prepare_threshold": None,
    "application_name": "flask-idem migrate",
}


@contextmanager
def connect(
    url: str, connect_options: Mapping[str, str | int | None] | None = None
) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection of its own to ``url`` for DDL, with no statement or lock timeout.

    It gets the TCP timeouts of every connection of the extension (:data:`DEFAULT_CONNECT_OPTIONS` under
    ``connect_options``, ``IDEM_CONNECT_OPTIONS``), not the request deadline the pool's connections
    give the server. Behind PgBouncer in transaction mode the session settings do not stick
    (``options`` is ignored or refused); each transaction sets its own, and the index builds run with
    the server's defaults. It prepares nothing: a migration runs few statements, and behind PgBouncer
    psycopg's prepared statements would meet other clients' of the same name on a shared server
    connection.
    """
    url = with_connect_options(url, {**DEFAULT_CONNECT_OPTIONS, **(connect_options or {})})
    options = " ".join(filter(None, [str(conninfo_to_dict(url).get("options") or ""), _SESSION]))
    try:
        conn = psycopg.connect(url, options=options, **_CONNECT)
    except psycopg.OperationalError as e:
        if "options" not in str(e):  # PgBouncer refusing the startup parameter, or not
            raise
        conn = psycopg.connect(url, **_CONNECT)
    with conn:
        yield conn


def pause(attempt: int) -> float:
    """Seconds to wait before trying again a transaction whose ``attempt`` (from 1) did not get its locks
    in time: from :data:`_FIRST_PAUSE` up to :data:`_MAX_PAUSE`, with equal jitter."""
    return backoff(attempt - 1, base=_FIRST_PAUSE, cap=_MAX_PAUSE, rng=_RNG, jitter="equal")


def pending(conn: psycopg.Connection[Any], table: str) -> tuple[Found, list[Revision]]:
    """The layout ``table`` has on ``conn``, and the revisions :func:`upgrade` would apply."""
    found = _layout.read(conn, table)
    done = found.layout or 0
    return found, [revision for revision in _layout.revisions() if revision.layout > done]


def upgrade(
    url: str,
    *,
    table: str,
    distributed: bool = False,
    lock_timeout: float = 2.0,
    connect_options: Mapping[str, str | int | None] | None = None,
    horizon: float = DEFAULT_HORIZON,
    to: int | None = None,
    echo: Callable[[str], None] = logger.info,
) -> Report:
    """Create the key table, or bring it to the latest layout, on a connection of its own to ``url``.

    Safe to run twice, and from two processes at once. With ``distributed`` each revision applied also
    runs its Citus statements (``distributed_sql``) in its transaction, and a key table that is not
    distributed yet gets those of every revision (each is safe to run again). A table in the latest
    layout, distributed as asked, is not touched: the command then needs no privilege beyond reading.

    :param url: a role that may create and alter the tables (their owner), not the application's role.
    :param lock_timeout: seconds a statement of a revision's transaction waits for a lock before the
        transaction is tried again.
    :param connect_options: libpq parameters over the default TCP timeouts (``IDEM_CONNECT_OPTIONS``).
    :param horizon: seconds ahead of now that the application's keys may expire while the upgrade runs:
        its longest retention and the time partitions are made ahead (the key table's first partition
        ends past it).
    :param to: the layout to stop at (``None``: the latest). Revisions after it are not applied, and a
        table at a later layout is left as it is (a test builds the layout before a revision so).
    :param echo: told of each step, for a person watching.
    :raises ValueError: when ``to`` is no layout of this release.
    """
    if to is not None and not 1 <= to <= _layout.latest():
        raise ValueError(f"There is no layout {to}: layouts are 1 to {_layout.latest()}.")
    names = {**_layout.names(table), "horizon": sql.Literal(float(horizon))}
    with connect(url, connect_options) as conn:
        runner = _Runner(conn, table, names, lock_timeout, echo, distributed=distributed)
        found, todo = pending(conn, table)
        report = Report(before=found, after=found.layout or 0)
        runner.report = report
        if distributed and found.layout is not None and not runner.is_distributed():
            # First the tables there are, so that the revisions to apply find them distributed (their
            # Citus statements co-locate new tables with the key table).
            runner.distribute(found.layout)
        for revision in todo:
            if to is not None and revision.layout > to:
                break
            if found.layout is not None and revision.compatible_from > found.layout:
                echo(
                    f"Layout {revision.layout} changes what the statements must do: no process of the"
                    f" code of layout {found.layout} may serve on it (the code of layout"
                    f" {revision.compatible_from} or later is deployed first, then the tables)."
                )
            if runner.apply(revision):
                report.applied.append(revision.layout)
            report.after = revision.layout
        if distributed and not runner.is_distributed():
            runner.distribute(to)
        report.found = _layout.read(conn, table)
    return report


def grant(
    url: str,
    *,
    table: str,
    role: str,
    lock_timeout: float = 2.0,
    connect_options: Mapping[str, str | int | None] | None = None,
) -> None:
    """Grant ``role`` what the application needs at run time on flask-idem's tables, and nothing more:
    ``SELECT, INSERT, UPDATE, DELETE`` (and ``USAGE`` on the key table's schema, if it names one)."""
    names = {**_layout.names(table), "role": sql.Identifier(role)}
    statements = [
        sql.SQL(revision.grants).format(**names) for revision in _layout.revisions() if revision.grants
    ]
    parts = table.split(".")
    if len(parts) == 2:
        statements.insert(
            0,
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(parts[0]), sql.Identifier(role)),
        )
    with connect(url, connect_options) as conn:
        runner = _Runner(conn, table, names, lock_timeout, logger.info)
        runner.transaction(lambda c: [c.execute(statement) for statement in statements])


class _InvalidIndex(Exception):
    """An index of a revision was not valid when its layout was to be recorded (its build failed)."""


class _Runner:
    """The steps of :func:`upgrade` on one connection."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        table: str,
        names: dict[str, sql.Composable],
        lock_timeout: float,
        echo: Callable[[str], None],
        *,
        distributed: bool = False,
    ) -> None:
        self.conn = conn
        self.distributed = distributed
        self.table = table
        self.names = names
        #: Milliseconds a statement of a transaction waits for a lock.
        self.lock_timeout_ms = max(1, round(lock_timeout * 1000))
        self.lock_timeout = sql.Literal(f"{self.lock_timeout_ms}ms")
        self.echo = echo
        self.lock = _layout.lock_key(table)
        self.report: Report | None = None

    def apply(self, revision: Revision) -> bool:
        """Apply ``revision`` unless the table has it already; whether this call applied it."""
        for attempt in range(1, _BUILD_ATTEMPTS + 1):
            try:
                return self._apply(revision)
            except _InvalidIndex as e:
                name, cause = e.args[0], e.args[1] if len(e.args) > 1 else None
                if attempt == _BUILD_ATTEMPTS:
                    if isinstance(cause, psycopg.Error):
                        raise cause from None
                    raise RuntimeError(
                        f"Building index {name} of layout {revision.layout} failed {attempt} times (it is"
                        " left invalid); see the server's log, then run 'flask idem migrate' again."
                    ) from None
                reason = f" ({type(cause).__name__})" if cause is not None else ""
                self.echo(f"Index {name} is not valid: its build failed{reason}; building it again.")
        raise AssertionError("unreachable")

    def _apply(self, revision: Revision) -> bool:
        def valid(conn: psycopg.Connection[Any]) -> bool:
            return all(
                conn.execute(_VALID, (self._name(index.name),)).fetchone() == (True,)
                for index in revision.indexes
            )

        def ddl(conn: psycopg.Connection[Any]) -> bool:
            recorded = (_layout.read(conn, self.table).layout or 0) >= revision.layout
            if recorded and valid(conn):
                return False
            citus = self.distributed and revision.distributed_sql and not recorded
            if citus:
                # Citus runs a function's DDL over one connection per node, so the whole transaction must
                # (it refuses to distribute a table, or a function, after a command that went over the
                # shards in parallel: an invalid index dropped, an ALTER TABLE).
                conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
            for index in revision.indexes:
                self._drop_if_invalid(conn, index.name)
            if revision.sql and not recorded:
                conn.execute(sql.SQL(revision.sql).format(**self.names))
            if citus:
                conn.execute(sql.SQL(revision.distributed_sql).format(**self.names))
            if not revision.indexes and not revision.after:
                self._record(conn, revision)
            return True

        self.echo(f"Layout {revision.layout}: {revision.summary}.")
        if not self.keeping_grants(revision, ddl):
            self.echo(f"Layout {revision.layout} was applied already.")
            return False
        if not revision.indexes and not revision.after:
            return True
        for index in revision.indexes:
            self._build(index)
        for step in revision.after[:-1]:
            statement = sql.SQL(step).format(**self.names)
            self.keeping_grants(revision, lambda conn, statement=statement: conn.execute(statement))  # type: ignore[misc]

        def record(conn: psycopg.Connection[Any]) -> bool:
            for index in revision.indexes:
                if not conn.execute(_VALID, (self._name(index.name),)).fetchone() == (True,):
                    raise _InvalidIndex(self._name(index.name))
            if (_layout.read(conn, self.table).layout or 0) >= revision.layout:
                return False
            if revision.after:
                conn.execute(sql.SQL(revision.after[-1]).format(**self.names))
            self._record(conn, revision)
            return True

        return self.keeping_grants(revision, record)

    def keeping_grants(self, revision: Revision, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """:meth:`transaction` for a transaction of ``revision``: the roles that could read and write the
        key table at its start get, at its end, the grants of every revision up to it
        (:func:`_layout.kept_grants`), on whatever ``work`` created or replaced."""
        remember, restore = _layout.kept_grants(self.table, revision.layout)

        def run(conn: psycopg.Connection[Any]) -> T:
            conn.execute(remember)
            done = work(conn)
            conn.execute(restore)
            return done

        return self.transaction(run)

    def _build(self, index: Index) -> None:
        """Build ``index`` with ``CREATE INDEX CONCURRENTLY``, unless it exists (valid, or being built by
        another migration, which is waited for).

        An index that exists is never built "again" with ``IF NOT EXISTS``: PostgreSQL would skip it, but
        Citus marks the existing index invalid while it goes over the shards.
        """
        self._wait_for_builds(index.name)
        if self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", (self._name(index.name),)).fetchone() == (
            True,
        ):
            return
        self.echo(f"Building index {self._name(index.name)} concurrently (writes go on meanwhile).")
        statement = sql.SQL(index.create() + " {} ").format(self.names[index.name])
        try:
            self.conn.execute(statement + sql.SQL(index.definition).format(**self.names))
        except psycopg.Error as e:
            # A build waits for every older transaction, another migration's included, which may wait for
            # this build's lock on the table: PostgreSQL breaks the deadlock, here or there. Citus may trip
            # over another migration's build of the same index on a shard. Either way the index is left
            # missing or invalid, and the revision is tried again.
            if self.conn.closed or self.conn.broken:
                raise
            raise _InvalidIndex(self._name(index.name), e) from e

    def is_distributed(self) -> bool:
        """Whether the key table is a Citus distributed table already."""
        found = self.conn.execute(
            "SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = to_regclass(%s))",
            (self.names["table"].as_string(None),),
        ).fetchone()
        return found == (True,)

    def distribute(self, to: int | None = None) -> None:
        """Run every revision's Citus statements (up to layout ``to``), in one transaction (each is safe
        to run again)."""

        def run(conn: psycopg.Connection[Any]) -> None:
            # Citus runs a function's DDL over one connection per node, so the whole transaction must.
            conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
            for revision in _layout.revisions():
                if revision.distributed_sql and (to is None or revision.layout <= to):
                    conn.execute(sql.SQL(revision.distributed_sql).format(**self.names))

        self.echo("Distributing the tables by org_id on Citus.")
        self.transaction(run)

    def transaction(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``work`` in a transaction under the migration's advisory lock and a short lock timeout;
        try again, after a growing pause, when a lock could not be had in time or a deadlock broke it."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                with self.conn.transaction():
                    if self.distributed:
                        # The timeouts hold on the nodes too, where Citus takes the locks of the shards.
                        self.conn.execute("SET LOCAL citus.propagate_set_commands TO 'local'")
                    self.conn.execute(
                        sql.SQL("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = {}").format(
                            self.lock_timeout
                        )
                    )
                    self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.lock,))
                    return work(self.conn)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as e:
                if attempt == ATTEMPTS:
                    raise
                if self.report is not None:
                    self.report.lock_retries += 1
                wait = pause(attempt)
                self.echo(f"{type(e).__name__}: a lock was not free in time; trying again in {wait:.1f} s.")
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _drop_if_invalid(self, conn: psycopg.Connection[Any], name: str) -> None:
        """Drop index ``name`` when a failed concurrent build left it invalid, so that it is built again.

        An index another migration is building right now is invalid too, and that build holds the
        table's ``SHARE UPDATE EXCLUSIVE`` lock until it ends: the lock is asked for with ``NOWAIT``.
        Had, no build is running and the index is dropped; not had, it is left to the build (waiting
        here would deadlock: a concurrent build waits for every older transaction, this one included).
        """
        literal = self._name(name)
        if not conn.execute(_INVALID, (literal,)).fetchone() == (True,) or self._building(conn, name):
            return
        try:
            with conn.transaction():  # a savepoint: NOWAIT failing must not end the revision's transaction
                conn.execute(
                    sql.SQL("LOCK TABLE {} IN SHARE UPDATE EXCLUSIVE MODE NOWAIT").format(self.names["table"])
                )
        except psycopg.errors.LockNotAvailable:
            return
        if conn.execute(_INVALID, (literal,)).fetchone() == (True,):
            self.echo(f"Dropping index {literal}, left invalid by a failed build.")
            # IF EXISTS: on Citus the drop goes to every shard, where a failed build may have made none.
            conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(self.names[f"{name}_qualified"]))

    def _building(self, conn: psycopg.Connection[Any], name: str) -> bool:
        bare = self.names[name].as_string(None).strip('"')
        return conn.execute(_BUILDING, {"name": bare}).fetchone() == (True,)

    def _wait_for_builds(self, name: str) -> None:
        """Wait while another migration builds index ``name``: on plain PostgreSQL a second build would
        wait for the first by itself, but on Citus it would trip over it on the shards."""
        told = False
        while self._building(self.conn, name):
            if not told:
                self.echo(f"Another migration is building {self._name(name)}; waiting for it.")
                told = True
            time.sleep(_BUILD_POLL)

    def _record(self, conn: psycopg.Connection[Any], revision: Revision) -> None:
        conn.execute(
            sql.SQL("COMMENT ON TABLE {} IS {}").format(self.names["table"], sql.Literal(revision.comment()))
        )

    def _name(self, key: str) -> str:
        """The schema-qualified name of object ``key``, as ``to_regclass`` reads it."""
        return self.names[f"{key}_qualified"].as_string(None)
