"""The partitioned key table where it breaks: keys whose attempts straddle partition
boundaries, retention that drops partitions while requests run, and no partition for a key's expiry.

Every test runs on a key table of its own (:data:`TABLE`), made by the migration with its first
partition ending a second from now, and partitions of one second each (``IDEM_PARTITION_INTERVAL=1``)
made ahead, and retired, by :func:`flask_idem._partitions.maintain` (what ``flask idem purge`` runs),
so that the attempts of one key land in different partitions, where no unique index stands between
them: what keeps a key once is its advisory lock, taken in a statement of its own before the statement
that looks for the key in every partition and among the compact tombstones.

The design under test (:mod:`flask_idem._partitions`): no default partition (PostgreSQL refuses
``DETACH ... CONCURRENTLY`` with one), partitions made ahead, and a request whose key's expiry has no
partition answered 503; a partition still holding a multi-step request in progress is kept until it
finishes; rows flagged for a person are moved to a live partition.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from flask.testing import FlaskClient
from psycopg import sql

from flask_idem import Idempotency, _migrate, _partitions, _protocol
from flask_idem._partitions import RetentionReport
from flask_idem._partitions.ahead import attach, replace_spare
from flask_idem._partitions.tables import Maintenance, Tables
from flask_idem._protocol import Claim, InFlight, Replay
from flask_idem._records import Final, KeyedRequest, Lease, lock_id
from flask_idem._state import IdemState, get_state
from flask_idem.errors import ConfigurationError
from flask_idem.flow import Flow, OutcomeUnknown, Run

from .support import citus, pgbouncer
from .support.helpers import close_pool, wait_for
from .support.notes_app import org_from_header
from .support.partitions import insert_completed

pytestmark = pytest.mark.skipif(
    citus.ENABLED,
    reason="a local key table rolling partitions of a second: partitions on Citus are tested in"
    " test_citus.py and test_tombstones.py",
)

#: The key table of these tests, apart from the suite's.
TABLE = "part_keys"
#: Seconds of ``expires_at`` one partition covers: a boundary every second.
INTERVAL = 1.0
#: A key's tombstone outlives every test.
TOMB = 60.0
ORG = 1
HEADERS = {"X-Org": str(ORG)}
SHA = b"\x01" * 32


# -- the table, its partitions, and an application on it ----------------------------------------------


def _drop_tables(url: str) -> None:
    """Drop the key table, its tombstones, its outbox, and partitions left detached."""
    with psycopg.connect(url, autocommit=True) as conn:
        names = [f"{TABLE}_outbox", TABLE, f"{TABLE}_tombstones"]
        names += [
            row[0]
            for row in conn.execute(
                "SELECT relname::text FROM pg_class WHERE relkind = 'r' AND relname ~ %s",
                (f"^{TABLE}_[pt][0-9]+$",),
            )
        ]
        for name in names:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def table(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """:data:`TABLE` in the latest layout, its first partition ending a second from now; dropped after."""
    _drop_tables(direct_database_url)
    _migrate.upgrade(direct_database_url, table=TABLE, horizon=1.0, echo=lambda _: None)
    yield TABLE
    _drop_tables(direct_database_url)


def maintain(
    url: str,
    *,
    horizon: float = 6.0,
    tombstone_ttl: float = TOMB,
    interval: float = INTERVAL,
    ahead: float = 0.0,
    now: Callable[[], datetime] | None = None,
) -> RetentionReport:
    """One run of ``flask idem purge``'s work on :data:`TABLE`, as the tables' owner."""
    return _partitions.maintain(
        url,
        table=TABLE,
        interval=interval,
        horizon=horizon,
        tombstone_ttl=tombstone_ttl,
        ahead=ahead,
        now=now,
        echo=lambda _: None,
    )


class Gates:
    """Where a test holds an attempt of a key (in the atomic view, or in the flow's outside call) until
    it lets it go; other attempts sleep a random moment there, so that they overlap."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.held: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def hold(self, key: uuid.UUID) -> threading.Event:
        """Hold the next attempt of ``key`` there; set the event returned to let it go."""
        self.entered[str(key)] = threading.Event()
        self.held[str(key)] = gate = threading.Event()
        return gate

    def wait_entered(self, key: uuid.UUID) -> None:
        assert self.entered[str(key)].wait(15), "the attempt never arrived"

    def pass_(self, key: uuid.UUID | str) -> None:
        gate = self.held.pop(str(key), None)
        if gate is not None:
            self.entered[str(key)].set()
            assert gate.wait(30), "the test never let the attempt go"
        elif self.delay:
            time.sleep(random.uniform(0, self.delay))


class Ledger:
    """The outside party of the flow: counts its calls per key (a second call is a duplicate)."""

    def __init__(self, gates: Gates) -> None:
        self.gates = gates
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.unknown: set[str] = set()

    def record(self, key: uuid.UUID, amount: int) -> dict[str, Any]:
        with self.lock:
            self.calls[str(key)] += 1
        self.gates.pass_(key)
        if str(key) in self.unknown:
            raise OutcomeUnknown("no answer")
        return {"entry": str(key), "amount": amount}


@dataclass
class Shop:
    """An application on :data:`TABLE`: ``POST /orders`` (atomic, answers a ``Location``) and
    ``POST /transfers`` (multi-step: the intent, then a call to :attr:`ledger`; no ``Location``)."""

    app: Flask
    idem: Idempotency
    gates: Gates
    ledger: Ledger
    clients: threading.local = field(default_factory=threading.local)

    def post(self, path: str, key: uuid.UUID, body: dict[str, Any]) -> Any:
        client: FlaskClient | None = getattr(self.clients, "client", None)
        if client is None:
            client = self.clients.client = self.app.test_client()
        return client.post(path, json=body, headers={**HEADERS, "Idempotency-Key": str(key)})

    @property
    def state(self) -> IdemState:
        return get_state(self.app)


def build(database_url: str, *, ttl: float = 2.0, delay: float = 0.0, **config: Any) -> Shop:
    """The :class:`Shop`, its routes' keys kept ``ttl`` seconds."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update(
        {
            "IDEM_DATABASE_URL": database_url,
            "IDEM_TABLE": TABLE,
            "IDEM_PARTITION_INTERVAL": INTERVAL,
            "IDEM_TOMBSTONE_TTL": TOMB,
            "IDEM_POOL_MAX_SIZE": 20,
            "IDEM_POOL_TIMEOUT": 10.0,
            "IDEM_LEASE_TIMEOUT": 30.0,
            "MAX_CONTENT_LENGTH": 4096,
            **config,
        }
    )
    idem = Idempotency(app, scope=org_from_header)
    gates = Gates(delay)
    ledger = Ledger(gates)
    flow = Flow("partitions.transfer")

    @flow.call
    def post(run: Run) -> dict[str, Any]:
        return ledger.record(run.key, run.intent["amount"])

    @flow.finish
    def done(run: Run) -> Any:
        return {"entry": run.results["post"]["entry"], "amount": run.results["post"]["amount"]}, 201

    @app.post("/orders")
    @idem.idempotent(ttl=ttl)
    def order() -> Any:
        gates.pass_(str(idem.key))
        row = idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, %s) RETURNING id",
            (ORG, f"order:{idem.key}:{uuid.uuid4()}"),
        ).fetchone()
        assert row is not None
        return {"id": row[0], "amount": request.get_json()["amount"]}, 201, {"Location": f"/orders/{row[0]}"}

    @app.post("/transfers")
    @idem.idempotent(flow=flow, ttl=ttl)
    def transfer() -> Any:
        idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, %s)", (ORG, f"transfer:{idem.key}:{uuid.uuid4()}")
        )
        return {"amount": request.get_json()["amount"]}

    return Shop(app, idem, gates, ledger)


@pytest.fixture
def make_shop(database_url: str, table: str) -> Iterator[Callable[..., Shop]]:
    """Build shops on :data:`TABLE`; their pools are closed afterwards."""
    shops: list[Shop] = []

    def make(**options: Any) -> Shop:
        shops.append(build(database_url, **options))
        return shops[-1]

    yield make
    for shop in shops:
        close_pool(shop.app)


def notes_of(db: psycopg.Connection[Any], kind: str, key: uuid.UUID) -> list[int]:
    """The ids of the business writes of ``key`` (``order`` or ``transfer``), committed."""
    return [r[0] for r in db.execute("SELECT id FROM notes WHERE body LIKE %s", (f"{kind}:{key}:%",))]


def partition_of(db: psycopg.Connection[Any], key: uuid.UUID, table: str = TABLE) -> str:
    """The partition that holds the row of ``key`` (of the key table, or of its tombstones)."""
    found = db.execute(
        sql.SQL("SELECT tableoid::regclass::text FROM {} WHERE idem_key = %s").format(sql.Identifier(table)),
        (key,),
    ).fetchall()
    assert len(found) == 1, found
    return str(found[0][0])


def exists(db: psycopg.Connection[Any], name: str) -> bool:
    """Whether the catalog has table ``name``, attached or not."""
    return db.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone() == (True,)


def attached(db: psycopg.Connection[Any], parent: str = TABLE) -> list[str]:
    """The partitions the catalog attaches to ``parent``."""
    return [p.name for p in _partitions.partitions(db, parent)]


def now(db: psycopg.Connection[Any]) -> datetime:
    row = db.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def next_second(db: psycopg.Connection[Any]) -> None:
    """Wait for the database's clock to pass a whole second: a key's expiry from now on falls into the
    partition after the one of an expiry computed before."""
    start = now(db).replace(microsecond=0)
    wait_for(lambda: now(db).replace(microsecond=0) > start, 5, 0.02)


def retire(url: str, db: psycopg.Connection[Any], name: str, **options: Any) -> list[RetentionReport]:
    """Run :func:`maintain` until partition ``name`` is dropped (its range has passed, and a grace of a
    second); every run's report."""
    reports: list[RetentionReport] = []

    def gone() -> bool:
        reports.append(maintain(url, **options))
        return not exists(db, name)

    wait_for(gone, 20, 0.2, message=lambda: f"{name} was not dropped: {reports[-1]}")
    return reports


# -- 1. a key is never run twice across a partition boundary -------------------------------------------


def test_the_unique_index_alone_lets_a_key_into_two_partitions(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The premise: the same key with expiries in two partitions is two rows to PostgreSQL, even with
    ``INSERT ... ON CONFLICT DO NOTHING``. What keeps a key once is the reservation, not the index."""
    maintain(direct_database_url, horizon=10)
    key = uuid.uuid4()
    for ttl in (3, 6):
        db.execute(
            sql.SQL(
                "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
                " VALUES (%s, %s, %s, 'POST', '/orders', 'completed', '{{}}',"
                " now() + make_interval(secs => %s)) ON CONFLICT DO NOTHING"
            ).format(sql.Identifier(TABLE)),
            (ORG, key, SHA, ttl),
        )
    rows = db.execute(
        sql.SQL("SELECT count(*), count(DISTINCT tableoid) FROM {} WHERE idem_key = %s").format(
            sql.Identifier(TABLE)
        ),
        (key,),
    ).fetchone()
    assert rows == (2, 2)


def hammer(app: Flask, n: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` from ``n`` threads released at once; what each answered, none of them an exception."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def attempt(i: int) -> None:
        with app.app_context():
            barrier.wait(10)
            try:
                results[i] = call(i)
            except BaseException as e:  # reported below, with the others
                results[i] = e

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results


def key_rows(db: psycopg.Connection[Any], key: uuid.UUID) -> int:
    row = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE idem_key = %s").format(sql.Identifier(TABLE)), (key,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_attempts_whose_rows_fall_in_different_partitions_run_once(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Sixteen atomic attempts at one key at once, each with a ttl a second longer than the last (sixteen
    partitions), then each once more: one runs, the others are in flight or replay it; one row, one
    business write."""
    maintain(direct_database_url, horizon=30)
    shop = make_shop()
    state = shop.state
    for _ in range(4):
        key = uuid.uuid4()

        def work(conn: psycopg.Connection[Any], key: uuid.UUID = key) -> Final[str]:
            conn.execute(
                "INSERT INTO notes (org_id, body) VALUES (%s, %s)", (ORG, f"order:{key}:{uuid.uuid4()}")
            )
            time.sleep(0.05)  # the others arrive while the key is held
            return Final("ran", {"status": 201, "headers": [], "body": str(key)}, 201)

        def attempt(i: int, key: uuid.UUID = key) -> Any:
            claim = Claim(KeyedRequest(ORG, key, SHA, "POST", "/orders"), ttl=3.0 + i)
            return _protocol.atomic(state, claim, work)

        outcomes = hammer(shop.app, 16, attempt)
        finals = [o for o in outcomes if isinstance(o, Final)]
        assert len(finals) == 1, outcomes
        stored = finals[0].document
        assert stored is not None
        assert all(o == InFlight() or o == Replay(stored) for o in outcomes if o is not finals[0]), outcomes
        with shop.app.app_context():  # and one at a time, once it committed
            assert all(attempt(i) == Replay(stored) for i in range(16))
        assert len(notes_of(db, "order", key)) == 1
        assert key_rows(db, key) == 1


def test_multi_step_attempts_in_different_partitions_reserve_once(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The same with multi-step reservations (a row inserted first, committed with its intent): one
    attempt reserves, under its lease; the others, at once or after it, find it in flight."""
    maintain(direct_database_url, horizon=30)
    shop = make_shop()
    state = shop.state
    flow = Flow("partitions.race")

    @flow.finish
    def done(run: Run) -> Any:
        return {}, 201

    for _ in range(4):
        key = uuid.uuid4()

        def start(conn: psycopg.Connection[Any], key: uuid.UUID = key) -> dict[str, Any]:
            conn.execute(
                "INSERT INTO notes (org_id, body) VALUES (%s, %s)", (ORG, f"transfer:{key}:{uuid.uuid4()}")
            )
            time.sleep(0.05)
            return {"amount": 1}

        def attempt(i: int, key: uuid.UUID = key) -> Any:
            claim = Claim(KeyedRequest(ORG, key, SHA, "POST", "/transfers"), ttl=3.0 + i)
            return _protocol.begin(state, claim, flow, Lease(ORG, key, uuid.uuid4(), 30.0), start)

        outcomes = hammer(shop.app, 16, attempt)
        runs = [o for o in outcomes if isinstance(o, Run)]
        assert len(runs) == 1, outcomes
        assert all(o == InFlight() for o in outcomes if o is not runs[0]), outcomes
        with shop.app.app_context():  # and one at a time, once it committed
            assert all(attempt(i) == InFlight() for i in range(16))
        assert len(notes_of(db, "transfer", key)) == 1
        assert key_rows(db, key) == 1


def test_a_reservation_acts_only_on_the_lock_its_lock_statement_took(
    make_shop: Callable[..., Shop], direct_database_url: str
) -> None:
    """The lock statement found the key in flight; its holder lets the lock go before the reservation's
    statement runs: the reservation still answers in flight and inserts nothing. A lock tried by that
    statement itself could be had after its snapshot was taken, and miss the row of a holder that
    committed in between (in another partition, where no unique index stops the insert)."""
    maintain(direct_database_url, horizon=30)
    store = make_shop().state.store
    key = uuid.uuid4()
    keyed = KeyedRequest(ORG, key, SHA, "POST", "/transfers")
    with psycopg.connect(direct_database_url) as holder, psycopg.connect(direct_database_url) as late:
        lease = Lease(ORG, key, uuid.uuid4(), 30.0)
        assert store.reserve(holder, keyed, ttl=5.0, flow="f", lease=lease).reserved
        params = {
            "org_id": ORG,
            "key": key,
            "sha": SHA,
            "method": "POST",
            "path": "/transfers",
            "task": None,
            "ttl": 20.0,
            "tomb": TOMB,
            "lock": lock_id(ORG, key),
            "flow": "f",
            "token": uuid.uuid4(),
            "lease": 30.0,
        }
        cursor = late.cursor(row_factory=psycopg.rows.dict_row)
        locked = cursor.execute(store._sql.lock, params).fetchone()
        assert locked is not None and locked["taken"] is False
        holder.rollback()  # the holder gives the key up: the lock is free now
        found = cursor.execute(store._sql.reserve_leased, params).fetchone()
        assert found is not None
        assert (found["fresh"], found["taken"], found["request_sha"]) == (False, False, None)
        late.rollback()
        # Taken in its own statement, the lock lets the reservation insert.
        assert store.reserve(late, keyed, ttl=20.0, flow="f", lease=lease).reserved
        late.rollback()


@pytest.mark.parametrize("path", ["/orders", "/transfers"])
def test_a_key_in_flight_is_409_at_once_from_the_next_partition(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any], path: str
) -> None:
    """While the first attempt of a key holds it (in the atomic view, or in the flow's outside call), a
    second later retries, whose rows would fall into the next partition, are answered 409 with
    ``Retry-After`` while the first is still held; once it finishes, they replay its answer."""
    maintain(direct_database_url, horizon=40)
    shop = make_shop(ttl=30.0)
    key = uuid.uuid4()
    gate = shop.gates.hold(key)
    first: list[Any] = []
    holder = threading.Thread(target=lambda: first.append(shop.post(path, key, {"amount": 5})))
    holder.start()
    try:
        shop.gates.wait_entered(key)
        next_second(db)
        retries: list[Any] = []
        retrying = threading.Thread(
            target=lambda: retries.extend(shop.post(path, key, {"amount": 5}) for _ in range(3))
        )
        retrying.start()
        retrying.join(15)
        assert not retrying.is_alive(), "a retry waited for the attempt in flight"
        assert holder.is_alive()
    finally:
        gate.set()
        holder.join(15)
    assert [r.status_code for r in retries] == [409, 409, 409]
    assert all(r.content_type == "application/problem+json" and r.headers["Retry-After"] for r in retries)
    assert retries[0].json["type"] == "urn:flask-idem:problem:key-in-use"
    assert first[0].status_code == 201
    again = shop.post(path, key, {"amount": 5})
    assert (again.status_code, again.data) == (200, first[0].data)  # a 201 is replayed as 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(notes_of(db, "order" if path == "/orders" else "transfer", key)) == 1
    assert shop.ledger.calls[str(key)] == (1 if path == "/transfers" else 0)


@dataclass
class Answer:
    path: str
    key: uuid.UUID
    sent: float
    status: int
    body: bytes
    location: str | None


def test_keys_retried_across_boundaries_while_partitions_roll(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Eight threads send atomic and multi-step requests, and retries of them for four seconds after
    the first, whose first attempts are held a random moment (so that boundaries pass under them), with
    keys kept two seconds; :func:`maintain` runs in a loop meanwhile, making partitions a second wide and
    retiring those passed. No key is run twice, every key is answered the same (its answer, 409 while
    in flight, replayed, then 303 to its ``Location`` or 410 from its tombstone), and nothing else."""
    ttl, window, load = 2.0, 4.0, 8.0
    maintain(direct_database_url, horizon=ttl + 4)
    shop = make_shop(ttl=ttl, delay=0.4)
    stop = threading.Event()
    reports: list[RetentionReport] = []
    failures: list[BaseException] = []

    def roll() -> None:
        while not stop.is_set():
            try:
                reports.append(maintain(direct_database_url, horizon=ttl + 4))
            except BaseException as e:  # reported by the test
                failures.append(e)
                return
            stop.wait(0.2)

    keys: list[tuple[float, str, uuid.UUID, dict[str, Any]]] = []
    answers: list[Answer] = []
    lock = threading.Lock()
    ends = time.monotonic() + load

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while (started := time.monotonic()) < ends:
                with lock:
                    live = [k for k in keys if started - k[0] < window]
                    if not live or rng.random() < 0.25:
                        path = rng.choice(["/orders", "/transfers"])
                        live = [(started, path, uuid.uuid4(), {"amount": rng.randint(1, 1000)})]
                        keys.append(live[0])
                _, path, key, body = rng.choice(live)
                sent = time.time()
                answer = shop.post(path, key, body)
                with lock:
                    answers.append(
                        Answer(
                            path, key, sent, answer.status_code, answer.data, answer.headers.get("Location")
                        )
                    )
        except BaseException as e:  # reported by the test
            failures.append(e)

    roller = threading.Thread(target=roll)
    roller.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(load + 60)
    stop.set()
    roller.join(60)
    assert not failures, failures

    unexpected = [a for a in answers if a.status not in (201, 200, 409, 303 if a.path == "/orders" else 410)]
    assert not unexpected, [(a.path, a.status, a.body[:200]) for a in unexpected[:10]]
    by_key: dict[uuid.UUID, list[Answer]] = {}
    for a in answers:
        by_key.setdefault(a.key, []).append(a)
    for key, seen in by_key.items():
        path = seen[0].path
        done = [a for a in seen if a.status != 409]
        writes = notes_of(db, "order" if path == "/orders" else "transfer", key)
        assert len(writes) <= 1, f"{path} {key} ran {len(writes)} times"
        if done:
            assert len(writes) == 1, f"{path} {key} was answered {done[0].status} and never ran"
        assert len({a.body for a in seen if a.status in (200, 201)}) <= 1, (
            f"{path} {key} answered differently"
        )
        if path == "/orders":
            assert {a.location for a in done} <= {f"/orders/{w}" for w in writes}, (key, done, writes)
        else:
            assert shop.ledger.calls[str(key)] == len(writes), (key, shop.ledger.calls[str(key)], writes)
    duplicates = db.execute(
        sql.SQL("SELECT org_id, idem_key, count(*) FROM {} GROUP BY 1, 2 HAVING count(*) > 1").format(
            sql.Identifier(TABLE)
        )
    ).fetchall()
    assert duplicates == []

    # What the run went through: attempts of one key whose rows would fall into different partitions,
    # keys in flight, partitions retired with keys in them, and keys answered from their tombstones.
    straddling = sum(1 for seen in by_key.values() if len({int(a.sent + ttl) for a in seen}) > 1)
    statuses = Counter(a.status for a in answers)
    dropped = sum(len(r.dropped) for r in reports)
    tombstoned = sum(r.tombstoned for r in reports)
    print(
        f"{len(answers)} answers {dict(statuses)}, {len(by_key)} keys, {straddling} straddling;"
        f" {dropped} partitions dropped, {tombstoned} tombstones written by {len(reports)} runs"
    )
    assert straddling >= 10 and statuses[409] > 0 and statuses[303] + statuses[410] > 0
    assert tombstoned > 0 and dropped >= 3


# -- 2. the isolation the reservation needs ----------------------------------------------------------


REPEATABLE_READ = {"options": "-c default_transaction_isolation=repeatable\\ read"}


@pytest.mark.parametrize("path", ["/orders", "/transfers"])
def test_repeatable_read_is_refused_as_a_configuration_error(
    make_shop: Callable[..., Shop],
    direct_database_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    """A route whose transactions run at REPEATABLE READ (whose one snapshot predates the key's lock,
    and could miss a row committed in another partition) is refused before the view runs: a
    ConfigurationError, as for the other mistakes of a server's setup (TESTING raises it; otherwise
    it is the application's 500, with the message in the log), never a key run twice."""
    if pgbouncer.ENABLED:
        pytest.skip("PgBouncer ignores the startup option that sets the isolation level")
    maintain(direct_database_url, horizon=30)
    shop = make_shop(ttl=10.0, IDEM_CONNECT_OPTIONS=REPEATABLE_READ, TESTING=True)
    key = uuid.uuid4()
    with pytest.raises(ConfigurationError, match="READ COMMITTED transactions"):
        shop.post(path, key, {"amount": 1})
    shop.app.config["TESTING"] = False
    with caplog.at_level(logging.ERROR):
        answer = shop.post(path, key, {"amount": 1})
    assert answer.status_code == 500
    [logged] = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], ConfigurationError)]
    assert "run the idempotent route's transaction at READ COMMITTED" in str(logged.exc_info[1])
    assert notes_of(db, "order", key) == notes_of(db, "transfer", key) == []
    assert key_rows(db, key) == 0 and shop.ledger.calls[str(key)] == 0


# -- 3. retention: partitions dropped whole ------------------------------------------------------------


def test_a_passed_partition_is_dropped_and_its_keys_answer_from_tombstones(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Once a partition's range has passed, maintain writes its keys' compact tombstones and drops it
    (gone from the catalog); then a retry of an atomic key is sent to its ``Location`` (303), one of a
    multi-step key is answered 410, a changed request under either key 422, and nothing runs again."""
    maintain(direct_database_url)
    shop = make_shop(ttl=1.0)
    order, transfer = uuid.uuid4(), uuid.uuid4()
    first_order = shop.post("/orders", order, {"amount": 1})
    first_transfer = shop.post("/transfers", transfer, {"amount": 2})
    assert (first_order.status_code, first_transfer.status_code) == (201, 201)
    parts = {partition_of(db, order), partition_of(db, transfer)}
    reports = [r for name in parts for r in retire(direct_database_url, db, name)]
    assert set(attached(db)).isdisjoint(parts)
    assert sum(r.tombstoned for r in reports) >= 2
    assert not db.execute(
        sql.SQL("SELECT FROM {} WHERE idem_key = ANY(%s)").format(sql.Identifier(TABLE)), ([order, transfer],)
    ).fetchall()
    tombstones = db.execute(
        sql.SQL("SELECT idem_key, status, location FROM {} ORDER BY location NULLS LAST").format(
            sql.Identifier(TABLE + "_tombstones")
        )
    ).fetchall()
    assert tombstones == [
        (order, 201, first_order.headers["Location"]),
        (transfer, 201, None),
    ]

    again = shop.post("/orders", order, {"amount": 1})
    assert (again.status_code, again.headers["Location"]) == (303, first_order.headers["Location"])
    gone = shop.post("/transfers", transfer, {"amount": 2})
    assert gone.status_code == 410 and gone.json["type"] == "urn:flask-idem:problem:key-expired"
    for path, key in (("/orders", order), ("/transfers", transfer)):
        changed = shop.post(path, key, {"amount": 99})
        assert changed.status_code == 422 and changed.json["type"] == "urn:flask-idem:problem:key-mismatch"
    assert len(notes_of(db, "order", order)) == len(notes_of(db, "transfer", transfer)) == 1
    assert shop.ledger.calls[str(transfer)] == 1


def test_a_partition_holding_a_flow_in_progress_is_kept_until_it_finishes(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A multi-step request still processing when its partition's range passes keeps the partition: it
    is reported kept, and stays; the request finishes (its row is written where it is), and a later run
    drops the partition; its key then answers 410 from its tombstone."""
    maintain(direct_database_url)
    shop = make_shop(ttl=1.0)
    key = uuid.uuid4()
    gate = shop.gates.hold(key)
    first: list[Any] = []
    holder = threading.Thread(target=lambda: first.append(shop.post("/transfers", key, {"amount": 3})))
    holder.start()
    try:
        shop.gates.wait_entered(key)
        part = partition_of(db, key)
        reports: list[RetentionReport] = []

        def kept() -> bool:
            reports.append(maintain(direct_database_url))
            return any(name == part for name, _ in reports[-1].kept)

        wait_for(kept, 20, 0.2, message=lambda: f"{part} was not kept: {reports[-1]}")
        assert exists(db, part) and part in attached(db)
        assert "multi-step request(s) still in progress" in dict(reports[-1].kept)[part]
        assert shop.post("/transfers", key, {"amount": 3}).status_code == 409
    finally:
        gate.set()
        holder.join(15)
    assert first[0].status_code == 201
    assert partition_of(db, key) == part
    retire(direct_database_url, db, part)
    gone = shop.post("/transfers", key, {"amount": 3})
    assert gone.status_code == 410
    assert shop.ledger.calls[str(key)] == 1


def test_a_flagged_row_is_moved_to_a_live_partition_and_kept(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A row flagged for a person (a flow the recovery job gave up on) is moved out of its partition
    before the partition is dropped: ``flask idem stuck`` still lists it, and its key is answered as
    before (its failure replayed), however many runs pass."""
    maintain(direct_database_url)
    shop = make_shop(ttl=1.0)
    key = uuid.uuid4()
    shop.ledger.unknown.add(str(key))
    pending = shop.post("/transfers", key, {"amount": 4})
    assert pending.status_code == 503  # the outcome of the call is unknown: the row stays processing
    token = db.execute(
        sql.SQL("SELECT lease_token FROM {} WHERE idem_key = %s").format(sql.Identifier(TABLE)), (key,)
    ).fetchone()
    assert token is not None
    document = {
        "status": 500,
        "headers": [["Content-Type", "application/json"]],
        "body": '{"error": "gave up"}',
    }
    with shop.app.app_context():
        assert _protocol.give_up_leased(shop.state, Lease(ORG, key, token[0], 30.0), document, "deadline")
    before = shop.post("/transfers", key, {"amount": 4})
    assert before.status_code == 500 and before.json == {"error": "gave up"}
    part = partition_of(db, key)
    reports = retire(direct_database_url, db, part)
    assert sum(r.moved for r in reports) >= 1
    assert partition_of(db, key) != part
    row = db.execute(
        sql.SQL("SELECT status, needs_attention, last_error FROM {} WHERE idem_key = %s").format(
            sql.Identifier(TABLE)
        ),
        (key,),
    ).fetchone()
    assert row == ("failed", True, "deadline")
    listed = shop.app.test_cli_runner().invoke(args=["idem", "stuck"])
    assert listed.exit_code == 0, listed.output
    assert f"NEEDS ATTENTION org={ORG} key={key}" in listed.output
    after = shop.post("/transfers", key, {"amount": 4})
    assert (after.status_code, after.data) == (before.status_code, before.data)
    assert shop.ledger.calls[str(key)] == 1


def test_an_interrupted_concurrent_detach_is_finished_by_the_next_run(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """``DETACH PARTITION ... CONCURRENTLY`` cancelled while it waits for a transaction that read the
    key table leaves the partition pending detach; the next run finishes it (``FINALIZE``) and drops it."""
    maintain(direct_database_url, horizon=3)

    def passed() -> list[_partitions.Partition]:  # with the grace of a second that maintain gives
        limit = now(db) - timedelta(seconds=1.5)
        return [p for p in _partitions.partitions(db, TABLE) if p.upper is not None and p.upper < limit]

    wait_for(lambda: bool(passed()), 10, 0.1)
    victim = passed()[0]
    failed: list[BaseException] = []
    with (
        psycopg.connect(direct_database_url) as reader,
        psycopg.connect(direct_database_url, autocommit=True) as detacher,
    ):
        reader.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(TABLE)))  # stays open
        pid = detacher.info.backend_pid

        def detach() -> None:
            try:
                detacher.execute(
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                        sql.Identifier(TABLE), sql.Identifier(victim.name)
                    )
                )
            except psycopg.Error as e:
                failed.append(e)

        thread = threading.Thread(target=detach)
        thread.start()
        wait_for(
            lambda: (
                db.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                == (True,)
            ),
            10,
            0.05,
        )
        db.execute("SELECT pg_cancel_backend(%s)", (pid,))
        thread.join(10)
        reader.rollback()
    assert [type(e) for e in failed] == [psycopg.errors.QueryCanceled]
    [pending] = [p for p in _partitions.partitions(db, TABLE) if p.name == victim.name]
    assert pending.detaching
    report = maintain(direct_database_url, horizon=3)
    assert victim.name in report.dropped
    assert not exists(db, victim.name)


def test_two_runs_at_once_both_succeed(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Three runs at once, a few times over while partitions with keys pass: none fails, each partition
    is made once and dropped once, the ranges never overlap, and the keys answer from their tombstones."""
    shop = make_shop(ttl=1.0)
    maintain(direct_database_url, horizon=3)
    keys = [uuid.uuid4() for _ in range(6)]
    for key in keys:
        assert shop.post("/orders", key, {"amount": 1}).status_code == 201
    made: list[str] = []
    dropped: list[str] = []
    for _ in range(5):
        barrier = threading.Barrier(3)
        failures: list[BaseException] = []

        def run(barrier: threading.Barrier = barrier, failures: list[BaseException] = failures) -> None:
            barrier.wait(10)
            try:
                report = maintain(direct_database_url, horizon=3)
            except BaseException as e:  # reported below
                failures.append(e)
                return
            made.extend(report.created)
            dropped.extend(report.dropped)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        time.sleep(0.7)  # partitions pass
    assert len(made) == len(set(made)) and len(dropped) == len(set(dropped))
    found = _partitions.partitions(db, TABLE)
    assert all(
        a.upper is not None and b.lower is not None and a.upper <= b.lower
        for a, b in zip(found, found[1:], strict=False)
    )
    assert all(not exists(db, name) for name in dropped)
    for key in keys:
        again = shop.post("/orders", key, {"amount": 1})
        assert again.status_code in (201, 303) and len(notes_of(db, "order", key)) == 1
    assert any(shop.post("/orders", key, {"amount": 1}).status_code == 303 for key in keys)


def test_tombstone_partitions_are_dropped_once_passed(
    make_shop: Callable[..., Shop], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A tombstone lives in a partition of the tombstones' table, dropped once its range has passed;
    then the key is forgotten, as its tombstone's period is over, and may be used anew."""
    tomb = 6.0  # longer than the partition's retirement may take after the key's expiry
    maintain(direct_database_url, tombstone_ttl=tomb)
    shop = make_shop(ttl=1.0, IDEM_TOMBSTONE_TTL=tomb)
    key = uuid.uuid4()
    assert shop.post("/orders", key, {"amount": 1}).status_code == 201
    retire(direct_database_url, db, partition_of(db, key), tombstone_ttl=tomb)
    held = partition_of(db, key, TABLE + "_tombstones")
    assert shop.post("/orders", key, {"amount": 1}).status_code == 303
    reports = retire(direct_database_url, db, held, tombstone_ttl=tomb)
    assert held in {name for r in reports for name in r.dropped}
    assert held not in attached(db, TABLE + "_tombstones")
    anew = shop.post("/orders", key, {"amount": 1})
    assert anew.status_code == 201 and len(notes_of(db, "order", key)) == 2


def _ranges(db: psycopg.Connection[Any], parent: str = TABLE) -> list[tuple[datetime, datetime]]:
    """The ranges of ``parent``'s partitions but the first (unbounded below), oldest first; they follow
    one another with no gap."""
    parts = _partitions.partitions(db, parent)
    ranges = [(p.lower, p.upper) for p in parts if p.lower is not None and p.upper is not None]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
    return ranges


def test_days_ahead_are_one_spare_partition_replaced_while_empty(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """With ``ahead`` (IDEM_PARTITION_AHEAD), partitions of the interval reach past the longest retention
    and the next run, and one spare partition covers the rest of the horizon: every lookup reads every
    partition, and a week of empty ones would cost each request. A later run replaces the spare, empty,
    by partitions of the interval and a new spare further on, with no gap and no range covered twice:
    once the next run is due to reach it (8 s), while no key can be written into it before its detach
    is through (the 4 s retention and 5 s for the detach's waits under a lock timeout of 2 s)."""
    start = now(db)
    maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: start)
    ranges = _ranges(db)
    *steps, spare = ranges
    assert all(upper - lower <= timedelta(seconds=INTERVAL) for lower, upper in steps)
    # Retention 4 s and 8 s until the next run (half of ahead): partitions of a second until then.
    assert steps[-1][1] >= start + timedelta(seconds=12)
    assert spare[1] - spare[0] > timedelta(seconds=INTERVAL) and spare[1] >= start + timedelta(seconds=20)
    [spare_name] = [p.name for p in _partitions.partitions(db, TABLE) if p.lower == spare[0]]

    later = start + timedelta(seconds=2)
    report = maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: later)
    assert spare_name in report.dropped and spare not in _ranges(db)
    *steps, spare = _ranges(db)
    assert all(upper - lower <= timedelta(seconds=INTERVAL) for lower, upper in steps)
    assert steps[-1][1] >= later + timedelta(seconds=12) and spare[1] >= later + timedelta(seconds=20)


def test_a_spare_partition_the_present_came_near_is_kept(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A run late enough that a key may be written into the spare before its detach is through keeps
    the spare as it is, a wider partition: a row written into it as the detach begins would be missed
    by every statement after it (its own transaction's too) until the spare were attached again."""
    start = now(db)
    maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: start)
    spare = _partitions.partitions(db, TABLE)[-1]
    assert spare.lower is not None and spare.lower <= start + timedelta(seconds=13)

    later = start + timedelta(seconds=6)  # keys expire until start + 10; the detach may take 5 s
    report = maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: later)
    assert spare.name not in report.dropped
    assert (spare.lower, spare.upper) in _ranges(db) and _ranges(db)[-1][1] >= later + timedelta(seconds=20)


def insert_expiring(db: psycopg.Connection[Any], expires_at: datetime) -> None:
    """Write a processing row of a new key expiring at ``expires_at`` (not committed)."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, expires_at)"
            " VALUES (%s, %s, %s, 'POST', '/orders', 'processing', %s)"
        ).format(sql.Identifier(TABLE)),
        (ORG, uuid.uuid4(), SHA, expires_at),
    )


def test_a_spare_replacement_left_pending_is_finished_and_its_range_filled(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The spare's detach waits for older transactions no longer than the lock timeout, and is left
    pending: no key can be written into its range meanwhile. The next run finishes it (``FINALIZE``),
    drops it, and fills the range it leaves, before and up to the partitions made after it."""
    start = now(db)
    maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: start)
    spare = _partitions.partitions(db, TABLE)[-1]
    assert spare.lower is not None and spare.upper is not None
    tables = Tables(TABLE)
    lines: list[str] = []
    with (
        psycopg.connect(direct_database_url) as reader,
        psycopg.connect(direct_database_url, autocommit=True) as conn,
    ):
        reader.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(TABLE)))  # stays open
        runner = _migrate._Runner(conn, TABLE, tables.names, 0.3, lines.append)
        replace_spare(Maintenance(runner, tables, lambda: start), tables.keys, spare)
        reader.rollback()
    assert any("the next run finishes it" in line for line in lines), lines
    [pending] = [p for p in _partitions.partitions(db, TABLE) if p.name == spare.name]
    assert pending.detaching
    with pytest.raises(psycopg.errors.CheckViolation, match="no partition"), db.transaction():
        insert_expiring(db, spare.lower)
    # A partition after it, as the same run makes once the detach is left pending.
    after = tables.partition("_p", spare.upper)
    attach(tables, db, TABLE, after, (spare.upper, spare.upper + timedelta(seconds=INTERVAL)), fillfactor=80)
    db.commit()

    later = start + timedelta(seconds=1)
    report = maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: later)
    assert spare.name in report.dropped
    covered = _ranges(db)  # no gap
    # Its range made again as partitions of the interval (the first one under the spare's name).
    assert (spare.lower, spare.lower + timedelta(seconds=INTERVAL)) in covered
    assert covered[-1][1] >= later + timedelta(seconds=20)
    insert_expiring(db, spare.lower)
    db.rollback()


def test_a_spare_partition_holding_a_key_is_kept_as_it_is(
    make_shop: Callable[..., Shop], table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A key kept longer than the retention the last run knew lands in the spare partition: the next run
    keeps that partition, wide, with the key in it, and makes partitions after it; the key replays (a
    201 as 200)."""
    start = now(db)
    maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: start)
    spare = _partitions.partitions(db, TABLE)[-1]
    shop = make_shop(ttl=16.0)
    key = uuid.uuid4()
    first = shop.post("/orders", key, {"amount": 1})
    assert first.status_code == 201
    assert partition_of(db, key) == spare.name

    later = start + timedelta(seconds=5)
    report = maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: later)
    assert spare.name not in report.dropped
    assert (spare.lower, spare.upper) in _ranges(db) and partition_of(db, key) == spare.name
    assert _ranges(db)[-1][1] >= later + timedelta(seconds=20)
    again = shop.post("/orders", key, {"amount": 1})
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert len(notes_of(db, "order", key)) == 1


def test_a_spare_partition_that_a_row_entered_is_attached_again(
    table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The spare is found empty, then detached: a row that came in between is found in the detached
    table, which is attached again with its range, the row in it, and not dropped."""
    start = now(db)
    maintain(direct_database_url, horizon=20.0, ahead=16.0, now=lambda: start)
    spare = _partitions.partitions(db, TABLE)[-1]
    key = uuid.uuid4()
    insert_completed(db, TABLE, key, spare.lower, org=ORG)
    db.commit()
    tables = Tables(TABLE)
    report = RetentionReport()
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        runner = _migrate._Runner(conn, TABLE, tables.names, 2.0, lambda _: None)
        replace_spare(Maintenance(runner, tables, lambda: start, report), tables.keys, spare)
    assert report.dropped == []
    assert (spare.lower, spare.upper) in _ranges(db) and partition_of(db, key) == spare.name


# -- 4. no partition for a key's expiry ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/orders", "/transfers"])
def test_no_partition_for_the_keys_expiry_is_503_until_purge_runs(
    make_shop: Callable[..., Shop], db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """A key whose expiry no partition covers (purge has not made partitions that far ahead) is answered
    503 problem+json with ``Retry-After``, never 500, with an error in the log that names ``flask idem
    purge``; nothing is recorded. Once ``flask idem purge`` ran, the same request goes through."""
    shop = make_shop(
        ttl=3600.0, IDEM_KEY_TTL=3600.0, IDEM_PARTITION_INTERVAL=600.0, IDEM_PARTITION_AHEAD=600.0
    )
    key = uuid.uuid4()
    with caplog.at_level(logging.ERROR, "flask_idem"):
        refused = shop.post(path, key, {"amount": 6})
    assert refused.status_code == 503 and refused.content_type == "application/problem+json"
    assert refused.headers["Retry-After"] == "1"
    assert refused.json["type"] == "urn:flask-idem:problem:store-unavailable"
    [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "no partition of the key table part_keys covers the key's expiry" in logged.getMessage()
    assert "'flask idem purge'" in logged.getMessage()
    assert key_rows(db, key) == 0 and shop.ledger.calls[str(key)] == 0
    assert notes_of(db, "order", key) == notes_of(db, "transfer", key) == []

    purged = shop.app.test_cli_runner().invoke(args=["idem", "purge"])
    assert purged.exit_code == 0, purged.output
    assert "partition(s) ahead" in purged.output
    done = shop.post(path, key, {"amount": 6})
    assert done.status_code == 201
    assert len(notes_of(db, "order" if path == "/orders" else "transfer", key)) == 1
