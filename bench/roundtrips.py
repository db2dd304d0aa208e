"""Database round trips per request, by path, counted on the wire; prints one table.

    uv run python bench/roundtrips.py            # against one PostgreSQL server
    uv run python bench/roundtrips.py --citus    # against a local Citus cluster (tests/support/citus.py)

The shop (with the baseline route of ``bench/app.py``) runs in this process behind Flask's test client,
with a pool of exactly one connection, and libpq's protocol trace (``PQtrace``, psycopg's
``pgconn.trace()``) on that connection. For each path a few requests warm it up (psycopg prepares a
statement on its 5th run, which costs one extra round trip once), then ``TRACED`` requests are traced and
the trace is counted:

- a round trip is a turn of the conversation: messages sent, then the server's answer (in the trace, a
  run of ``F`` lines followed by a ``B`` line). Without pipelining that is one per simple ``Query``
  (BEGIN, COMMIT, ROLLBACK) and one per ``Sync`` (a statement with parameters); with psycopg's pipeline
  mode several statements share one turn, and this count shows it;
- a statement is a ``Query`` or an ``Execute`` message sent.

The authentication query of ``example_app.auth`` is one of them on every path. A second table gives the
wall time and this process's CPU time per request of each path (the test client, Flask and psycopg, but
not the server's CPU): the median of ``ROUNDS`` rounds of ``TIMED`` requests, the paths taking turns, so
that a burst of other work on the machine moves one round rather than one path.

The database is ``flask_idem_bench_roundtrips`` on ``FLASK_IDEM_BENCH_DATABASE_URL`` (default: the local
PostgreSQL), created afresh and dropped at the end. With ``--citus`` it is a local Citus cluster (a
coordinator and two workers, Citus built by ``shared/vendor/citus/build.sh``) started for the run, the
tables distributed (``IDEM_DISTRIBUTED``); the application talks to the coordinator, and a third column
counts the commands the coordinator sent to worker nodes per request (``citus.log_remote_commands``, read
from the trace), each one a round trip between nodes.
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/roundtrips.py` from anywhere

import psycopg  # noqa: E402
from flask import Flask  # noqa: E402
from psycopg import pq  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from bench.harness import BODY, DEFAULT_SERVER_URL, citus_database, scratch_database  # noqa: E402
from flask_idem._state import get_state

WARMUP = 8
TRACED = 5
TIMED = 100
ROUNDS = 5


@dataclass(frozen=True)
class Step:
    """One request: the URL, the key to send, and the status it must get."""

    url: str
    key: Callable[[], str]
    expect: int


@dataclass(frozen=True)
class Case:
    """A path through the route: its requests (usually one), and what must hold while they run."""

    name: str
    steps: tuple[Step, ...]
    around: Callable[[], AbstractContextManager[object]] = nullcontext


@dataclass(frozen=True)
class Count:
    round_trips: float
    statements: float
    messages: dict[str, float]
    bytes_out: float
    bytes_in: float
    #: Commands the Citus coordinator sent to worker nodes (0 on one server).
    remote: float = 0.0


def main() -> None:
    if "--citus" not in sys.argv[1:]:
        server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
        with scratch_database(server, "flask_idem_bench_roundtrips") as url:
            _print(*_measure(url, distributed=False))
        return
    with citus_database("flask_idem_bench_roundtrips") as url:
        # The same server, settings and machine without Citus: a database where it is not created.
        with scratch_database(url, "flask_idem_bench_plain") as plain:
            print("### One server: the coordinator's PostgreSQL, in a database without Citus\n")
            _print(*_measure(plain, distributed=False))
        print("\n### Citus: the coordinator and two workers, the tables distributed\n")
        _print(*_measure(url, distributed=True))


def _measure(url: str, *, distributed: bool) -> tuple[dict[str, Count], dict[str, tuple[float, float]]]:
    """Counts and times of every path of the shop on database ``url``."""
    from bench.app import create_app
    from example_app.cli import create_org
    from example_app.db import init_db

    config = {"DATABASE_URL": url, "IDEM_POOL_MIN_SIZE": 1, "IDEM_POOL_MAX_SIZE": 1}
    app = create_app({**config, "IDEM_DISTRIBUTED": distributed})
    # Counted on connections the coordinator tells about every command it sends to a worker; timed
    # without that chatter.
    logged = make_conninfo(url, options="-c citus.log_remote_commands=on -c client_min_messages=log")
    counting = create_app({**config, "DATABASE_URL": logged, "IDEM_DISTRIBUTED": distributed})
    with app.app_context():
        init_db()
        org_id, api_key = create_org("bench")
    try:
        cases = _cases(app, url, org_id, api_key)
        counts = {c.name: _count(counting if distributed else app, c, api_key) for c in cases}
        times = _times(app, cases, api_key)
    finally:
        get_state(app).source.close()
        get_state(counting).source.close()
    return counts, times


def _cases(app: Flask, url: str, org_id: int, api_key: str) -> list[Case]:
    finished = str(uuid.uuid4())
    client = app.test_client()
    response = client.post("/orders", data=BODY, headers=_headers(api_key, finished))
    assert response.status_code == 201, response.data

    held = str(uuid.uuid4())

    @contextmanager
    def in_flight() -> Iterator[object]:
        """Another connection holds ``held`` reserved and uncommitted, as a running request would."""
        from flask_idem._fingerprint import fingerprint
        from flask_idem._records import KeyedRequest

        store = get_state(app).store
        sha = fingerprint(method="POST", path="/orders", query=b"", mimetype="application/json", body=BODY)
        with psycopg.connect(url) as other:  # not autocommit: the first statement opens a transaction
            try:
                keyed = KeyedRequest(org_id, uuid.UUID(held), sha, "POST", "/orders")
                found = store.reserve(other, keyed, ttl=3600.0)
                assert found.reserved
                yield found
            finally:
                other.rollback()  # never committed, like a request that is still running

    def fresh() -> str:
        return str(uuid.uuid4())

    conflict = Step("/orders", lambda: held, 409)
    return [
        Case("baseline (POST /bench/orders, no decorator)", (Step("/bench/orders", fresh, 201),)),
        Case("fresh key (201)", (Step("/orders", fresh, 201),)),
        Case("replay of a finished key (200)", (Step("/orders", lambda: finished, 200),)),
        Case("key in flight elsewhere (409)", (conflict,), in_flight),
        # What a ROLLBACK does to the requests after it on the same connection (psycopg forgets its
        # prepared statements on ROLLBACK and sends DEALLOCATE ALL before the next statement).
        Case("a 409, then a fresh key (per pair)", (conflict, Step("/orders", fresh, 201)), in_flight),
        Case(
            "a 409, then 6 fresh keys (per 7 requests)",
            (conflict, *[Step("/orders", fresh, 201)] * 6),
            in_flight,
        ),  # fmt: skip
    ]


def _headers(api_key: str, key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", "Idempotency-Key": key}


def _send(app: Flask, case: Case, api_key: str, n: int) -> None:
    client = app.test_client()
    for _ in range(n):
        for step in case.steps:
            response = client.post(step.url, data=BODY, headers=_headers(api_key, step.key()))
            if response.status_code != step.expect:
                got = f"{response.status_code}: {response.data!r}"
                raise SystemExit(f"{case.name}: expected {step.expect}, got {got}")


def _count(app: Flask, case: Case, api_key: str) -> Count:
    """Trace ``TRACED`` requests of ``path`` on the pool's only connection and count the messages."""
    with app.app_context(), case.around():
        _send(app, case, api_key, WARMUP)
        with get_state(app).source.connection() as conn:
            pgconn = conn.pgconn  # the same connection every request of this process borrows
        with tempfile.TemporaryFile("w+") as trace:
            pgconn.trace(trace.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            try:
                _send(app, case, api_key, TRACED)
            finally:
                pgconn.untrace()  # flushes libpq's buffer into the file
            trace.seek(0)
            # A message's text may span lines (the remote commands of Citus); only its first line counts.
            lines = [
                cols
                for cols in (line.split("\t") for line in trace.read().splitlines())
                if len(cols) > 2 and cols[0] in ("F", "B") and (cols[1].isdigit() or cols[1] == "NN")
            ]
    sent = collections.Counter(cols[2].strip() for cols in lines if cols[0] == "F")
    return Count(
        round_trips=sum(1 for a, b in itertools.pairwise(lines) if a[0] == "F" and b[0] == "B") / TRACED,
        statements=(sent["Query"] + sent["Execute"]) / TRACED,
        messages={name: n / TRACED for name, n in sent.items()},
        bytes_out=sum(int(cols[1]) + 1 for cols in lines if cols[0] == "F") / TRACED,
        bytes_in=sum(int(cols[1]) + 1 for cols in lines if cols[0] == "B" and cols[1] != "NN") / TRACED,
        remote=sum(1 for cols in lines if cols[2] == "NoticeResponse" and "issuing " in "\t".join(cols[3:]))
        / TRACED,
    )


def _times(app: Flask, cases: list[Case], api_key: str) -> dict[str, tuple[float, float]]:
    """Wall and CPU microseconds per request (or per pair, per group) of each case: medians of rounds."""
    rounds: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for _ in range(ROUNDS):
        for case in cases:
            with app.app_context(), case.around():
                _send(app, case, api_key, WARMUP)
                wall, cpu = time.perf_counter(), time.process_time()
                _send(app, case, api_key, TIMED)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rounds[case.name].append((wall * 1e6 / TIMED, cpu * 1e6 / TIMED))
    return {
        name: (statistics.median(w for w, _ in figures), statistics.median(c for _, c in figures))
        for name, figures in rounds.items()
    }


def _print(counts: dict[str, Count], times: dict[str, tuple[float, float]]) -> None:
    print("| path | round trips | statements | messages sent | bytes out / in | commands to workers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, c in counts.items():
        messages = ", ".join(f"{kind} {n:g}" for kind, n in sorted(c.messages.items()))
        traffic = f"{c.bytes_out:.0f} / {c.bytes_in:.0f}"
        print(f"| {name} | {c.round_trips:g} | {c.statements:g} | {messages} | {traffic} | {c.remote:g} |")
    print()
    print("| path | wall µs | client CPU µs |")
    print("| --- | --- | --- |")
    for name, (wall, cpu) in times.items():
        print(f"| {name} | {wall:.0f} | {cpu:.0f} |")
    print(
        f"\nCounted on the wire with libpq's trace over {TRACED} requests per path after {WARMUP} warm-up"
        f" requests; times: median of {ROUNDS} rounds of {TIMED} per path, through Flask's test client"
        " (no HTTP server), per request (per pair, per group of 7 in the last two rows)."
        " Every path includes example_app's API-key query (1 round trip, 1 statement)."
        " Bytes in leave out Citus's notices of its remote commands."
    )


if __name__ == "__main__":
    main()
