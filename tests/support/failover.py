"""A failover seen from the shop's side: probes that place orders, the kill and the promotion, timed.

:class:`Prober` threads each place one new order at a time (one attempt, no retry: what a client sees),
tagging every request with a sequence number that gunicorn's access log writes next to the worker process
that answered it (:func:`shop_logging`), so the timeline can be told per worker. :func:`fail_over`
kills the primary, waits like a failover manager that noticed it, promotes the standby, and returns
once the shop has acknowledged an order again; :class:`Timeline` holds what happened when.

Every probe is also an operation of the history checker (:class:`tests.history.workload.Op`): one that got
its 201 must be found after the failover like any other acknowledged order.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from ..history.checker import Report, check, settle
from ..history.cluster import Cluster, running_cluster
from ..history.workload import Op, client_loop
from .replication import Pair, running_pair
from .servers import wait_for

#: What gunicorn's access log says of each request: "<pid> status probe-number".
ACCESS_LOG_FORMAT = "%(p)s %(s)s %({x-probe}i)s"


def shop_logging(workdir: Path) -> tuple[str, ...]:
    """gunicorn options (the cluster's ``shop_args``) for the logs the timeline reads, in ``workdir``.

    ``access.log``: :data:`ACCESS_LOG_FORMAT` per request (:meth:`Prober.attribute`). ``pool.log``:
    psycopg_pool's record of every connection attempt, with the time and the worker (:func:`pool_events`).
    Everything else goes to the server's stderr as usual.
    """
    console = {"class": "logging.StreamHandler", "formatter": "generic", "stream": "ext://sys.stderr"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "root": {"level": "WARNING", "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["console"], "propagate": False},
            "gunicorn.access": {"level": "INFO", "handlers": ["access"], "propagate": False},
            "psycopg.pool": {"level": "INFO", "handlers": ["pool"], "propagate": False},
        },
        "handlers": {
            "console": console,
            "access": {
                "class": "logging.FileHandler",
                "filename": str(workdir / "access.log"),
                "formatter": "bare",
            },
            "pool": {
                "class": "logging.FileHandler",
                "filename": str(workdir / "pool.log"),
                "formatter": "timed",
            },
        },
        "formatters": {
            "generic": {"format": "%(asctime)s [%(process)d] [%(levelname)s] %(message)s"},
            "bare": {"format": "%(message)s"},
            "timed": {"format": "%(created).3f %(process)d %(message)s"},
        },
    }
    path = workdir / "logging.json"
    path.write_text(json.dumps(config))
    return ("--log-config-json", str(path), "--access-logformat", ACCESS_LOG_FORMAT)


def pool_events(pool_log: Path, since: float) -> dict[int, list[tuple[float, str]]]:
    """Each shop worker's connection attempts after ``since`` (``time.time()``): when, "failed" or "ok"."""
    events: dict[int, list[tuple[float, str]]] = {}
    for line in pool_log.read_text().splitlines():
        if not (m := re.fullmatch(r"([0-9.]+) ([0-9]+) (.*)", line)):
            continue  # the next lines of a message: libpq's, one per host it tried
        created, pid, message = m.groups()
        if float(created) < since:
            continue
        if message.startswith("error connecting"):
            events.setdefault(int(pid), []).append((float(created), "failed"))
        elif message.startswith("adding new connection"):
            events.setdefault(int(pid), []).append((float(created), "ok"))
    return events


@dataclass
class Probe:
    """One order placed by a probe: when it was sent and answered (``time.monotonic()``), and how."""

    seq: int
    op: Op
    sent: float
    done: float = 0.0
    status: int | None = None  # None: no answer (connection refused, timed out)
    pid: int | None = None  # the shop worker that answered, from the access log


class Prober:
    """``threads`` threads that place orders one after another, ``interval`` seconds apart, until stopped.

    :param timeout: how long one probe waits for its answer before it counts as no answer.
    """

    def __init__(
        self, shop_url: str, api_key: str, *, threads: int = 4, interval: float = 0.05, timeout: float = 10.0
    ) -> None:
        self.shop_url = shop_url
        self.api_key = api_key
        self.interval = interval
        self.timeout = timeout
        self.probes: list[Probe] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = itertools.count(1)
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Prober:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def _loop(self) -> None:
        rng = random.Random()
        while not self._stop.is_set():
            with self._lock:
                seq = next(self._seq)
            body = {"amount": rng.randint(1, 10**6), "currency": "EUR"}
            op = Op("order", self.api_key, uuid.uuid4(), body)
            probe = Probe(seq, op, sent=time.monotonic())
            headers = {"Authorization": f"Bearer {self.api_key}", "Idempotency-Key": str(op.key)}
            try:
                # A connection of its own per probe, so that the workers share the probes.
                response = requests.post(
                    self.shop_url + "/orders",
                    json=body,
                    headers={**headers, "X-Probe": str(seq)},
                    timeout=self.timeout,
                )
            except requests.RequestException:
                op.outcome = "unknown"
            else:
                probe.status = op.status = response.status_code
                op.statuses = [response.status_code]
                if response.status_code == 201:
                    op.outcome, op.response = "ok", response.content
                else:
                    op.outcome = "unknown"  # resolved afterwards with the same key, like the clients' ones
            probe.done = time.monotonic()
            with self._lock:
                self.probes.append(probe)
            self._stop.wait(self.interval)

    def snapshot(self) -> list[Probe]:
        """The probes answered so far."""
        with self._lock:
            return list(self.probes)

    def answered_since(self, moment: float) -> Probe | None:
        """The first probe acknowledged (201) after ``moment``, if any yet."""
        done = [p for p in self.snapshot() if p.status == 201 and p.done > moment]
        return min(done, key=lambda p: p.done, default=None)

    def attribute(self, access_log: Path) -> None:
        """Fill in each probe's worker from gunicorn's access log (:data:`ACCESS_LOG_FORMAT`)."""
        by_seq = {p.seq: p for p in self.snapshot()}
        for line in access_log.read_text().splitlines():
            pid, _, seq = line.split(" ")
            if seq.isdigit() and int(seq) in by_seq:
                by_seq[int(seq)].pid = int(pid.strip("<>"))

    def ops(self) -> list[Op]:
        """The probes as operations of the history checker."""
        return [p.op for p in self.snapshot()]


@dataclass
class Timeline:
    """When the primary was killed and the standby promoted (``time.monotonic()``), and what followed."""

    killed: float
    promote_started: float
    promoted: float
    #: ``time.time() - time.monotonic()`` at the kill, to place the logs' wall-clock times.
    clock: float
    probes: list[Probe] = field(default_factory=list)
    #: Each worker's connection attempts after the kill (:func:`pool_events`), in monotonic time.
    attempts: dict[int, list[tuple[float, str]]] = field(default_factory=dict)

    def read_logs(self, prober: Prober, workdir: Path) -> None:
        """Take the probes (attributed to workers) and the pool's attempts from the shop's logs."""
        prober.attribute(workdir / "access.log")
        self.probes = prober.snapshot()
        events = pool_events(workdir / "pool.log", since=self.killed + self.clock)
        self.attempts = {pid: [(t - self.clock, what) for t, what in e] for pid, e in events.items()}

    @property
    def first_answer(self) -> Probe | None:
        """The first order acknowledged after the promotion."""
        done = [p for p in self.probes if p.status == 201 and p.done > self.promoted]
        return min(done, key=lambda p: p.done, default=None)

    @property
    def last_acknowledged_before_kill(self) -> Probe | None:
        """The last order acknowledged before the primary was killed."""
        done = [p for p in self.probes if p.status == 201 and p.done <= self.killed]
        return max(done, key=lambda p: p.done, default=None)

    def first_answers(self) -> dict[int, Probe | None]:
        """Each worker's first 201 after the promotion (``None``: none yet)."""
        pids = {p.pid for p in self.probes if p.pid is not None} | set(self.attempts)
        return {
            pid: min(
                (p for p in self.probes if p.pid == pid and p.status == 201 and p.done > self.promoted),
                key=lambda p: p.done,
                default=None,
            )
            for pid in sorted(pids)
        }

    def outage(self) -> dict[str, int]:
        """What the probes answered between the kill and the first 201 after the promotion, counted."""
        first = self.first_answer
        statuses: dict[str, int] = {}
        for p in self.probes:
            if self.killed < p.done and (first is None or p.done < first.done):
                name = str(p.status) if p.status is not None else "no answer"
                statuses[name] = statuses.get(name, 0) + 1
        return statuses

    def summary(self) -> str:
        """The timeline in words; times in seconds from the kill."""

        def at(t: float) -> str:
            return f"{t - self.killed:+.2f}"

        lines = [
            f"primary killed at 0; promotion started at {at(self.promote_started)} s,"
            f" done at {at(self.promoted)} s"
        ]
        if (last := self.last_acknowledged_before_kill) is not None:
            lines.append(f"last order acknowledged before the kill: {at(last.done)} s")
        first = self.first_answer
        if first is None:
            lines.append("no order acknowledged after the promotion")
        else:
            lines.append(
                f"first order acknowledged after the promotion: {at(first.done)} s"
                f" ({first.done - self.promoted:.2f} s after it; sent at {at(first.sent)} s)"
            )
        lines.append(
            "answers in between: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(self.outage().items())) or "none")
        )
        for pid, ok in self.first_answers().items():
            attempts = " ".join(f"{at(t)}:{what}" for t, what in self.attempts.get(pid, []))
            answer = (
                f"{at(ok.done)} s ({ok.done - self.promoted:.2f} s after the promotion)" if ok else "none"
            )
            lines.append(f"  worker {pid}: first 201 {answer}; pool connection attempts [{attempts}]")
        return "\n".join(lines)


def fail_over(pair: Pair, prober: Prober, *, gap: float, answer_within: float = 120.0) -> Timeline:
    """Kill the primary, promote the standby ``gap`` seconds later, wait until an order is acknowledged.

    ``answer_within`` seconds after the promotion without an acknowledged order is a hang: an
    :class:`AssertionError` with the timeline so far.
    """
    killed = pair.kill_primary()
    clock = time.time() - time.monotonic()
    time.sleep(max(0.0, killed + gap - time.monotonic()))
    promote_started = time.monotonic()
    pair.promote()
    timeline = Timeline(killed, promote_started, time.monotonic(), clock)

    def unanswered() -> str:
        timeline.probes = prober.snapshot()
        return f"the shop did not answer again:\n{timeline.summary()}"

    wait_for(
        lambda: prober.answered_since(timeline.promoted) is not None,
        timeline.promoted + answer_within - time.monotonic(),
        0.02,
        message=unanswered,
    )
    return timeline


@contextmanager
def running_system(*, seed: int) -> Iterator[tuple[Pair, Cluster, Path]]:
    """A pair (:func:`.running_pair`), and the gateway and the shop (2 workers x 4 threads) on its
    multi-host URL, logging what :class:`Timeline` reads; yields the pair, the cluster and the shop's
    directory."""
    with running_pair() as pair, tempfile.TemporaryDirectory(prefix="flask-idem-failover-shop-") as tmp:
        workdir = Path(tmp)
        with running_cluster(
            workdir,
            seed=seed,
            workers=2,
            threads=4,
            database_url=pair.create_database("shop"),
            shop_args=shop_logging(workdir),
            proxy=False,  # a multi-host URL: the shop connects to the nodes themselves
        ) as cluster:
            yield pair, cluster, workdir


@dataclass
class Outcome:
    """One failover under load: its timeline, the history checker's report, and the operations."""

    timeline: Timeline
    report: Report
    history: list[Op]
    #: The shop's worker processes after the failover.
    workers: set[int]


def fail_over_under_load(
    pair: Pair,
    cluster: Cluster,
    workdir: Path,
    *,
    synchronous_commit: str | None,
    gap: float,
    warm: float = 1.0,
    after: float = 3.0,
    clients: int = 2,
    cut: float | None = None,
    every_worker_within: float = 0.0,
) -> Outcome:
    """Fail over while clients place and pay orders and probes place orders; then settle and check.

    The pair is healed and replicates as ``synchronous_commit`` says (:meth:`.Pair.heal`); the clients and
    probes run for ``warm`` seconds, the primary is killed and the standby promoted ``gap`` seconds later,
    and the clients go on for ``after`` seconds after that (the probes until the clients are done). With
    ``cut``, the standby stops receiving WAL that many seconds before the kill (asynchronous only). With
    ``every_worker_within``, the probes go on until every shop worker has acknowledged an order after the
    promotion, or that many seconds after it.
    """
    pair.heal(synchronous_commit)
    history: list[Op] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + warm + gap + after
    threads = [
        threading.Thread(target=client_loop, args=(cluster, 300 + i, stop_at, history, lock))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    with Prober(cluster.shop_url, cluster.api_keys[0]) as prober:
        if cut is not None:
            time.sleep(max(0.0, warm - cut))
            pair.cut_replication()
            time.sleep(cut)
        else:
            time.sleep(warm)
        timeline = fail_over(pair, prober, gap=gap)
        for thread in threads:
            thread.join(60)  # each client's last operation is bounded by the helper's deadline
        workers = {p.pid for p in psutil.Process(cluster.shop.pid).children()}
        while time.monotonic() < timeline.promoted + every_worker_within:
            timeline.read_logs(prober, workdir)
            if workers <= {pid for pid, probe in timeline.first_answers().items() if probe is not None}:
                break
            time.sleep(0.2)
    timeline.read_logs(prober, workdir)
    history.extend(prober.ops())
    report = Report()
    settle(cluster, history, report)
    check(cluster, history, report)
    return Outcome(timeline, report, history, workers)
