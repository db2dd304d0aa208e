"""What a network fault between the shop and PostgreSQL costs: a timeline, before and after the fault.

    uv run python bench/faults.py --fault hung            # open connections silent for good (hung peer)
    uv run python bench/faults.py --fault dead            # ... as a dead host (iptables; needs root)
    uv run python bench/faults.py --fault hold --hold 10  # all traffic held for 10 s, then resumed
    uv run python bench/faults.py --fault reset           # every connection reset

The shop (``example_app``) runs under gunicorn (4 workers x 4 threads by default) on a scratch database,
reaching PostgreSQL through the suite's fault proxy (``tests/faultproxy.py``). ``--clients`` threads place
orders one after another, each with a fresh key and **one attempt** (a 30 s client timeout, no retry), and a
reader asks ``GET /orders`` every 0.25 s. After ``--before`` seconds the fault is injected; the run goes
on for ``--after`` seconds. The table counts, per time bucket (by when each request started, relative to
the fault), the orders that succeeded, failed with 503, failed otherwise or timed out, their slowest
answer, and the slowest ``GET /orders``. Extra ``--env NAME=VALUE`` settings go to the shop (e.g.
``--env FLASK_IDEM_DATABASE_DEADLINE=null`` to see the shop without its deadline).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/faults.py` from anywhere

import requests  # noqa: E402

from bench.harness import DEFAULT_SERVER_URL, scratch_database, set_up_shop  # noqa: E402
from tests.faultproxy import FaultProxy, can_drop_packets  # noqa: E402
from tests.servers import gunicorn  # noqa: E402

#: Statuses named in the table; anything else counts as "other".
ORDER = b'{"amount": 1250, "currency": "EUR"}'


@dataclass
class Sample:
    """One request: when it started (seconds from the fault) and how it ended."""

    kind: str  # "order" or "read"
    start: float
    seconds: float
    outcome: str  # "ok", "503", "other <status>", "timeout", "error"


def _one(send: Callable[[], requests.Response], kind: str, t0: float, out: list[Sample]) -> None:
    start = time.monotonic()
    try:
        status = send().status_code
        outcome = "ok" if status < 300 else str(status) if status == 503 else f"other {status}"
    except requests.Timeout:
        outcome = "timeout"
    except requests.RequestException:
        outcome = "error"
    out.append(Sample(kind, start - t0, time.monotonic() - start, outcome))


def run(args: argparse.Namespace) -> list[Sample]:
    """Serve the shop behind the proxy, load it, inject the fault; return every request's sample."""
    with (
        tempfile.TemporaryDirectory(prefix="flask-idem-bench-faults-") as workdir,
        scratch_database(args.server_url, "flask_idem_bench_faults") as url,
    ):
        _, api_key = set_up_shop(url)
        proxy = FaultProxy(url)
        env = {"FLASK_DATABASE_URL": proxy.conninfo(url), "FLASK_METRICS": "false"}
        env.update(dict(item.split("=", 1) for item in args.env))
        try:
            with gunicorn(
                Path(workdir) / "shop.log", env=env, workers=args.workers, threads=args.threads
            ) as (base, _):
                return _load(args, base, api_key, proxy)
        finally:
            proxy.close()
            if args.keep_log:
                print((Path(workdir) / "shop.log").read_text()[-20000:], file=sys.stderr)


def _load(args: argparse.Namespace, base: str, api_key: str, proxy: FaultProxy) -> list[Sample]:
    samples: list[Sample] = []
    auth = {"Authorization": f"Bearer {api_key}"}
    t0 = time.monotonic() + args.before
    stop = t0 + args.after

    def order() -> requests.Response:
        headers = {**auth, "Idempotency-Key": str(uuid.uuid4()), "Content-Type": "application/json"}
        return requests.post(base + "/orders", data=ORDER, headers=headers, timeout=30)

    def writer() -> None:
        while time.monotonic() < stop:
            _one(order, "order", t0, samples)

    def reader() -> None:
        while time.monotonic() < stop:
            _one(lambda: requests.get(base + "/orders", headers=auth, timeout=30), "read", t0, samples)
            time.sleep(0.25)

    threads = [threading.Thread(target=writer) for _ in range(args.clients)]
    threads.append(threading.Thread(target=reader))
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, t0 - time.monotonic()))
    if args.fault in ("hung", "dead"):
        print(f"silenced {proxy.silence(args.fault)} connections ({args.fault})", file=sys.stderr)
    elif args.fault == "hold":
        proxy.hold(args.hold)
    elif args.fault == "reset":
        print(f"reset {proxy.reset()} connections", file=sys.stderr)
    for thread in threads:
        thread.join()
    return samples


def table(samples: list[Sample], bucket: float, start: float) -> str:
    """The timeline, one row per ``bucket`` seconds from ``start`` (relative to the fault)."""
    rows = [
        "| from (s) | orders ok | 503 | other | timeout/error | slowest order (s) | reads ok/all"
        " | slowest read (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    edge = start
    end = max(s.start for s in samples)
    while edge <= end:
        inside = [s for s in samples if edge <= s.start < edge + bucket]
        orders = [s for s in inside if s.kind == "order"]
        reads = [s for s in inside if s.kind == "read"]
        rows.append(
            f"| {edge:+.0f} | {sum(s.outcome == 'ok' for s in orders)} | "
            f"{sum(s.outcome == '503' for s in orders)} | "
            f"{sum(s.outcome.startswith('other') for s in orders)} | "
            f"{sum(s.outcome in ('timeout', 'error') for s in orders)} | "
            f"{max((s.seconds for s in orders), default=0):.1f} | "
            f"{sum(s.outcome == 'ok' for s in reads)}/{len(reads)} | "
            f"{max((s.seconds for s in reads), default=0):.1f} |"
        )
        edge += bucket
    return "\n".join(rows)


def summary(samples: list[Sample], after: float) -> str:
    """First-attempt success of the orders started ``after`` seconds or more past the fault."""
    late = [s for s in samples if s.kind == "order" and s.start >= after]
    ok = sum(s.outcome == "ok" for s in late)
    others = sorted({s.outcome for s in late if s.outcome != "ok"})
    share = f"{100 * ok / len(late):.1f}%" if late else "n/a"
    return f"orders started {after:.0f} s or more after the fault: {ok} of {len(late)} ok ({share}) {others}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/faults.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=["hung", "dead", "hold", "reset", "none"], required=True)
    parser.add_argument("--hold", type=float, default=10.0, help="seconds of a hold")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the fault")
    parser.add_argument("--after", type=float, default=40.0, help="seconds of load after the fault")
    parser.add_argument("--bucket", type=float, default=2.0, help="seconds per row of the table")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--server-url", default=os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the shop")
    parser.add_argument("--keep-log", action="store_true", help="print the end of the shop's log")
    args = parser.parse_args()
    if args.fault == "dead" and (reason := can_drop_packets()):
        parser.error(f"--fault dead: {reason}")
    samples = run(args)
    print(table(samples, args.bucket, -args.before))
    print(summary(samples, 20.0))
    odd = sorted({s.outcome for s in samples if s.outcome not in ("ok", "503")})
    print(f"other outcomes: {odd or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
