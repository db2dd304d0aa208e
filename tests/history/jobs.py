"""Background jobs in the history check: the outbox relay and Celery workers, their nemesis, their checks.

Every payment that succeeds writes a fulfilment task into the outbox (example_app/fulfilment.py). During
the run a relay process (``flask idem relay --loop``) publishes them to the real RabbitMQ, on a queue of
the run's own, and a Celery worker runs them, mailing receipts to a Maildir. A second nemesis SIGKILLs
the relay (restarted at once: a kill between publish and mark publishes again), one of the worker's
pool processes (its task is redelivered), or the whole worker with its pool (a new one is started).
Afterwards :func:`check_fulfilment` proves every paid order was fulfilled and mailed exactly once, no
unpaid one was, nothing was left unsent or processing, and no process of theirs is left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from example_app.fulfilment import receipts

from ..support.celery_workers import BROKER_URL, broker_missing, delete_queue, kill, new_queue, running, stop
from ..support.servers import ROOT
from .cluster import LEASE_TIMEOUT, Cluster

__all__ = ["Jobs", "broker_missing", "check_fulfilment", "jobs_nemesis", "running_jobs", "settle_jobs"]


@dataclass
class Jobs:
    """The relay and the Celery worker of a run, which the nemesis kills and restarts."""

    env: dict[str, str]
    sink: Path
    workdir: Path
    queue: str
    relay: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    #: Every process started, to prove none is left running at the end.
    started: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with (self.workdir / log).open("ab") as out:
            proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **self.env}, stdout=out, stderr=out)
        self.started.append(proc.pid)
        return proc

    def start_relay(self) -> None:
        args = [sys.executable, "-m", "flask", "--app", "example_app", "idem", "relay", "--loop"]
        self.relay = self._start([*args, "--interval", "0.2"], "relay.log")

    def start_worker(self) -> None:
        args = [sys.executable, "-m", "celery", "-A", "example_app.worker", "worker", "--pool", "prefork"]
        args += ["--concurrency", "2", "--without-mingle", "--without-gossip", "--without-heartbeat"]
        args += ["--hostname", f"{self.queue}-{len(self.started)}@%h"]  # a node name of its own
        self.worker = self._start(args, "celery.log")

    def family(self) -> list[int]:
        """The worker's processes: its main process and its pool."""
        if self.worker is None:
            return []
        try:
            main = psutil.Process(self.worker.pid)
            found = [main.pid, *(p.pid for p in main.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []
        self.started.extend(pid for pid in found if pid not in self.started)
        return found


@contextmanager
def running_jobs(cluster: Cluster, workdir: Path) -> Iterator[Jobs]:
    """Start the relay and a Celery worker for ``cluster``; stop them (and their queue) afterwards."""
    queue = new_queue("flask-idem-history")
    sink = workdir / "mail"
    env = {
        "FLASK_DATABASE_URL": cluster.database_url,
        "FLASK_CELERY__broker_url": BROKER_URL,
        "FLASK_CELERY__task_default_queue": queue,
        "FLASK_MAIL_SINK": str(sink),
        "FLASK_IDEM_LEASE_TIMEOUT": str(LEASE_TIMEOUT),
        "FLASK_IDEM_OUTBOX_LEASE": "2",
        "FLASK_IDEM_JOB_BACKOFF": "0.2",
        "FLASK_IDEM_JOB_BACKOFF_CAP": "2",
        "FLASK_IDEM_POOL_TIMEOUT": "2",
        "FLASK_IDEM_DISTRIBUTED": "true" if cluster.citus is not None else "false",
        **cluster.env(),
    }
    jobs = Jobs(env=env, sink=sink, workdir=workdir, queue=queue)
    jobs.start_relay()
    jobs.start_worker()
    # The in-process shop that settles the run (checker.settle) may finish a fulfilment: it mails to the
    # same sink.
    before = os.environ.get("FLASK_MAIL_SINK")
    os.environ["FLASK_MAIL_SINK"] = str(sink)
    try:
        yield jobs
    finally:
        if before is None:
            os.environ.pop("FLASK_MAIL_SINK", None)
        else:
            os.environ["FLASK_MAIL_SINK"] = before
        with jobs.lock:
            for proc in (jobs.relay, jobs.worker):
                if proc is not None:
                    stop(proc)
        delete_queue(queue)


def jobs_nemesis(cluster: Cluster, jobs: Jobs, stop_at: float, interval: float, max_faults: int) -> None:
    """Until ``stop_at``, every ``interval`` seconds or so, SIGKILL the relay, a pool process or the
    whole worker, and start what was killed again."""
    rng = cluster.rng
    injected = 0
    while injected < max_faults and time.monotonic() + interval < stop_at:
        time.sleep(rng.uniform(0.5, 1.5) * interval)
        with jobs.lock:
            choice = rng.choice(["relay", "pool process", "worker"])
            if choice == "relay" and jobs.relay is not None:
                kill(jobs.relay.pid)
                jobs.relay.wait()
                jobs.start_relay()
            elif choice == "pool process" and len(jobs.family()) > 1:
                kill(rng.choice(jobs.family()[1:]))  # the worker starts a new one
            else:
                family = jobs.family()
                for pid in family:
                    kill(pid)
                if jobs.worker is not None:
                    jobs.worker.wait()
                jobs.start_worker()
            name = f"kill celery {choice}"
            cluster.faults[name] = cluster.faults.get(name, 0) + 1
        injected += 1


def settle_jobs(cluster: Cluster, jobs: Jobs, timeout: float = 120.0) -> None:
    """Wait until the outbox is empty of unsent messages and no fulfilment is left unfinished."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(cluster.database_url, autocommit=True) as db:
        while time.monotonic() < deadline:
            unsent = db.execute(
                "SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL"
            ).fetchone()
            open_tasks = db.execute(
                "SELECT count(*) FROM idempotency_keys"
                " WHERE (task IS NOT NULL OR method = 'TASK') AND status = 'processing'"
            ).fetchone()
            paid = db.execute("SELECT count(*) FROM payments WHERE status = 'succeeded'").fetchone()
            sent = db.execute(
                "SELECT count(DISTINCT (org_id, order_id)) FROM fulfilments WHERE status = 'sent'"
            )
            if unsent == (0,) and open_tasks == (0,) and sent.fetchone() == paid:
                return
            time.sleep(0.5)


def check_fulfilment(cluster: Cluster, jobs: Jobs, report: Any) -> None:
    """Every succeeded payment's order has one fulfilment, sent, and one receipt; no other order has any."""
    with psycopg.connect(cluster.database_url, autocommit=True) as db:
        paid = {
            (r[0], r[1])
            for r in db.execute("SELECT org_id, order_id FROM payments WHERE status = 'succeeded'")
        }
        rows = db.execute("SELECT org_id, order_id, status FROM fulfilments").fetchall()
        unsent = db.execute("SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL").fetchone()
        flagged = db.execute(
            "SELECT count(*) FROM idempotency_keys"
            " WHERE (task IS NOT NULL OR method = 'TASK') AND status <> 'completed'"
        ).fetchone()
    fulfilled = Counter((r[0], r[1]) for r in rows)
    mailed = Counter(
        tuple(int(part) for part in str(m["X-Shop-Order"]).split(":")) for m in receipts(jobs.sink)
    )
    report.operations["fulfilments"] = len(rows)
    report.operations["receipts"] = sum(mailed.values())
    for order in sorted(paid):
        if fulfilled[order] != 1 or mailed[order] != 1:
            kind = "duplicates" if fulfilled[order] > 1 or mailed[order] > 1 else "lost"
            report.anomaly(
                kind, f"paid order {order}: {fulfilled[order]} fulfilment(s), {mailed[order]} receipt(s)"
            )
    for order in sorted(set(fulfilled) | set(mailed)):
        if order not in paid:
            report.anomaly("unexpected", f"order {order} is not paid but was fulfilled or mailed")
    if any(r[2] != "sent" for r in rows):
        report.anomaly("lost", f"{sum(r[2] != 'sent' for r in rows)} fulfilment(s) never sent")
    if unsent != (0,):
        report.anomaly("lost", f"{unsent} outbox message(s) never published")
    if flagged != (0,):
        report.anomaly("unexpected", f"{flagged} task key row(s) not completed")
    with jobs.lock:
        for proc in (jobs.relay, jobs.worker):
            if proc is not None:
                stop(proc)
        jobs.relay = jobs.worker = None
    left = running(jobs.started)
    if left:
        report.anomaly("unexpected", f"processes of the jobs left running: {left}")
