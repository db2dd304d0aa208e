"""With FLASK_IDEM_TEST_CITUS=1: the layout on Citus, the plans of the hot path, the in-flight rule.

Every statement a request runs must reach one shard: Citus must plan it as a router query (one task on
one node), never with subplans or an INSERT ... SELECT pulled through the coordinator. The statements are
not copied here: they are recorded as the store and the shop really send them, then explained.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from example_app import create_app
from flask_idem import _migrate, _partitions
from flask_idem._partitions.ahead import replace_spare
from flask_idem._partitions.tables import Maintenance, Tables
from flask_idem._pool import ForkSafeConnectionPool, PooledConnection
from flask_idem._records import KeyedRequest, KeyRef, Lease, Reservation, lock_id
from flask_idem._state import get_state
from flask_idem._store import Store

from .support import citus
from .support.helpers import count, headers
from .support.layouts import drop
from .support.notes_app import post
from .support.partitions import insert_completed
from .support.servers import wait_for

pytestmark = pytest.mark.skipif(not citus.ENABLED, reason="runs only with FLASK_IDEM_TEST_CITUS=1")

SHA = b"\x02" * 32


class RecordingCursor(psycopg.Cursor[Any]):
    """A cursor that notes every statement it executes, with its parameters."""

    log: list[tuple[Any, Any]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        RecordingCursor.log.append((query, params))
        return super().execute(query, params, **kwargs)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, Any]]]:
    """Statements of every pooled connection opened from now on (the store's and the shop's)."""
    log: list[tuple[Any, Any]] = []
    monkeypatch.setattr(RecordingCursor, "log", log)
    init = PooledConnection.__init__

    def recording_init(self: PooledConnection, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.cursor_factory = RecordingCursor

    monkeypatch.setattr(PooledConnection, "__init__", recording_init)
    yield log


def plan(conn: psycopg.Connection[Any], query: Any, params: Any) -> str:
    """The EXPLAIN of ``query`` (not run), in a transaction of its own as the application runs it."""
    text = query if isinstance(query, bytes) else str(query).encode()
    with conn.transaction(force_rollback=True):
        rows = conn.execute(b"EXPLAIN (COSTS OFF) " + text, params).fetchall()
    return "\n".join(row[0] for row in rows)


def assert_router(explained: str, statement: Any) -> None:
    """One task on one node, nothing planned in steps through the coordinator."""
    assert "Task Count: 1\n" in explained, (statement, explained)
    for multi_step in ("Subplan", "pull to coordinator", "repartition", "Citus INSERT ... SELECT"):
        assert multi_step not in explained, (statement, explained)


#: What a new pooled connection asks once, before any request (flask_idem._timeouts.server_timeouts).
CONNECTION_SETUP = ("SELECT pg_backend_pid()", "SELECT set_config(")


def is_data_statement(query: Any) -> bool:
    """A statement of a request: a query or a write, not a connection's setup."""
    text = (query.decode() if isinstance(query, bytes) else str(query)).lstrip()
    if text.startswith(CONNECTION_SETUP):
        return False
    return text.split(None, 1)[0].upper() in ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")


@pytest.fixture
def store(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Store]:
    store = Store(ForkSafeConnectionPool(database_url, max_size=4), distributed=True, tombstone_ttl=3600.0)
    yield store
    store.source.close()


def test_tables_are_distributed_and_colocated(db: psycopg.Connection[Any]) -> None:
    """The key table (partitioned, with its first partition), its outbox, its tombstones, orders, payments
    and fulfilments are distributed by org_id in one co-location group; orgs is a reference table; the
    reserve function is delegated with the key table."""
    rows = dict(
        db.execute(
            "SELECT logicalrelid::text, partmethod::text || ':'"
            " || coalesce(column_to_column_name(logicalrelid, partkey), '') || ':' || colocationid"
            " FROM pg_dist_partition"
        ).fetchall()
    )
    keys = rows["idempotency_keys"]
    assert keys.startswith("h:org_id:")
    assert rows["orders"] == keys and rows["payments"] == keys
    assert rows["idempotency_keys_outbox"] == keys and rows["fulfilments"] == keys
    assert rows["orgs"].startswith("n::")
    assert rows["idempotency_keys_tombstones"] == keys and rows["idempotency_keys_p0"] == keys
    found = db.execute(
        "SELECT distribution_argument_index, colocationid, force_delegation FROM pg_dist_object"
        " WHERE objid = %s::regproc",
        ("idempotency_keys_reserve",),
    ).fetchone()
    assert found == (0, int(keys.rsplit(":", 1)[1]), True)


def test_store_statements_are_router_queries(
    store: Store, recorded: list[tuple[Any, Any]], db: psycopg.Connection[Any]
) -> None:
    """Reserve, replay lookup, complete, and every write under a lease reach one shard."""
    atomic, leased = uuid.uuid4(), uuid.uuid4()
    mine, theirs = Lease(7, leased, uuid.uuid4(), 60), Lease(7, leased, uuid.uuid4(), 60)
    with store.source.connection() as conn:
        with conn.transaction():
            assert store.reserve(conn, KeyedRequest(7, atomic, SHA, "POST", "/x"), ttl=60).reserved
            store.complete(conn, KeyRef(7, atomic), {"status": 201})
        with conn.transaction():  # the replay path
            assert store.reserve(conn, KeyedRequest(7, atomic, SHA, "POST", "/x"), ttl=60).record is not None
        with conn.transaction():
            request = KeyedRequest(7, leased, SHA, "POST", "/x")
            assert store.reserve(conn, request, ttl=60, flow="f", lease=mine).reserved
        with conn.transaction():
            assert store.hold(conn, mine)
            assert store.record_step(conn, mine, "s", 1)
            assert store.release(conn, mine, error="e", retry_in=0)
        with conn.transaction():
            assert store.take_over(conn, theirs)
            assert store.complete(conn, theirs, {"status": 200})
    statements = [(q, p) for q, p in recorded if is_data_statement(q)]
    # Before each reserve function, the guard: the key table's lock on the coordinator, no shard read.
    guards = [q for q, _ in statements if q == store._sql.guard]
    assert len(guards) == 3
    guarded = plan(db, store._sql.guard, None)
    assert "One-Time Filter: (false" in guarded and "Scan on" not in guarded, guarded
    statements = [(q, p) for q, p in statements if q != store._sql.guard]
    assert len(statements) == 9
    for query, params in statements:
        assert_router(plan(db, query, params), query)
    assert "Function Scan on idempotency_keys_reserve" in plan(db, *statements[0])
    # The lookup in every partition and among the tombstones (a replay's, after an expired key's delete).
    assert_router(plan(db, store._sql.lookup, {"org_id": 7, "key": atomic, "tomb": 60.0}), "lookup")


def test_plain_reserve_statement_is_multi_step(
    database_url: str, recorded: list[tuple[Any, Any]], db: psycopg.Connection[Any]
) -> None:
    """Why the function exists: the single-statement reserve of plain PostgreSQL is not a router query."""
    plain = Store(ForkSafeConnectionPool(database_url, max_size=1))
    try:
        with plain.source.connection() as conn, conn.transaction():
            plain.reserve(conn, KeyedRequest(7, uuid.uuid4(), SHA, "P", "/"), ttl=1.0)
    finally:
        plain.source.close()
    reserve = next((q, p) for q, p in recorded if is_data_statement(q) and b"INSERT INTO" in q)
    explained = plan(db, *reserve)
    assert "Distributed Subplan" in explained and "pull to coordinator" in explained


def test_shop_requests_run_router_queries(
    database_url: str, gateway_url: str, recorded: list[tuple[Any, Any]], db: psycopg.Connection[Any]
) -> None:
    """An order, its replay and its payment: every statement the shop and the store send hits one shard."""
    app = create_app({"TESTING": True, "DATABASE_URL": database_url, "GATEWAY_URL": gateway_url})
    try:
        client = app.test_client()
        with app.app_context():
            from example_app.cli import create_org

            _, api_key = create_org("acme")
        key = uuid.uuid4()
        order = client.post("/orders", json={"amount": 5, "currency": "EUR"}, headers=headers(api_key, key))
        assert order.status_code == 201
        assert client.post("/orders", json={"amount": 5, "currency": "EUR"}, headers=headers(api_key, key))
        pay = {"order_id": order.get_json()["id"], "source": "tok_visa"}
        assert client.post("/payments", json=pay, headers=headers(api_key, uuid.uuid4())).status_code == 201
        assert client.get(f"/orders/{pay['order_id']}", headers=headers(api_key)).status_code == 200
    finally:
        get_state(app).source.close()
    statements = [(q, p) for q, p in recorded if is_data_statement(q)]
    touched = " ".join(str(q) for q, _ in statements)
    for table in ("orders", "payments", "idempotency_keys"):
        assert table in touched
    for query, params in statements:
        explained = plan(db, query, params)
        if "INSERT INTO orgs" in str(query):  # a reference table: one task per node, by design
            continue
        if "gateway_" in str(query):  # the gateway simulator's own tables stay on the coordinator
            continue
        if "obj_description(" in str(query):  # the key table's layout, read once from the catalog
            continue
        assert_router(explained, query)


def _node_urls(cluster: citus.Cluster, database_url: str) -> list[str]:
    name = conninfo_to_dict(database_url)["dbname"]
    return [node.url(name) for node in cluster.nodes]


@pytest.mark.parametrize(
    ("first", "second"),
    [(0, 0), (0, 1), (1, 2), (2, 0)],
    ids=["coordinator-coordinator", "coordinator-worker", "worker-other-worker", "worker-coordinator"],
)
def test_in_flight_duplicate_is_refused_at_once_through_any_node(
    citus_cluster: citus.Cluster, store: Store, database_url: str, first: int, second: int
) -> None:
    """A duplicate while the first attempt's transaction is open is answered "in flight" at once,
    whichever nodes the two requests enter through: the key's lock lives on its shard's node."""
    urls = _node_urls(citus_cluster, database_url)
    key = uuid.uuid4()
    request = KeyedRequest(3, key, SHA, "POST", "/x")
    with (
        psycopg.connect(urls[first], autocommit=True) as a,
        psycopg.connect(urls[second], autocommit=True) as b,
    ):
        # A wait on the first attempt's row would hit this and fail the test instead of passing slowly.
        b.execute("SET lock_timeout = '2s'")
        with a.transaction():
            assert store.reserve(a, request, ttl=60).reserved
            with b.transaction():
                assert store.reserve(b, request, ttl=60) == Reservation(reserved=False)
            store.complete(a, request, {"status": 201})
        with b.transaction():
            found = store.reserve(b, request, ttl=60)
    assert not found.reserved and found.record is not None and found.record.status == "completed"


def test_lock_is_taken_on_the_shards_node(
    citus_cluster: citus.Cluster, store: Store, database_url: str, db: psycopg.Connection[Any]
) -> None:
    """The advisory lock of a reservation is held on the node of the key's shard, not where it entered."""
    key = uuid.uuid4()
    node = db.execute(
        "SELECT nodeport FROM pg_dist_shard_placement p JOIN pg_dist_shard s USING (shardid)"
        " WHERE s.logicalrelid = 'idempotency_keys'::regclass"
        " AND get_shard_id_for_distribution_column('idempotency_keys', 5) = shardid"
    ).fetchone()
    assert node is not None
    lock = lock_id(5, key)
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = %s"
        " AND objid::bigint = %s AND objsubid = 1"
    )
    name = conninfo_to_dict(database_url)["dbname"]
    with psycopg.connect(citus_cluster.coordinator.url(name)) as a, a.transaction():
        store.reserve(a, KeyedRequest(5, key, SHA, "POST", "/x"), ttl=60.0)
        for n in citus_cluster.nodes:
            with psycopg.connect(n.url(name)) as probe:
                got = probe.execute(held, ((lock >> 32) & 0xFFFFFFFF, lock & 0xFFFFFFFF)).fetchone()
            assert got == ((1,) if n.port == node[0] else (0,)), n.name


def test_concurrent_duplicates_make_one_order(
    gunicorn_shop: str, make_org: Callable[[str], tuple[int, str]], db: psycopg.Connection[Any]
) -> None:
    """Twenty concurrent requests with one key per organisation, four organisations: one order each."""
    import requests

    keys = [make_org(f"org-{i}")[1] for i in range(4)]
    statuses: list[int] = []

    def send(api_key: str, key: uuid.UUID) -> None:
        response = requests.post(
            gunicorn_shop + "/orders",
            json={"amount": 5, "currency": "EUR"},
            headers=headers(api_key, key),
            timeout=30,
        )
        statuses.append(response.status_code)

    threads = [
        threading.Thread(target=send, args=(api_key, key))
        for api_key, key in ((k, uuid.uuid4()) for k in keys)
        for _ in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert count(db, "orders") == 4
    assert set(statuses) <= {200, 201, 409} and statuses.count(201) == 4


def test_recovery_claim_and_stuck_span_shards(store: Store, db: psycopg.Connection[Any]) -> None:
    """The multi-shard statements work across organisations on every node."""
    for org in range(1, 9):
        db.execute(
            "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, expires_at, flow,"
            " lease_token, lease_expires_at, created_at) VALUES (%s, gen_random_uuid(), %s, 'POST', '/x',"
            " now() + interval '1 h', 'f', gen_random_uuid(), now() - interval '1 s',"
            " now() - interval '1 h')",
            (org, SHA),
        )
    shards = db.execute(
        "SELECT count(DISTINCT get_shard_id_for_distribution_column('idempotency_keys', o))"
        " FROM generate_series(1, 8) o"
    ).fetchone()
    assert shards is not None and shards[0] > 1
    assert len(store.stuck(older_than=60)) == 8
    claimed: set[int] = set()
    with store.source.connection() as conn, conn.transaction():
        for row in store.claim_stranded(
            conn, token=uuid.uuid4(), lease=60, limit=5, deadline=60, flows=["f"]
        ):
            assert row.overdue
            claimed.add(row.org_id)
    with store.source.connection() as conn, conn.transaction():
        more = store.claim_stranded(conn, token=uuid.uuid4(), lease=60, limit=5, deadline=60, flows=["f"])
    assert len(claimed) == 5 and {r.org_id for r in more} == set(range(1, 9)) - claimed


# -- the key table partitioned by time --------------------------------------------------------

#: A key table of its own for the tests below, whose first partition ends a second after it is made, so
#: that partitions of a few seconds follow it (IDEM_PARTITION_INTERVAL).
SHORT = "short_keys"


@pytest.fixture
def short_table(direct_database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """``short_keys``, distributed, its first partition ending a second from now; dropped afterwards."""
    drop(direct_database_url, SHORT)
    _migrate.upgrade(direct_database_url, table=SHORT, distributed=True, horizon=1.0)
    yield SHORT
    drop(direct_database_url, SHORT)


def partition_of(db: psycopg.Connection[Any], table: str, moment: datetime) -> _partitions.Partition:
    """The partition of ``table`` whose range holds ``moment``."""
    found = [
        part
        for part in _partitions.partitions(db, table)
        if (part.lower is None or part.lower <= moment) and (part.upper is None or moment < part.upper)
    ]
    assert len(found) == 1, (moment, _partitions.partitions(db, table))
    return found[0]


def made_ahead(db: psycopg.Connection[Any], table: str, seconds: float, make: Callable[[], Any]) -> None:
    """Call ``make`` (which makes partitions of ``table`` ahead) until they cover ``seconds`` from now:
    on a busy machine making them may take longer than the time they were to cover."""

    def covered() -> bool:
        make()
        last = _partitions.partitions(db, table)[-1].upper
        until = db.execute("SELECT now() + make_interval(secs => %s)", (seconds,)).fetchone()
        return last is not None and until is not None and last >= until[0]

    wait_for(covered, timeout=300, interval=0, message=f"partitions of {table} were not made ahead")


def test_reservations_across_a_partition_boundary_find_the_key(
    citus_cluster: citus.Cluster,
    short_table: str,
    database_url: str,
    direct_database_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """A key reserved in one partition is found by reservations whose rows would go to the next one,
    through any node: in flight while the first attempt's transaction is open, its answer once it
    committed; never a second row. The primary key guards one partition only: the key's lock and the
    lookup in every partition, in the delegated reserve function, decide."""
    ttl = 3.0
    made_ahead(
        db,
        short_table,
        ttl + 20,
        lambda: _partitions.maintain(
            direct_database_url, table=short_table, interval=5.0, horizon=ttl + 40, tombstone_ttl=0
        ),
    )
    store = Store(
        ForkSafeConnectionPool(database_url, max_size=2),
        table=short_table,
        distributed=True,
        tombstone_ttl=3600.0,
    )
    urls = _node_urls(citus_cluster, database_url)
    key = uuid.uuid4()
    request = KeyedRequest(9, key, SHA, "POST", "/x")
    try:
        with psycopg.connect(urls[0], autocommit=True) as a, psycopg.connect(urls[2], autocommit=True) as b:
            b.execute("SET lock_timeout = '2s'")
            with a.transaction():
                assert store.reserve(a, request, ttl=ttl).reserved
                row = a.execute(
                    sql.SQL("SELECT expires_at FROM {} WHERE org_id = 9 AND idem_key = %s").format(
                        sql.Identifier(short_table)
                    ),
                    (key,),
                ).fetchone()
                assert row is not None
                first = partition_of(db, short_table, row[0])
                assert first.upper is not None

                def next_partition() -> bool:
                    """A reservation now would expire past the first attempt's partition."""
                    later = db.execute("SELECT now() + make_interval(secs => %s)", (ttl,)).fetchone()
                    return later is not None and later[0] >= first.upper

                while not next_partition():
                    with b.transaction():  # meanwhile, through a worker: in flight
                        assert store.reserve(b, request, ttl=ttl) == Reservation(reserved=False)
                with b.transaction():
                    assert store.reserve(b, request, ttl=ttl) == Reservation(reserved=False)
                store.complete(a, request, {"status": 201})
            with b.transaction():
                found = store.reserve(b, request, ttl=ttl)
                moment = b.execute(
                    "SELECT statement_timestamp() + make_interval(secs => %s)", (ttl,)
                ).fetchone()
        assert not found.reserved and found.record is not None and found.record.status == "completed"
        assert moment is not None and partition_of(db, short_table, moment[0]).name != first.name
        rows = db.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE idem_key = %s").format(sql.Identifier(short_table)), (key,)
        ).fetchone()
        assert rows == (1,)
    finally:
        store.source.close()


def test_the_spares_replacement_is_one_transaction(
    short_table: str, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """On Citus the spare's detach is a plain one, done with its check and its drop in one transaction:
    a spare that a row came into after it was chosen is never detached (the transaction rolls back), its
    row in the key table all along; an empty one is dropped, and the next run makes its range again."""
    start = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]

    def maintain() -> _partitions.RetentionReport:
        return _partitions.maintain(
            direct_database_url, table=short_table, interval=2.0, horizon=20.0, tombstone_ttl=0,
            ahead=16.0, now=lambda: start, echo=lambda _: None,
        )  # fmt: skip

    maintain()
    spare = _partitions.partitions(db, short_table)[-1]
    assert spare.lower is not None and spare.upper is not None
    assert spare.upper - spare.lower > timedelta(seconds=2)
    key = uuid.uuid4()
    insert_completed(db, short_table, key, spare.lower, org=9)
    db.commit()
    tables = Tables(short_table, distributed=True)

    def replace() -> tuple[_partitions.RetentionReport, list[str]]:
        report, lines = _partitions.RetentionReport(), []
        with psycopg.connect(direct_database_url, autocommit=True) as conn:
            runner = _migrate._Runner(conn, short_table, tables.names, 2.0, lines.append)
            runner.distributed = runner.is_distributed()
            assert runner.distributed
            replace_spare(Maintenance(runner, tables, lambda: start, report), tables.keys, spare)
        return report, lines

    seen: list[int] = []
    done = threading.Event()

    query = sql.SQL("SELECT count(*) FROM {} WHERE idem_key = %s").format(sql.Identifier(short_table))

    def read() -> None:
        """The key's row through the key table, over and over, while the spare is being replaced."""
        with psycopg.connect(direct_database_url, autocommit=True) as reader:
            while not done.is_set():
                found = reader.execute(query, (key,)).fetchone()
                seen.append(found[0] if found else -1)

    reading = threading.Thread(target=read)
    reading.start()
    try:
        wait_for(lambda: len(seen) > 0, message="the reader read nothing")
        report, lines = replace()
        after = len(seen)  # and reads on after the replacement: a read it held up has returned
        wait_for(lambda: len(seen) > after + 1, message="the reader stopped")
    finally:
        done.set()
        reading.join()
    assert report.dropped == [] and any("left attached, and kept" in line for line in lines), lines
    assert len(seen) > 1 and set(seen) == {1}  # never missed
    assert spare in _partitions.partitions(db, short_table)
    assert partition_of(db, short_table, spare.lower).name == spare.name
    assert count(db, short_table) == 1

    db.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(short_table)))
    db.commit()
    report, lines = replace()
    assert report.dropped == [spare.name]
    assert spare.name not in {p.name for p in _partitions.partitions(db, short_table)}
    assert db.execute("SELECT to_regclass(%s)", (spare.name,)).fetchone() == (None,)
    maintain()  # the range it leaves is made again: no gap
    parts = _partitions.partitions(db, short_table)
    assert all(a.upper == b.lower for a, b in zip(parts, parts[1:], strict=False))
    assert partition_of(db, short_table, spare.lower).lower == spare.lower  # a partition of the interval


def test_maintain_drops_passed_partitions_and_tombstones_answer(
    short_table: str, make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """`flask idem purge` on the distributed partitioned table: partitions made ahead, a passed one
    retired (its keys' compact tombstones written, then detached and dropped), and a late retry
    answered from the tombstone: 303 to the first answer's Location, or 410 without one."""
    app = make_app(
        IDEM_TABLE=short_table,
        IDEM_KEY_TTL=2,
        IDEM_TOMBSTONE_TTL=3600,
        IDEM_PARTITION_INTERVAL=5,
        IDEM_PARTITION_AHEAD=40,
    )
    runner = app.test_cli_runner()

    def purge() -> str:
        result = runner.invoke(args=["idem", "purge"])
        assert result.exit_code == 0, result.output
        return result.output

    made_ahead(db, short_table, 20, purge)
    located, plain = uuid.uuid4(), uuid.uuid4()
    first = post(app, "/notes", located, {"body": "located"})
    assert first.status_code == 201
    assert post(app, "/notes/replayable", plain, {"body": "plain"}).status_code == 201
    expiries = [
        row[0] for row in db.execute(sql.SQL("SELECT expires_at FROM {}").format(sql.Identifier(short_table)))
    ]
    assert len(expiries) == 2
    holding = {partition_of(db, short_table, moment).name for moment in expiries}
    last = max(p.upper for p in _partitions.partitions(db, short_table) if p.name in holding)  # type: ignore[type-var]

    def passed() -> bool:
        """Their partitions' ranges passed, and the grace after (the interval)."""
        now = db.execute("SELECT now() - interval '5 seconds'").fetchone()
        return now is not None and now[0] >= last

    wait_for(passed, timeout=30, interval=0.2, message="the partitions' ranges did not pass")
    assert "wrote 2 tombstone(s)" in purge()
    assert not holding & {p.name for p in _partitions.partitions(db, short_table)}
    for name in holding:
        assert db.execute("SELECT to_regclass(%s)", (name,)).fetchone() == (None,)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(short_table))).fetchone() == (
        0,
    )

    late = post(app, "/notes", located, {"body": "located"})
    assert (late.status_code, late.headers["Location"]) == (303, first.headers["Location"])
    gone = post(app, "/notes/replayable", plain, {"body": "plain"})
    assert gone.status_code == 410
    assert count(db, "notes") == 2
