"""The key store on its own: schema, reservation races, leases, claiming, purge."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from flask_idem._migrate import upgrade
from flask_idem._pool import ForkSafeConnectionPool, PooledConnection
from flask_idem._records import KeyedRequest, KeyRef, Lease, lock_id
from flask_idem._store import Store

from .support import citus
from .support.helpers import PREPARE_THRESHOLD, wait_for

SHA = b"\x01" * 32


@pytest.fixture
def store(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Store]:
    pool = ForkSafeConnectionPool(database_url, max_size=20, prepare_threshold=PREPARE_THRESHOLD)
    store = Store(pool, distributed=citus.ENABLED)
    yield store
    store.source.close()


def reserve(store: Store, conn: Any, key: uuid.UUID, **extra: Any) -> Any:
    return store.reserve(conn, KeyedRequest(1, key, SHA, "POST", "/x"), ttl=60.0, **extra)


def test_init_schema_twice_and_custom_table(database_url: str, db: psycopg.Connection[Any]) -> None:
    """The DDL is idempotent and honours a schema-qualified table name."""
    db.execute("CREATE SCHEMA IF NOT EXISTS idem_custom")
    pool = ForkSafeConnectionPool(database_url, prepare_threshold=PREPARE_THRESHOLD)
    custom = Store(pool, table="idem_custom.keys", distributed=citus.ENABLED)
    try:
        for _ in range(2):
            upgrade(database_url, table="idem_custom.keys", distributed=citus.ENABLED)
        with custom.source.connection() as conn, conn.transaction():
            assert reserve(custom, conn, uuid.uuid4()).reserved
        assert db.execute("SELECT count(*) FROM idem_custom.keys").fetchone() == (1,)
    finally:
        custom.source.close()
        db.execute("DROP SCHEMA idem_custom CASCADE")


@pytest.mark.parametrize("table", ["", "a.b.c", ".x"], ids=["empty", "three-parts", "empty-schema"])
def test_bad_table_names(table: str) -> None:
    """A table name that is not 'table' or 'schema.table' is refused."""
    with pytest.raises(ValueError):
        Store(ForkSafeConnectionPool("postgresql://unused"), table=table)


def test_concurrent_reservations_have_one_winner(store: Store) -> None:
    """Ten transactions reserving one key at once: one wins, the others see it in flight, none waits."""
    key = uuid.uuid4()
    barrier = threading.Barrier(10)
    release = threading.Event()
    outcomes: list[str] = []

    def attempt() -> None:
        with store.source.connection() as conn, conn.transaction():
            barrier.wait(10)
            found = reserve(store, conn, key)
            outcomes.append("won" if found.reserved else "in flight" if found.record is None else "seen")
            if found.reserved:
                release.wait(10)  # hold the reservation until every loser has answered

    threads = [threading.Thread(target=attempt) for _ in range(10)]
    for t in threads:
        t.start()
    try:  # the losers must answer while the winner holds its reservation, not wait for it
        wait_for(lambda: len(outcomes) == 10, 10, 0.01, message=lambda: f"only {outcomes} answered")
    finally:
        release.set()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["in flight"] * 9 + ["won"]


def test_lock_ids_differ_by_org_and_key() -> None:
    """The advisory lock id mixes organisation and key."""
    key = uuid.uuid4()
    assert lock_id(1, key) != lock_id(2, key)
    assert lock_id(1, key) != lock_id(1, uuid.uuid4())
    assert -(2**63) <= lock_id(-5, key) < 2**63


def test_claims_are_disjoint(store: Store, db: psycopg.Connection[Any]) -> None:
    """Two claimers at once never get the same stranded row."""
    for _ in range(6):
        db.execute(
            "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, expires_at, flow,"
            " lease_token, lease_expires_at)"
            " VALUES (1, gen_random_uuid(), %s, 'POST', '/x', now() + interval '1 hour', 'f',"
            " gen_random_uuid(), now() - interval '1 second')",
            (SHA,),
        )
    first_claimed = threading.Event()
    results: dict[str, list[Any]] = {}

    def claim(name: str, hold: bool) -> None:
        with store.source.connection() as conn, conn.transaction():
            results[name] = store.claim_stranded(
                conn, token=uuid.uuid4(), lease=60, limit=4, deadline=3600, flows=["f"]
            )
            if hold:
                first_claimed.set()
                conn.execute("SELECT pg_sleep(0.3)")  # keep the claimed rows locked a moment

    holder = threading.Thread(target=claim, args=("a", True))
    holder.start()
    assert first_claimed.wait(10)
    claim("b", False)  # runs while "a" still holds its rows: it gets the others
    holder.join(10)
    a = {r.key for r in results["a"]}
    b = {r.key for r in results["b"]}
    assert (len(a), len(b)) == (4, 2)
    assert not a & b


def test_lease_guard(store: Store, db: psycopg.Connection[Any]) -> None:
    """Only the holder of the current lease token can record, finish or release."""
    key = uuid.uuid4()
    mine, theirs = uuid.uuid4(), uuid.uuid4()
    with store.source.connection() as conn, conn.transaction():
        assert reserve(store, conn, key, flow="f", lease=Lease(1, key, mine, 60)).reserved
    mine_lease, their_lease = Lease(1, key, mine, 60), Lease(1, key, theirs, 60)
    with store.source.connection() as conn, conn.transaction():
        assert not store.take_over(conn, their_lease)  # lease still live
        assert store.record_step(conn, mine_lease, "s", {"n": 1})
        assert not store.record_step(conn, their_lease, "s", {"n": 2})
    db.execute("UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'")
    with store.source.connection() as conn, conn.transaction():
        assert store.take_over(conn, their_lease)
        assert not store.complete(conn, mine_lease, {"status": 200})
        assert not store.release(conn, mine_lease, error="late", retry_in=1)
        assert store.complete(conn, their_lease, {"status": 200, "headers": [], "body": ""})
    assert db.execute("SELECT status, state, attempts FROM idempotency_keys").fetchone() == (
        "completed",
        {"s": {"n": 1}},
        1,
    )


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_pool_is_per_process(store: Store) -> None:
    """A forked child gets a pool of its own instead of the parent's connections."""
    parent_pool = store.source.pool
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports whether it got a new pool that works, then exits at once
        try:
            ok = store.source.pool is not parent_pool
            with store.source.connection() as conn:
                ok = ok and conn.execute("SELECT 1").fetchone() == (1,)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    with store.source.connection() as conn:  # the parent's pool still works after the child exited
        assert conn.execute("SELECT 2").fetchone() == (2,)


def test_expired_key_flagged_for_a_person_is_kept(store: Store, db: psycopg.Connection[Any]) -> None:
    """An expired row flagged for a person is not renewed: its stored answer stands."""
    key = uuid.uuid4()
    db.execute(
        "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response,"
        " expires_at, needs_attention)"
        " VALUES (1, %s, %s, 'POST', '/x', 'failed', '{\"status\": 500}', now() - interval '1 hour', true)",
        (key, SHA),
    )
    with store.source.connection() as conn, conn.transaction():
        found = reserve(store, conn, key)
    assert not found.reserved
    assert found.record is not None and found.record.status == "failed"
    assert count_rows(db) == 1


def count_rows(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM idempotency_keys").fetchone()
    assert row is not None
    return int(row[0])


def test_racing_reservations_on_rotating_keys(store: Store, db: psycopg.Connection[Any]) -> None:
    """Eight threads racing on keys that change every few milliseconds: each key is won once, nothing fails.

    A request can take a key's lock just after another committed it, with a snapshot from just before:
    the rare path where the reservation must look again. Only many real races reach it.
    """
    deadline = time.monotonic() + 4
    won: dict[uuid.UUID, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def hammer() -> None:
        while time.monotonic() < deadline:
            key = uuid.UUID(int=int(time.monotonic() * 200))  # a new key every 5 ms
            try:
                with store.source.connection() as conn, conn.transaction():
                    found = reserve(store, conn, key)
                    if found.reserved:
                        store.complete(conn, KeyRef(1, key), {"status": 201, "headers": [], "body": ""})
                        with lock:
                            won[key] = won.get(key, 0) + 1
                    else:
                        assert found.record is None or found.record.status == "completed"
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    assert won and set(won.values()) == {1}
    assert count_rows(db) == len(won)


def test_store_statements_share_one_cursor_per_pooled_connection(database_url: str, store: Store) -> None:
    """The pool's connections keep one cursor for the store; a plain psycopg connection works too."""
    with store.source.connection() as conn:
        assert isinstance(conn, PooledConnection)
        with conn.transaction():
            assert reserve(store, conn, uuid.uuid4()).reserved
        first = conn._idem_store_cursor
        assert first is not None and not first.closed
        with conn.transaction():
            assert reserve(store, conn, uuid.uuid4()).reserved
            store.complete(conn, KeyRef(1, uuid.uuid4()), {"status": 200})
        assert conn._idem_store_cursor is first
        first.close()  # whoever closes it, the next statement gets a new one
        with conn.transaction():
            assert reserve(store, conn, uuid.uuid4()).reserved
        assert conn._idem_store_cursor is not first and not conn._idem_store_cursor.closed
    with psycopg.connect(database_url, autocommit=True) as plain, plain.transaction():
        key = uuid.uuid4()
        assert reserve(store, plain, key).reserved
        assert not reserve(store, plain, key).reserved
