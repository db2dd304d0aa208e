"""The machinery for future layouts, proven on a layout no release has: layout 2 of the test suite
(``tests/support/second_layout/v2_labels.py``: a nullable column on the partitioned key table and a new
table, with its grants and an index built concurrently), applied while the code of layout 1 serves.

The application runs here, in this process, as the code of layout 1 (this process never imports layout
2), under a role that does not own the tables and got exactly ``flask idem migrate --grant``. Several
threads send it fresh keys and replays of stored ones while the newer release's migration runs in a
process of its own, as a deployment runs it: ``flask idem migrate`` from an application that knows
layout 2 (``tests/support/newer_release.py``), or ``alembic upgrade heads`` in the plain Alembic project
of the upgrades page with the test's revision folder in ``version_locations``. With
``FLASK_IDEM_TEST_PGBOUNCER=1`` the migration and a second application go through PgBouncer (which logs
every client in as the server's superuser, so the role's application connects directly); with
``FLASK_IDEM_TEST_CITUS=1`` everything runs on the Citus coordinator and the tables are distributed.
"""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from flask_idem import _layout, _migrate, _partitions

from .support import citus
from .support.alembic_project import PLAIN_ALEMBIC, alembic, deployed, plain_project
from .support.helpers import app_factory, wait_for
from .support.layouts import drop, layout_of
from .support.notes_app import ORG, build_app
from .support.servers import ROOT

pytestmark = pytest.mark.slow

#: The key table of these tests (its outbox, tombstones and layout 2's labels table follow its name).
TABLE = "second_keys"
#: What layout 2 adds, named here without importing it: this process is the code of layout 1.
COLUMN, NEW_TABLE = "client_note", TABLE + "_labels"
#: The test's revisions, for Alembic's version_locations.
SECOND_LAYOUT = ROOT / "tests" / "support" / "second_layout"
#: Keys stored before the migration, threads sending requests, and requests each side of it.
STORED, THREADS, REQUESTS = 30, 4, 40
DML = ("SELECT", "INSERT", "UPDATE", "DELETE")


@pytest.fixture(scope="module")
def app_role(direct_database_url: str, database_url: str) -> Iterator[str]:
    """A login role that owns nothing, with DML on the notes table the view writes; its name."""
    role = "idem_second_" + conninfo_to_dict(direct_database_url)["dbname"].removeprefix("flask_idem_test_")
    ident = sql.Identifier(role)
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(ident))
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON notes TO {}").format(ident))
        conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE notes_id_seq TO {}").format(ident))
    yield role
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def drop_all(url: str) -> None:
    """The test's tables, layout 2's included, and Alembic's history."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}, alembic_version").format(sql.Identifier(NEW_TABLE)))
    drop(url, TABLE)


@pytest.fixture
def clean(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[None]:
    drop_all(direct_database_url)
    yield
    drop_all(direct_database_url)


@dataclass
class Load:
    """Requests from several threads to the applications of layout 1 while the migration runs: fresh
    keys, and replays of keys stored before and during the run."""

    apps: list[Flask]
    #: Each key's first answer (its status and body), by key.
    first: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    #: Every request that was not answered as it should be (anything but 201 new, 200 replayed).
    errors: list[str] = field(default_factory=list)
    replays: int = 0
    done: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, app: Flask, key: str) -> Any:
        return app.test_client().post("/notes", json={"body": key}, headers={**ORG, "Idempotency-Key": key})

    def fresh(self, app: Flask) -> None:
        key = str(uuid.uuid4())
        answer = self.send(app, key)
        with self.lock:
            if answer.status_code == 201:
                self.first[key] = (201, answer.data)
            else:
                self.errors.append(f"new key {key}: {answer.status_code} {answer.data[:300]!r}")

    def replay(self, app: Flask, key: str) -> None:
        answer = self.send(app, key)
        with self.lock:
            self.replays += 1
            expected = self.first[key][1]
            if answer.status_code != 200 or answer.data != expected:
                self.errors.append(f"replay of {key}: {answer.status_code} {answer.data[:300]!r}")

    def worker(self, number: int) -> None:
        rng = uuid.uuid4().int
        turn = 0
        while not self.stop.is_set():
            app = self.apps[(number + turn) % len(self.apps)]
            try:
                if turn % 2 == 0:
                    self.fresh(app)
                else:
                    with self.lock:
                        keys = list(self.first)
                    self.replay(app, keys[(rng + turn * 7919) % len(keys)])
            except Exception as e:  # reported by the test
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
            turn += 1
            with self.lock:
                self.done += 1

    def during(self, migration: Callable[[], None]) -> None:
        """Store keys, then run ``migration`` while the threads send requests, REQUESTS of them before
        it starts and REQUESTS more after it is done."""
        for _ in range(STORED):
            self.fresh(self.apps[0])
        threads = [threading.Thread(target=self.worker, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: self.done >= REQUESTS, timeout=120)
            before = self.done
            migration()
            after = self.done
            wait_for(lambda: self.done >= after + REQUESTS, timeout=120)
            print(
                f"\n{before} requests before the migration, {after - before} while it ran,"
                f" {self.done - after} after; {self.replays} replays, {len(self.first)} keys"
            )
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(60)


def newer_migrate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``flask idem migrate ARGS`` of the release that knows layout 2, in a process of its own."""
    app = "tests.support.newer_release:create_app"
    return deployed(
        ROOT, url, "flask", "--app", app, "idem", "migrate", *args, env={"FLASK_IDEM_TABLE": TABLE}
    )


def alembic_project(directory: Path) -> Path:
    """The upgrades page's plain Alembic project, with the test's revision folder after flask-idem's."""
    ini = (PLAIN_ALEMBIC / "alembic.ini").read_text()
    ini = ini.replace(" flask_idem:migrations", f" flask_idem:migrations {SECOND_LAYOUT}")
    return plain_project(directory, ini=ini)


def check_privileges(db: psycopg.Connection[Any], role: str, role_url: str) -> None:
    """The role may read and write every table of layout 2, and reaches the rows of every partition of
    the key table and of its tombstones through them (the application names no partition); layout 2's
    column is on every partition."""
    for table in (TABLE, TABLE + "_tombstones", TABLE + "_outbox", NEW_TABLE):
        held = [
            privilege
            for privilege in DML
            if db.execute("SELECT has_table_privilege(%s, %s, %s)", (role, table, privilege)).fetchone()
            == (True,)
        ]
        assert held == list(DML), table
    with psycopg.connect(role_url) as as_role:
        for parent in (TABLE, TABLE + "_tombstones"):
            for partition in _partitions.partitions(db, parent):
                where = sql.SQL("expires_at >= {} AND expires_at < {}").format(
                    sql.Literal(partition.lower) if partition.lower else sql.SQL("'-infinity'"),
                    sql.Literal(partition.upper) if partition.upper else sql.SQL("'infinity'"),
                )
                through = sql.SQL("SELECT count(*) FROM {} WHERE ").format(sql.Identifier(parent)) + where
                direct = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(partition.name))
                assert as_role.execute(through).fetchone() == db.execute(direct).fetchone(), partition.name
                if parent == TABLE:
                    column = db.execute(
                        "SELECT count(*) FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s",
                        (partition.name, COLUMN),
                    ).fetchone()
                    assert column == (1,), partition.name


def check_keys(load: Load, db: psycopg.Connection[Any]) -> None:
    """No error; every key's view ran once: one row per key in the key table, one note per key."""
    assert load.errors == []
    assert load.replays >= REQUESTS
    rows = db.execute(
        sql.SQL("SELECT idem_key::text, count(*) FROM {} GROUP BY 1").format(sql.Identifier(TABLE))
    ).fetchall()
    assert {key: 1 for key in load.first} == dict(rows)
    notes = db.execute("SELECT body FROM notes WHERE body = ANY(%s)", (list(load.first),)).fetchall()
    assert sorted(body for (body,) in notes) == sorted(load.first)


@pytest.mark.parametrize("path", ["migrate", "alembic"])
def test_layout_2_applied_under_load_by_the_newer_release(
    path: str,
    clean: None,
    app_role: str,
    direct_database_url: str,
    database_url: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    """Layout 2 applied by `flask idem migrate` (or Alembic's `upgrade heads`) while the code of layout 1
    serves, under a role that owns nothing, fresh keys and replays from several threads: no error (no 500
    nor 503), every key stored before and during the run replays its first answer, each key's view ran
    once; then the role holds its privileges on every table, layout 2's new one included, and reaches
    every partition, those purge makes after the upgrade included; the code of layout 1 starts again on
    layout 2 and serves, and the newer release finds nothing to do."""
    project = alembic_project(tmp_path / "project") if path == "alembic" else None
    env = {"FLASK_IDEM_TABLE": TABLE}
    if project is not None:
        made = alembic(project, database_url, "upgrade", _layout.alembic_id(1), env=env)
        assert made.returncode == 0, made.stderr
    else:
        _migrate.upgrade(database_url, table=TABLE, distributed=citus.ENABLED)
    assert layout_of(db, TABLE) == 1
    role_url = make_conninfo(direct_database_url, user=app_role)
    with app_factory(lambda url: build_app(url, IDEM_TABLE=TABLE, IDEM_DISTRIBUTED=citus.ENABLED)[0]) as make:
        owner = make(url=database_url)
        granted = owner.test_cli_runner().invoke(args=["idem", "migrate", "--grant", app_role])
        assert granted.exit_code == 0, granted.output
        load = Load([make(url=role_url), make(url=database_url)])

        def migration() -> None:
            if project is not None:
                done = alembic(project, database_url, "upgrade", "heads", env=env)
                assert done.returncode == 0, done.stderr
            else:
                done = newer_migrate(database_url)
                assert done.returncode == 0, done.stderr
                assert "now layout 2 (applied 2)" in done.stdout, done.stdout

        load.during(migration)
        assert layout_of(db, TABLE) == _layout.latest() + 1 == 2
        check_keys(load, db)
        if citus.ENABLED:
            distributed = db.execute(
                "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid = %s::regclass", (NEW_TABLE,)
            ).fetchone()
            assert distributed == (1,)

        purged = owner.test_cli_runner().invoke(args=["idem", "purge"])  # partitions made ahead, after
        assert purged.exit_code == 0, purged.output
        assert len(_partitions.partitions(db, TABLE)) > 1
        check_privileges(db, app_role, role_url)

        restarted = make(url=role_url)  # a process of layout 1's code started after the upgrade
        with restarted.app_context():
            restarted.extensions["idem"].check_layout()
        key = str(uuid.uuid4())
        assert load.send(restarted, key).status_code == 201
        assert load.send(restarted, key).status_code == 200
    check = newer_migrate(database_url, "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "at layout 2; the latest layout is 2" in check.stdout
    if project is not None:
        current = alembic(project, database_url, "current", env=env)
        assert current.stdout.split() == [_layout.alembic_id(2), "(head)"], current.stderr
