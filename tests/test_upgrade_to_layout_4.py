"""Layout 3 to layout 4 while the application serves, by both paths users have: ``flask idem migrate`` and
Alembic (``alembic upgrade heads``), each in a process of its own, as a deployment runs them.

The key table starts in layout 3 (the first release's DDL and revisions 2 and 3, or Alembic's revisions 1
to 3), with FILLER finished keys and, written through the application, rows in every state: completed
requests and a completed flow, layout 3's tombstones kept in the row (one with a ``Location``, one
without), a flow in progress under a live lease (its outside call held open across the upgrade), a
stranded flow, and a flow failed and flagged for a person. While WRITERS threads post fresh keys and
retry each (atomic requests and flows), a transaction that wrote to the table stays open until the
upgrade has had to give way to it at least once, and the upgrade runs. Then, on the same application,
not restarted: it has noticed layout 4 by itself (``LAYOUT_RECHECK`` is made short here); every load key
was applied once and replays; every stored key replays with the same status, body and id; the tombstones
answer 303 with their ``Location`` and 410; the held flow finishes, the stranded one is finished by the
recovery job, and the flagged one is still listed by ``flask idem stuck``.

Runs in every mode of the suite: the application reaches PostgreSQL through PgBouncer with
``FLASK_IDEM_TEST_PGBOUNCER=1``, and so do the upgrades (they use the application's URL); on a Citus
cluster with ``FLASK_IDEM_TEST_CITUS=1``.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from psycopg import sql

from flask_idem import Idempotency, _layout, _migrate, _partitions, _state
from flask_idem._connection import Batched
from flask_idem._state import get_state
from flask_idem.flow import Flow, OutcomeUnknown, Run

from .support import citus
from .support.alembic_project import alembic, plain_project
from .support.helpers import close_pool, wait_for
from .support.layouts import catalog, check_distributed, create_first_release, drop, layout_of
from .support.notes_app import ORG, build_app
from .support.partitions import holding
from .support.servers import ROOT

pytestmark = pytest.mark.slow

TABLE = "upgrading_keys"
#: Finished keys written straight into the layout-3 table, so that the upgrade's index build and scans
#: have something to do.
FILLER = 50_000
WRITERS = 4
#: IDEM_MIGRATION_LOCK_TIMEOUT of the upgrades: short, so that the open transaction makes them give way.
LOCK_TIMEOUT = 0.2
#: How often the application reads the layout again while it is older than the newest.
RECHECK = 0.5
#: The amounts that make the ledger lose its answer (the flow is left stranded), or hold its call open.
LOSE, HOLD = 13, 17


class Ledger:
    """The outside party of the payments flow: one entry per key; loses its answer or holds the call open
    for the amounts the test picks."""

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.entered, self.release = threading.Event(), threading.Event()

    def record(self, key: str, amount: int) -> dict[str, Any]:
        with self.lock:
            self.calls[key] += 1
            self.entries.setdefault(key, amount)
        if amount == HOLD:
            self.entered.set()
            self.release.wait(120)
        if amount == LOSE:
            raise OutcomeUnknown("connection reset")
        return {"entry": key, "amount": self.entries[key]}

    def find(self, key: str) -> dict[str, Any] | None:
        with self.lock:
            return {"entry": key, "amount": self.entries[key]} if key in self.entries else None


def build(database_url: str, ledger: Ledger, **config: Any) -> tuple[Flask, Idempotency]:
    """The notes app (atomic ``POST /notes``) with a flow, ``POST /payments``: the intent, a call to
    ``ledger``, and a finish step that writes a note named after the key (``notes.body`` is unique, so a
    key run twice fails)."""
    app, idem = build_app(database_url, **config)
    flow = Flow("upgrade.payment")

    @flow.call(resolve=lambda run: ledger.find(run.derived_key("charge")))
    def charge(run: Run) -> dict[str, Any]:
        return ledger.record(run.derived_key("charge"), run.intent["amount"])

    @flow.finish
    def done(run: Run) -> Any:
        run.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, %s)", (run.org_id, f"paid {run.key}")
        )
        return {"entry": run.results["charge"]["entry"], "amount": run.results["charge"]["amount"]}, 201

    @app.post("/payments")
    @idem.idempotent(flow=flow)
    def pay() -> Any:
        return {"amount": request.get_json()["amount"]}

    return app, idem


def post(app: Flask, path: str, key: uuid.UUID, json: Any) -> Any:
    return app.test_client().post(path, json=json, headers={**ORG, "Idempotency-Key": str(key)})


def cli(app: Flask, *args: str) -> str:
    result = app.test_cli_runner().invoke(args=["idem", *args])
    assert result.exit_code == 0, result.output
    return result.output


def age(db: psycopg.Connection[Any], key: uuid.UUID, interval: str) -> None:
    """Move one key's expiry ``interval`` into the past (epoch arithmetic: Citus refuses the other)."""
    db.execute(
        sql.SQL(
            "UPDATE {} SET expires_at = to_timestamp(extract(epoch FROM expires_at - 'epoch'::timestamptz)"
            " - extract(epoch FROM %s::interval)) WHERE org_id = 1 AND idem_key = %s"
        ).format(sql.Identifier(TABLE)),
        (interval, key),
    )


def set_row(db: psycopg.Connection[Any], key: uuid.UUID, assignments: str) -> None:
    db.execute(
        sql.SQL("UPDATE {} SET {} WHERE org_id = 1 AND idem_key = %s").format(
            sql.Identifier(TABLE),
            sql.SQL(assignments),  # type: ignore[arg-type]  # the test's own constants
        ),
        (key,),
    )


# -- the two paths ------------------------------------------------------------------------------------------


@dataclass
class Upgrade:
    """One way of upgrading: how the layout-3 table is made, and the command that upgrades it."""

    name: str
    url: str
    project: Path | None = None

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FLASK_IDEM_DATABASE_URL": self.url,
            "FLASK_IDEM_TABLE": TABLE,
            "FLASK_IDEM_MIGRATION_LOCK_TIMEOUT": str(LOCK_TIMEOUT),
        }

    def make_layout_3(self, direct_url: str) -> None:
        if self.project is None:
            create_first_release(direct_url, TABLE, distributed=citus.ENABLED)
            to_layout_3 = _layout.revisions()[:3]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_layout, "revisions", lambda: to_layout_3)
                _migrate.upgrade(direct_url, table=TABLE, distributed=citus.ENABLED)
        else:
            made = alembic(self.project, self.url, "upgrade", _layout.alembic_id(3), env=self.env())
            assert made.returncode == 0, made.stderr

    def start_upgrade(self) -> subprocess.Popen[str]:
        if self.project is None:
            command = [sys.executable, "-m", "flask", "--app", "tests.support.notes_app:create_app"]
            return subprocess.Popen(
                [*command, "idem", "migrate"],
                cwd=ROOT,
                env=self.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        return subprocess.Popen(
            [sys.executable, "-m", "alembic", "upgrade", "heads"],
            cwd=self.project,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.fixture(params=["migrate", "alembic"])
def path(
    request: pytest.FixtureRequest,
    database_url: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
) -> Iterator[Upgrade]:
    """The upgrade's path, with the key table TABLE made in layout 3 by it; dropped afterwards (with
    Alembic's ``alembic_version``)."""
    drop(direct_database_url, TABLE)
    project = plain_project(tmp_path / "project") if request.param == "alembic" else None
    chosen = Upgrade(request.param, database_url, project)
    try:
        chosen.make_layout_3(direct_database_url)
        assert layout_of(db, TABLE) == 3
        yield chosen
    finally:
        drop(direct_database_url, TABLE)
        db.execute("DROP TABLE IF EXISTS alembic_version")


# -- the load ------------------------------------------------------------------------------------------------


@dataclass
class Load:
    """Fresh keys posted and retried by WRITERS threads, atomic requests and flows in turn."""

    app: Flask
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Every answer: (path, status, problem type or None, Retry-After or None).
    answers: list[tuple[str, int, str | None, str | None]] = field(default_factory=list)
    #: Each key done, by path, with the body of its first 2xx.
    done: dict[uuid.UUID, tuple[str, Any]] = field(default_factory=dict)

    def run(self, number: int) -> None:
        for turn in itertools.count():
            if self.stop.is_set():
                return
            path = "/notes" if (number + turn) % 2 else "/payments"
            key = uuid.uuid4()
            body = {"body": f"load {key}"} if path == "/notes" else {"amount": 5}
            first = None
            for _ in range(50):  # until it succeeds (a 409 or a documented 503 is retried), then again
                answer = post(self.app, path, key, body)
                problem = answer.json.get("type") if answer.is_json and answer.status_code >= 400 else None
                with self.lock:
                    self.answers.append(
                        (path, answer.status_code, problem, answer.headers.get("Retry-After"))
                    )
                if answer.status_code < 300:
                    if first is not None:
                        break
                    first = answer.json
                elif answer.status_code not in (409, 503):
                    break
            if first is not None:
                with self.lock:
                    self.done[key] = (path, first)

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self.run, args=(n,)) for n in range(WRITERS)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def hold_until_given_way(
    url: str, stop: threading.Event, holding: threading.Event, waited: threading.Event
) -> None:
    """Keep a transaction that wrote to the key table open until the upgrade's first statement has
    waited for it (``waited``), and then longer than its lock timeout: it gives way, and tries again."""
    with psycopg.connect(url) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
                " VALUES (2, gen_random_uuid(), sha256('x'), 'POST', '/x', 'completed', '{{}}',"
                " now() + interval '1 day')"
            ).format(sql.Identifier(TABLE))
        )
        pid = conn.info.backend_pid
        holding.set()
        with psycopg.connect(url, autocommit=True) as watcher:
            blocked = (
                "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))"
                " AND query ILIKE '%%ADD COLUMN IF NOT EXISTS task%%')"
            )
            while not stop.is_set():
                if watcher.execute(blocked, (pid,)).fetchone() == (True,):
                    waited.set()
                    break
                time.sleep(0.01)
        time.sleep(3 * LOCK_TIMEOUT)
        conn.commit()


# -- the test ------------------------------------------------------------------------------------------------


def test_upgrade_from_layout_3_under_load(
    path: Upgrade,
    database_url: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layout 3, rows in every state, upgraded to layout 4 by `flask idem migrate` or Alembic while
    fresh keys are posted and retried, and a transaction stays open across its first statement: no 5xx
    but the documented 503, no key run twice or lost, every stored key and tombstone answered as before,
    the flows in progress finished, the flagged one still listed; the application switched by itself."""
    monkeypatch.setattr(_state, "LAYOUT_RECHECK", RECHECK)
    keys = sql.Identifier(TABLE)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
            " SELECT i %% 50 + 100, gen_random_uuid(), sha256(i::text::bytea), 'POST', '/notes', 'completed',"
            " '{{\"status\": 201}}', now() + interval '1 day' FROM generate_series(1, %s) AS i"
        ).format(keys),
        (FILLER,),
    )
    ledger = Ledger()
    app, _ = build(
        database_url, ledger, IDEM_TABLE=TABLE, IDEM_LEASE_TIMEOUT=120, IDEM_POOL_MAX_SIZE=WRITERS + 4
    )
    state = get_state(app)
    held: list[Any] = []
    holder: threading.Thread | None = None
    try:
        # -- rows in every state, written by the application on layout 3 ---------------------------------
        stored = {
            key: post(app, "/notes", key, {"body": f"stored {key}"}) for key in (uuid.uuid4(), uuid.uuid4())
        }
        paid = uuid.uuid4()
        stored[paid] = post(app, "/payments", paid, {"amount": 3})
        tomb_303, tomb_410 = uuid.uuid4(), uuid.uuid4()
        gone_303 = post(app, "/notes", tomb_303, {"body": "tomb 303"})
        assert post(app, "/notes/replayable", tomb_410, {"body": "tomb 410"}).status_code == 201
        assert all(answer.status_code == 201 for answer in (*stored.values(), gone_303))
        age(db, tomb_303, "25 hours")
        age(db, tomb_410, "25 hours")
        assert cli(app, "purge").strip() == "Purged 0 expired key(s); 2 turned into tombstones."

        stranded, flagged = uuid.uuid4(), uuid.uuid4()
        for key in (flagged, stranded):
            assert post(app, "/payments", key, {"amount": LOSE}).status_code == 503  # answer lost
        set_row(db, stranded, "next_attempt_at = now() + interval '1 hour'")
        set_row(db, flagged, "next_attempt_at = now(), created_at = now() - interval '2 hours'")
        assert "1 failed" in cli(app, "recover")  # past IDEM_RECOVERY_DEADLINE: failed and flagged

        live = uuid.uuid4()
        runner = threading.Thread(target=lambda: held.append(post(app, "/payments", live, {"amount": HOLD})))
        runner.start()
        assert ledger.entered.wait(30)  # its outside call is running, under its lease

        before = {
            key: post(app, "/notes" if key != paid else "/payments", key, body(key, paid)) for key in stored
        }
        statuses = dict(db.execute(sql.SQL("SELECT idem_key, status FROM {} WHERE org_id = 1").format(keys)))
        assert statuses == {
            **dict.fromkeys(stored, "completed"),
            tomb_303: "completed",
            tomb_410: "completed",
            stranded: "processing",
            flagged: "failed",
            live: "processing",
        }
        assert not state.store.partitioned and layout_of(db, TABLE) == 3

        # -- the upgrade, under load ---------------------------------------------------------------------
        stop, holding, waited = threading.Event(), threading.Event(), threading.Event()
        holder = threading.Thread(
            target=hold_until_given_way, args=(direct_database_url, stop, holding, waited)
        )
        with Load(app) as load:
            time.sleep(0.5)
            holder.start()
            assert holding.wait(30)
            upgrade = path.start_upgrade()
            output, _ = upgrade.communicate(timeout=300)
            stop.set()
            holder.join(30)
            assert upgrade.returncode == 0, output
            assert waited.is_set()  # it met the open transaction, and gave way to it
            wait_for(lambda: state.store.partitioned, timeout=30)  # noticed by the load's requests
            time.sleep(2 * RECHECK)

        # -- what the upgrade made --------------------------------------------------------------------
        assert layout_of(db, TABLE) == 4
        assert state.layout_checked.is_set()
        made = catalog(db, TABLE)
        assert not any("INVALID" in index for index in made["indexes"])
        first = catalog(db, TABLE + "_p0")
        assert not any("INVALID" in index for index in first["indexes"])
        unique = [index for index in first["indexes"] if index.startswith("CREATE UNIQUE")]
        assert sorted(index.split(" USING ")[1] for index in unique) == [
            "btree (org_id, idem_key)",  # its primary key, kept
            "btree (org_id, idem_key, expires_at)",  # built concurrently, taken over: no second one
        ], unique
        if citus.ENABLED:
            check_distributed(db, TABLE)
        if path.project is not None:
            current = alembic(path.project, path.url, "current", env=path.env())
            assert current.stdout.split() == [_layout.alembic_id(4), "(head)"], current.stderr

        # -- the load: no 5xx but the documented 503, nothing run twice, nothing lost -----------------
        answered = Counter(status for _, status, _, _ in load.answers)
        print(f"\n{path.name}: {len(load.done)} keys under load, answers {dict(answered)}")
        assert set(answered) <= {200, 201, 409, 503}, answered
        for _, status, problem, retry_after in load.answers:
            if status == 503:
                assert problem == "urn:flask-idem:problem:store-unavailable" and retry_after is not None
        assert sum(1 for _, status, _, _ in load.answers if status == 201) == len(load.done)
        notes = dict(
            db.execute(
                "SELECT body, count(*) FROM notes WHERE body LIKE 'load %' OR body LIKE 'paid %'"
                " GROUP BY body"
            ).fetchall()
        )
        wanted = {
            (f"load {key}" if where == "/notes" else f"paid {key}"): 1
            for key, (where, _) in load.done.items()
        }
        assert {text: n for text, n in notes.items() if text != f"paid {paid}"} == wanted
        assert all(n == 1 for n in ledger.calls.values()), ledger.calls
        rows = db.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE idem_key = ANY(%s)").format(keys), (list(load.done),)
        ).fetchone()
        assert rows == (len(load.done),)
        for key, (where, first_body) in load.done.items():
            replay = post(app, where, key, body_of(where, key))
            assert (replay.status_code, replay.json) == (200, first_body)

        # -- every key stored before: the same answer ------------------------------------------------
        for key, answer in before.items():
            again = post(app, "/notes" if key != paid else "/payments", key, body(key, paid))
            assert (
                (again.status_code, again.json)
                == (answer.status_code, answer.json)
                == (200, stored[key].json)
            )
            assert again.headers["Idempotent-Replayed"] == "true"
        assert post(app, "/notes", next(iter(stored)), {"body": "changed"}).status_code == 422
        see_other = post(app, "/notes", tomb_303, {"body": "tomb 303"})
        assert (see_other.status_code, see_other.headers["Location"]) == (303, gone_303.headers["Location"])
        assert post(app, "/notes/replayable", tomb_410, {"body": "tomb 410"}).status_code == 410

        # -- the flows: in progress, stranded, flagged ---------------------------------------------------
        busy = post(app, "/payments", live, {"amount": HOLD})
        assert busy.status_code == 409 and "Retry-After" in busy.headers
        ledger.release.set()
        runner.join(60)
        [finished] = held
        assert finished.status_code == 201, finished.json
        assert (post(app, "/payments", live, {"amount": HOLD}).json) == finished.json

        set_row(db, stranded, "next_attempt_at = now()")
        assert f"completed org=1 key={stranded} answered 201" in cli(app, "recover")
        recovered = post(app, "/payments", stranded, {"amount": LOSE})
        assert (recovered.status_code, recovered.json["amount"]) == (200, LOSE)

        assert f"NEEDS ATTENTION org=1 key={flagged}" in cli(app, "stuck")
        assert post(app, "/payments", flagged, {"amount": LOSE}).status_code == 500  # its stored answer
        assert all(n == 1 for n in ledger.calls.values()), ledger.calls
        assert db.execute("SELECT count(*) FROM notes WHERE body LIKE 'paid %'").fetchone() == (
            sum(1 for where, _ in load.done.values() if where == "/payments") + 3,  # paid, live, stranded
        )
    finally:
        ledger.release.set()
        close_pool(app)
        if holder is not None and holder.is_alive():
            holder.join(30)


def body(key: uuid.UUID, paid: uuid.UUID) -> dict[str, Any]:
    """The body of a stored key's first request, to send again."""
    return {"amount": 3} if key == paid else {"body": f"stored {key}"}


def body_of(path: str, key: uuid.UUID) -> dict[str, Any]:
    """The body of a load key's request."""
    return {"body": f"load {key}"} if path == "/notes" else {"amount": 5}


@pytest.fixture
def layout_3(database_url: str, direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """TABLE made in layout 3 (the first release's DDL, then revisions 2 and 3); dropped afterwards."""
    drop(direct_database_url, TABLE)
    try:
        Upgrade("migrate", database_url).make_layout_3(direct_database_url)
        yield TABLE
    finally:
        drop(direct_database_url, TABLE)


@pytest.mark.parametrize("recheck", [RECHECK, 3600.0], ids=["read-again-soon", "read-again-in-an-hour"])
def test_a_running_application_notices_layout_4_by_itself(
    layout_3: str,
    recheck: float,
    database_url: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An application that found layout 3 reads the layout again every LAYOUT_RECHECK seconds: after the
    upgrade it switches to layout 4's statements by itself, without a restart, and says so once. Until
    it does (here, with an hour between reads), its statements of layout 3 serve on the partitioned
    table: fresh keys of atomic requests and flows are taken, in the first partition, and keys replay."""
    monkeypatch.setattr(_state, "LAYOUT_RECHECK", recheck)
    ledger = Ledger()
    app, _ = build(database_url, ledger, IDEM_TABLE=layout_3)
    state = get_state(app)
    try:
        stored = uuid.uuid4()
        first = post(app, "/notes", stored, {"body": f"stored {stored}"})
        assert first.status_code == 201
        assert not state.store.partitioned
        _migrate.upgrade(direct_database_url, table=layout_3, distributed=citus.ENABLED)
        assert layout_of(db, layout_3) == 4

        fresh: list[uuid.UUID] = []

        def serve() -> bool:
            key, payment = uuid.uuid4(), uuid.uuid4()
            fresh.extend((key, payment))
            note = post(app, "/notes", key, {"body": f"fresh {key}"})
            assert note.status_code == 201, note.json
            paid = post(app, "/payments", payment, {"amount": 5})
            assert paid.status_code == 201, paid.json
            replay = post(app, "/notes", stored, {"body": f"stored {stored}"})
            assert (replay.status_code, replay.json) == (200, first.json)
            return state.store.partitioned

        with caplog.at_level(logging.INFO, "flask_idem"):
            if recheck == RECHECK:
                wait_for(serve, timeout=30)
                assert state.layout_checked.is_set()
            else:
                for _ in range(3):
                    assert not serve()
        switched = [r for r in caplog.records if "was upgraded to layout 4" in r.getMessage()]
        assert len(switched) == (1 if recheck == RECHECK else 0)
        expiries = db.execute(
            sql.SQL("SELECT expires_at FROM {} WHERE idem_key = ANY(%s)").format(sql.Identifier(layout_3)),
            (fresh,),
        ).fetchall()
        where = {holding(db, layout_3, expires_at).name for (expires_at,) in expiries}
        assert where == {layout_3 + "_p0"}  # every key expiring before its bound goes there
        assert all(n == 1 for n in ledger.calls.values()) and len(ledger.calls) == len(fresh) // 2
    finally:
        close_pool(app)


def test_the_first_partition_is_retired_like_any_other(
    layout_3: str, database_url: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Once its bound has passed, `purge`'s retirement takes the first partition of an upgraded table
    (the layout-3 table, from MINVALUE, with its own primary key) as any other: kept while a flow in it
    is in progress; then its finished keys become compact tombstones (303 with their Location, 410), its
    flagged row moves to a live partition (still listed by `stuck`, still answered), and it is detached
    and dropped. Partitions of a second, ahead for five, so that the test waits seconds, not a day."""
    ledger = Ledger()
    old, _ = build(database_url, ledger, IDEM_TABLE=layout_3)
    located, plain, stranded, flagged = (uuid.uuid4() for _ in range(4))
    try:
        first = post(old, "/notes", located, {"body": "located"})
        assert first.status_code == 201
        assert post(old, "/notes/replayable", plain, {"body": "plain"}).status_code == 201
        for key in (flagged, stranded):
            assert post(old, "/payments", key, {"amount": LOSE}).status_code == 503  # answer lost
        set_row(db, flagged, "next_attempt_at = now(), created_at = now() - interval '2 hours'")
        assert "1 failed" in cli(old, "recover")
    finally:
        close_pool(old)
    for key in (located, plain, stranded, flagged):
        age(db, key, "25 hours")  # past retention, within the tombstones' 30 days
    _migrate.upgrade(direct_database_url, table=layout_3, distributed=citus.ENABLED, horizon=1.0)
    [first_partition] = _partitions.partitions(db, layout_3)
    assert first_partition.lower is None and first_partition.upper is not None

    def retire() -> _partitions.RetentionReport:
        return _partitions.maintain(
            direct_database_url, table=layout_3, interval=1.0, horizon=5.0, tombstone_ttl=30 * 86400.0
        )

    wait_for(
        lambda: (
            db.execute("SELECT now() > %s + interval '1 second'", (first_partition.upper,)).fetchone()
            == (True,)
        )
    )
    kept = retire()
    assert kept.kept == [(layout_3 + "_p0", "1 multi-step request(s) still in progress")]
    assert kept.dropped == [] and kept.tombstoned == 0 and kept.moved == 0

    app, _ = build(database_url, ledger, IDEM_TABLE=layout_3)
    try:
        set_row(db, stranded, "next_attempt_at = now()")
        assert f"completed org=1 key={stranded} answered 201" in cli(app, "recover")
        report = retire()
        assert layout_3 + "_p0" in report.dropped
        assert (report.tombstoned, report.moved) == (3, 1)  # located, plain, stranded; flagged
        assert layout_3 + "_p0" not in {part.name for part in _partitions.partitions(db, layout_3)}

        see_other = post(app, "/notes", located, {"body": "located"})
        assert (see_other.status_code, see_other.headers["Location"]) == (303, first.headers["Location"])
        assert post(app, "/notes/replayable", plain, {"body": "plain"}).status_code == 410
        assert post(app, "/payments", stranded, {"amount": LOSE}).status_code == 410
        assert post(app, "/notes", located, {"body": "other"}).status_code == 422
        assert f"NEEDS ATTENTION org=1 key={flagged}" in cli(app, "stuck")
        assert post(app, "/payments", flagged, {"amount": LOSE}).status_code == 500  # its stored answer
        assert all(n == 1 for n in ledger.calls.values()), ledger.calls
    finally:
        close_pool(app)


def test_a_reservation_keeps_the_statements_it_began_with(
    layout_3: str,
    database_url: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The application switches to layout 4's statements while other requests are in the middle of
    their reservation: each finishes with the statements it began with. Here the switch is made as an
    atomic request's lock and lookup of layout 3 are sent, with BEGIN: the lock's answer is then read as
    theirs, not as a partitioned lock's, which has one column more (a 500 before)."""
    ledger = Ledger()
    app, _ = build(database_url, ledger, IDEM_TABLE=layout_3)
    state = get_state(app)
    try:
        assert post(app, "/notes", uuid.uuid4(), {"body": "before"}).status_code == 201
        assert not state.store.partitioned
        _migrate.upgrade(direct_database_url, table=layout_3, distributed=citus.ENABLED)
        begin_all = Batched.begin_all

        def switching(self: Batched, statements: Any) -> Any:
            state.store.use_layout(4)  # as another request's layout check does, at the worst moment
            return begin_all(self, statements)

        monkeypatch.setattr(Batched, "begin_all", switching)
        key = uuid.uuid4()
        body = {"body": f"switched {key}"}
        answer = post(app, "/notes", key, body)
        assert answer.status_code == 201, answer.json
        assert state.store.partitioned
        monkeypatch.undo()
        replay = post(app, "/notes", key, body)
        assert (replay.status_code, replay.json) == (200, answer.json)
    finally:
        close_pool(app)
