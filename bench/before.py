"""This checkout against another commit, side by side under load: the same scenarios on both codes at once.

    uv run python bench/before.py --before 3da42f4                  # 6 rounds of 8 s per pair (~6 min)
    uv run python bench/before.py --before 3da42f4 --rounds 4 --seconds 5
    uv run python bench/before.py --before-env FLASK_IDEM_DATABASE_DEADLINE=null   # one code, two settings

``bench/run.py`` compares scenarios of one code with each other; this compares two codes in one
scenario. Two gunicorns of 1 worker × 4 threads serve the shop (``bench/app.py``) on one scratch
database: **now**, this checkout, and **before**, the commit ``--before`` extracted with ``git archive``
(its ``flask_idem``, ``example_app`` and ``bench``; the key table's schema must be the same), or this
checkout too when ``--before`` is not given. ``--before-env`` and ``--now-env`` (``NAME=VALUE``, repeated)
set the environment of one server, to compare two settings of one code. Each pair is
two wrk runs at once, one against each server (wrk -t1 -c8 each, as in ``run.py``), so both see the same
moments of the machine; the ratio now / before is taken round by round, by requests per second and by
capacity (requests per CPU second of the server's workers and of its own PostgreSQL backends), and the
table gives the median of the rounds' ratios and their quartiles:

- **(a) baseline**: ``POST /bench/orders`` on both, a route without the decorator, which neither code's
  flask-idem is on: the method's own error (A/A);
- **(b) fresh key**: ``POST /orders`` with a new key per request;
- **(c) replay**: ``POST /orders`` cycling through 1000 finished keys.

When the two codes make different layouts of the key table (``--before dd82ca5``, the last of layout 3,
against layout 4), each serves a key table of its own: "before" one made by its own migration
(``idempotency_keys_before``), "now" the shop's; the finished keys that (c) replays are copied into
both. ``--now-daily`` gives "now" a key table as it is once ``flask idem purge`` has run (layout 4's
daily partitions over the next days and a spare one until eight days ahead; a fresh table keeps its
first partition for eight days), with the same keys copied into it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/before.py` from anywhere

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from bench import report  # noqa: E402
from bench.harness import (  # noqa: E402
    DEFAULT_SERVER_URL,
    Server,
    WrkJob,
    WrkRun,
    backend_pids,
    daily_table,
    ensure_tool,
    gunicorn,
    scratch_database,
    server_version,
    set_up_shop,
    snapshot,
    wrk_together,
)
from bench.run import Plan, _precreate_keys, _seed  # noqa: E402

DATABASE = "flask_idem_bench_before"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the commit to compare this checkout with (default: this one)")
    parser.add_argument("--before-env", action="append", default=[], help="NAME=VALUE for 'before'")
    parser.add_argument("--now-env", action="append", default=[], help="NAME=VALUE for 'now'")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument(
        "--now-daily", action="store_true", help="serve 'now' from a key table in daily partitions (layout 4)"
    )
    args = parser.parse_args()
    plan = Plan(seconds=args.seconds, warmup=3, rounds=args.rounds, big_rows=0, workers=2, threads=4)
    ensure_tool("wrk", "wrk")
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    with (
        tempfile.TemporaryDirectory(prefix="flask-idem-bench-before-") as tmpdir,
        scratch_database(server, DATABASE) as url,
    ):
        tmp = Path(tmpdir)
        machine = report.machine(server_version(url), 2, 4)  # with the load average at the start
        here = Path(__file__).resolve().parent.parent
        roots = {"now": here, "before": snapshot(args.before, tmp / "before") if args.before else here}
        envs = {
            name: dict(item.split("=", 1) for item in items)
            for name, items in (("now", args.now_env), ("before", args.before_env))
        }
        org_id, api_key = set_up_shop(url)
        with gunicorn(url, workers=1, threads=plan.threads, log=tmp / "gunicorn.log") as shop:
            replay_file = _precreate_keys(shop, url, org_id, api_key, plan, tmp)
        layouts = {name: _layout_of(root) for name, root in roots.items()}
        tables = {"now": "idempotency_keys", "before": "idempotency_keys"}
        if layouts["before"] != layouts["now"]:
            tables["before"] = "idempotency_keys_before"
            _run_in(roots["before"], "from flask_idem._migrate import upgrade; import sys;"
                    " upgrade(sys.argv[1], table=sys.argv[2])", url, tables["before"])  # fmt: skip
        if args.now_daily:
            tables["now"] = "idempotency_keys_daily"
            daily_table(url, tables["now"])
        for name, table in tables.items():
            if table != "idempotency_keys":
                _copy_keys(url, "idempotency_keys", table, replay_file)
                envs[name]["FLASK_IDEM_TABLE"] = table
        scenarios: dict[str, tuple[str, str, list[str]]] = {
            "(a) baseline: POST /bench/orders, no decorator (A/A)": ("/bench/orders", "fresh.lua", []),
            "(b) fresh key: POST /orders": ("/orders", "fresh.lua", []),
            "(c) replay of finished keys: POST /orders": ("/orders", "replay.lua", [str(replay_file)]),
        }
        runs: dict[str, list[tuple[WrkRun, WrkRun]]] = {label: [] for label in scenarios}
        with contextlib.ExitStack() as stack:
            servers = {
                name: stack.enter_context(
                    gunicorn(make_conninfo(url, application_name=f"bench-{name}"), workers=1,
                             threads=plan.threads, log=tmp / f"gunicorn-{name}.log", root=root,
                             env=envs[name])
                )
                for name, root in roots.items()
            }  # fmt: skip

            def pair(label: str, seconds: float) -> tuple[WrkRun, WrkRun]:
                path, script, extra = scenarios[label]
                jobs = [
                    WrkJob(script, servers[name].base + path, [api_key, _seed(), *extra], threads=1,
                           connections=plan.connections // 2, watch=_watch(servers[name], url, name))
                    for name in ("before", "now")
                ]  # fmt: skip
                before, now = wrk_together(jobs, seconds)
                return before, now

            labels = list(scenarios)
            for label in labels:
                pair(label, plan.warmup)
            for r in range(plan.rounds):
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    print(f"# round {r + 1}/{plan.rounds}: {label}", flush=True)
                    runs[label].append(pair(label, plan.seconds))
    _print(runs, args, machine, {name: f"{tables[name]} (layout {layouts[name]})" for name in tables})


def _layout_of(root: Path) -> int:
    """The newest layout of the key table that the code under ``root`` makes."""
    out = _run_in(root, "from flask_idem import _layout; print(_layout.revisions()[-1].layout)")
    return int(out)


def _run_in(root: Path, code: str, *args: str) -> str:
    """Run ``code`` with the flask_idem under ``root`` (it comes first on ``sys.path``)."""
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout


def _copy_keys(url: str, source: str, target: str, keys: Path) -> None:
    """Copy the rows of the keys listed in ``keys`` from ``source`` into ``target`` (their common columns)."""
    with psycopg.connect(url) as conn:
        columns = [
            name
            for (name,) in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
                " AND NOT attisdropped AND attname IN (SELECT attname FROM pg_attribute"
                " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped) ORDER BY attnum",
                (target, source),
            )
        ]
        names = sql.SQL(", ").join(map(sql.Identifier, columns))
        conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE idem_key = ANY(%s::uuid[])").format(
                sql.Identifier(target), names, names, sql.Identifier(source)
            ),
            (keys.read_text().split(),),
        )


def _watch(server: Server, url: str, name: str) -> dict[str, list[int]]:
    """The processes whose CPU a run counts: the server's workers and its own PostgreSQL backends."""
    return {"app": server.worker_pids(), "db": backend_pids(url, f"bench-{name}")}


def _print(
    runs: dict[str, list[tuple[WrkRun, WrkRun]]],
    args: argparse.Namespace,
    machine: str,
    tables: dict[str, str],
) -> None:
    def ratio(label: str, value: Callable[[WrkRun], float]) -> report.Paired:
        return report.paired([b for b, _ in runs[label]], [n for _, n in runs[label]], value)

    def cpu(side: list[WrkRun]) -> str:
        app, db = report.cpu_per_request(side, "app"), report.cpu_per_request(side, "db")
        return f"{app:.2f} / {db:.2f}"

    def side(commit: str | None, env: list[str]) -> str:
        return (commit or "this checkout") + (f" with {' '.join(env)}" if env else "")

    print(f"now: {side(None, args.now_env)}, key table {tables['now']}; before:"
          f" {side(args.before, args.before_env)}, key table {tables['before']}\n")  # fmt: skip
    print("| scenario | now / before, req/s | now / before, capacity | CPU ms/req before (app / db) | now |")
    print("| --- | --- | --- | --- | --- |")
    for label, pairs in runs.items():
        before, now = [b for b, _ in pairs], [n for _, n in pairs]
        print(
            f"| {label} | {ratio(label, report.rps)} | {ratio(label, report.capacity)} | {cpu(before)} |"
            f" {cpu(now)} |"
        )
    print(
        f"\n- {machine}\n- here each of the two servers has 1 worker × 4 threads and a pool of 4"
        f" connections, and wrk -t1 -c8 drives each at once; {args.rounds} rounds of {args.seconds:g} s per"
        " pair, order rotated per round, after a 3 s warm-up of each\n- load average at the end: "
        + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    )
    failed = {
        label: [sum(r.status_errors + r.socket_errors for r in side) for side in zip(*pairs, strict=True)]
        for label, pairs in runs.items()
    }
    print("- non-2xx responses and socket errors, before / now: "
          + "; ".join(f"{label[:3]} {b} / {n}" for label, (b, n) in failed.items()))  # fmt: skip


if __name__ == "__main__":
    main()
