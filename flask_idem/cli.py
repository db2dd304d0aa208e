"""The ``flask idem`` command group, added to the application by ``init_app``."""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
import psycopg
from flask import current_app
from flask.cli import AppGroup
from psycopg.conninfo import conninfo_to_dict

from . import _jobs_state, _layout, _migrate, _partitions, relay
from ._cipher import new_key
from ._outbox import outbox_table
from ._pool import ForkSafeConnectionPool
from ._records import RangeRows, TableStats
from ._settings import Settings
from ._state import IdemState, get_state
from ._timeouts import DEFAULT_CONNECT_OPTIONS, with_connect_options
from .errors import ConfigurationError, missing_table_hint
from .recovery import RecoveryReport, recover, run_forever

__all__ = ["idem_cli"]

F = TypeVar("F", bound=Callable[..., Any])

idem_cli = click.version_option(package_name="flask-idem", prog_name="flask-idem")(
    AppGroup("idem", help="Manage the idempotency key table of flask-idem.")
)


def _state() -> IdemState:
    """The current application's flask-idem state; a clear error when the application has none (the
    ``idem`` group is offered to every Flask application of the environment, through its entry point)."""
    try:
        return get_state()
    except RuntimeError:
        raise click.ClickException(
            "flask-idem is not initialised on this application: call idem.init_app(app) in it, or name"
            " the application that does with --app."
        ) from None


def _database_errors(command: F) -> F:
    """Check the database can be reached first; report a database error as one line without its
    message, which may quote settings or values."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_connection()
        try:
            return command(*args, **kwargs)
        except psycopg.Error as e:
            hint = ""
            if isinstance(e, psycopg.errors.UndefinedTable):
                hint = missing_table_hint(e, _state().settings.table) or f": {e.diag.message_primary}"
            raise click.ClickException(
                f"database error: {type(e).__name__} (SQLSTATE {e.sqlstate or 'none'}){hint}"
            ) from None

    return wrapper  # type: ignore[return-value]


def _check_connection() -> None:
    """Make one direct connection, so that a database that cannot be reached is reported with the
    server's own reason at once, not as a pool timeout after the pool's retries.

    The reason is libpq's message (host, port, user or database, and what went wrong); a password is
    never part of it, and is blanked out should it appear. With SQLAlchemy the engine makes that
    connection, with its own connection arguments (its pool does not retry).
    """
    state = _state()
    params = conninfo_to_dict(state.settings.database_url)
    try:
        if isinstance(state.source, ForkSafeConnectionPool):
            psycopg.connect(_check_conninfo(state.settings)).close()
        else:
            with state.source.connection():
                pass
    except psycopg.OperationalError as e:
        reason = str(e).strip()
        password = params.get("password")
        if password:
            reason = reason.replace(str(password), "***")
        raise click.ClickException(f"cannot connect to the database: {reason}") from None


def _check_conninfo(settings: Settings) -> str:
    """Where :func:`_check_connection` connects: the URL with the connection options of every connection
    of the extension (:data:`DEFAULT_CONNECT_OPTIONS` under ``IDEM_CONNECT_OPTIONS``; the URL's own win)."""
    options = {**DEFAULT_CONNECT_OPTIONS, **settings.connect_options}
    return with_connect_options(settings.database_url, options)


def _ready() -> None:
    """Refuse to work on a key table that is missing or in a layout this code cannot run on."""
    try:
        _state().check_layout()
    except ConfigurationError as e:
        raise click.ClickException(str(e)) from None


_distributed_option = click.option(
    "--distributed",
    is_flag=True,
    help="Also distribute the tables by org_id on Citus, with the reserve function (as IDEM_DISTRIBUTED).",
)


def _upgrade(distributed: bool, *, quiet: bool = False) -> _migrate.Report:
    """Create or upgrade the tables; exit with status 1 and the reason when this code cannot run on
    what is there then (a newer flask-idem's layout, which is left as it is)."""
    settings = _state().settings
    report = _migrate.upgrade(
        settings.database_url,
        table=settings.table,
        distributed=distributed or settings.distributed,
        lock_timeout=settings.migration_lock_timeout,
        connect_options=settings.connect_options,
        horizon=_state().horizon(),
        echo=(lambda _: None) if quiet else click.echo,
    )
    problem = _layout.problem(report.found, settings.table)
    if problem is not None:
        raise click.ClickException(problem)
    return report


@idem_cli.command("init-db")
@_distributed_option
@_database_errors
def init_db(distributed: bool) -> None:
    """Create the key table and the outbox of background jobs in the latest layout, or upgrade them as
    migrate does (safe to run again).

    Run it as a role that may create tables (see the privileges in the documentation).
    """
    report = _upgrade(distributed, quiet=True)
    table = _state().settings.table
    click.echo(f"Key table {table} is ready (layout {report.found.layout}).")
    click.echo(f"Outbox {outbox_table(table)} of background jobs is ready.")


@idem_cli.command("migrate")
@_distributed_option
@click.option(
    "--check",
    is_flag=True,
    help="Change nothing: print the layout found and what would be done; exit with status 1 if anything"
    " would.",
)
@click.option(
    "--grant",
    "roles",
    multiple=True,
    metavar="ROLE",
    help="Then grant ROLE, the application's role, SELECT, INSERT, UPDATE and DELETE on flask-idem's"
    " tables (repeatable).",
)
@_database_errors
def migrate(distributed: bool, check: bool, roles: tuple[str, ...]) -> None:
    """Upgrade the key table to the latest layout, online; create it if missing.

    Each revision's DDL runs in one transaction under a short lock timeout (IDEM_MIGRATION_LOCK_TIMEOUT),
    tried again when a lock is busy; indexes are built with CREATE INDEX CONCURRENTLY, so the application
    keeps serving meanwhile. Safe to run twice, and from two processes at once. Run it as the tables'
    owner, not as the application's role.
    """
    settings = _state().settings
    if check:
        with _migrate.connect(settings.database_url, settings.connect_options) as conn:
            found, todo = _migrate.pending(conn, settings.table)
        where = "missing" if found.layout is None else f"at layout {found.layout}"
        click.echo(f"Key table {settings.table} is {where}; the latest layout is {_layout.latest()}.")
        problem = _layout.problem(found, settings.table)
        if problem is not None:
            click.echo(problem)
        for revision in todo:
            click.echo(f"  would apply layout {revision.layout}: {revision.summary}")
        if todo or problem is not None:
            raise SystemExit(1)
        return
    report = _upgrade(distributed)
    for role in roles:
        _migrate.grant(
            settings.database_url, table=settings.table, role=role, connect_options=settings.connect_options
        )
        click.echo(f"Granted {role} SELECT, INSERT, UPDATE, DELETE on flask-idem's tables.")
    before = "missing" if report.before.layout is None else f"layout {report.before.layout}"
    if report.applied:
        applied = ", ".join(str(layout) for layout in report.applied)
        click.echo(f"Key table {settings.table}: {before}, now layout {report.after} (applied {applied}).")
    else:
        click.echo(f"Key table {settings.table} is at layout {report.after}: nothing to do.")


@idem_cli.command("purge")
@_database_errors
def purge() -> None:
    """Forget keys past their retention period (IDEM_KEY_TTL), keeping a tombstone of each for
    IDEM_TOMBSTONE_TTL more.

    A tombstone keeps the key, the request's fingerprint, the first answer's status and Location, so
    that a late retry is never run again. Whole partitions of the key table whose range has passed
    are dropped (DETACH PARTITION CONCURRENTLY, then DROP TABLE), after their keys' compact tombstones
    are written, and partitions are made ahead (IDEM_PARTITION_AHEAD): run it as the tables' owner, at
    least daily. Multi-step requests still processing and rows flagged for a person are never lost.
    """
    _ready()
    state = _state()
    settings = state.settings
    try:
        report = _partitions.maintain(
            settings.database_url,
            table=settings.table,
            interval=settings.partition_interval,
            horizon=state.horizon(),
            tombstone_ttl=settings.tombstone_ttl,
            ahead=settings.partition_ahead,
            lock_timeout=settings.migration_lock_timeout,
            connect_options=settings.connect_options,
            echo=click.echo,
        )
    except psycopg.errors.InsufficientPrivilege:
        raise click.ClickException(
            f"flask idem purge creates and drops partitions of {settings.table}, which only the tables'"
            " owner may do: run it as the role that runs 'flask idem migrate' (for instance with"
            " FLASK_IDEM_DATABASE_URL set to that role's URL)."
        ) from None
    for name, why in report.kept:
        click.echo(f"Kept {name}: {why}; it is dropped by a later run once they finish.")
    click.echo(
        f"Dropped {len(report.dropped)} partition(s), wrote {report.tombstoned} tombstone(s), moved"
        f" {report.moved} flagged row(s); made {len(report.created)} partition(s) ahead."
    )


def _pass_options(what: str, loop: str, *, interval: tuple[float, float, str]) -> Callable[[F], F]:
    """``--limit``, ``--loop`` and ``--interval`` (default, least, help): a command that works in passes."""
    default, least, between = interval

    def decorate(command: F) -> F:
        for option in (
            click.option(
                "--interval",
                default=default,
                show_default=True,
                type=click.FloatRange(min=least),
                help=between,
            ),
            click.option("--loop", is_flag=True, help=loop),
            click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1), help=what),
        ):
            command = option(command)
        return command

    return decorate


@idem_cli.command("recover")
@_pass_options(
    "Rows per pass.",
    "Keep running, one pass every --interval seconds, until stopped.",
    interval=(5.0, 0.1, "Seconds between passes."),
)
@_database_errors
def recover_command(limit: int, loop: bool, interval: float) -> None:
    """Finish multi-step requests stranded by a crash (their lease has expired).

    Each is resumed after its last finished step; an outside call is first looked up through the step's
    resolver. Requests past IDEM_RECOVERY_DEADLINE are marked failed and flagged for a person. Only
    requests of flows this application declares are touched.
    """
    _ready()
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    if loop:
        click.echo(f"Recovering every {interval} s; stop with SIGTERM or Ctrl-C.")
        run_forever(app, interval=interval, limit=limit, stop=_stop_on_signals(), on_pass=_print_report)
        return
    _print_report(recover(app, limit=limit))


def _stop_on_signals() -> threading.Event:
    """An event that SIGTERM or SIGINT sets: a loop stops after its pass."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _print_report(report: RecoveryReport) -> None:
    for outcome in ("completed", "pending", "failed", "lost"):
        for org_id, key, detail in getattr(report, outcome):
            click.echo(f"{outcome:9} org={org_id} key={key} {detail}")
    click.echo(
        f"Claimed {report.claimed}: {len(report.completed)} completed, {len(report.pending)} pending,"
        f" {len(report.failed)} failed, {len(report.lost)} lost."
    )


@idem_cli.command("relay")
@_pass_options(
    "Messages per pass.",
    "Keep running until stopped: a pass every --interval seconds. A failed publish is logged and tried"
    " again by a later pass; the command exits with status 0 when stopped.",
    interval=(1.0, 0.05, "Seconds between passes that found nothing to publish."),
)
@_database_errors
def relay_command(limit: int, loop: bool, interval: float) -> None:
    """Publish the outbox's unsent messages to the broker, and mark each sent.

    Each message is claimed under a lease (IDEM_OUTBOX_LEASE), published, and marked sent once the
    broker confirmed it. A relay that dies in between leaves the message to be published again: the
    task's key absorbs the duplicate. Sent messages older than IDEM_OUTBOX_RETENTION are deleted.
    Needs background jobs set up on the application (flask_idem.celery.CeleryJobs.init_app).

    One pass exits with status 1 when a message could not be published (it is tried again by the next
    pass), naming the broker and the reason.
    """
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        _jobs_state.get_jobs(app)
    except Exception as e:
        raise click.ClickException(str(e)) from None
    if loop:
        click.echo(f"Relaying every {interval} s when idle; stop with SIGTERM or Ctrl-C.")
        stop = _stop_on_signals()
        relay.relay_forever(app, interval=interval, limit=limit, stop=stop, on_pass=_print_relay)
        return
    report = relay.relay(app, limit=limit)
    _print_relay(report)
    if report.failed:
        more = f" (and {report.failed - 1} more)" if report.failed > 1 else ""
        raise click.ClickException(f"{report.errors[0]}{more} Tried again by the next pass.")


def _print_relay(report: relay.RelayReport) -> None:
    click.echo(
        f"Published {report.published}, failed {report.failed}, taken over {report.lost};"
        f" purged {report.purged} sent message(s)."
    )


@idem_cli.command("stuck")
@click.option(
    "--older-than",
    default=None,
    type=click.FloatRange(min=0),
    help="Report processing rows older than this many seconds. Default: twice IDEM_LEASE_TIMEOUT.",
)
@_database_errors
def stuck(older_than: float | None) -> None:
    """List requests that need a person, and requests processing for longer than expected."""
    _ready()
    state = _state()
    rows = state.store.stuck(
        older_than=2 * state.settings.lease_timeout if older_than is None else older_than
    )
    for row in rows:
        flag = "NEEDS ATTENTION" if row.needs_attention else "slow"
        task = "" if row.task is None else f" task={row.task}"
        click.echo(
            f"{flag:15} org={row.org_id} key={row.key}{task} status={row.status} flow={row.flow}"
            f" step={row.step}"
            f" attempts={row.attempts} age={row.age_seconds:.0f}s last_error={row.last_error}"
        )
    click.echo(f"{len(rows)} row(s).")


@idem_cli.command("stats")
@_database_errors
def stats() -> None:
    """Print the key table at a glance: rows by status and by flow and step, flagged rows, tombstones,
    what purge would do now, the oldest processing request and the table's size.

    Also the key table's partitions and its tombstones' (how many, the
    oldest and the newest, each one's range, rows and bytes), the passed partitions waiting for purge
    and why, and a warning when the newest partition ends less than half of IDEM_PARTITION_AHEAD past
    the longest retention (purge has not run for days).

    It counts every row (one pass over the table), so it takes a moment on millions of keys; the
    gauges of flask_idem.metrics are the cheap view for a monitoring system.
    """
    _ready()
    state = _state()
    table = state.settings.table
    with state.source.connection() as conn:
        parts = _partitions.overview(conn, table)
    found = state.store.stats(
        key_bounds=[p.upper for p in parts.keys if p.upper is not None],
        tombstone_bounds=[p.upper for p in parts.tombstones if p.upper is not None],
    )
    click.echo(
        f"Key table {table}: {_size(found.total_bytes)} with indexes ({_size(found.index_bytes)} of indexes)"
    )
    click.echo("Rows by status:")
    for status, rows in found.by_status or [("(none)", 0)]:
        click.echo(f"  {status:<12} {rows:>10}")
    if found.by_flow:
        click.echo("Multi-step rows by flow, status and last finished step:")
        width = max(len(flow) for flow, *_ in found.by_flow)
        for flow, status, step, rows in found.by_flow:
            click.echo(f"  {flow:<{width}}  {status:<12} {step or '-':<16} {rows:>10}")
    click.echo(f"Flagged for a person: {found.flagged}")
    click.echo(f"Tombstones: {found.tombstones}")
    oldest = found.oldest_processing
    if oldest is None:
        click.echo("Oldest processing request: none")
    else:
        click.echo(
            f"Oldest processing request: org={oldest.org_id} key={oldest.key} flow={oldest.flow}"
            f" step={oldest.step or '-'} attempts={oldest.attempts} age={oldest.age_seconds:.0f}s"
            f" last_error={oldest.last_error}"
        )
    _print_partitions(parts, found, horizon=state.horizon(), ahead=state.settings.partition_ahead)


def _print_partitions(
    parts: _partitions.Overview, found: TableStats, *, horizon: float, ahead: float
) -> None:
    """The partitions part of ``flask idem stats``: both tables' partitions, the passed ones waiting for
    purge and why, and the warning when the key table's run out soon."""
    tables = (
        (parts.table, parts.keys, found.keys_by_range),
        (f"{parts.table}_tombstones", parts.tombstones, found.tombstones_by_range),
    )
    waiting: list[tuple[_partitions.Partition, str]] = []
    for name, listed, counted in tables:
        click.echo(f"Partitions of {name}: {len(listed)}{_ends(parts, listed)}")
        if not listed:
            continue
        width = max(len(p.name) for p in listed)
        click.echo(
            f"  {'partition':<{width}}  {'expires_at from':<19}  {'to':<19}  {'rows':>10}  {'bytes':>10}"
        )
        passed = parts.passed(listed)
        # One count per bound, and one past the last: as many as partitions, or one more (empty).
        for part, rows in zip(listed, counted, strict=False):
            lower, upper = _moment(part.lower, "MINVALUE"), _moment(part.upper, "MAXVALUE")
            click.echo(
                f"  {part.name:<{width}}  {lower:<19}  {upper:<19}  {rows.rows:>10}  {_size(part.bytes):>10}"
            )
            if part in passed:
                waiting.append((part, _why_waiting(part, rows, tombstones=listed is parts.tombstones)))
    click.echo("Passed partitions waiting for purge:" + ("" if waiting else " none"))
    for part, why in waiting:
        assert part.upper is not None  # passed
        ago = _partitions.duration((parts.now - part.upper).total_seconds())
        click.echo(f"  {part.name} (ended {ago} ago): {why}")
    warning = parts.warning(horizon=horizon, ahead=ahead)
    if warning is not None:
        click.echo(f"Warning: {warning}")


def _why_waiting(part: _partitions.Partition, rows: RangeRows, *, tombstones: bool) -> str:
    """What purge does with a passed partition, or why it keeps it."""
    if part.detaching:
        return "its detach was interrupted; the next purge finishes it"
    if tombstones:
        return f"{rows.rows} tombstone(s) past their period, to drop"
    if rows.processing:
        return (
            f"kept while {rows.processing} multi-step request(s) are in progress; dropped by the first purge"
            " after they finish"
        )
    moved = f", {rows.flagged} flagged for a person to move to a live partition" if rows.flagged else ""
    return f"{rows.rows} row(s) to drop once their tombstones are written{moved}"


def _ends(parts: _partitions.Overview, listed: list[_partitions.Partition]) -> str:
    """ "; the oldest, ... ends ...; the newest, ... ends ..." of a table's partitions."""

    def end(part: _partitions.Partition) -> str:
        if part.upper is None:
            return f"{part.name}, is unbounded"
        left = (part.upper - parts.now).total_seconds()
        when = f"in {_partitions.duration(left)}" if left > 0 else f"{_partitions.duration(left)} ago"
        return f"{part.name}, ends {_moment(part.upper, '')} UTC ({when})"

    if not listed:
        return ""
    if len(listed) == 1:
        return f"; {end(listed[0])}"
    return f"; the oldest, {end(listed[0])}; the newest, {end(listed[-1])}"


def _moment(moment: datetime | None, unbounded: str) -> str:
    return unbounded if moment is None else f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    value = size / 1024
    for unit in ("kB", "MB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


@idem_cli.command("new-response-key", with_appcontext=False)
def new_response_key_command() -> None:
    """Print a new key for IDEM_RESPONSE_KEYS (encrypted stored responses).

    It does not load the application, so it runs when a malformed IDEM_RESPONSE_KEYS keeps the
    application from starting.

    To rotate, put it first in the list and keep the old key after it until every response the old key
    encrypted has expired: for the longest retention of any route that uses it (IDEM_KEY_TTL or the
    route's ttl=); then drop the old key.
    """
    try:
        click.echo(new_key())
    except ConfigurationError as e:  # cryptography is not installed
        raise click.ClickException(str(e)) from None
