"""``uv run python -m tests.history [--duration S] [--clients N] [--seed N] [--citus]``: a long check."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from . import run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.history", description=__doc__)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load with faults")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--seed", type=int, default=1, help="seed of the workload and the nemesis")
    parser.add_argument("--fault-interval", type=float, default=3.0, help="mean seconds between faults")
    parser.add_argument("--max-faults", type=int, default=1000, help="most faults to inject")
    parser.add_argument(
        "--citus",
        action="store_true",
        help="run against a local Citus cluster (coordinator + 2 workers; restarts hit a worker node)",
    )
    parser.add_argument(
        "--no-jobs", action="store_true", help="leave out the background jobs (relay and Celery workers)"
    )
    parser.add_argument(
        "--partitions",
        action="store_true",
        help="partition the key table by the second and roll its partitions during the run",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flask-idem-history-") as workdir:
        report = run(
            Path(workdir),
            duration=args.duration,
            clients=args.clients,
            seed=args.seed,
            fault_interval=args.fault_interval,
            max_faults=args.max_faults,
            citus=args.citus,
            jobs=not args.no_jobs,
            partitions=args.partitions,
        )
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
