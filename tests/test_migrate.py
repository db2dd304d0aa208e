"""The key table's life: layouts, `flask idem init-db` and `migrate`, the first release's table upgraded.

Each test works on a key table of its own name (``IDEM_TABLE``) in the worker's database, made by the
first release's DDL (:mod:`tests.support.layouts`) or by the migration itself, and dropped afterwards.
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
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idem import ConfigurationError, _layout, _migrate, _partitions

from .support import citus
from .support.flow_app import Ledger, build_flow_app
from .support.helpers import app_factory, close_pool, wait_for
from .support.layouts import catalog, check_distributed, create_first_release, drop, layout_of
from .support.notes_app import build_app, post
from .support.servers import ROOT

LEGACY = "legacy_keys"


@pytest.fixture
def legacy(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """A key table named ``legacy_keys`` made by the first release's ``init-db``; dropped afterwards."""
    drop(direct_database_url, LEGACY)
    create_first_release(direct_database_url, LEGACY, distributed=citus.ENABLED)
    yield LEGACY
    drop(direct_database_url, LEGACY)


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


def age(db: psycopg.Connection[Any], table: str, key: uuid.UUID, interval: str) -> None:
    """Move one key's expiry ``interval`` into the past (epoch arithmetic: Citus refuses the other)."""
    db.execute(
        sql.SQL(
            "UPDATE {} SET expires_at = to_timestamp(extract(epoch FROM expires_at - 'epoch'::timestamptz)"
            " - extract(epoch FROM %s::interval)) WHERE idem_key = %s"
        ).format(sql.Identifier(table)),
        (interval, key),
    )


def migrate(app: Flask, *args: str) -> Any:
    result = app.test_cli_runner().invoke(args=["idem", "migrate", *args])
    return result


# -- layouts -----------------------------------------------------------------------------------------------


def test_revisions_are_numbered_and_chained() -> None:
    """Layouts 1, 2, ... in order, each an Alembic revision following the one before, on one branch."""
    revisions = _layout.revisions()
    assert [r.layout for r in revisions] == list(range(1, len(revisions) + 1))
    assert _layout.latest() == revisions[-1].layout >= 2
    assert _layout.REQUIRED <= _layout.latest()


def test_upgrades_page_names_the_layouts_this_code_runs_on() -> None:
    """The upgrades page has a row for each layout and says which layouts this code runs on."""
    page = (ROOT / "docs" / "upgrades.rst").read_text()
    assert f"This release runs on layouts {_layout.REQUIRED} to {_layout.latest()}." in page
    rows = [int(number) for number in re.findall(r"^(\d+) {2,}\S", page, re.MULTILINE)]
    assert rows == [revision.layout for revision in _layout.revisions()]


def test_reserve_function_answers_the_store_columns() -> None:
    """Layout 1's reserve function (Citus) returns the very columns the store's reserve statement reads."""
    from flask_idem._store import _Statements

    record = _Statements("idempotency_keys").record.decode().replace("%(tomb)s", "p_tomb")
    function = _layout.revisions()[0].distributed_sql
    body = function[function.index("SELECT false, v_taken, ") + len("SELECT false, v_taken, ") :]
    body = body[: body.index("\n        FROM (SELECT)")]
    assert " ".join(body.split()) == " ".join(record.split())


def test_partitioned_reserve_function_looks_as_the_store_does() -> None:
    """Layout 4's reserve function (Citus) looks for a key in every partition and among the tombstones
    with the very statement the store's reservations on the partitioned table use, and answers its
    columns."""
    from flask_idem._store import _Statements

    found = _Statements("idempotency_keys", partitioned=True).found.decode()
    for parameter, variable in (("%(org_id)s", "p_org_id"), ("%(key)s", "p_key"), ("%(tomb)s", "p_tomb")):
        found = found.replace(parameter, variable)
    revision = _layout.revisions()[3]
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


def test_upgraded_and_fresh_tables_are_the_same(
    legacy: str, fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The first release's table upgraded and a table made fresh have the same columns, constraints,
    indexes (all valid), storage options and recorded layout: one chain of revisions makes both."""
    _migrate.upgrade(direct_database_url, table=legacy, distributed=citus.ENABLED)
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    upgraded, made = catalog(db, legacy), catalog(db, fresh)
    assert upgraded == made
    assert not any("INVALID" in index for index in made["indexes"])
    assert any("GREATEST(lease_expires_at, next_attempt_at)" in index for index in made["indexes"])
    assert made["comment"] == _layout.revisions()[-1].comment()
    if citus.ENABLED:
        check_distributed(db, legacy)
        check_distributed(db, fresh)


# -- the first release's table, with rows in every state, upgraded ------------------------------------------


def test_first_release_rows_keep_the_contract_after_the_upgrade(
    legacy: str, database_url: str, db: psycopg.Connection[Any], ledger: Ledger, apps: Callable[..., Flask]
) -> None:
    """Rows written in every state on the first release's table (completed, processing under a live
    lease, stranded, failed and flagged, tombstone, expired) are served as before after `migrate`:
    replay, 422, 409, recovery, purge."""
    config = {"IDEM_TABLE": legacy}
    made: list[Flask] = []

    def flow_app() -> Flask:
        made.append(build_flow_app(database_url, ledger, **config))
        return made[-1]

    notes, flows = apps(**config), flow_app()
    try:
        # The rows, written through the application on the first release's layout (this code runs on it).
        done, tomb, expired, gone = (uuid.uuid4() for _ in range(4))
        first = post(notes, "/notes", done, {"body": "done"})
        assert first.status_code == 201
        for key, body in ((tomb, "tomb"), (expired, "expired"), (gone, "gone")):
            assert post(notes, "/notes", key, {"body": body}).status_code == 201
        age(db, legacy, tomb, "25 hours")
        age(db, legacy, gone, "25 hours")
        assert notes.test_cli_runner().invoke(args=["idem", "purge"]).exit_code == 0  # two tombstones
        age(db, legacy, gone, "31 days")  # past the tombstone's period: purge deletes it

        live, stranded, flagged = (uuid.uuid4() for _ in range(3))
        for key in (live, stranded, flagged):
            db.execute("DELETE FROM notes WHERE body IN ('intent', 'prepared')")  # the flow's, unique
            ledger.lose_answer = True  # recorded by the ledger, answer lost: processing, backing off
            assert post(flows, "/transfers", key, {"amount": 5}).status_code == 503
        keys = sql.Identifier(legacy)
        db.execute(
            sql.SQL("UPDATE {} SET next_attempt_at = now() + interval '1 hour' WHERE idem_key = %s").format(
                keys
            ),
            (stranded,),
        )
        db.execute(
            sql.SQL("UPDATE {} SET lease_expires_at = now() + interval '1 hour' WHERE idem_key = %s").format(
                keys
            ),
            (live,),
        )
        db.execute(
            sql.SQL(
                "UPDATE {} SET next_attempt_at = now(), created_at = now() - interval '2 hours'"
                " WHERE idem_key = %s"
            ).format(keys),
            (flagged,),
        )
        report = flows.test_cli_runner().invoke(args=["idem", "recover"])
        assert "1 failed" in report.output  # past IDEM_RECOVERY_DEADLINE: failed and flagged
        statuses = dict(db.execute(sql.SQL("SELECT idem_key, status FROM {}").format(keys)).fetchall())
        assert statuses == {
            done: "completed",
            tomb: "completed",
            expired: "completed",
            gone: "completed",
            live: "processing",
            stranded: "processing",
            flagged: "failed",
        }
        assert layout_of(db, legacy) == 1

        # The upgrade.
        check = migrate(notes, "--check")
        assert check.exit_code == 1
        assert "would apply layout 2" in check.output
        result = migrate(notes)
        assert result.exit_code == 0, result.output
        assert f"layout 1, now layout {_layout.latest()}" in result.output
        assert layout_of(db, legacy) == _layout.latest()
        if citus.ENABLED:
            check_distributed(db, legacy)

        # The contract, on a fresh start of both applications.
        notes, flows = apps(**config), flow_app()
        replay = post(notes, "/notes", done, {"body": "done"})
        assert (replay.status_code, replay.json) == (200, first.json)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert post(notes, "/notes", done, {"body": "changed"}).status_code == 422
        assert post(notes, "/notes", tomb, {"body": "tomb"}).status_code == 303
        busy = post(flows, "/transfers", live, {"amount": 5})
        assert busy.status_code == 409
        assert "Retry-After" in busy.headers
        assert post(flows, "/transfers", flagged, {"amount": 5}).status_code == 500  # its stored answer
        stuck = flows.test_cli_runner().invoke(args=["idem", "stuck"]).output
        assert f"NEEDS ATTENTION org=1 key={flagged}" in stuck

        db.execute(
            sql.SQL("UPDATE {} SET next_attempt_at = now() WHERE idem_key = %s").format(keys), (stranded,)
        )
        db.execute("DELETE FROM notes WHERE body IN ('intent', 'prepared')")
        recovered = flows.test_cli_runner().invoke(args=["idem", "recover"]).output
        assert f"completed org=1 key={stranded} answered 201" in recovered
        finished = post(flows, "/transfers", stranded, {"amount": 5})
        assert (finished.status_code, finished.json["amount"]) == (200, 5)
        assert len(ledger.entries) == 3  # one entry per transfer, never two

        # Retention on layout 4 drops whole partitions: the first release's rows are in the first one,
        # whose range ends days ahead, so purge makes partitions ahead and drops none. Each row is
        # answered by what it holds meanwhile.
        age(db, legacy, expired, "25 hours")
        age(db, legacy, flagged, "400 days")
        purged = notes.test_cli_runner().invoke(args=["idem", "purge"]).output
        assert re.fullmatch(
            r"Dropped 0 partition\(s\), wrote 0 tombstone\(s\), moved 0 flagged row\(s\); made \d+"
            r" partition\(s\) ahead\.",  # of the tombstones' table
            purged.strip(),
        ), purged
        # The first partition ends after the last tombstone's end, 30 days ahead: none to make after it.
        [first] = _partitions.partitions(db, legacy)
        assert first.upper is not None
        last = db.execute(sql.SQL("SELECT max(expires_at) FROM {}").format(keys)).fetchone()
        assert last is not None and last[0] < first.upper
        remaining = {row[0] for row in db.execute(sql.SQL("SELECT idem_key FROM {}").format(keys))}
        assert remaining == {done, tomb, expired, gone, live, stranded, flagged}
        assert post(notes, "/notes", expired, {"body": "expired"}).status_code == 303  # past retention
        again = post(notes, "/notes", gone, {"body": "gone again"})  # past its tombstone's period
        assert again.status_code == 201, again.json
        assert "Idempotent-Replayed" not in again.headers
        stuck = flows.test_cli_runner().invoke(args=["idem", "stuck"]).output
        assert f"NEEDS ATTENTION org=1 key={flagged}" in stuck
    finally:
        for app in made:
            close_pool(app)


# -- at the same time as others ------------------------------------------------------------------------------


def test_two_migrations_at_once(legacy: str, direct_database_url: str, db: psycopg.Connection[Any]) -> None:
    """Two processes upgrading one table at once both succeed; it is upgraded once, its index valid."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
            " SELECT 1, gen_random_uuid(), sha256(i::text::bytea), 'POST', '/x', 'completed', '{{}}',"
            " now() + interval '1 day' FROM generate_series(1, 20000) AS i"
        ).format(sql.Identifier(legacy))
    )
    reports: list[_migrate.Report] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait()
        try:
            reports.append(_migrate.upgrade(direct_database_url, table=legacy, distributed=citus.ENABLED))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert sorted(layout for report in reports for layout in report.applied) == list(
        range(2, _layout.latest() + 1)
    )
    assert all(report.after == _layout.latest() for report in reports)
    assert layout_of(db, legacy) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, legacy)["indexes"])
    if citus.ENABLED:
        check_distributed(db, legacy)


@pytest.mark.parametrize("start", ["fresh", "legacy"], ids=["missing", "first-release"])
def test_two_migrate_commands_at_once(
    start: str, request: pytest.FixtureRequest, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Two `flask idem migrate` processes started together (held at the migration's lock until both
    wait there), on a missing table or a full first-release one, both exit 0; the layouts are applied
    once between them, and the rows are kept."""
    table: str = request.getfixturevalue(start)
    keys = sql.Identifier(table)
    if start == "legacy":
        db.execute(
            sql.SQL(
                "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
                " SELECT i % 7, gen_random_uuid(), sha256(i::text::bytea), 'POST', '/x', 'completed', '{{}}',"
                " now() + interval '1 day' FROM generate_series(1, 20000) AS i"
            ).format(keys)
        )
    rows = sql.SQL("SELECT org_id, idem_key, request_sha, status, response, expires_at FROM {} ORDER BY 1, 2")
    before = db.execute(rows.format(keys)).fetchall() if start == "legacy" else []
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
    first = 1 if start == "fresh" else 2
    assert sorted(applied) == list(range(first, _layout.latest() + 1)), outputs
    assert layout_of(db, table) == _layout.latest()
    assert not any("INVALID" in index for index in catalog(db, table)["indexes"])
    assert db.execute(rows.format(keys)).fetchall() == before
    if citus.ENABLED:
        check_distributed(db, table)


def test_writers_go_on_while_the_index_is_built(
    legacy: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """While the upgrade waits for a long transaction that wrote to the table, other writes go through:
    the index is built concurrently, so nothing queues behind it."""
    keys = sql.Identifier(legacy)
    insert = sql.SQL(
        "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
        " VALUES (1, gen_random_uuid(), sha256('x'), 'POST', '/x', 'completed', '{{}}', now())"
    ).format(keys)
    with psycopg.connect(direct_database_url) as holder, psycopg.connect(direct_database_url) as writer:
        holder.execute(insert)  # an open transaction holding a write lock on the table
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (
                _migrate.upgrade(direct_database_url, table=legacy, distributed=citus.ENABLED),
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
    assert layout_of(db, legacy) == _layout.latest()


def test_invalid_index_left_by_a_failed_build_is_built_again(
    legacy: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """An index left invalid by a failed concurrent build (here: a unique one over duplicates) is
    dropped and built again; the layout is recorded only once it is valid."""
    keys = sql.Identifier(legacy)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, flow, lease_token,"
            " lease_expires_at, expires_at) SELECT 1, gen_random_uuid(), sha256('x'), 'POST', '/x',"
            " 'processing', 'f', gen_random_uuid(), '2030-01-01', now() FROM generate_series(1, 2)"
        ).format(keys)
    )
    with pytest.raises(psycopg.errors.UniqueViolation):
        db.execute(
            sql.SQL(
                "CREATE UNIQUE INDEX CONCURRENTLY {} ON {}"
                " (org_id, (greatest(lease_expires_at, next_attempt_at))) WHERE lease_expires_at IS NOT NULL"
            ).format(sql.Identifier(legacy + "_due_idx"), keys)
        )
    assert any(index.endswith(" INVALID") for index in catalog(db, legacy)["indexes"])
    lines: list[str] = []
    _migrate.upgrade(direct_database_url, table=legacy, distributed=citus.ENABLED, echo=lines.append)
    assert f'Dropping index "{legacy}_due_idx", left invalid by a failed build.' in lines
    due = [index for index in catalog(db, legacy)["indexes"] if "GREATEST" in index]
    assert len(due) == 1
    assert "UNIQUE" not in due[0] and "INVALID" not in due[0] and "org_id" not in due[0]
    assert layout_of(db, legacy) == _layout.latest()


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


def test_check_layout_names_the_command_to_run(
    fresh: str, legacy: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`idem.check_layout()` raises ConfigurationError naming `flask idem init-db` for a missing key
    table and `flask idem migrate` for a layout older than the code runs on, and passes after them."""
    monkeypatch.setattr(_layout, "REQUIRED", 2)
    built: list[Flask] = []
    try:
        for table, command in ((fresh, "init-db"), (legacy, "migrate")):
            app, idem = build_app(database_url, IDEM_TABLE=table)
            built.append(app)
            with app.app_context(), pytest.raises(ConfigurationError) as refused:
                idem.check_layout()
            assert f"'flask idem {command}'" in str(refused.value)
            result = app.test_cli_runner().invoke(args=["idem", command])
            assert result.exit_code == 0, result.output
            with app.app_context():
                idem.check_layout()
    finally:
        for app in built:
            close_pool(app)


def test_older_layout_than_the_code_runs_on(
    legacy: str, apps: Callable[..., Flask], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code that needs layout 2 refuses layout 1 and names `flask idem migrate`; after it, it serves."""
    monkeypatch.setattr(_layout, "REQUIRED", 2)
    app = apps(IDEM_TABLE=legacy)
    with caplog.at_level(logging.ERROR, "flask_idem"):
        refused = post(app, "/notes", uuid.uuid4(), {"body": "old"})
    assert refused.status_code == 503
    assert "has layout 1, older than this flask-idem runs on (2 to" in caplog.text
    assert "Upgrade it with 'flask idem migrate'" in caplog.text
    assert migrate(app).exit_code == 0
    assert post(app, "/notes", uuid.uuid4(), {"body": "old"}).status_code == 201


def test_older_layout_it_runs_on_is_served_with_a_warning(
    legacy: str, apps: Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    """This code runs on layout 1 (layout 2 only adds an index): it serves, and says once to migrate."""
    app = apps(IDEM_TABLE=legacy)
    with caplog.at_level(logging.WARNING, "flask_idem"):
        for body in ("a", "b"):
            assert post(app, "/notes", uuid.uuid4(), {"body": body}).status_code == 201
    warnings = [r for r in caplog.records if "run 'flask idem migrate' to upgrade" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("alembic", "names", "not_named"),
    [
        (False, ["'flask idem migrate'"], "'flask db upgrade'"),
        (True, ["'flask db upgrade' (Flask-Migrate)", "'alembic upgrade heads'"], "'flask idem migrate'"),
    ],
    ids=["flask-idem", "alembic"],
)
def test_older_layout_names_the_command_of_the_path_the_project_uses(
    legacy: str,
    apps: Callable[..., Flask],
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    alembic: bool,
    names: list[str],
    not_named: str,
) -> None:
    """With an `alembic_version` table in the search path (a Flask-Migrate or Alembic project), the
    warning of an older layout, its refusal, and the enqueue's need for layout 3 name Alembic's upgrade,
    which keeps `alembic_version` in step; without one, `flask idem migrate`."""
    if alembic:
        db.execute("CREATE TABLE alembic_version (version_num varchar(32) NOT NULL PRIMARY KEY)")
    try:
        app = apps(IDEM_TABLE=legacy)
        with caplog.at_level(logging.WARNING, "flask_idem"):
            assert post(app, "/notes", uuid.uuid4(), {"body": "old"}).status_code == 201
        with app.app_context(), app.extensions["idem"].source.connection() as conn:
            found = _layout.read(conn, legacy)
        with pytest.raises(ConfigurationError) as jobs:
            _layout.check_jobs(found, legacy)
        monkeypatch.setattr(_layout, "REQUIRED", 2)
        messages = [caplog.text, _layout.problem(found, legacy) or "", str(jobs.value)]
    finally:
        db.execute("DROP TABLE IF EXISTS alembic_version")
    assert "It runs on both; run " in caplog.text
    for message in messages:
        assert all(name in message for name in names), message
        assert not_named not in message


# -- a key table changed by hand ---------------------------------------------------------------------------


def test_the_columns_the_code_uses_are_the_key_tables(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """`_layout.columns(latest)`, what the layout check compares and what its message adds back, is the key
    table's columns as the revisions make them: a table made from it has the same names, types, nullity
    and defaults, in the same order."""
    _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED)
    wanted = _layout.columns(_layout.latest())
    columns = ", ".join(f"{name} {definition}" for name, definition in wanted.items())
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
    """`migrate --grant ROLE` grants SELECT, INSERT, UPDATE, DELETE on the key table, and nothing else."""
    role = f"idem_grant_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    try:
        result = migrate(apps(IDEM_TABLE=fresh), "--grant", role)
        assert result.exit_code == 0, result.output
        granted = db.execute(
            "SELECT array_agg(privilege_type::text ORDER BY privilege_type)"
            " FROM information_schema.role_table_grants WHERE grantee = %s AND table_name = %s",
            (role, fresh),
        ).fetchone()
        assert granted == (["DELETE", "INSERT", "SELECT", "UPDATE"],)
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- what layout 2 is for ----------------------------------------------------------------------------------


@pytest.mark.skipif(citus.ENABLED, reason="Citus claims organisation by organisation, with other plans")
def test_claim_reads_only_due_rows_on_layout_2(
    legacy: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """With 5,000 stranded requests backing off and 3 due, the recovery claim reads them all on layout 1
    and only the due ones through layout 2's index (its plan names the index: the claim statement and
    the index's expression must stay in step). Prints the buffers each plan touched."""
    from flask_idem._store import Store

    keys = sql.Identifier(legacy)
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
    claim = Store(None, table=legacy, layout=2)._sql.claim  # type: ignore[arg-type]  # the statement only
    params = {
        "token": uuid.uuid4(),
        "lease": 30.0,
        "limit": 1,
        "deadline": 3600.0,
        "flows": ["notes.transfer"],
    }

    def explain() -> tuple[str, int]:
        with db.transaction(force_rollback=True):
            rows = db.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim, params).fetchone()
        assert rows is not None
        tree = rows[0][0]["Plan"]
        text = str(tree)
        return text, int(tree.get("Shared Hit Blocks", 0)) + int(tree.get("Shared Read Blocks", 0))

    before, blocks_before = explain()
    to_layout_2 = _layout.revisions()[:2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_layout, "revisions", lambda: to_layout_2)
        _migrate.upgrade(direct_database_url, table=legacy)
    assert layout_of(db, legacy) == 2
    after, blocks_after = explain()
    print(
        f"\nclaim with 5,000 rows backing off: {blocks_before} buffers on layout 1,"
        f" {blocks_after} on layout 2"
    )
    assert f"{legacy}_due_idx" not in before
    assert f"{legacy}_due_idx" in after
    assert blocks_after < blocks_before


def test_column_revision_gives_way_to_a_long_transaction(
    legacy: str, direct_database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A revision that adds a column needs an instant of ACCESS EXCLUSIVE. Behind a long transaction
    it waits at most the lock timeout, lets the writers queued behind it through, and tries again; it
    rewrites nothing (a constant default)."""
    _migrate.upgrade(direct_database_url, table=legacy, distributed=citus.ENABLED)
    column = _layout.Revision(
        layout=_layout.latest() + 1,
        compatible_from=1,
        summary="a column, for this test",
        sql="ALTER TABLE {table} ADD COLUMN IF NOT EXISTS test_policy text NOT NULL DEFAULT 'strict'",
    )
    with_column = (*_layout.revisions(), column)
    monkeypatch.setattr(_layout, "revisions", lambda: with_column)
    keys = sql.Identifier(legacy)
    insert = sql.SQL(
        "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
        " VALUES (1, gen_random_uuid(), sha256('x'), 'POST', '/x', 'completed', '{{}}', now())"
    ).format(keys)
    relfilenode = sql.SQL("SELECT pg_relation_filenode({})").format(sql.Literal(legacy))
    file_before = db.execute(relfilenode).fetchone()
    lines: list[str] = []
    reports: list[_migrate.Report] = []
    with psycopg.connect(direct_database_url) as holder, psycopg.connect(direct_database_url) as writer:
        holder.execute(insert)  # a long transaction that wrote to the table
        thread = threading.Thread(
            target=lambda: reports.append(
                _migrate.upgrade(
                    direct_database_url,
                    table=legacy,
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
    assert layout_of(db, legacy) == column.layout
    assert db.execute(relfilenode).fetchone() == file_before  # no rewrite
    policies = db.execute(sql.SQL("SELECT DISTINCT test_policy FROM {}").format(keys)).fetchall()
    assert policies == [("strict",)]


def test_upgrade_stops_at_the_layout_asked(
    fresh: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """``to`` applies the revisions up to that layout only; the next call goes on from there, and a
    layout this release does not have is refused before anything is done."""
    for wrong in (0, _layout.latest() + 1):
        with pytest.raises(ValueError, match=f"no layout {wrong}"):
            _migrate.upgrade(direct_database_url, table=fresh, to=wrong)
    assert layout_of(db, fresh) is None
    first = _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, to=2)
    assert (first.applied, first.after, layout_of(db, fresh)) == ([1, 2], 2, 2)
    second = _migrate.upgrade(direct_database_url, table=fresh, distributed=citus.ENABLED, to=3)
    assert (second.applied, second.after, layout_of(db, fresh)) == ([3], 3, 3)
    assert db.execute("SELECT to_regclass(%s)", (fresh + "_outbox",)).fetchone() == (fresh + "_outbox",)
    assert db.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", (fresh,)).fetchone() == ("r",)
