"""Where a fresh key's cost goes: the application's and the database's CPU per request, part by part.

    uv run python bench/breakdown.py                       # 7 rounds of 400 requests per variant (~3 min)
    uv run python bench/breakdown.py --rounds 3 --requests 200

The shop (``bench/app.py``) in this process, through Flask's test client (no HTTP server), on one pooled
connection to a scratch database (``flask_idem_bench_breakdown`` on ``FLASK_IDEM_BENCH_DATABASE_URL``),
with the shop's metrics off. Each *variant* is a route, or ``POST /orders`` with one part of the
extension replaced by a stand-in that costs nothing (an *ablation*); the variants take turns, ``--requests``
each per round, the order rotated every round, and each figure is the median of the rounds:

- app CPU: this thread's CPU time per request (``time.thread_time``: Flask, the shop, flask-idem,
  psycopg and libpq on the client's side; no waiting);
- database CPU: the pooled connection's backend's CPU time per request (``/proc/<pid>/schedstat``).

The part a stand-in removes costs what the variant saves against ``POST /orders``. The variants:

- ``(a)`` the baseline, ``POST /bench/orders``: the same route without the decorator;
- ``(h)`` the batched floor, ``POST /bench/floor-batched``: the baseline plus a ``SELECT 1`` sent with
  ``BEGIN`` and another with ``COMMIT``, the way a decorated route's transaction is sent;
- ``(b)`` ``POST /orders`` with a fresh key, and ``(b)`` without: the request's fingerprint (a constant),
  its key's parsing (a UUID made in advance), the stored response's recording (a constant document), the
  outcome signals (nothing sent), the deadline (``IDEM_DATABASE_DEADLINE = None``: no arming, no server
  timeouts), and the key row's write (a ``SELECT 1`` deferred to ``COMMIT`` instead of the ``INSERT`` of
  the completed row);
- ``(b) reserving first``: not an ablation, the way every atomic request wrote its key before the row was
  written once (an ``INSERT`` of a processing row with the reservation, an ``UPDATE`` with ``COMMIT``).

What is left between ``(h)`` and ``(b)`` once the parts are removed is the reservation's own statements
(the key's lock and its lookup) against the floor's ``SELECT 1`` and the Python that runs around the view.

``--instructions`` counts the application's instructions instead of its CPU time, with valgrind's
callgrind: the same count from run to run, whatever else the machine is doing (the database's CPU in
that mode is measured on a client slowed down fifty times, and is not comparable with the other mode's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/breakdown.py` from anywhere

from flask import Flask  # noqa: E402
from flask.testing import FlaskClient  # noqa: E402

from bench.app import create_app  # noqa: E402
from bench.harness import DEFAULT_SERVER_URL, scratch_database, set_up_shop  # noqa: E402
from flask_idem import _store, _view, signals  # noqa: E402
from flask_idem._pool import batched  # noqa: E402
from flask_idem._state import get_state  # noqa: E402
from flask_idem._wire import Statement  # noqa: E402

BODY = b'{"amount": 1250, "currency": "EUR"}'
SHA = b"\x07" * 32
DOCUMENT = {"status": 201, "headers": [["Content-Type", "application/json"]], "body": {"id": 1}}
_NO_OP = Statement.from_query(b"SELECT 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the application's instructions per request under valgrind's callgrind instead",
    )
    parser.add_argument("--only", help="measure only the variants whose name contains this")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one variant, under callgrind
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.requests)
        return
    server = os.environ.get("FLASK_IDEM_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    with scratch_database(server, "flask_idem_bench_breakdown") as url:
        _, api_key = set_up_shop(url)
        if args.instructions:
            figures = _count_instructions(url, api_key, args.requests, args.only)
        else:
            with _apps(url) as (app, bare):
                variants = {k: v for k, v in _variants(app, bare).items() if _chosen(k, args.only)}
                figures = _measure(variants, _headers(api_key), args.rounds, args.requests)
    _print(figures, args)


def _chosen(name: str, only: str | None) -> bool:
    return only is None or only in name or name.startswith(("(a)", "(b) POST"))


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}


@contextmanager
def _apps(url: str) -> Iterator[tuple[Flask, Flask]]:
    """The shop, and the shop without a database deadline, on one pooled connection each."""
    config = {"DATABASE_URL": url, "METRICS": False, "IDEM_POOL_MIN_SIZE": 1, "IDEM_POOL_MAX_SIZE": 1}
    app = create_app(config)
    bare = create_app({**config, "IDEM_DATABASE_DEADLINE": None})
    try:
        yield app, bare
    finally:
        get_state(app).source.close()
        get_state(bare).source.close()


Variant = tuple[Flask, str, Callable[[], Any]]


def _variants(app: Flask, bare: Flask) -> dict[str, Variant]:
    nothing: Callable[[], Any] = ExitStack
    return {
        "(a) baseline: the route without the decorator": (app, "/bench/orders", nothing),
        "(h) batched floor: (a) + SELECT 1 with BEGIN and COMMIT": (app, "/bench/floor-batched", nothing),
        "(b) POST /orders, fresh key": (app, "/orders", nothing),
        "(b) without the fingerprint": (app, "/orders", lambda: _patched(_view, "fingerprint", _sha)),
        "(b) without the key's parsing": (app, "/orders", _parsed_keys),
        "(b) without recording the response": (
            app,
            "/orders",
            lambda: _patched(_view, "record_response", lambda *a, **k: DOCUMENT),
        ),
        "(b) without the outcome signals": (app, "/orders", lambda: _patched(signals, "send", _nothing)),
        "(b) without the deadline": (bare, "/orders", nothing),
        "(b) without the key row's write (SELECT 1 instead)": (app, "/orders", _no_completion),
        "(b) reserving first (INSERT, then UPDATE)": (app, "/orders", lambda: _reserving_first(app)),
    }


def _sha(**parts: Any) -> bytes:
    return SHA


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


#: Keys made in advance, handed out by the stand-in of the key's parsing (the header is still sent).
_KEYS: list[uuid.UUID] = []


@contextmanager
def _parsed_keys() -> Iterator[None]:
    with _patched(_view, "parse_key", lambda values: _KEYS.pop()):
        yield


@contextmanager
def _reserving_first(app: Flask) -> Iterator[None]:
    """The key's row inserted processing at the reservation and completed by an UPDATE, as multi-step
    requests (and atomic ones before the row was written once) do."""
    store = get_state(app).store
    store.write_once = False
    try:
        yield
    finally:
        store.write_once = True


@contextmanager
def _no_completion() -> Iterator[None]:
    def complete(self: Any, conn: Any, owner: Any, response: Any, **kwargs: Any) -> bool:
        closing = batched(conn)
        assert closing is not None and closing.begun
        closing.defer(_NO_OP, {})
        return True

    with _patched(_store.Store, "complete", complete):
        yield


def _run(client: FlaskClient, variant: Variant, count: int, headers: dict[str, str]) -> None:
    """Place ``count`` orders through ``variant``, each with a fresh key."""
    _, path, stand_in = variant
    _KEYS.extend(uuid.uuid4() for _ in range(count))
    with stand_in():
        for _ in range(count):
            key = str(uuid.uuid4())
            answer = client.post(path, data=BODY, headers={**headers, "Idempotency-Key": key})
            assert answer.status_code == 201, answer.data


def _server_cpu(pid: int) -> float:
    """Seconds of CPU the server process ``pid`` has run (the scheduler's count, in nanoseconds)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def _backend_pid(app: Flask) -> int:
    with app.app_context(), get_state(app).source.connection() as conn:
        return int(conn.info.backend_pid)


def _measure(
    variants: dict[str, Variant], headers: dict[str, str], rounds: int, requests: int
) -> dict[str, tuple[float, float]]:
    """Median app and database CPU µs per request of each variant."""
    clients = {id(app): app.test_client() for app, _, _ in variants.values()}

    def run(variant: Variant, count: int, headers: dict[str, str]) -> None:
        _run(clients[id(variant[0])], variant, count, headers)

    names = list(variants)
    for variant in variants.values():  # warm-up: prepared statements, caches
        run(variant, 100, headers)
    pids = {id(app): _backend_pid(app) for app, _, _ in variants.values()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            variant = variants[name]
            pid = pids[id(variant[0])]
            client, server = time.thread_time(), _server_cpu(pid)
            run(variant, requests, headers)
            per = 1e6 / requests
            samples[name].append(((time.thread_time() - client) * per, (_server_cpu(pid) - server) * per))
        print(f"# round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return {
        name: (statistics.median(s[0] for s in values), statistics.median(s[1] for s in values))
        for name, values in samples.items()
    }


def _count_instructions(
    url: str, api_key: str, requests: int, only: str | None
) -> dict[str, tuple[float, float]]:
    """Instructions per request of each variant, counted by callgrind in a process of its own, and the
    database's CPU µs per request in that run.

    The child runs ``requests`` requests, then ``3 × requests`` more, and callgrind dumps its count after
    each; what a request costs is the difference over the ``2 × requests`` more, so that what the
    process does once (starting, toggling the count) cancels out. The count is the same from run to run
    (0.3 % here), whatever else the machine is doing.
    """
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    names = [name for name in _variants(*([None] * 2)) if _chosen(name, only)]  # type: ignore[arg-type]
    everything = list(_variants(*([None] * 2)))  # type: ignore[arg-type]
    figures: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="flask-idem-breakdown-") as tmp:
        for name in names:
            out = Path(tmp) / f"{everything.index(name)}.out"
            command = [
                "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                sys.executable, __file__, "--child", str(everything.index(name)), "--requests", str(requests),
            ]  # fmt: skip
            env = {**os.environ, "PYTHONHASHSEED": "0", _URL_ENV: url, _KEY_ENV: api_key}
            child = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            database = float(child.stdout.strip().splitlines()[-1])
            first, second = (_instructions(Path(f"{out}.{n}")) for n in (1, 2))
            figures[name] = ((second - first) / (2 * requests), database)
            print(f"# {name}", file=sys.stderr, flush=True)
    return figures


_URL_ENV, _KEY_ENV = "FLASK_IDEM_BREAKDOWN_URL", "FLASK_IDEM_BREAKDOWN_API_KEY"


def _child(index: int, requests: int) -> None:
    """Run variant ``index`` under callgrind (see :func:`_count_instructions`); print its database CPU µs
    per request over the counted part."""
    with _apps(os.environ[_URL_ENV]) as (app, bare):
        variant = list(_variants(app, bare).values())[index]
        headers = _headers(os.environ[_KEY_ENV])
        client = app.test_client() if variant[0] is app else bare.test_client()
        pid = _backend_pid(variant[0])
        _run(client, variant, 100, headers)  # warm-up: prepared statements, caches

        def callgrind(*flags: str) -> None:
            subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, capture_output=True)

        callgrind("--instr=on")
        _run(client, variant, requests, headers)
        callgrind("--dump")
        server = _server_cpu(pid)
        _run(client, variant, 3 * requests, headers)
        database = (_server_cpu(pid) - server) * 1e6 / (3 * requests)
        callgrind("--dump")
        callgrind("--instr=off")
    print(database)


def _instructions(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no total in {dump}")


def _print(figures: dict[str, tuple[float, float]], args: argparse.Namespace) -> None:
    full = figures["(b) POST /orders, fresh key"]
    base = figures["(a) baseline: the route without the decorator"]
    app = "app instructions/req" if args.instructions else "app CPU µs/req"
    print(f"| variant | {app} | database CPU µs/req | saves vs (b), app / database |")
    print("| --- | --- | --- | --- |")
    for name, (client, db) in figures.items():
        saved = f"{full[0] - client:+,.0f} / {full[1] - db:+.0f}" if name.startswith("(b) without") else ""
        print(f"| {name} | {client:,.0f} | {db:.0f} | {saved} |")
    unit = "instructions" if args.instructions else "µs of app CPU"
    how = (
        f"callgrind, a process per variant: {args.requests} requests, then {3 * args.requests} more, the"
        " difference per request; database CPU over the second part"
        if args.instructions
        else f"{args.rounds} rounds of {args.requests} requests per variant, order rotated per round, medians"
    )
    print(
        f"\n- (b) − (a): {full[0] - base[0]:,.0f} {unit} and {full[1] - base[1]:.0f} µs of database CPU"
        f" per request\n- {how}; one process, Flask's test client, one pooled connection; load average at"
        " the end: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    )


if __name__ == "__main__":
    main()
