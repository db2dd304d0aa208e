"""What signals, metrics and tracing cost a fresh-key request; prints two tables.

    uv run python bench/signals.py                 # 15 rounds of 300 requests per variant (~4 min)
    uv run python bench/signals.py --rounds 5 --requests 100

The shop (``bench.app``) runs in one process per variant, behind Flask's test client, with a pool of one
connection, each on a scratch database of its own. Every request is ``POST /orders`` with a fresh key,
the path where the signals' checks cost the most relative to the work (two outcome signals, two timed
key-table operations). The variants:

- **before**: the code of ``--before`` (default: where this branch left ``main``), extracted with
  ``git archive``: no signals at all;
- **no receiver**: this code, the shop's metrics off (``METRICS = False``), logging at WARNING;
- **metrics**: this code with the shop's Prometheus metrics (counters, histograms; a scrape is not
  part of a request);
- **metrics + tracing**: also :class:`flask_idem.tracing.Tracing` with an SDK tracer provider that
  records spans (no exporter), each request inside a span standing for the Flask instrumentation's.
  That request span's own cost is part of this row.

The processes take turns, one batch of ``--requests`` each per round, the order rotated every round, so
that the machine's phases touch every variant alike. Each batch is timed by the process's CPU time
(``time.process_time``: the test client, Flask, flask-idem and psycopg, not PostgreSQL) and by the wall
clock. The table gives the median over rounds and the quartiles, and each variant's ratio to
**before**, paired round by round.

The second table times the checks themselves in a loop (``timeit`` on CPU time, best of 7), in the
"no receiver" process: ``signals.wanted()`` and the ``timed`` wrapper of a store method against the
bare method; and, in each variant's process, what one fresh-key request's signals add (``_checks``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "no receiver", "metrics", "metrics + tracing")


def _worker(code: str, variant: str, url: str) -> None:
    """Serve ``run N`` commands on stdin: N fresh-key requests, answered with their CPU and wall time."""
    sys.path.insert(0, code)
    import flask_idem
    from bench.app import create_app
    from bench.harness import BODY
    from example_app.cli import create_org
    from example_app.db import init_db

    assert Path(flask_idem.__file__).resolve().is_relative_to(Path(code).resolve()), flask_idem.__file__
    config: dict[str, Any] = {"DATABASE_URL": url, "IDEM_POOL_MIN_SIZE": 1, "IDEM_POOL_MAX_SIZE": 1}
    if variant != "before":
        config["METRICS"] = variant != "no receiver"
    app = create_app(config)
    with app.app_context():
        init_db()
        _, api_key = create_org("bench")
    span: Any = None
    if variant == "metrics + tracing":
        from opentelemetry.sdk.trace import TracerProvider

        from flask_idem.tracing import Tracing

        provider = TracerProvider()
        Tracing(app, tracer_provider=provider)
        span = provider.get_tracer("bench").start_as_current_span
    client = app.test_client()
    auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    def one() -> None:
        response = client.post("/orders", data=BODY, headers={**auth, "Idempotency-Key": str(uuid.uuid4())})
        assert response.status_code == 201, response.data

    for _ in range(20):  # warm: prepared statements, caches
        one()
    checks = _checks(app, variant, span) if variant != "before" else {}
    print(json.dumps({"ready": variant, "checks": checks}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "quit":
            break
        n = int(command[1])
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            if span is None:
                one()
            else:
                with span("POST /orders"):
                    one()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(json.dumps({"cpu": cpu / n, "wall": wall / n}), flush=True)


def _checks(app: Any, variant: str, span: Any) -> dict[str, float]:
    """Nanoseconds per call of the checks, and per request of what a fresh-key request sends.

    "per request" replays, in a request context of ``POST /orders``, what flask-idem adds to a fresh
    key: the two outcome signals (``key-reserved``, ``response-stored``, each behind its check) and
    two timed key-table operations (here of a method that does nothing), minus the same bare calls.
    """
    import timeit

    from flask_idem import signals

    def bare() -> None:
        return None

    timed = signals.timed("reserve")(bare)
    key = uuid.uuid4()

    def request() -> None:
        if signals.wanted(signals.key_reserved):
            signals.send(signals.key_reserved, org_id=1, key=key, flow=None)
        timed()
        timed()
        if signals.wanted(signals.response_stored):
            signals.send(signals.response_stored, org_id=1, key=key, flow=None, status=201)

    def request_bare() -> None:
        bare()
        bare()

    def best(call: Any, loops: int) -> float:
        # CPU time, like the first table: other work on the machine stretches wall time, not this.
        return min(timeit.repeat(call, number=loops, repeat=7, timer=time.process_time)) / loops * 1e9

    results = {}
    with app.test_request_context("/orders", method="POST"):
        if variant == "no receiver":
            results["signals.wanted(signal)"] = best(lambda: signals.wanted(signals.key_reserved), 200_000)
            results["a store method, timed wrapper"] = best(timed, 200_000)
            results["the same method, bare"] = best(bare, 200_000)
        if span is None:
            added = best(request, 20_000) - best(request_bare, 20_000)
        else:  # each replayed request in a span of its own, against the same span around the bare calls

            def traced(call: Any) -> Any:
                def run() -> None:
                    with span("POST /orders"):
                        call()

                return run

            added = best(traced(request), 5_000) - best(traced(request_bare), 5_000)
        results[f"added per fresh-key request, {variant}"] = added
    return results


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=300, help="requests per variant per round")
    parser.add_argument("--before", help="the commit to compare with (default: merge-base of HEAD and main)")
    parser.add_argument("--worker", nargs=3, metavar=("CODE", "VARIANT", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return

    sys.path.insert(0, str(ROOT))
    from bench.harness import DEFAULT_SERVER_URL, scratch_database, snapshot

    before = (
        args.before
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    with tempfile.TemporaryDirectory(prefix="flask-idem-before-") as tmp:
        codes = {v: str(snapshot(before, Path(tmp)) if v == "before" else ROOT) for v in VARIANTS}
        from contextlib import ExitStack

        with ExitStack() as stack:
            urls = {
                v: stack.enter_context(scratch_database(server, f"flask_idem_bench_signals_{i}"))
                for i, v in enumerate(VARIANTS)
            }
            procs = {}
            for v in VARIANTS:
                procs[v] = subprocess.Popen(
                    [sys.executable, __file__, "--worker", codes[v], v, urls[v]],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={k: val for k, val in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"},
                )
                stack.callback(procs[v].wait, 30)
                stack.callback(_quit, procs[v])
            checks: dict[str, float] = {}
            for v in VARIANTS:
                checks.update(json.loads(_read(procs[v]))["checks"])
            results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
            load_start = os.getloadavg()
            for r in range(args.rounds):
                order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
                for v in order:
                    stdin = procs[v].stdin
                    assert stdin is not None
                    stdin.write(f"run {args.requests}\n")
                    stdin.flush()
                    results[v].append(json.loads(_read(procs[v])))
                print(f"# round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    _print(results, checks, before, args, load_start, os.getloadavg())


def _read(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker exited with {proc.wait()}")
    return line


def _quit(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None and proc.poll() is None:
        proc.stdin.write("quit\n")
        proc.stdin.close()


def _print(
    results: dict[str, list[dict[str, float]]],
    checks: dict[str, float],
    before: str,
    args: argparse.Namespace,
    load_start: tuple[float, float, float],
    load_end: tuple[float, float, float],
) -> None:
    print(
        "| variant | CPU µs/request (quartiles) | wall µs/request (quartiles) | CPU × before (quartiles) |"
        " wall × before (quartiles) |"
    )
    print("| --- | --- | --- | --- | --- |")
    base = results["before"]
    for v in VARIANTS:
        row = results[v]
        cells = []
        for measure in ("cpu", "wall"):
            q1, q2, q3 = _quartiles([x[measure] * 1e6 for x in row])
            cells.append(f"{q2:.0f} ({q1:.0f}-{q3:.0f})")
        for measure in ("cpu", "wall"):
            q1, q2, q3 = _quartiles([x[measure] / b[measure] for x, b in zip(row, base, strict=True)])
            cells.append(f"{q2:.3f} ({q1:.3f}-{q3:.3f})")
        print(f"| {v} | " + " | ".join(cells) + " |")
    print()
    print("| check | ns |")
    print("| --- | --- |")
    for name, ns in checks.items():
        print(f"| {name} | {ns:.0f} |")
    print()
    print(
        f"- {args.rounds} rounds × {args.requests} fresh-key requests per variant, order rotated per round;"
        f" before = {before[:7]}; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end"
    )


if __name__ == "__main__":
    main()
