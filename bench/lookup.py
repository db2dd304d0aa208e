"""What a key's lookup costs PostgreSQL, by the partitions it reads; prints two tables.

    uv run python bench/lookup.py               # 20,000 transactions a statement and round
    uv run python bench/lookup.py --quick       # 2,000 (a few seconds)

How much each partition a lookup reads costs the server. ``before.py`` measures requests through the
shop, where a difference of a few per cent is near the method's error; this script measures the
statements themselves, in the server, where it is not. The
statements are this checkout's own (``flask_idem._store``), for each table as the store composes them:
the key's lock (``lock``), then its lookup (``lookup``: the key's row in every partition,
else its live compact tombstone), for a key that has a row (a replay) and for one that has none (a fresh
key); and a fresh key written: the lock, the lookup and the completed row's ``INSERT``
(``insert_completed``), then ``COMMIT`` (``synchronous_commit`` off: not the disk's flush). Tables, each
with the same 1000 finished keys, expiring in a day:

- the key table as ``flask idem migrate`` makes it (one partition), and as ``flask idem purge`` keeps
  it at the defaults (daily partitions, a spare, tombstones in quarters of 30 days;
  ``bench.harness.daily_table``), and the same with ``IDEM_PARTITION_AHEAD=0`` (no spare: a partition
  per day, 8 days ahead);
- a variant not used by flask-idem, on the daily table: the tombstones read through a PL/pgSQL function,
  which runs its query only when the key table has no row, so that a replay does not open the
  tombstones' partitions and a fresh key pays for the function call.

Two measures, each the median of ``--rounds`` rounds, the tables taking turns:

- **in the server**: a procedure runs the statement ``--n`` times, each in a transaction of its own
  (``COMMIT`` in the loop, so that each one takes its locks anew), on its cached generic plan, as the
  application's prepared statements run; less the same loop with no statement. No network, no client:
  the figures repeat to a few tenths of a microsecond;
- **a request's transaction**: ``BEGIN``, the lock, the lookup and ``COMMIT`` in one pipeline from this
  process (prepared, as psycopg does from a statement's 5th run), and the CPU time of the server's
  backend per transaction, from ``/proc`` (only when the server runs on this machine; 10 ms ticks).

The database is ``flask_idem_bench_lookup`` on ``FLASK_IDEM_BENCH_DATABASE_URL`` (default: the local
PostgreSQL), created afresh and dropped at the end. Nothing here asserts; it prints tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/lookup.py` from anywhere

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from bench.harness import DEFAULT_SERVER_URL, daily_table, scratch_database, server_version  # noqa: E402
from flask_idem._migrate import upgrade  # noqa: E402
from flask_idem._store import _Statements  # noqa: E402

DATABASE = "flask_idem_bench_lookup"
KEYS = 1000
#: The plpgsql variables the statements' parameters become in the procedures.
VARIABLES = {
    "%(org_id)s": "v_org",
    "%(key)s": "v_key",
    "%(lock)s": "v_lock",
    "%(tomb)s": "v_tomb",
    "%(sha)s": "v_sha",
    "%(method)s": "'POST'",
    "%(path)s": "'/orders'",
    "%(task)s": "NULL",
    "%(response)s": "v_response",
    "%(ttl)s": "86400",
}


@dataclass
class Case:
    label: str
    table: str
    lookup: str = ""  # the lookup statement, when not the store's own (the variant)

    def statements(self) -> tuple[str, str, str]:
        """The lock, the lookup and a fresh key's completed row, as the store runs them on this table."""
        q = _Statements(self.table)
        return q.lock.decode(), self.lookup or q.lookup.decode(), q.insert_completed.decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="transactions a statement and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2,000 transactions a statement and round")
    args = parser.parse_args()
    n = 2_000 if args.quick else args.n
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    with scratch_database(server, DATABASE) as url:
        machine = (
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, PostgreSQL {server_version(url)},"
            f" load average at the start {os.getloadavg()[0]:.2f}"
        )
        cases = _tables(url)
        with psycopg.connect(url, autocommit=True) as conn:
            keys = [row[0] for row in conn.execute("SELECT idem_key FROM keys_l4 ORDER BY idem_key")]
            shapes = {case.label: _partitions(conn, case.table) for case in cases}
            for case in cases:
                _procedures(conn, case)
            conn.execute(_procedure("bench_empty"))
            conn.execute("SET synchronous_commit = off")  # a fresh key's COMMIT: no wait for the disk
            local = _backend_cpu(conn) is not None
            server_us: dict[tuple[str, str], list[float]] = {}
            wire_us: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                print(f"# round {r + 1}/{args.rounds}", flush=True)
                empty = _call(conn, "bench_empty", n)
                for case in cases:
                    for what in ("lock", "hit", "miss", "write"):
                        spent = _call(conn, _name(case, what), n) - empty
                        server_us.setdefault((case.label, what), []).append(spent)
                    if local:
                        for what in ("hit", "miss"):
                            spent = _transactions(url, case, keys if what == "hit" else None, n // 4)
                            wire_us.setdefault((case.label, what), []).append(spent)
    _print(cases, shapes, server_us, wire_us, machine, n, args.rounds)


def _tables(url: str) -> list[Case]:
    """The key tables measured, made by this checkout's migration, each with the same finished keys."""
    quiet: Callable[[str], None] = lambda _: None  # noqa: E731
    upgrade(url, table="keys_l4", echo=quiet)
    daily_table(url, "keys_daily")
    daily_table(url, "keys_days", ahead=0.0)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO keys_l4 (org_id, idem_key, request_sha, method, path, status, response,"
            " expires_at) SELECT 1, gen_random_uuid(), sha256(g::text::bytea), 'POST', '/orders',"
            ' \'completed\', \'{"status": 201, "headers": [], "body": "{}"}\','
            " statement_timestamp() + interval '1 day'"
            " FROM generate_series(1, %s) AS g",
            (KEYS,),
        )
        for table in ("keys_daily", "keys_days"):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response,"
                    " expires_at) SELECT org_id, idem_key, request_sha, method, path, status, response,"
                    " statement_timestamp() + interval '1 day' FROM keys_l4"
                ).format(sql.Identifier(table))
            )
        conn.execute("VACUUM ANALYZE")
        variant = _lazy_tombstones(conn, "keys_daily")
    return [
        Case("as migrated", "keys_l4"),
        Case("daily, as purge keeps it", "keys_daily"),
        Case("daily, no spare (IDEM_PARTITION_AHEAD=0)", "keys_days"),
        Case("variant: daily, tombstones through a function", "keys_daily", variant),
    ]


def _lazy_tombstones(conn: psycopg.Connection[tuple[object, ...]], table: str) -> str:
    """The variant's lookup on ``table``: the store's, its tombstones' branch moved into a PL/pgSQL
    function (created here), which the outer statement calls only when the key table had no row."""
    lookup = _Statements(table).lookup.decode()
    keys, tombstones = lookup.split(" UNION ALL ")
    assert tombstones.endswith(" LIMIT 1) LIMIT 1) AS f"), "the lookup's shape changed"
    query = tombstones.removeprefix("(").removesuffix(") LIMIT 1) AS f")
    query = query.replace("%(org_id)s", "p_org").replace("%(key)s", "p_key")
    conn.execute(
        "CREATE FUNCTION bench_tombstone(p_org bigint, p_key uuid) RETURNS TABLE (request_sha bytea,"
        " status text, response jsonb, expired bool, stale bool, lease_live bool, flow text, step text,"
        f" state jsonb) LANGUAGE plpgsql STABLE AS $f$ BEGIN RETURN QUERY {query}; END $f$"
    )
    # The store's own statement text, no input: S608 does not apply.
    return keys + " UNION ALL (SELECT * FROM bench_tombstone(%(org_id)s, %(key)s)) LIMIT 1) AS f"  # noqa: S608


def _partitions(conn: psycopg.Connection[tuple[object, ...]], table: str) -> str:
    """How many partitions a lookup on ``table`` opens: the key table's, and the tombstones' that end
    after now (the others are pruned as the statement starts)."""
    if conn.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone() != ("p",):
        return "1 table"
    count = (
        "SELECT count(*) FROM pg_partition_tree(%s::regclass) AS p JOIN pg_class AS c ON c.oid = p.relid"
        " WHERE p.isleaf AND (%s OR (regexp_match(pg_get_expr(c.relpartbound, c.oid),"
        " 'TO \\(''(.*)''\\)'))[1]::timestamptz > now())"
    )
    keys = conn.execute(count, (table, True)).fetchone()
    tombstones = conn.execute(count, (f"{table}_tombstones", False)).fetchone()
    return f"{keys[0] if keys else '?'} + {tombstones[0] if tombstones else '?'}"


def _name(case: Case, what: str) -> str:
    return f"bench_{case.table}_{'v' if case.lookup else 's'}_{what}"


def _plpgsql(statement: str) -> str:
    for parameter, variable in VARIABLES.items():
        statement = statement.replace(parameter, variable)
    return statement


def _procedure(name: str, *statements: str, keys: str = "stored") -> str:
    """A procedure that runs ``statements`` in one transaction, ``n`` transactions, for the stored keys
    (``keys="stored"``), as many keys that have no row (``"absent"``), or a new key each time
    (``"new"``, for a statement that writes it)."""
    run = " ".join(
        f"FOR v_row IN {statement} LOOP END LOOP;"
        if statement.startswith(("SELECT", "WITH"))
        else f"{statement};"
        for statement in statements
    )
    pool = "idem_key" if keys == "stored" else "gen_random_uuid()"
    key = "gen_random_uuid()" if keys == "new" else f"v_keys[1 + i % {KEYS}]"
    # The store's own statements and this script's names, no input: S608 does not apply.
    return f"""CREATE PROCEDURE {name}(n int) LANGUAGE plpgsql AS $$
        DECLARE v_keys uuid[] := ARRAY(SELECT {pool} FROM keys_l4);
                v_org bigint := 1; v_key uuid; v_lock bigint; v_tomb float8 := 2592000; v_row record;
                v_sha bytea := sha256('bench'); v_response jsonb := '{{"status": 201, "headers": []}}';
        BEGIN
            FOR i IN 1..n LOOP
                v_key := {key}; v_lock := i;
                {run}
                COMMIT;
            END LOOP;
        END $$"""  # noqa: S608


def _procedures(conn: psycopg.Connection[tuple[object, ...]], case: Case) -> None:
    lock, lookup, insert = (_plpgsql(s) for s in case.statements())
    conn.execute(_procedure(_name(case, "lock"), lock))
    conn.execute(_procedure(_name(case, "hit"), lookup))
    conn.execute(_procedure(_name(case, "miss"), lookup, keys="absent"))
    conn.execute(_procedure(_name(case, "write"), lock, lookup, insert, keys="new"))


def _call(conn: psycopg.Connection[tuple[object, ...]], name: str, n: int) -> float:
    """Microseconds per transaction of procedure ``name`` run ``n`` times (after a warm-up)."""
    conn.execute(sql.SQL("CALL {}(%s)").format(sql.Identifier(name)), (50,))
    start = time.perf_counter()
    conn.execute(sql.SQL("CALL {}(%s)").format(sql.Identifier(name)), (n,))
    return (time.perf_counter() - start) / n * 1e6


def _backend_cpu(conn: psycopg.Connection[tuple[object, ...]]) -> float | None:
    """CPU seconds the server's backend of ``conn`` has used, or None when it is not on this machine."""
    try:
        with open(f"/proc/{conn.info.backend_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if not open(f"/proc/{conn.info.backend_pid}/cmdline").read().startswith("postgres"):
            return None
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _transactions(url: str, case: Case, keys: list[uuid.UUID] | None, n: int) -> float:
    """Backend CPU microseconds per transaction of BEGIN, lock, lookup, COMMIT, pipelined, for ``keys``
    (None: keys that have no row)."""
    lock, lookup, _ = case.statements()
    pool = keys or [uuid.uuid4() for _ in range(KEYS)]
    with psycopg.connect(url, autocommit=True) as conn:
        spent = 0.0
        for phase, count in (("warm", 50), ("measure", n)):
            before = _backend_cpu(conn)
            for i in range(count):
                params = {"org_id": 1, "key": pool[i % len(pool)], "lock": i, "tomb": 2592000.0}
                with conn.pipeline():
                    conn.execute("BEGIN")
                    conn.execute(lock.encode(), params)
                    conn.execute(lookup.encode(), params)
                    conn.execute("COMMIT")
            if phase == "measure":
                spent = (_backend_cpu(conn) or 0.0) - (before or 0.0)
    return spent / n * 1e6


def _print(
    cases: list[Case],
    shapes: dict[str, str],
    server_us: dict[tuple[str, str], list[float]],
    wire_us: dict[tuple[str, str], list[float]],
    machine: str,
    n: int,
    rounds: int,
) -> None:
    def median(figures: dict[tuple[str, str], list[float]], label: str, what: str) -> float:
        return statistics.median(figures[label, what])

    base = cases[0].label
    print()
    print("In the server, µs per statement (the median of the rounds; less the loop's own cost):")
    print()
    print("| key table | partitions read, keys + tombstones | lock | lookup, replay | lookup, fresh key "
          "| replay, lock + lookup, − as migrated | fresh key, − as migrated "
          "| fresh key written (lock, lookup, INSERT, COMMIT) | written, − as migrated |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        lock, hit, miss, write = (median(server_us, case.label, w) for w in ("lock", "hit", "miss", "write"))
        base_lock, base_write = median(server_us, base, "lock"), median(server_us, base, "write")
        base_hit, base_miss = median(server_us, base, "hit"), median(server_us, base, "miss")
        print(f"| {case.label} | {shapes[case.label]} | {lock:.1f} | {hit:.1f} | {miss:.1f} "
              f"| {lock + hit - base_lock - base_hit:+.1f} | {lock + miss - base_lock - base_miss:+.1f} "
              f"| {write:.1f} | {write - base_write:+.1f} |")  # fmt: skip
    if wire_us:
        print()
        print("A request's transaction (BEGIN, lock, lookup, COMMIT, pipelined), server backend CPU µs:")
        print()
        print("| key table | replay | fresh key | replay − as migrated | fresh key − as migrated |")
        print("| --- | --- | --- | --- | --- |")
        for case in cases:
            hit, miss = median(wire_us, case.label, "hit"), median(wire_us, case.label, "miss")
            print(f"| {case.label} | {hit:.0f} | {miss:.0f} | {hit - median(wire_us, base, 'hit'):+.0f} "
                  f"| {miss - median(wire_us, base, 'miss'):+.0f} |")  # fmt: skip
    else:
        print("\n(the server is not on this machine: no backend CPU)")
    print()
    print(f"- {machine}")
    print(f"- {rounds} rounds of {n:,} transactions a statement in the server; {n // 4:,} a transaction "
          "through the pipeline")  # fmt: skip


if __name__ == "__main__":
    main()
