"""What a network fault between the shop and PostgreSQL costs: a timeline, before and after the fault.

    uv run python bench/faults.py --fault hung            # open connections silent for good (hung peer)
    uv run python bench/faults.py --fault dead            # ... as a dead host (iptables; needs root)
    uv run python bench/faults.py --fault hold --hold 10  # all traffic held for 10 s, then resumed
    uv run python bench/faults.py --fault reset           # every connection reset
    uv run python bench/faults.py --fault hung --unprotected   # flask-idem without its deadline and timeouts

The shop (``example_app``) runs under gunicorn (4 workers x 8 threads and 4 connections per worker by default,
as ``docs/deployment`` advises) on a scratch database, reaching PostgreSQL through the suite's fault proxy
(``tests/support/faultproxy.py``), under the suite's load (``tests/support/outage.py``): ``--clients`` threads
place orders one after another, each with a fresh key and **one attempt** (a 30 s client timeout, no retry),
and ``GET /orders`` and ``GET /health`` go out every 0.25 s on a schedule of their own. After ``--before``
seconds the fault is injected; the run goes on for ``--after`` seconds. The table counts, per time bucket (by
when each request was sent, relative to the fault), the orders that succeeded, failed with 503, failed
otherwise or got no answer, their slowest answer, and the reads and health checks answered 200.
``--unprotected`` runs the shop with ``IDEM_DATABASE_DEADLINE = None`` and none of flask-idem's connect
options: what a shop without them sees. Extra ``--env NAME=VALUE`` settings go to the shop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/faults.py` from anywhere

from bench.harness import DEFAULT_SERVER_URL, scratch_database, set_up_shop  # noqa: E402
from flask_idem import DEFAULT_CONNECT_OPTIONS  # noqa: E402
from tests.support.faultproxy import FaultProxy, can_drop_packets  # noqa: E402
from tests.support.outage import Load, Sample  # noqa: E402
from tests.support.servers import gunicorn  # noqa: E402

#: The shop's settings with none of flask-idem's protection against a silent database.
UNPROTECTED = {
    "FLASK_IDEM_DATABASE_DEADLINE": "null",
    "FLASK_IDEM_CONNECT_OPTIONS": json.dumps(dict.fromkeys(DEFAULT_CONNECT_OPTIONS)),
}


def run(args: argparse.Namespace) -> Load:
    """Serve the shop behind the proxy, load it, inject the fault; return the load with its samples."""
    with (
        tempfile.TemporaryDirectory(prefix="flask-idem-bench-faults-") as workdir,
        scratch_database(args.server_url, "flask_idem_bench_faults") as url,
    ):
        _, api_key = set_up_shop(url)
        proxy = FaultProxy(url)
        env = {
            "FLASK_DATABASE_URL": proxy.conninfo(url),
            "FLASK_METRICS": "false",
            "FLASK_IDEM_POOL_MAX_SIZE": str(args.connections),
            **(UNPROTECTED if args.unprotected else {}),
            **dict(item.split("=", 1) for item in args.env),
        }
        try:
            with gunicorn(
                Path(workdir) / "shop.log", env=env, workers=args.workers, threads=args.threads
            ) as (base, _):
                load = Load(base, api_key, clients=args.clients, timeout=args.timeout)
                load.start()
                try:
                    time.sleep(args.before)
                    load.fault()
                    inject(args, proxy)
                    time.sleep(args.after)
                finally:
                    load.stop()
                return load
        finally:
            proxy.close()


def inject(args: argparse.Namespace, proxy: FaultProxy) -> None:
    if args.fault in ("hung", "dead"):
        print(f"silenced {proxy.silence(args.fault)} connections ({args.fault})", file=sys.stderr)
    elif args.fault == "hold":
        proxy.hold(args.hold)
    elif args.fault == "reset":
        print(f"reset {proxy.reset()} connections", file=sys.stderr)


def table(load: Load, bucket: float, start: float) -> str:
    """The timeline, one row per ``bucket`` seconds from ``start`` (relative to the fault)."""
    rows = [
        "| from (s) | orders ok | 503 | other | no answer | slowest order (s) | reads ok/all"
        " | health ok/all | slowest read (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    end = max(load.since_fault(s) for s in load.samples)
    edge = start
    while edge <= end:

        def inside(kind: str, low: float = edge) -> list[Sample]:
            return [s for s in load.samples if s.kind == kind and low <= load.since_fault(s) < low + bucket]

        orders, reads, health = inside("order"), inside("read"), inside("health")
        rows.append(
            f"| {edge:+.0f} | {sum(s.ok for s in orders)} | {sum(s.status == 503 for s in orders)} | "
            f"{sum(s.status not in (None, 503) and not s.ok for s in orders)} | "
            f"{sum(s.status is None for s in orders)} | {max((s.seconds for s in orders), default=0):.1f} | "
            f"{sum(s.ok for s in reads)}/{len(reads)} | {sum(s.ok for s in health)}/{len(health)} | "
            f"{max((s.seconds for s in reads), default=0):.1f} |"
        )
        edge += bucket
    return "\n".join(rows)


def summary(load: Load) -> str:
    """When the last order caught by the fault was answered, and first-attempt success from 20 s on."""
    orders = [s for s in load.samples if s.kind == "order"]
    failed = [s for s in orders if not s.ok and load.since_fault(s) >= -5]
    recovered = max((s.answered - load.fault_at for s in failed), default=0.0)
    late = [s for s in orders if load.since_fault(s) >= 20]
    ok = sum(s.ok for s in late)
    share = f"{100 * ok / len(late):.1f}%" if late else "n/a"
    worst = max((s.seconds for s in load.samples), default=0.0)
    statuses = sorted({str(s.status) for s in load.samples if not s.ok})
    return (
        f"- orders that failed: {len(failed)}, the last one answered {recovered:.1f} s after the fault\n"
        f"- orders sent 20 s or more after the fault: {ok} of {len(late)} succeeded at once ({share})\n"
        f"- the slowest answer of any request: {worst:.1f} s; statuses other than 2xx: {statuses or 'none'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/faults.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=["hung", "dead", "hold", "reset", "none"], required=True)
    parser.add_argument("--hold", type=float, default=10.0, help="seconds of a hold")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the fault")
    parser.add_argument("--after", type=float, default=30.0, help="seconds of load after the fault")
    parser.add_argument("--bucket", type=float, default=2.0, help="seconds per row of the table")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--connections", type=int, default=4, help="IDEM_POOL_MAX_SIZE of each worker")
    parser.add_argument("--timeout", type=float, default=30.0, help="the client's timeout, in seconds")
    parser.add_argument("--unprotected", action="store_true", help="no deadline, no connect options")
    parser.add_argument(
        "--server-url", default=os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the shop")
    args = parser.parse_args()
    if args.fault == "dead" and (reason := can_drop_packets()):
        parser.error(f"--fault dead: {reason}")
    load = run(args)
    print(table(load, args.bucket, -args.before))
    print(summary(load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
