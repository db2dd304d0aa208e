"""Celery workers against the real RabbitMQ, for the background job tests and the history checker.

The broker is ``FLASK_IDEM_TEST_BROKER_URL`` (default ``amqp://guest:guest@127.0.0.1:5672//``). Where
nothing answers there, the tests that need it are skipped with the reason; under ``CI=true`` they fail,
since CI has a broker. Each test gets a queue of its own (deleted afterwards), so xdist workers and
concurrent runs sharing the broker never take each other's messages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from .servers import ROOT

__all__ = [
    "BROKER_URL",
    "broker_marks",
    "broker_missing",
    "children",
    "delete_queue",
    "kill",
    "new_queue",
    "ready_messages",
    "running",
    "stop",
    "worker",
]

BROKER_URL = os.environ.get("FLASK_IDEM_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def broker_missing() -> str | None:
    """Why the broker cannot be used (nothing answers at its address), or ``None`` when it answers."""
    parts = urlsplit(BROKER_URL)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as e:
        return (
            f"no RabbitMQ answers at {host}:{port} ({e.strerror or e}); the background job tests need one"
            " (Debian: apt-get install rabbitmq-server, or set FLASK_IDEM_TEST_BROKER_URL)"
        )
    return None


def broker_marks() -> list[pytest.MarkDecorator]:
    """The marks of a module of tests on real workers: slow, and skipped with the reason where no broker
    answers. Under ``CI=true`` a missing broker fails instead: CI has RabbitMQ."""
    missing = broker_missing()
    if missing is None:
        return [pytest.mark.slow]
    if os.environ.get("CI"):
        raise RuntimeError(missing)
    return [pytest.mark.slow, pytest.mark.skip(reason=missing)]


def new_queue(prefix: str = "flask-idem-test") -> str:
    """A queue name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def delete_queue(name: str) -> None:
    """Delete ``name`` from the broker (its messages with it); nothing if it is gone already."""
    from kombu import Connection, Queue

    with Connection(BROKER_URL, connect_timeout=5) as connection:
        try:
            Queue(name).bind(connection.default_channel).delete()
        except Exception:  # never declared, or gone: nothing to clean
            pass


def ready_messages(name: str) -> int:
    """How many messages of queue ``name`` wait for a consumer (not those delivered and unacknowledged)."""
    from kombu import Connection, Queue

    with Connection(BROKER_URL, connect_timeout=5) as connection:
        declared = Queue(name).bind(connection.default_channel).queue_declare(passive=True)
        return int(declared.message_count)


@contextmanager
def worker(
    app: str, env: dict[str, str], log: Path, *, concurrency: int = 2, queue: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``celery -A app worker`` (prefork) until the block ends; then stop it and every child it left.

    :param env: the worker's environment, on top of this process's.
    """
    args = [sys.executable, "-m", "celery", "-A", app, "worker", "--pool", "prefork"]
    args += ["--concurrency", str(concurrency), "--loglevel", "INFO"]
    args += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    # A node name of its own: two workers named alike on one host fight over their remote-control queue.
    args += ["--hostname", f"{uuid.uuid4().hex[:12]}@%h"]
    if queue is not None:
        args += ["--queues", queue]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=out)
    try:
        yield proc
    finally:
        stop(proc)


def children(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The pool processes of a worker (they run the tasks)."""
    try:
        return psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []


def kill(pid: int) -> None:
    """SIGKILL ``pid``, if it still runs."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def running(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout`` seconds (a zombie has stopped running)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Stop a worker (warm shutdown, then SIGKILL) and every process it started: nothing left running."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + timeout
    for member in family:
        try:
            member.wait(max(0.1, deadline - time.monotonic()))
        except psutil.TimeoutExpired:
            member.kill()
        except psutil.NoSuchProcess:
            pass
