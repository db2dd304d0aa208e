"""Ways to send a fresh key's transaction, side by side: client and server CPU per transaction.

    uv run python bench/batches.py                 # 7 rounds of 1000 transactions per way (~1 min)
    uv run python bench/batches.py --rounds 3 --transactions 500

One process, one connection, the extension's own statements (``flask_idem._store``) against a scratch
database (``flask_idem_bench_batches`` on ``FLASK_IDEM_BENCH_DATABASE_URL``). Each way runs the SQL of a
fresh-key request without HTTP: the reservation, an order's ``INSERT``, the completion, in one
transaction. The ways take turns, ``--transactions`` each per round, the order rotated every round, and
each figure is the median of the rounds:

- client CPU: this process's CPU time (psycopg, libpq, the store's Python) per transaction;
- server CPU: the connection's backend's CPU time (``/proc/<pid>/stat``) per transaction;
- wall: time per transaction, one after another (no concurrency: every wait is paid in full).

The ways (round trips per transaction in brackets):

- **bare transaction** (3): ``BEGIN``, the ``INSERT``, ``COMMIT``, as without the extension;
- **floor** (5): the bare transaction plus two ``SELECT 1``;
- **one statement per round trip** (5): psycopg's own ``transaction()`` around the store's statements,
  as before batches;
- **one statement per round trip, unprepared** (5): the same with psycopg's prepared statements off, as
  behind PgBouncer without prepared statements;
- **psycopg pipeline** (3): ``BEGIN`` and the reservation in one ``conn.pipeline()`` block, the
  completion and ``COMMIT`` in another;
- **batches, unprepared** (3): ``flask_idem._pool.Batched`` with nothing prepared, as behind PgBouncer
  without prepared statements (``IDEM_PREPARE_THRESHOLD = None``);
- **batches, prepared** (3): ``Batched`` as the pool uses it by default;
- **server functions** (3): batches calling PL/pgSQL functions for the reservation (the Citus one,
  ``distributed.sql``) and the completion, unprepared: their plans are cached by PL/pgSQL instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/batches.py` from anywhere

from psycopg import sql  # noqa: E402
from psycopg.rows import dict_row  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

from bench.harness import DEFAULT_SERVER_URL, scratch_database  # noqa: E402
from flask_idem import _layout, _wire  # noqa: E402
from flask_idem._pool import Batched, PooledConnection  # noqa: E402
from flask_idem._records import KeyedRequest, lock_id  # noqa: E402
from flask_idem._store import Store  # noqa: E402

INSERT = "INSERT INTO orders (org_id, k, amount, currency) VALUES (%s, %s, %s, %s) RETURNING id, created_at"
RESPONSE = {
    "status": 201,
    "headers": [["Content-Type", "application/json"], ["Location", "/orders/12345"]],
    "body": '{"amount":1250,"created_at":"2026-12-01T03:00:00+00:00","currency":"EUR","id":12345}\n',
}
TTL = 86400.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transactions", type=int, default=1000)
    args = parser.parse_args()
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    with scratch_database(server, "flask_idem_bench_batches") as url:
        conn = PooledConnection.connect(url, autocommit=True, prepare_threshold=5)
        try:
            ways = _ways(conn)
            figures = _measure(conn, ways, args.rounds, args.transactions)
        finally:
            conn.close()
    _print(figures, args)


def _ways(conn: PooledConnection) -> dict[str, Callable[[], None]]:
    store = Store(None, tombstone_ttl=TTL)  # type: ignore[arg-type]  # no pool: the statements only
    key_table = _layout.revisions()[0]  # layout 1: the table, and the reserve function below
    names = _layout.names("idempotency_keys")
    conn.execute(sql.SQL(key_table.sql).format(**names))
    conn.execute(
        "CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, org_id bigint, k uuid,"
        " amount bigint, currency text, created_at timestamptz DEFAULT now(), UNIQUE (org_id, k))"
    )
    # The reserve function of layout 1's Citus statements, without the others, and a completion function.
    ddl = sql.SQL(key_table.distributed_sql).format(**names).as_string(None)
    conn.execute(
        ddl[ddl.index("CREATE OR REPLACE FUNCTION") : ddl.index("SELECT create_distributed_function")]
    )
    conn.execute(
        "CREATE FUNCTION idempotency_keys_complete(p_org_id bigint, p_key uuid, p_response jsonb)"
        " RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN"
        " UPDATE idempotency_keys SET status = 'completed', response = p_response"
        " WHERE org_id = p_org_id AND idem_key = p_key; RETURN FOUND; END $$"
    )
    reserve_call = _wire.Statement.from_query(
        b"SELECT * FROM idempotency_keys_reserve(%(org_id)s::bigint, %(key)s, %(sha)s, %(method)s,"
        b" %(path)s, %(ttl)s, %(lock)s, NULL, NULL, NULL, %(tomb)s)"
    )
    complete_call = _wire.Statement.from_query(
        b"SELECT idempotency_keys_complete(%(org_id)s, %(key)s, %(response)s)"
    )
    cursor = conn.cursor(row_factory=dict_row)

    def request() -> KeyedRequest:
        return KeyedRequest(1, uuid.uuid4(), os.urandom(32), "POST", "/orders")

    def insert(key: uuid.UUID) -> None:
        conn.execute(INSERT, (1, key, 1250, "EUR")).fetchone()

    def bare() -> None:
        with conn.transaction():
            insert(uuid.uuid4())

    def floor() -> None:
        with conn.transaction():
            conn.execute("SELECT 1")
            insert(uuid.uuid4())
            conn.execute("SELECT 1")

    def through_store(batched: Batched | None) -> Callable[[], None]:
        def run() -> None:
            keyed = request()
            with batched or conn.transaction():
                assert store.reserve(conn, keyed, ttl=TTL).reserved
                insert(keyed.key)
                store.complete(conn, keyed, RESPONSE)

        return run

    def unprepared(way: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            conn.prepare_threshold = None
            try:
                way()
            finally:
                conn.prepare_threshold = 5

        return run

    def pipeline() -> None:
        keyed = request()
        transaction = conn.transaction()
        with conn.pipeline():
            transaction.__enter__()
            cursor.execute(store._sql.reserve, _params(keyed, store))
        row = cursor.fetchone()
        assert row is not None and row["fresh"]
        insert(keyed.key)
        with conn.pipeline():
            cursor.execute(store._sql.complete, {"org_id": 1, "key": keyed.key, "response": Jsonb(RESPONSE)})
            transaction.__exit__(None, None, None)

    def functions() -> None:
        keyed = request()
        with Batched(conn, prepare=False) as transaction:
            assert transaction.begin(reserve_call, _params(keyed, store)).rows[0]["fresh"]
            insert(keyed.key)
            transaction.defer(complete_call, {"org_id": 1, "key": keyed.key, "response": Jsonb(RESPONSE)})

    return {
        "bare transaction (BEGIN, INSERT, COMMIT)": bare,
        "floor (bare + 2 × SELECT 1)": floor,
        "one statement per round trip (before)": through_store(None),
        "one statement per round trip, unprepared": unprepared(through_store(None)),
        "psycopg pipeline": pipeline,
        "batches, unprepared": lambda: through_store(Batched(conn, prepare=False))(),
        "batches, prepared (chosen)": lambda: through_store(Batched(conn, prepare=True))(),
        "server functions in batches": functions,
    }


def _params(keyed: KeyedRequest, store: Store) -> dict[str, Any]:
    return {
        "org_id": keyed.org_id,
        "key": keyed.key,
        "sha": keyed.request_sha,
        "method": keyed.method,
        "path": keyed.path,
        "ttl": TTL,
        "tomb": store.tombstone_ttl,
        "lock": lock_id(keyed.org_id, keyed.key),
    }


def _server_cpu(pid: int) -> float:
    """CPU seconds the backend ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(
    conn: PooledConnection, ways: dict[str, Callable[[], None]], rounds: int, transactions: int
) -> dict[str, tuple[float, float, float]]:
    """Median client CPU, server CPU and wall µs per transaction of each way."""
    pid = conn.info.backend_pid
    names = list(ways)
    for way in ways.values():  # warm-up: past psycopg's prepare threshold, caches filled
        for _ in range(50):
            way()
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            way = ways[name]
            client, server, wall = time.process_time(), _server_cpu(pid), time.perf_counter()
            for _ in range(transactions):
                way()
            client, server = time.process_time() - client, _server_cpu(pid) - server
            wall = time.perf_counter() - wall
            per = 1e6 / transactions
            samples[name].append((client * per, server * per, wall * per))
        print(f"# round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return {
        name: tuple(statistics.median(sample[i] for sample in rows) for i in range(3))  # type: ignore[misc]
        for name, rows in samples.items()
    }


def _print(figures: dict[str, tuple[float, float, float]], args: argparse.Namespace) -> None:
    before = figures["one statement per round trip (before)"]
    print("| way | client CPU µs | server CPU µs | both | × before | wall µs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (client, server, wall) in figures.items():
        both = client + server
        ratio = both / (before[0] + before[1])
        print(f"| {name} | {client:.0f} | {server:.0f} | {both:.0f} | {ratio:.2f} | {wall:.0f} |")
    print(
        f"\n{args.rounds} rounds of {args.transactions} transactions per way, taking turns; medians of the"
        f" rounds. Server CPU is the backend's, from /proc (in clock ticks of"
        f" {1000 / os.sysconf('SC_CLK_TCK'):.0f} ms over {args.transactions} transactions); load average at"
        f" the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )


if __name__ == "__main__":
    main()
