"""Failover figures: how soon the shop answers after the standby is promoted, and what each mode loses.

    uv run python bench/failover.py --runs 2        # every mode, gaps 1 3 5 10 20 s, twice (~20 min)
    uv run python bench/failover.py --modes on --gaps 1 10

The system of ``tests/test_failover.py``: a primary and a streaming standby of the embedded PostgreSQL
(``tests/support/replication.py``), the gateway, and the shop under gunicorn (2 workers x 4 threads, the
history checker's settings: ``IDEM_POOL_TIMEOUT`` 2 s, the other pool settings at their defaults) on the
multi-host URL ``host=127.0.0.1,127.0.0.1 port=A,B target_session_attrs=read-write``. Each run: two clients
place and pay orders through the retry helper and four probes place orders one attempt at a time
(``tests/support/failover.py``); after 1 s the primary's processes are SIGKILLed, the standby is promoted
*gap* seconds later (what a failover manager takes to decide), the clients go on for 3 s more (the probes
until every worker has acknowledged an order again, or 60 s after the promotion), and then the history checker
settles and compares the database with what every client was told.

Modes: ``on`` and ``remote_apply`` (a synchronous standby, the primary's ``synchronous_commit``),
``async`` (an asynchronous standby: whatever it had not received at the kill is lost) and ``async-cut``
(asynchronous, the standby's WAL receiver cut 1 s before the kill, as a standby that lags by a second
would be: the loss made certain).

For each run the table gives: how long the promotion took (``pg_ctl promote -w``); the first order
acknowledged after it (any worker) and the last worker's first one, in seconds after the promotion;
what the probes were answered between the kill and the first acknowledgement; orders acknowledged in
the run; and the checker's findings: acknowledged orders and payments lost, and duplicates. Then, for
the last run of each gap, every worker's connection attempts after the kill (psycopg_pool's log), in
seconds after the kill.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/failover.py` from anywhere

import psycopg  # noqa: E402

from tests.support.failover import Outcome, fail_over_under_load, running_system  # noqa: E402

MODES = {"on": "on", "remote_apply": "remote_apply", "async": None, "async-cut": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--gaps", nargs="+", type=float, default=[1.0, 3.0, 5.0, 10.0, 20.0])
    parser.add_argument("--runs", type=int, default=1, help="runs per mode and gap")
    parser.add_argument(
        "--async-gaps", nargs="+", type=float, default=[1.0], help="gaps of the asynchronous modes"
    )
    args = parser.parse_args()
    rows: list[tuple[str, float, Outcome, int]] = []
    with running_system(seed=5) as (pair, cluster, workdir):
        for mode in args.modes:
            gaps = args.async_gaps if MODES[mode] is None else args.gaps
            for gap in gaps:
                for _ in range(args.runs):
                    outcome = fail_over_under_load(
                        pair,
                        cluster,
                        workdir,
                        synchronous_commit=MODES[mode],
                        gap=gap,
                        cut=1.0 if mode == "async-cut" else None,
                        every_worker_within=60.0,
                    )
                    rows.append((mode, gap, outcome, _ids_reused(cluster.database_url, outcome)))
                    print(f"# {mode}, gap {gap:g} s\n{outcome.timeline.summary()}\n", flush=True)
    _print(rows)


def _ids_reused(url: str, outcome: Outcome) -> int:
    """Acknowledged orders whose id now names an order of another key.

    After an asynchronous failover the new primary's identity sequence goes on from where its replicated
    state says (PostgreSQL logs sequences 32 values ahead), so the ids of lost orders can be handed out
    again.
    """
    acknowledged = {
        json.loads(op.response or b"{}")["id"]: op.key
        for op in outcome.history
        if op.kind == "order" and op.outcome.endswith("ok")
    }
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, idempotency_key FROM orders WHERE id = ANY(%s)", (list(acknowledged),)
        ).fetchall()
    return sum(1 for order_id, key in rows if key != acknowledged[order_id])


def _print(rows: list[tuple[str, float, Outcome, int]]) -> None:
    print(
        "| mode | gap (s) | promotion (s) | first 201 after it (s) | last worker's first 201 (s) |"
        " answers from the kill to the first 201 | orders acknowledged | lost orders | lost payments |"
        " duplicates | other findings | acknowledged ids reused |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, gap, outcome, reused in rows:
        t = outcome.timeline
        first = t.first_answer
        per_worker = t.first_answers()
        last = (
            max(p.done for p in per_worker.values() if p is not None) - t.promoted
            if per_worker and all(p is not None for p in per_worker.values())
            else None
        )
        lost = outcome.report.anomalies.get("lost", [])
        acknowledged = sum(1 for op in outcome.history if op.kind == "order" and op.outcome.endswith("ok"))
        print(
            f"| {mode} | {gap:g} | {t.promoted - t.promote_started:.2f} |"
            f" {first.done - t.promoted if first else float('nan'):.2f} |"
            f" {'-' if last is None else f'{last:.2f}'} |"
            f" {', '.join(f'{k} x{v}' for k, v in sorted(t.outage().items())) or 'none'} |"
            f" {acknowledged} |"
            f" {sum('acknowledged order' in d for d in lost)} |"
            f" {sum('acknowledged payment' in d for d in lost)} |"
            f" {len(outcome.report.anomalies.get('duplicates', []))} |"
            f" {len(outcome.report.anomalies.get('unexpected', []))} | {reused} |"
        )


if __name__ == "__main__":
    main()
