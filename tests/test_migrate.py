"""The key table's life: its layout, `flask idem init-db` and `migrate`, the check at the first use, and
the machinery for the layouts after the first (proven here on revisions made for a test).

Each test works on a key table of its own name (``IDEM_TABLE``) in the worker's database, made by the
migration itself, and dropped afterwards.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idem import ConfigurationError, _layout, _migrate, _partitions
from flask_idem._store import _Statements

from .support import citus
from .support.helpers import app_factory, close_pool, wait_for
from .support.layouts import catalog, check_distributed, drop, layout_of
from .support.notes_app import build_app, post
from .support.servers import ROOT


@pytest.fixture
def fresh(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """The name of a key table that does not exist yet; dropped afterwards."""
    drop(direct_database_url, "fresh_keys")
    yield "fresh_keys"
    drop(direct_database_url, "fresh_keys")


@pytest.fixture
def apps(database_url: str) -> Iterator[Callable[..., Flask]]:
    """The notes app on a table of the test's choosing (``IDEM_TABLE``); pools closed afterwards."""
    with app_factory(lambda **config: build_app(database_url, **config)[0]) as make:
        yield make


def migrate(app: Flask, *args: str) -> Any:
    result = app.test_cli_runner().invoke(args=["idem", "migrate", *args])
    return result


def second_layout(monkeypatch: pytest.MonkeyPatch, **revision: Any) -> _layout.Revision:
    """Make this release's revisions end with a second layout made for the test (``revision``: the
    fields of :class:`flask_idem._layout.Revision` besides its number, by default compatible with the
    code of layout 1)."""
    fields: dict[str, Any] = {"compatible_from": 1, "summary": "a layout of this test", **revision}
    added = _layout.Revision(layout=_layout.latest() + 1, **fields)
    with_it = (*_layout.revisions(), added)
    monkeypatch.setattr(_layout, "revisions", lambda: with_it)
    return added


#: A second layout's index on the outbox, a table that is not partitioned: built concurrently.
OUTBOX_INDEX = {
    "names": {"outbox_task_index": "_outbox_task_idx"},
    "indexes": (_layout.Index("outbox_task_index", "ON {outbox_qualified} (task)"),),
}


def fill_outbox(db: psycopg.Connection[Any], table: str, rows: int, task: str = "t") -> None:
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, id, task, idem_key) SELECT 1, gen_random_uuid(), %s, gen_random_uuid()"
            " FROM generate_series(1, %s)"
        ).format(sql.Identifier(table + "_outbox")),
        (task, rows),
    )


# -- the layout ------------------------------------------------------------------------------------------


def test_revisions_are_numbered_and_chained() -> None:
    """Layouts 1, 2, ... in order, each an Alembic revision following the one before, on one branch."""
    revisions = _layout.revisions()
    assert [r.layout for r in revisions] == list(range(1, len(revisions) + 1))
    assert _layout.latest() == revisions[-1].layout


def test_upgrades_page_names_the_layouts_this_code_runs_on() -> None:
    """The upgrades page has a row for each layout and says which layout this code runs on."""
    page = (ROOT / "docs" / "upgrades.rst").read_text()
    assert f"This release runs on layout {_layout.latest()}." in page
    rows = [int(number) for number in re.findall(r"^(\d+) {2,}\S", page, re.MULTILINE)]
    assert rows == [revision.layout for revision in _layout.revisions()]


def test_reserve_function_looks_as_the_store_does() -> None:
    """The reserve function (Citus) looks for a key in every partition and among the tombstones with the
    very statement the store's reservations use, and answers its columns."""
    found = _Statements("idempotency_keys").found.decode()
    for parameter, variable in (("%(org_id)s", "p_org_id"), ("%(key)s", "p_key"), ("%(tomb)s", "p_tomb")):
        found = found.replace(parameter, variable)
    revision = _layout.revisions()[0]
    function = sql.SQL(revision.distributed_sql).format(**_layout.names("idempotency_keys")).as_string(None)
    body = function[function.index("LEFT JOIN LATERAL (") + len("LEFT JOIN LATERAL (") :]
    body = body[: body.index(") AS f ON true")]
    assert " ".join(body.split()) == " ".join(found.split())


def test_fresh_table_gets_the_latest_layout(fresh: str, apps: Callable[..., Flask]) -> None:
    """`init-db` on a missing table makes the latest layout; `migrate --check` is then happy, and
    `migrate` has nothing to do."""
    app = apps(IDEM_TABLE=fresh)
    before = migrate(app, "--check")
    assert before.exit_code == 1
    assert f"Key table {fresh} is missing" in before.output
    assert "would apply layout 1" in before.output
    init = app.test_cli_runner().invoke(args=["idem", "init-db"])
    assert init.exit_code == 0, init.output
    assert f"Key table {fresh} is ready (layout {_layout.latest()})." in init.output
    check = migrate(app, "--check")
    assert check.exit_code == 0, check.output
    again = migrate(app)
    assert again.exit_code == 0
    assert f"is at layout {_layout.latest()}: nothing to do." in again.output
    assert post(app, "/notes", uuid.uuid4(), {"body": "fresh"}).status_code == 201


def test_a_fresh_table_is_partitioned_with_a_first_partition(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The layout made from nothing: the key table and its tombstones partitioned by expiry, every index
    valid, the layout recorded, and one first partition that takes every key expiring before the
    horizon (so that keys are written before the first purge); the tombstones have none yet."""
    horizon = 3 * 24 * 3600.0
    before = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, horizon=horizon)
    for table in (fresh, fresh + "_tombstones"):
        kind = db.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
        assert kind == ("p",)
    made = catalog(db, fresh)
    assert not any("INVALID" in index for index in made["indexes"])
    assert any("GREATEST(lease_expires_at, next_attempt_at)" in index for index in made["indexes"])
    assert "UNIQUE (org_id, idem_key, expires_at)" in made["constraints"]
    assert made["comment"] == _layout.revisions()[-1].comment()
    [first] = _partitions.partitions(db, fresh)
    assert first.name == fresh + "_p0" and first.lower is None and first.upper is not None
    reach = timedelta(seconds=horizon)
    assert before + reach - timedelta(seconds=1) <= first.upper <= datetime.now(first.upper.tzinfo) + reach
    assert _partitions.partitions(db, fresh + "_tombstones") == []
    if citus.ENABLED:
        check_distributed(db, fresh)


# -- at the same time as others ------------------------------------------------------------------------------


def test_two_migrations_at_once(fresh: str, direct_database_url: str, db: psycopg.Connection[Any]) -> None:
    """Two processes creating one table at once both succeed; it is made once, its indexes valid."""
    reports: list[_migrate.Report] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait()
        try:
            reports.append(_migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert sorted(layout for report in reports for layout in report.applied) == list(
        range(1, _layout.latest() + 1)
    )
    assert all(report.after == _layout.latest() for report in reports)
    assert layout_of(db, fresh) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, fresh)["indexes"])
    if citus.ENABLED:
        check_distributed(db, fresh)


def test_two_migrate_commands_at_once(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Two `flask idem migrate` processes started together on a missing table (held at the migration's
    lock until both wait there) both exit 0; the layout is made once between them."""
    table = fresh
    command = [
        sys.executable,
        "-m",
        "flask",
        "--app",
        "tests.support.notes_app:create_app",
        "idem",
        "migrate",
    ]
    env = {**os.environ, "FLASK_IDEM_DATABASE_URL": direct_database_url, "FLASK_IDEM_TABLE": table}
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'flask-idem migrate' AND wait_event = 'advisory'"
    )
    with psycopg.connect(direct_database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_layout.lock_key(table),))
        processes = [
            subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for _ in range(2)
        ]
        try:
            wait_for(lambda: db.execute(waiting).fetchone() == (2,), timeout=60)
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (_layout.lock_key(table),))
        outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    applied = [
        int(layout)
        for output in outputs
        for found in re.findall(r"\(applied ([\d, ]+)\)", output)
        for layout in found.split(", ")
    ]
    assert sorted(applied) == list(range(1, _layout.latest() + 1)), outputs
    assert layout_of(db, table) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, table)["indexes"])
    if citus.ENABLED:
        check_distributed(db, table)


def test_writers_go_on_while_the_index_is_built(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a second layout's index build waits for a long transaction that wrote to its table, other
    writes go through: the index is built concurrently, so nothing queues behind it."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    second_layout(monkeypatch, **OUTBOX_INDEX)
    insert = sql.SQL(
        "INSERT INTO {} (org_id, id, task, idem_key) VALUES (1, gen_random_uuid(), 't', gen_random_uuid())"
    ).format(sql.Identifier(fresh + "_outbox"))
    with psycopg.connect(direct_database_url) as holder, psycopg.connect(direct_database_url) as writer:
        holder.execute(insert)  # an open transaction holding a write lock on the table
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (
                _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED),
                done.set(),
            )
        )
        thread.start()
        try:
            wait_for(
                lambda: (
                    db.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'flask-idem migrate'"
                        " AND wait_event_type IS NOT NULL AND wait_event_type IN ('Lock', 'IPC')"
                        " AND query ILIKE 'CREATE INDEX CONCURRENTLY%%'"
                    ).fetchone()
                    == (1,)
                )
            )
            writer.execute("SET lock_timeout = '20s'")  # generous: it must not wait at all
            writer.execute(insert)
            writer.commit()
            assert not done.is_set()  # the build still waits for the holder's transaction
        finally:
            holder.commit()
            thread.join(60)
    assert done.is_set()
    assert layout_of(db, fresh) == _layout.latest()


def test_invalid_index_left_by_a_failed_build_is_built_again(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index left invalid by a failed concurrent build (here: a unique one over duplicates, with the
    distribution column, which a unique index on Citus needs) is dropped and built again; the layout is
    recorded only once it is valid."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    second = second_layout(monkeypatch, **OUTBOX_INDEX)
    fill_outbox(db, fresh, 2)
    name = fresh + "_outbox_task_idx"
    outbox = sql.Identifier(fresh + "_outbox")
    with pytest.raises(psycopg.errors.UniqueViolation):
        db.execute(
            sql.SQL("CREATE UNIQUE INDEX CONCURRENTLY {} ON {} (org_id, task)").format(
                sql.Identifier(name), outbox
            )
        )
    assert any(index.endswith(" INVALID") for index in catalog(db, fresh + "_outbox")["indexes"])
    lines: list[str] = []
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, echo=lines.append)
    assert f'Dropping index "{name}", left invalid by a failed build.' in lines
    [built] = [index for index in catalog(db, fresh + "_outbox")["indexes"] if "(task)" in index]
    assert "UNIQUE" not in built and "INVALID" not in built and "org_id" not in built
    assert layout_of(db, fresh) == second.layout


# -- the check at the first use of the database ------------------------------------------------------------


@pytest.mark.parametrize(
    ("comment", "served", "says"),
    [
        (_layout.comment(99, 99), False, "made by a newer flask-idem, and needs the code of layout 99"),
        (_layout.comment(99, 1), True, None),
    ],
    ids=["newer-incompatible", "newer-compatible"],
)
def test_newer_layout(
    fresh: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    apps: Callable[..., Flask],
    caplog: pytest.LogCaptureFixture,
    comment: str,
    served: bool,
    says: str | None,
) -> None:
    """A layout made by a newer flask-idem is served when it says this code may run on it, and refused
    (503, the reason in the log, the CLI's error) when it says not."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    db.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(sql.Identifier(fresh), sql.Literal(comment)))
    app = apps(IDEM_TABLE=fresh)
    with caplog.at_level(logging.ERROR, "flask_idem"):
        answer = post(app, "/notes", uuid.uuid4(), {"body": "newer"})
    stats = app.test_cli_runner().invoke(args=["idem", "stats"])
    assert answer.status_code == (201 if served else 503)
    assert (stats.exit_code == 0) is served
    if says is not None:
        assert says in caplog.text
        assert says in stats.output


@pytest.mark.parametrize("command", ["migrate", "init-db"])
@pytest.mark.parametrize(
    ("compatible_from", "runs"), [(99, False), (1, True)], ids=["incompatible", "compatible"]
)
def test_commands_on_a_newer_layout(
    fresh: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    apps: Callable[..., Flask],
    command: str,
    compatible_from: int,
    runs: bool,
) -> None:
    """`migrate` and `init-db` leave a newer flask-idem's layout as it is: they succeed when it lets this
    code run (init-db reports the layout it found), and exit 1 saying to deploy the newer flask-idem when
    it does not."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    newer = _layout.comment(99, compatible_from)
    db.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(sql.Identifier(fresh), sql.Literal(newer)))
    result = apps(IDEM_TABLE=fresh).test_cli_runner().invoke(args=["idem", command])
    assert (result.exit_code == 0) is runs, result.output
    if runs:
        said = "is ready (layout 99)." if command == "init-db" else "is at layout 99: nothing to do."
        assert said in result.output
    else:
        assert "made by a newer flask-idem, and needs the code of layout 99" in result.output
        assert "Deploy the newer flask-idem." in result.output
        assert "nothing to do" not in result.output and "ready" not in result.output
    assert db.execute("SELECT obj_description(%s::regclass)", (fresh,)).fetchone() == (newer,)


@pytest.fixture
def older(
    fresh: str, direct_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, _layout.Revision]]:
    """A key table of layout 1 while the code has a second layout (a nullable column, for this test)."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    yield fresh, second_layout(monkeypatch, sql="ALTER TABLE {table} ADD COLUMN IF NOT EXISTS test_note text")


def test_check_layout_names_the_command_to_run(
    fresh: str, database_url: str, direct_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`idem.check_layout()` raises ConfigurationError naming `flask idem init-db` for a missing key
    table and `flask idem migrate` for a layout older than the code's, and passes after them."""
    app, idem = build_app(database_url, IDEM_TABLE=fresh)
    try:
        for command in ("init-db", "migrate"):
            if command == "migrate":
                second_layout(monkeypatch, sql="ALTER TABLE {table} ADD COLUMN IF NOT EXISTS test_note text")
                app.extensions["idem"].layout_checked.clear()
            with app.app_context(), pytest.raises(ConfigurationError) as refused:
                idem.check_layout()
            assert f"'flask idem {command}'" in str(refused.value)
            result = app.test_cli_runner().invoke(args=["idem", command])
            assert result.exit_code == 0, result.output
            with app.app_context():
                idem.check_layout()
    finally:
        close_pool(app)


def test_older_layout_than_the_code_is_refused_until_migrated(
    older: tuple[str, _layout.Revision],
    apps: Callable[..., Flask],
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Code of a second layout refuses a table of layout 1 (503, the command in the log) and names
    `flask idem migrate`; after it, it serves, and the table has the second layout's column."""
    table, second = older
    app = apps(IDEM_TABLE=table)
    with caplog.at_level(logging.ERROR, "flask_idem"):
        refused = post(app, "/notes", uuid.uuid4(), {"body": "old"})
    assert refused.status_code == 503
    assert f"has layout 1; this flask-idem runs on layout {second.layout}." in caplog.text
    assert "Upgrade it with 'flask idem migrate'" in caplog.text
    result = migrate(app)
    assert result.exit_code == 0, result.output
    assert f"layout 1, now layout {second.layout} (applied {second.layout})" in result.output
    assert post(app, "/notes", uuid.uuid4(), {"body": "old"}).status_code == 201
    assert "test_note" in [column[0] for column in catalog(db, table)["columns"]]


@pytest.mark.parametrize(
    ("alembic", "names", "not_named"),
    [
        (False, ["'flask idem migrate'"], "'flask db upgrade'"),
        (True, ["'flask db upgrade' (Flask-Migrate)", "'alembic upgrade heads'"], "'flask idem migrate'"),
    ],
    ids=["flask-idem", "alembic"],
)
def test_older_layout_names_the_command_of_the_path_the_project_uses(
    older: tuple[str, _layout.Revision],
    apps: Callable[..., Flask],
    db: psycopg.Connection[Any],
    alembic: bool,
    names: list[str],
    not_named: str,
) -> None:
    """With an `alembic_version` table in the search path (a Flask-Migrate or Alembic project), the
    refusal of an older layout names Alembic's upgrade, which keeps `alembic_version` in step; without
    one, `flask idem migrate`."""
    table, _ = older
    if alembic:
        db.execute("CREATE TABLE alembic_version (version_num varchar(32) NOT NULL PRIMARY KEY)")
    try:
        app = apps(IDEM_TABLE=table)
        with app.app_context(), app.extensions["idem"].source.connection() as conn:
            found = _layout.read(conn, table)
    finally:
        db.execute("DROP TABLE IF EXISTS alembic_version")
    message = _layout.problem(found, table) or ""
    assert all(name in message for name in names), message
    assert not_named not in message


# -- a key table changed by hand ---------------------------------------------------------------------------


def test_the_columns_the_code_uses_are_the_key_tables(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """`_layout.COLUMNS`, what the layout check compares and what its message adds back, is the key
    table's columns as the revision makes them: a table made from it has the same names, types, nullity
    and defaults, in the same order."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    columns = ", ".join(f"{name} {definition}" for name, definition in _layout.COLUMNS.items())
    db.execute(f"CREATE TABLE columns_only ({columns})")  # type: ignore[arg-type]  # our own constants
    try:
        assert catalog(db, "columns_only")["columns"] == catalog(db, fresh)["columns"]
    finally:
        db.execute("DROP TABLE columns_only")


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("ALTER TABLE {} DROP COLUMN step", "lacks column(s) step"),
        (
            "ALTER TABLE {} DROP CONSTRAINT fresh_keys_key",
            "lacks its unique key (org_id, idem_key, expires_at)",
        ),
    ],
    ids=["column", "unique-key"],
)
def test_a_key_table_changed_by_hand_is_refused_at_the_check_naming_the_repair(
    fresh: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    apps: Callable[..., Flask],
    caplog: pytest.LogCaptureFixture,
    damage: str,
    says: str,
) -> None:
    """A table in the latest layout whose column or unique key was dropped by hand (its layout comment
    intact) is found by the layout check: the first request is a 503 (not a 500 from the statement),
    `flask idem stats` exits 1, both saying what is missing and the statement that puts it back; once
    that has run, the same key succeeds."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    db.execute(sql.SQL(damage).format(sql.Identifier(fresh)))  # type: ignore[arg-type]  # a constant
    app = apps(IDEM_TABLE=fresh)
    key = uuid.uuid4()
    with caplog.at_level(logging.ERROR, "flask_idem"):
        refused = post(app, "/notes", key, {"body": "drift"})
    assert refused.status_code == 503
    assert refused.json["type"] == "urn:flask-idem:problem:store-unavailable"
    assert says in caplog.text and "Answered 503 until then." in caplog.text
    assert "UndefinedColumn" not in caplog.text
    stats = app.test_cli_runner().invoke(args=["idem", "stats"])
    assert stats.exit_code == 1 and says in stats.output
    repair = re.search(r"Restore them as the table's owner: (.*)$", stats.output.strip())
    assert repair is not None, stats.output
    db.execute(repair[1])  # type: ignore[arg-type]  # the statements the message names
    assert post(app, "/notes", key, {"body": "drift"}).status_code == 201


def test_an_index_dropped_by_hand_is_served_with_a_warning_naming_its_build(
    fresh: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    apps: Callable[..., Flask],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An index of the layout dropped by hand only slows its statements: the application serves, and
    says once which index is missing with the statement that builds it again, which restores it as the
    revisions made it."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    made = catalog(db, fresh)["indexes"]
    db.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(fresh + "_due_idx")))
    app = apps(IDEM_TABLE=fresh)
    with caplog.at_level(logging.WARNING, "flask_idem"):
        for body in ("a", "b"):
            assert post(app, "/notes", uuid.uuid4(), {"body": body}).status_code == 201
    warned = [r.getMessage() for r in caplog.records if "lacks indexes of its layout" in r.getMessage()]
    assert len(warned) == 1
    build = warned[0][warned[0].index("CREATE INDEX") :]
    # Not CONCURRENTLY: PostgreSQL builds a partitioned table's index on each partition at once.
    assert build.startswith("CREATE INDEX IF NOT EXISTS")
    assert build.count("CREATE INDEX") == 1 and f'"{fresh}_due_idx"' in build
    db.execute(build)  # type: ignore[arg-type]  # the statement the warning names
    assert catalog(db, fresh)["indexes"] == made


def test_grant_gives_the_application_role_dml_only(
    fresh: str, apps: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """`migrate --grant ROLE` grants SELECT, INSERT, UPDATE, DELETE on the key table, its tombstones and
    its outbox, and nothing else."""
    role = f"idem_grant_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        result = migrate(apps(IDEM_TABLE=fresh), "--grant", role)
        assert result.exit_code == 0, result.output
        granted = db.execute(
            "SELECT table_name::text, array_agg(privilege_type::text ORDER BY privilege_type)"
            " FROM information_schema.role_table_grants WHERE grantee = %s GROUP BY 1 ORDER BY 1",
            (role,),
        ).fetchall()
        dml = ["DELETE", "INSERT", "SELECT", "UPDATE"]
        assert granted == [(fresh, dml), (fresh + "_outbox", dml), (fresh + "_tombstones", dml)]
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- what the due index is for ----------------------------------------------------------------------------


@pytest.mark.skipif(citus.ENABLED, reason="Citus claims organisation by organisation, with other plans")
def test_claim_reads_only_due_rows_through_the_due_index(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """With 5,000 stranded requests backing off and 3 due, the recovery claim reads only the due ones
    through the due index (its plan names the index: the claim statement and the index's expression must
    stay in step), and them all without it. Prints the buffers each plan touched."""
    _migrate.upgrade(direct_database_url, table=fresh)
    keys = sql.Identifier(fresh)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, flow, lease_token,"
            " lease_expires_at, next_attempt_at, expires_at)"
            " SELECT i % 7, gen_random_uuid(), sha256('x'), 'POST', '/t', 'processing', 'notes.transfer',"
            " gen_random_uuid(), now() - interval '1 minute',"
            " CASE WHEN i <= 3 THEN now() - interval '1 second' ELSE now() + interval '1 hour' END,"
            " now() + interval '1 day' FROM generate_series(1, 5000) AS i"
        ).format(keys)
    )
    db.execute(sql.SQL("ANALYZE {}").format(keys))
    claim = _Statements(fresh).claim
    params = {
        "token": uuid.uuid4(),
        "lease": 30.0,
        "limit": 1,
        "deadline": 3600.0,
        "flows": ["notes.transfer"],
    }
    [(partition_index,)] = db.execute(
        "SELECT c.relname::text FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %s::regclass",
        (fresh + "_due_idx",),
    ).fetchall()

    def explain() -> tuple[str, int]:
        with db.transaction(force_rollback=True):
            rows = db.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim, params).fetchone()
        assert rows is not None
        tree = rows[0][0]["Plan"]
        text = str(tree)
        return text, int(tree.get("Shared Hit Blocks", 0)) + int(tree.get("Shared Read Blocks", 0))

    with_index, blocks_with = explain()
    db.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(fresh + "_due_idx")))
    without, blocks_without = explain()
    print(
        f"\nclaim with 5,000 rows backing off: {blocks_with} buffers with the due index,"
        f" {blocks_without} without"
    )
    assert partition_index in with_index
    assert partition_index not in without
    assert blocks_with < blocks_without


# -- the machinery for the layouts after the first ---------------------------------------------------------


def test_column_revision_gives_way_to_a_long_transaction(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second layout that adds a column needs an instant of ACCESS EXCLUSIVE. Behind a long
    transaction it waits at most the lock timeout, lets the writers queued behind it through, and tries
    again; it rewrites nothing (a constant default)."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    column = second_layout(
        monkeypatch,
        sql="ALTER TABLE {table} ADD COLUMN IF NOT EXISTS test_policy text NOT NULL DEFAULT 'strict'",
    )
    keys = sql.Identifier(fresh)
    insert = sql.SQL(
        "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
        " VALUES (1, gen_random_uuid(), sha256('x'), 'POST', '/x', 'completed', '{{}}', now())"
    ).format(keys)
    # The partition's file: the partitioned table has none of its own.
    relfilenode = sql.SQL("SELECT pg_relation_filenode({})").format(sql.Literal(fresh + "_p0"))
    file_before = db.execute(relfilenode).fetchone()
    lines: list[str] = []
    reports: list[_migrate.Report] = []
    with psycopg.connect(direct_database_url) as holder, psycopg.connect(direct_database_url) as writer:
        holder.execute(insert)  # a long transaction that wrote to the table
        thread = threading.Thread(
            target=lambda: reports.append(
                _migrate.upgrade(
                    direct_database_url,
                    table=fresh,
                    distributed=citus.ENABLED,
                    lock_timeout=0.2,
                    echo=lines.append,
                )
            )
        )
        thread.start()
        try:
            wait_for(lambda: any("a lock was not free in time" in line for line in lines))
            writer.execute("SET lock_timeout = '10s'")  # waits 0.2 s at most behind the ALTER
            writer.execute(insert)
            writer.commit()
        finally:
            holder.commit()
            thread.join(60)
    [report] = reports
    assert report.applied == [column.layout]
    assert report.lock_retries >= 1
    assert layout_of(db, fresh) == column.layout
    assert db.execute(relfilenode).fetchone() == file_before  # no rewrite
    policies = db.execute(sql.SQL("SELECT DISTINCT test_policy FROM {}").format(keys)).fetchall()
    assert policies == [("strict",)]


def test_upgrade_stops_at_the_layout_asked(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``to`` applies the revisions up to that layout only; the next call goes on from there, and a
    layout this release does not have is refused before anything is done."""
    second = second_layout(monkeypatch, sql="ALTER TABLE {table} ADD COLUMN IF NOT EXISTS test_note text")
    for wrong in (0, second.layout + 1):
        with pytest.raises(ValueError, match=f"no layout {wrong}"):
            _migrate.upgrade(direct_database_url, table=fresh, to=wrong)
    assert layout_of(db, fresh) is None
    first = _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, to=1)
    assert (first.applied, first.after, layout_of(db, fresh)) == ([1], 1, 1)
    assert "test_note" not in [column[0] for column in catalog(db, fresh)["columns"]]
    then = _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, to=second.layout)
    assert (then.applied, then.after, layout_of(db, fresh)) == ([second.layout], second.layout, second.layout)
    assert "test_note" in [column[0] for column in catalog(db, fresh)["columns"]]


# -- the application's privileges, kept by every revision ---------------------------------------------------


@pytest.mark.parametrize(
    ("revision", "lacks"),
    [
        ({"sql": "CREATE TABLE IF NOT EXISTS {extra_qualified} (id int)", "names": {"extra": "_x"}}, "extra"),
        (
            {
                "sql": "CREATE TABLE {extra_qualified} (id int)",
                "names": {"extra": "_x"},
                "tables": ("extra",),
                "grants": "GRANT SELECT ON {table} TO {role}",
            },
            "extra",
        ),
        ({"sql": "DROP FUNCTION IF EXISTS {reserve_qualified}(bigint)"}, "a function dropped"),
    ],
    ids=["table-not-in-tables", "table-not-granted", "function-dropped"],
)
def test_a_revision_that_could_lose_a_grant_is_refused(revision: dict[str, Any], lacks: str) -> None:
    """A revision whose new table is not among its tables, or not named by its grants, or that drops a
    function (which loses its privileges) is refused when the revisions are loaded; a partition it
    makes needs no grant of its own."""
    with pytest.raises(RuntimeError, match=f"must be in its tables and its grants \\({lacks}\\)"):
        _layout._check(_layout.Revision(layout=2, compatible_from=1, summary="s", **revision))
    partition = "CREATE TABLE IF NOT EXISTS {first_qualified} PARTITION OF {table} DEFAULT"
    _layout._check(_layout.Revision(layout=2, compatible_from=1, summary="s", sql=partition))


def test_add_takes_a_revision_from_outside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_layout.add` makes a revision of the test suite's the next layout, once; one out of order is
    refused when the revisions are read."""
    monkeypatch.setattr(_layout, "_ADDED", [])
    second = _layout.Revision(layout=2, compatible_from=1, summary="added")
    try:
        _layout.add(second, "flask_idem_0002", "flask_idem_0001")
        _layout.add(second, "flask_idem_0002", "flask_idem_0001")
        assert _layout.revisions()[1:] == (second,)
        assert _layout.latest() == 2
        _layout.add(_layout.Revision(layout=4, compatible_from=1, summary="gap"), "flask_idem_0004", "x")
        with pytest.raises(RuntimeError, match="revision of layout 4 is out of order"):
            _layout.revisions()
    finally:
        monkeypatch.undo()
        _layout.revisions.cache_clear()
    assert _layout.latest() == 1


@pytest.mark.skipif(citus.ENABLED, reason="a table made anew on Citus is distributed again by its revision")
def test_a_table_a_revision_replaces_keeps_the_application_roles_grants(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second layout that makes the outbox anew (a table with no privileges at all) leaves the role
    `migrate --grant` was given for with its privileges on it, in the transaction that made it; a role
    that may only read the key table (a reporting role) is not given any."""
    _migrate.upgrade(direct_database_url, table=fresh)
    app_role, reader = (f"idem_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("app", "reader"))
    for role in (app_role, reader):
        db.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        _migrate.grant(direct_database_url, table=fresh, role=app_role)
        db.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(sql.Identifier(fresh), sql.Identifier(reader)))
        second_layout(
            monkeypatch,
            sql=(
                "ALTER TABLE {outbox_qualified} RENAME TO fresh_keys_outbox_old;"
                " CREATE TABLE {outbox_qualified} (LIKE fresh_keys_outbox_old INCLUDING ALL);"
                " DROP TABLE fresh_keys_outbox_old"
            ),
        )
        outbox = fresh + "_outbox"
        before = db.execute("SELECT oid FROM pg_class WHERE relname = %s", (outbox,)).fetchone()
        _migrate.upgrade(direct_database_url, table=fresh)
        assert db.execute("SELECT oid FROM pg_class WHERE relname = %s", (outbox,)).fetchone() != before

        def held(role: str) -> list[str]:
            return [
                privilege
                for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE")
                if db.execute("SELECT has_table_privilege(%s, %s, %s)", (role, outbox, privilege)).fetchone()
                == (True,)
            ]

        assert held(app_role) == ["SELECT", "INSERT", "UPDATE", "DELETE"]
        assert held(reader) == []
    finally:
        for role in (app_role, reader):
            db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_older_layout_whose_upgrade_changes_the_statements_says_code_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layout that is not compatible with the code of the table's layout is not called online: the
    message says to upgrade once no process of that code runs."""
    second_layout(monkeypatch, compatible_from=2)
    message = _layout.problem(_layout.Found(1), "idempotency_keys") or ""
    assert "online" not in message
    assert "once no process of the code of layout 1 runs any more: layout 2 changes what the" in message
