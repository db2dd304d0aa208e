"""What the 409's tail waits on: scenario (d) of ``run.py`` under several ways of serving the shop.

    uv run python bench/inflight.py                  # 3 runs of 10 s per way, 64 clients on 4 keys (~8 min)
    uv run python bench/inflight.py --runs 1 --seconds 5

Scenario (d) is many clients on a few keys at once (``inflight.lua``): most requests find their key in
flight and are answered 409 at once, without waiting for the attempt that holds it. Its latency, server
side (gunicorn's access log, from reading the request to writing the response), is the time the request
spends in the worker: its own CPU, and every wait for a thread, the GIL, a pooled connection or the
database. Each *way* changes one of those and keeps the rest, so what it changes in the tail is what the
tail waits on:

- **2 × 4, as run.py**: gunicorn 2 workers × 4 threads (gthread), a pool of 4 connections per worker;
- **switch interval 1 ms**: the same, with ``sys.setswitchinterval(0.001)`` in the workers (Python's
  default is 5 ms: a thread that wants the GIL while another runs Python waits up to that long);
- **4 × 2** and **8 × 1**: the same 8 threads in more processes, so fewer threads share a GIL;
- **2 × 4, pool of 2**: fewer connections than threads, so requests wait for connections;
- **2 × 4, wrk -t2**: the same clients driven by 2 wrk threads instead of one per client, so that the
  load generator's own threads crowd the run queue less (``inflight.lua``'s shared mode: the client's
  latencies are then unknown, the server's are what the table gives).

The table also gives, per request (warm-up included), how long the shop's worker threads and the
PostgreSQL backends serving them ran on a CPU and how long they waited in the run queue for one (the
scheduler's own counts): time a request spends neither running nor queued for a CPU is spent waiting
for I/O, a lock or the GIL.

The ways take turns, run by run; each figure is the median of the runs. Every run also counts the
orders and keys, as ``run.py`` does: a duplicate would show in the last column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/inflight.py` from anywhere

from bench.harness import (  # noqa: E402
    DEFAULT_SERVER_URL,
    backend_pids,
    ensure_tool,
    gunicorn,
    scratch_database,
    set_up_shop,
)
from bench.run import Plan, _inflight  # noqa: E402


@dataclass(frozen=True)
class Way:
    name: str
    workers: int
    threads: int
    env: dict[str, str]
    #: wrk's threads; ``None``: one per client.
    wrk_threads: int | None = None


WAYS = [
    Way("2 × 4, as run.py", 2, 4, {}),
    Way("2 × 4, switch interval 1 ms", 2, 4, {"FLASK_IDEM_BENCH_SWITCH_INTERVAL": "0.001"}),
    Way("4 × 2", 4, 2, {}),
    Way("8 × 1", 8, 1, {}),
    Way("2 × 4, pool of 2", 2, 4, {"FLASK_IDEM_POOL_MIN_SIZE": "2", "FLASK_IDEM_POOL_MAX_SIZE": "2"}),
    Way("2 × 4, wrk -t2", 2, 4, {}, wrk_threads=2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--keys", type=int, default=4)
    args = parser.parse_args()
    ensure_tool("wrk", "wrk")
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    figures: dict[str, list[dict[str, float]]] = {way.name: [] for way in WAYS}
    with (
        tempfile.TemporaryDirectory(prefix="flask-idem-inflight-") as tmpdir,
        scratch_database(server, "flask_idem_bench_inflight") as url,
    ):
        tmp = Path(tmpdir)
        org_id, api_key = set_up_shop(url)
        for run in range(args.runs):
            for way in WAYS[run % len(WAYS) :] + WAYS[: run % len(WAYS)]:
                plan = Plan(args.seconds, 3, 1, 0, way.workers, way.threads)
                notes: list[str] = []
                access = tmp / "access.log"
                access.write_text("")
                with gunicorn(url, workers=way.workers, threads=way.threads, log=tmp / "gunicorn.log",
                              access_log=access, env=way.env) as shop:  # fmt: skip
                    workers = shop.worker_pids()
                    before = _scheduled(workers) + _scheduled(backend_pids(url))
                    _inflight(shop, url, org_id, api_key, args.clients, args.keys, plan, tmp, notes,
                              wrk_threads=way.wrk_threads)  # fmt: skip
                    app = _scheduled(workers)
                    db = _scheduled(backend_pids(url))
                requests = len(access.read_text().splitlines())
                found = _parse(notes)
                found["app run"], found["app wait"] = (
                    (app[0] - before[0]) / requests,
                    (app[1] - before[1]) / requests,
                )
                found["db run"], found["db wait"] = (db[0] / requests, db[1] / requests)  # their whole life
                figures[way.name].append(found)
                print(f"# run {run + 1}/{args.runs}: {way.name}", file=sys.stderr, flush=True)
    _print(figures, args)


class _Ticks(tuple[float, float]):
    def __add__(self, other: object) -> _Ticks:
        assert isinstance(other, tuple)
        return _Ticks((self[0] + other[0], self[1] + other[1]))


def _scheduled(pids: list[int]) -> _Ticks:
    """Milliseconds the threads of ``pids`` ran on a CPU, and waited in the run queue for one, so far
    (the scheduler's own counts, ``/proc/<pid>/task/<tid>/schedstat``)."""
    run = wait = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:  # gone meanwhile
                continue
            run, wait = run + int(fields[0]), wait + int(fields[1])
    return _Ticks((run / 1e6, wait / 1e6))


def _parse(notes: list[str]) -> dict[str, float]:
    """The figures of one (d) run, from the notes ``_inflight`` writes."""
    found: dict[str, float] = {}
    for part in notes[0].split("; "):
        if "server p50/p99 " not in part:
            continue
        status = part.split(":")[0].split()[-1]
        server = part.split("server p50/p99 ")[1].split(" ms")[0]
        if "-" in server.split("/"):
            print(f"# no server figures: {part}", file=sys.stderr)
            continue
        p50, p99 = (float(v) for v in server.split("/"))
        found[f"{status} p50"], found[f"{status} p99"] = p50, p99
        found[f"{status} n"] = float(part.split(": ")[1].split(" ")[0])
    found["duplicates"] = float(notes[1].split(" duplicate")[0].rsplit(", ", 1)[1])
    return found


def _print(figures: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    def median(name: str, field: str, digits: int = 1) -> str:
        values = [run[field] for run in figures[name] if field in run]
        return f"{statistics.median(values):.{digits}f}" if values else "-"

    print(
        "| way | 409 server p50 / p99 ms | 201 p99 ms | 200 p99 ms | 409s | app: ms on a CPU / waiting"
        " for one, per request | PostgreSQL: the same | duplicates |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in figures:
        dups = sum(run["duplicates"] for run in figures[name])
        print(
            f"| {name} | {median(name, '409 p50')} / {median(name, '409 p99')} | {median(name, '201 p99')} |"
            f" {median(name, '200 p99')} | {median(name, '409 n')} |"
            f" {median(name, 'app run', 2)} / {median(name, 'app wait', 2)} |"
            f" {median(name, 'db run', 2)} / {median(name, 'db wait', 2)} | {dups:.0f} |"
        )
    print(
        f"\n- {args.clients} clients on {args.keys} keys (wrk -t{args.clients} -c{args.clients} unless"
        f" said), {args.runs} runs of {args.seconds:g} s per way after a 3 s warm-up, ways taking turns;"
        " medians of the runs;"
        " load average at the end: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    )


if __name__ == "__main__":
    main()
