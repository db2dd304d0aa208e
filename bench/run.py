"""Benchmarks of flask-idem on the reference shop, measured side by side in one run; prints one table.

    uv run python bench/run.py [--quick]

The database server is ``FLASK_IDEM_BENCH_DATABASE_URL`` (default: the local PostgreSQL). A database
``flask_idem_bench`` is created there afresh and dropped at the end. The shop runs under gunicorn on
loopback; wrk drives it (installed with apt-get if missing). See bench/README.md for what each scenario
shows. The script never asserts: it prints figures, the goal from issue 5 beside each, and whether the
figure meets it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import secrets
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/run.py` from anywhere

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from bench import report  # noqa: E402
from bench.harness import (  # noqa: E402
    DEFAULT_SERVER_URL,
    Result,
    Server,
    WrkJob,
    WrkRun,
    backend_pids,
    citus_database,
    ensure_tool,
    gunicorn,
    percentile,
    pgbench,
    scratch_database,
    server_version,
    set_up_shop,
    wrk,
    wrk_together,
)

DATABASE = "flask_idem_bench"
BIG_TABLE = "idempotency_keys_10m"
#: How many finished keys the replay scenarios cycle through (the same number for both tables).
REPLAY_KEYS = 1000
#: In-flight scenario: every this many milliseconds all clients move on to new keys together.
SLOT_MS = 25
#: In-flight scenario's goal: the 409's p99 in milliseconds, server-side (gunicorn's access log)
#: (issue 25 tightened it from issue 5's 20 ms).
INFLIGHT_P99_MS = 10


@dataclass(frozen=True)
class Plan:
    seconds: float
    warmup: float
    rounds: int
    big_rows: int
    workers: int
    threads: int
    #: Days of daily partitions (f)'s keys are spread over (0: the table as the migration leaves it).
    spread: int = 0
    #: The scenarios to run, by letter.
    scenarios: str = "abcdefghi"

    @property
    def connections(self) -> int:
        """wrk's connections: twice what the server handles at once, so a request is always waiting."""
        return 2 * self.workers * self.threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s per scenario, 1M-row key table")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn worker processes (default 2)")
    parser.add_argument("--threads", type=int, default=4, help="threads per worker (default 4)")
    parser.add_argument("--rounds", type=int, help="rounds of the throughput scenarios (default 6)")
    parser.add_argument("--seconds", type=float, help="seconds per measurement (default 10, 3 with --quick)")
    parser.add_argument("--big-rows", type=int, help="rows of (f)'s key table (default 10M)")
    parser.add_argument(
        "--spread",
        type=int,
        default=0,
        metavar="DAYS",
        help="spread (f)'s keys over DAYS daily partitions made by flask idem purge (layout 4)",
    )
    parser.add_argument(
        "--scenarios", default="abcdefghi", help="the scenarios to run, by letter (default all: abcdefghi)"
    )
    parser.add_argument("--show-sql", action="store_true", help="print the pgbench script of (e) and exit")
    parser.add_argument(
        "--citus",
        action="store_true",
        help="run against a local Citus cluster (coordinator + 2 workers), the tables distributed",
    )
    args = parser.parse_args()
    if args.citus:  # every application started from here on, gunicorn's included, uses the layout
        os.environ["FLASK_IDEM_DISTRIBUTED"] = "true"
    if args.show_sql:
        print(pgbench_script())
        return
    plan = Plan(
        seconds=args.seconds or (3 if args.quick else 10),
        warmup=1 if args.quick else 3,
        rounds=args.rounds or (1 if args.quick else 6),
        big_rows=args.big_rows or (1_000_000 if args.quick else 10_000_000),
        workers=args.workers,
        threads=args.threads,
        spread=args.spread,
        scenarios=args.scenarios,
    )
    if args.spread and args.citus:
        parser.error("--spread runs on one server: flask idem purge does not make partitions on Citus here")
    ensure_tool("wrk", "wrk")
    ensure_tool("pgbench", "postgresql-client")
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    notes: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="flask-idem-bench-") as tmpdir,
        citus_database(DATABASE) if args.citus else scratch_database(server, DATABASE) as url,
    ):
        tmp = Path(tmpdir)
        notes.append(report.machine(server_version(url), plan.workers, plan.threads))
        if args.citus:
            notes.append(
                "Citus: a coordinator and 2 workers on this machine (tests/support/citus.py); the shop talks"
                " to the coordinator; CPU ms/req counts the coordinator's backends, not the workers'"
            )
        org_id, api_key = set_up_shop(url)

        def serve(**options: object) -> AbstractContextManager[Server]:
            return gunicorn(url, workers=plan.workers, threads=plan.threads, log=tmp / "gunicorn.log",
                            **options)  # type: ignore[arg-type]  # fmt: skip

        with serve() as shop:
            replay_file = _precreate_keys(shop, url, org_id, api_key, plan, tmp)
        big_file = None
        if "f" in plan.scenarios:
            big_file = _load_big_table(url, org_id, plan.big_rows, plan.spread, tmp, notes)
        rows = _throughput(url, api_key, replay_file, big_file, plan, tmp, notes)
        if "d" in plan.scenarios:
            with serve(access_log=tmp / "access.log") as shop:
                for clients, keys in ((64, 4), (plan.workers * plan.threads, 2)):
                    rows.append(_inflight(shop, url, org_id, api_key, clients, keys, plan, tmp, notes))
        if "e" in plan.scenarios:
            with serve() as shop:  # (b) had half the machine beside (a); (e) has all of it, and so has this
                for seconds in (plan.warmup, plan.seconds):
                    alone = wrk("fresh.lua", shop.base + "/orders", [api_key, _seed()], threads=1,
                                connections=plan.connections, seconds=seconds)  # fmt: skip
            database = _pgbench(url, org_id, api_key, plan, tmp, notes)
            database.ratio = f"(b) alone {alone.rps:.0f} req/s = {alone.rps / database.rps:.2f} × (e)"
            database.goal = "report the ratio"
            rows.append(database)
            notes.append(
                f"(e)'s ratio: (b) measured alone, {plan.workers} workers × {plan.threads} threads, wrk -t1"
                f" -c{plan.connections}, {plan.seconds:g} s after a {plan.warmup:g} s warm-up, so that both"
                " have the whole machine"
            )
    notes.append("load average at the end: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    report.print_table(rows, notes)


# -- scenarios ------------------------------------------------------------------------------------------


def _precreate_keys(shop: Server, url: str, org_id: int, api_key: str, plan: Plan, tmp: Path) -> Path:
    """Send fresh keys to POST /orders for a few seconds (this warms gunicorn up); keep REPLAY_KEYS."""
    wrk("fresh.lua", shop.base + "/orders", [api_key, _seed()], threads=1, connections=plan.connections,
        seconds=max(plan.warmup, 3))  # fmt: skip
    with psycopg.connect(url) as conn:
        keys = conn.execute(
            "SELECT idem_key FROM idempotency_keys WHERE org_id = %s AND status = 'completed'"
            " ORDER BY random() LIMIT %s",
            (org_id, REPLAY_KEYS),
        ).fetchall()
    path = tmp / "replay-keys.txt"
    path.write_text("".join(f"{key}\n" for (key,) in keys))
    return path


def _load_big_table(url: str, org_id: int, rows: int, spread: int, tmp: Path, notes: list[str]) -> Path:
    """Bulk-load ``rows`` finished keys of the bench organisation into BIG_TABLE; sample REPLAY_KEYS.

    With ``spread`` (days), the table is made as ``flask idem purge`` leaves it on layout 4 (a first
    partition that ends a minute from now, then daily partitions), and the keys' expiries are spread
    evenly over the ``spread`` days from an hour from now, so over as many partitions, each of which a
    lookup reads.
    """
    from flask_idem._migrate import upgrade
    from flask_idem._partitions import maintain

    day = 86_400.0
    if spread:
        upgrade(url, table=BIG_TABLE, horizon=60.0, echo=lambda _: None)
        maintain(url, table=BIG_TABLE, interval=day, horizon=(spread + 1) * day, tombstone_ttl=30 * day,
                 echo=lambda _: None)  # fmt: skip
        expiry = sql.SQL("now() + interval '1 hour' + random() * make_interval(secs => %(span)s)")
    else:
        upgrade(url, table=BIG_TABLE, distributed=_distributed())  # the very DDL of idempotency_keys, renamed
        expiry = sql.SQL("now() + interval '1 day'")
    print(f"# loading {rows:,} rows into {BIG_TABLE} ...", flush=True)
    with psycopg.connect(url, autocommit=True) as conn:
        # Every row answers a replay of the same request: the fingerprint and stored response of a real
        # one. Keys are sorted before the insert so the primary key is built in order, not at random.
        table = sql.Identifier(BIG_TABLE)
        conn.execute("SET work_mem = '1GB'")
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response, expires_at)"
                " SELECT %(org)s, k, s.request_sha, s.method, s.path, 'completed', s.response, {}"
                " FROM (SELECT gen_random_uuid() AS k FROM generate_series(1, %(rows)s) ORDER BY 1) AS keys,"
                "      (SELECT request_sha, method, path, response FROM idempotency_keys"
                "       WHERE org_id = %(org)s AND status = 'completed' LIMIT 1) AS s"
            ).format(table, expiry),
            {"org": org_id, "rows": rows, **({"span": spread * day - 7200.0} if spread else {})},
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
        conn.execute("CHECKPOINT")
        keys = conn.execute(  # a sample over every partition, shuffled before the limit
            sql.SQL(
                "SELECT idem_key FROM (SELECT idem_key FROM {} TABLESAMPLE BERNOULLI (%s)) AS s"
                " ORDER BY random() LIMIT %s"
            ).format(table),
            (min(100.0, 300.0 * REPLAY_KEYS / rows), REPLAY_KEYS),
        ).fetchall()
        sizes = conn.execute(
            "SELECT pg_size_pretty(sum(pg_table_size(relid))), pg_size_pretty(sum(pg_indexes_size(relid))),"
            " count(*) FILTER (WHERE (SELECT reltuples FROM pg_class WHERE oid = relid) > 0)"
            " FROM pg_partition_tree(%s) WHERE isleaf",
            (BIG_TABLE,),
        ).fetchone()
        shop = conn.execute(
            "SELECT count(*) FROM pg_partition_tree('idempotency_keys') WHERE isleaf"
        ).fetchone()
    assert sizes is not None and shop is not None
    notes.append(f"(f) {BIG_TABLE}: {rows:,} rows, table {sizes[0]}, indexes {sizes[1]}, in {sizes[2]}"
                 f" partition(s) with rows (idempotency_keys, (c)'s: {shop[0]}); the replayed keys are"
                 f" {len(keys)} random ones of them")  # fmt: skip
    path = tmp / "big-keys.txt"
    path.write_text("".join(f"{key}\n" for (key,) in keys))
    return path


#: The servers of the side-by-side scenarios, and their environment: each pair of runs is served by two
#: of them at once.
TWINS: dict[str, dict[str, str]] = {"shop": {}, "twin": {}, "big": {"FLASK_IDEM_TABLE": BIG_TABLE}}


@dataclass(frozen=True)
class Side:
    """One side of a side-by-side pair: which server, which path, which wrk script with which arguments."""

    server: str
    path: str
    script: str = "fresh.lua"
    keys: Path | None = None  # the finished keys replay.lua cycles through


def _throughput(
    url: str, api_key: str, replay_file: Path, big_file: Path | None, plan: Plan, tmp: Path, notes: list[str]
) -> list[Result]:
    """Scenarios (a), (b), (c), (f), (g), (h) and (i) (those of ``plan.scenarios``), each measured at the
    same moments as what it is compared to.

    Each comparison is a pair of wrk runs at once, against two gunicorns that split the usual setup
    between them (half the workers each, so the machine runs as many threads as in the other
    scenarios). Both runs see the same moods of the machine, so their ratio is steady where two runs a
    few seconds apart are not. (a) is compared with itself on two servers: how far from 1.00 that ratio
    lands shows how far to trust the others.
    """
    baseline, replay = Side("shop", "/bench/orders"), Side("shop", "/orders", "replay.lua", replay_file)
    pairs = {
        "(a) baseline: POST /bench/orders, no decorator": (baseline, Side("twin", "/bench/orders")),
        "(b) decorated POST /orders, fresh key": (baseline, Side("twin", "/orders")),
        "(c) decorated, replay of finished keys": (
            baseline,
            Side("twin", "/orders", "replay.lua", replay_file),
        ),
        f"(f) replay, {plan.big_rows:,}-row key table"
        + (f" over {plan.spread} daily partitions" if plan.spread else ""): (
            replay,
            Side("big", "/orders", "replay.lua", big_file),
        ),
        "(g) floor: (a) + 2 no-op statements": (baseline, Side("twin", "/bench/floor")),
        "(h) floor, batched: (g) sent with BEGIN, COMMIT": (
            baseline,
            Side("twin", "/bench/floor-batched"),
        ),
        "(i) hand-written baseline: POST /bench/orders-plain": (
            baseline,
            Side("twin", "/bench/orders-plain"),
        ),
    }
    labels = [label for label in pairs if label[1] in plan.scenarios]
    if not labels:
        return []
    by = {label[1]: label for label in labels}
    runs: dict[str, list[tuple[WrkRun, WrkRun]]] = {label: [] for label in labels}
    half = max(1, plan.workers // 2)
    needed = {side.server for label in labels for side in pairs[label]}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                gunicorn(make_conninfo(url, application_name=f"bench-{name}"), workers=half,
                         threads=plan.threads, log=tmp / "gunicorn.log", env=env)
            )
            for name, env in TWINS.items() if name in needed
        }  # fmt: skip

        def job(side: Side) -> WrkJob:
            server = servers[side.server]
            extra = [] if side.keys is None else [str(side.keys)]
            watch = {"app": server.worker_pids(), "db": backend_pids(url, f"bench-{side.server}")}
            return WrkJob(side.script, server.base + side.path, [api_key, _seed(), *extra], threads=1,
                          connections=max(1, plan.connections // 2), watch=watch)  # fmt: skip

        def run(label: str, seconds: float) -> tuple[WrkRun, WrkRun]:
            first, second = wrk_together([job(side) for side in pairs[label]], seconds)
            return first, second

        for label in labels:
            run(label, plan.warmup)
        for r in range(plan.rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                print(f"# round {r + 1}/{plan.rounds}: {label}", flush=True)
                runs[label].append(run(label, plan.seconds))

    def measured(label: str) -> list[WrkRun]:
        return [y for _, y in runs[label]]

    def ratio(label: str, value: Callable[[WrkRun], float]) -> report.Paired:
        return report.paired([x for x, _ in runs[label]], measured(label), value)

    def cpu_ms(label: str, group: str) -> float:
        return report.cpu_per_request(measured(label), group)

    results = [report.summary(label, measured(label)) for label in labels]
    row, goal = {label[1]: result for label, result in zip(labels, results, strict=True)}, "bounds (b)"
    if "a" in row:
        row["a"].ratio = f"req/s {ratio(by['a'], report.rps)} × (a)"
        row["a"].goal = "near 1.00: the method's own error"
    if "b" in row:
        report.judge(row["b"], ratio(by["b"], report.rps), "req/s", ">= 0.90 × (a)", 0.90)
    if "c" in row:
        report.judge(row["c"], ratio(by["c"], report.rps), "req/s", ">= 1.0 × (a)", 1.0)
    if "f" in row:
        flat = ratio(by["f"], lambda run: run.p99_us)
        row["f"].ratio, row["f"].goal, row["f"].verdict = (
            f"p99 {flat} × (c)",
            "p99 <= 1.2 × (c)",
            "met" if flat.median <= 1.2 else "MISSED",
        )
        if "c" not in row:  # what (f) was compared with: (c)'s replays, measured beside it
            partner = report.summary(
                "(c) replay of finished keys, measured beside (f)", [x for x, _ in runs[by["f"]]]
            )
            results.insert(labels.index(by["f"]), partner)
    for letter, text in (("g", goal), ("h", goal), ("i", "what the shop's framework costs")):
        if letter in row:
            row[letter].ratio, row[letter].goal = f"req/s {ratio(by[letter], report.rps)} × (a)", text
    notes.append(
        f"{','.join(label[:3] for label in labels)} side by side: each scenario runs at the same time as"
        f" what it is compared to ((f) with (c), the others with (a)), each on its own gunicorn of {half}"
        f" worker(s) × {plan.threads} threads driven by wrk -t1 -c{max(1, plan.connections // 2)};"
        f" {plan.rounds} rounds of {plan.seconds:g} s per pair, order rotated per round, after a"
        f" {plan.warmup:g} s warm-up of each; a ratio is the median of the rounds' ratios, with its"
        " quartiles; req/s, p50, p99 and CPU ms/req are the median of the rounds' (each server has half"
        " the machine, so req/s is about half of what one server alone serves)"
    )
    notes.append(
        "capacity from CPU per request (requests per CPU second of the server's workers and backends),"
        " round by round:"
        + ",".join(f" {label[:3]} {ratio(label, report.capacity)} × {'(c)' if label[1] == 'f' else '(a)'}"
                   for label in labels)
    )  # fmt: skip
    notes.append(
        "per round, req/s ratio: "
        + "; ".join(
            f"{label[:3]} " + ", ".join(f"{y.rps / x.rps:.2f}" for x, y in runs[label]) for label in labels
        )
    )
    notes.append(
        "CPU ms per request, app (gunicorn workers) / PostgreSQL (the pool's backends) / wrk: "
        + "; ".join(f"{label[:3]} " + " / ".join(f"{report.cpu_per_request(measured(label), group):.2f}"
                    for group in ("app", "db", "wrk")) for label in labels)
        + f" ({os.cpu_count()} CPUs = {os.cpu_count()}000 CPU ms per second)"
    )  # fmt: skip
    if "a" in by and "b" in by:
        notes.append(
            "what a fresh key costs, CPU ms per request, (b) − (a) measured at the same moments, app /"
            " PostgreSQL: "
            + " / ".join(f"{cpu_ms(by['b'], group) - cpu_ms(by['a'], group):+.3f}" for group in ("app", "db"))
        )
    notes.append(
        "CPU used by other processes on the machine, per round, in % of all CPUs: "
        + "; ".join(f"{label[:3]} {report.others_share(measured(label))}" for label in labels)
    )
    with psycopg.connect(url) as conn:
        updates = conn.execute(
            "SELECT sum(n_tup_ins), sum(n_tup_upd), sum(n_tup_hot_upd) FROM pg_stat_user_tables"
            " WHERE relid IN (SELECT relid FROM pg_partition_tree('idempotency_keys'))"
        ).fetchone()
    if updates is not None and updates[0] is not None:
        notes.append(f"idempotency_keys so far: {updates[0]} rows inserted, {updates[1]} updated, of which"
                     f" {updates[2]} HOT (heap-only) updates")  # fmt: skip
    return results


def _inflight(
    shop: Server, url: str, org_id: int, api_key: str, clients: int, keys: int, plan: Plan, tmp: Path,
    notes: list[str], *, wrk_threads: int | None = None,
) -> Result:  # fmt: skip
    """Scenario (d): ``clients`` connections on ``keys`` keys at once; per-status latency, duplicates.

    ``wrk_threads``: fewer wrk threads than connections (``inflight.lua``'s shared mode); the client's
    latencies and the keys answered 201 are then unknown, the server's latencies and the database's
    duplicate counts are not.
    """
    threads = clients if wrk_threads is None else wrk_threads
    shared = ["shared"] if threads < clients else []
    nonce = secrets.token_hex(4)  # marks the keys of the measured run (the warm-up has its own)
    samples, access = tmp / f"inflight-{clients}.txt", tmp / "access.log"
    script_args = [api_key, _seed(), nonce, str(SLOT_MS), str(keys), str(samples), *shared]
    target = shop.base + "/orders"
    warmup_args = [api_key, _seed(), secrets.token_hex(4), str(SLOT_MS), str(keys), str(samples), *shared]
    wrk("inflight.lua", target, warmup_args, threads=threads, connections=clients, seconds=plan.warmup)
    offset = access.stat().st_size
    watch = {"app": shop.worker_pids(), "db": backend_pids(url)}
    run = wrk("inflight.lua", target, script_args, threads=threads, connections=clients, seconds=plan.seconds,
              watch=watch)  # fmt: skip
    client: dict[int, list[float]] = collections.defaultdict(list)
    statuses = collections.Counter[int]()
    created = collections.Counter[str]()
    for line in samples.read_text().splitlines():
        status, micros, key = line.split()
        statuses[int(status)] += 1
        if not shared:
            client[int(status)].append(int(micros) / 1000)
            if status == "201":
                created[key] += 1
    server: dict[int, list[float]] = collections.defaultdict(list)
    with access.open() as log:
        log.seek(offset)
        for line in log:
            status, micros = line.split()
            server[int(status)].append(int(micros) / 1000)
    with psycopg.connect(url) as conn:
        orders, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT idempotency_key) FROM orders"
            " WHERE org_id = %s AND idempotency_key::text LIKE %s",
            (org_id, nonce + "-%"),
        ).fetchone() or (0, 0)
        dup_groups = conn.execute(
            "SELECT count(*) FROM (SELECT FROM orders GROUP BY org_id, idempotency_key HAVING count(*) > 1) d"
        ).fetchone()
        stuck = conn.execute("SELECT count(*) FROM idempotency_keys WHERE status = 'processing'").fetchone()
    assert dup_groups is not None and stuck is not None
    twice = sum(1 for n in created.values() if n > 1)  # a key acknowledged with 201 more than once
    duplicates = (orders - distinct) + dup_groups[0] + twice
    unexpected = sum(n for s, n in statuses.items() if s not in (200, 201, 409))
    p99_409 = percentile(server[409], 99)  # the goal's: the client's adds wrk's own threads' queue
    label = f"(d) {clients} clients on {keys} keys at once"
    cpu_ms = report.cpu_per_request([run], "app") + report.cpu_per_request([run], "db")
    result = Result(label, run.rps, run.p50_us / 1000, run.p99_us / 1000, run.status_errors,
                    run.socket_errors + unexpected, run.requests, cpu_ms=cpu_ms)  # fmt: skip
    client_p99 = "" if shared else f" (client {report.ms(percentile(client[409], 99))} ms)"
    result.ratio = f"409 p99 server {report.ms(p99_409)} ms{client_p99}, {duplicates} dup"
    result.goal = f"409 p99 server <= {INFLIGHT_P99_MS} ms, 0 dup"
    met = p99_409 is not None and p99_409 <= INFLIGHT_P99_MS and duplicates == 0
    result.verdict = "met" if met else "MISSED"
    per_status = "; ".join(
        f"{s}: {statuses[s]} (client p50/p99 {report.ms(percentile(client[s], 50))}/"
        f"{report.ms(percentile(client[s], 99))} ms, server p50/p99 {report.ms(percentile(server[s], 50))}/"
        f"{report.ms(percentile(server[s], 99))} ms)"
        for s in sorted(statuses)
    )
    notes.append(f"(d) {clients}/{keys}: wrk -t{threads} -c{clients}, keys change every {SLOT_MS} ms;"
                 f" {per_status}")  # fmt: skip
    notes.append(
        f"(d) {clients}/{keys}: {orders} orders for {distinct} keys, {len(created)} keys answered 201,"
        f" {twice} answered 201 twice, {dup_groups[0]} duplicate (org, key) groups in orders,"
        f" {stuck[0]} key rows left processing"
    )
    return result


def _pgbench(url: str, org_id: int, api_key: str, plan: Plan, tmp: Path, notes: list[str]) -> Result:
    """Scenario (e): the decorated route's SQL, fresh key per transaction, straight from pgbench."""
    from example_app.auth import hash_api_key

    script = tmp / "route.pgbench"
    script.write_text(pgbench_script())
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT request_sha, response::text FROM idempotency_keys WHERE status = 'completed' LIMIT 1"
        ).fetchone()
    assert row is not None
    clients = plan.workers * plan.threads
    variables = {"org": str(org_id), "apisha": hash_api_key(api_key).hex(), "sha": row[0].hex(),
                 "response": row[1]}  # fmt: skip
    run = pgbench(url, script, clients=clients, seconds=plan.seconds, warmup=plan.warmup, logdir=tmp,
                  variables=variables)  # fmt: skip
    p50, p99 = percentile(run.latencies_us, 50), percentile(run.latencies_us, 99)
    result = Result("(e) pgbench: the route's SQL, fresh key", run.tps, None if p50 is None else p50 / 1000,
                    None if p99 is None else p99 / 1000, 0, run.failed)  # fmt: skip
    notes.append(f"(e) pgbench -n -M prepared -c {clients} -j 2 -T {plan.seconds:g} -f route.pgbench, after a"
                 f" {plan.warmup:g} s warm-up (`bench/run.py --show-sql` prints the script); latencies from"
                 " its per-transaction log")  # fmt: skip
    return result


def pgbench_script() -> str:
    """A pgbench script sending what POST /orders sends for a fresh key, statement for statement.

    The key table's statements come from flask_idem._store itself, so they cannot drift; the API-key
    lookup and the order INSERT are example_app's. Each key is two random bigints; the first doubles as
    the advisory lock id (the store derives it with BLAKE2b on the client, which costs the server nothing).
    On one server an atomic request writes its key's row once (``Store._reserve_once``): the key's lock
    and a lookup with BEGIN, the row, completed, with COMMIT, on the partitioned key table that
    ``flask idem migrate`` makes. On Citus it reserves first and completes after.
    """
    from flask_idem._store import _Statements

    distributed = _distributed()
    statements = _Statements("idempotency_keys", distributed=distributed)
    key = "(lpad(to_hex(:k1::bigint), 16, '0') || lpad(to_hex(:k2::bigint), 16, '0'))::uuid"
    values = {"org_id": ":org", "key": key, "sha": "decode(:sha, 'hex')", "method": "'POST'",
              "path": "'/orders'", "ttl": "86400", "flow": "NULL", "token": "NULL", "lease": "NULL",
              "lock": ":k1::bigint", "response": ":response", "tomb": "2592000", "task": "NULL"}  # fmt: skip

    def render(statement: bytes) -> str:
        text = statement.decode("utf-8")
        for name, value in values.items():
            text = text.replace(f"%({name})s", value)
        if "%(" in text:
            raise SystemExit(f"bench/run.py does not know a parameter of this statement:\n{text}")
        return text + ";"

    if distributed:
        before, after = [render(statements.reserve)], [render(statements.complete)]
    else:
        before = [render(statements.lock), render(statements.lookup)]
        after = [render(statements.insert_completed)]
    return "\n".join([
        "\\set k1 random(1, 9223372036854775806)",
        "\\set k2 random(1, 9223372036854775806)",
        "SELECT id FROM orgs WHERE api_key_sha = decode(:apisha, 'hex') AND revoked_at IS NULL;",
        "BEGIN;",
        *before,
        # Text for pgbench, never executed from Python.
        "INSERT INTO orders (org_id, idempotency_key, amount, currency)"  # noqa: S608
        f" VALUES (:org, {key}, 1250, 'EUR')"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING RETURNING id, amount, currency, created_at;",
        *after,
        "COMMIT;",
        "",
    ])  # fmt: skip


def _distributed() -> bool:
    """Whether this run is against Citus (``--citus``), as the applications it starts see it."""
    return os.environ.get("FLASK_IDEM_DISTRIBUTED") == "true"


def _seed() -> str:
    return str(random.randrange(1, 2**31))


if __name__ == "__main__":
    main()
