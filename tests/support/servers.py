"""Real server processes for tests and for the history checker: free ports, readiness, gunicorn; and
:func:`wait_for`, the one polling loop of the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from werkzeug.serving import make_server

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    condition: Callable[[], bool],
    timeout: float = 15.0,
    interval: float = 0.05,
    *,
    message: str | Callable[[], str] = "condition not met in time",
    ignore: type[Exception] | tuple[type[Exception], ...] = (),
) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``timeout`` seconds.

    :param message: what the failure (an :class:`AssertionError`) says; a function is called then, so
        that it can tell what it sees at that moment (a server's log).
    :param ignore: exceptions of ``condition`` that mean "not yet", such as a server still starting; the
        last one is chained to the failure. Any other exception of ``condition`` fails at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        error = None
        try:
            if condition():
                return
        except ignore as e:
            error = e
        if time.monotonic() >= deadline:
            raise AssertionError(message() if callable(message) else message) from error
        time.sleep(interval)


def wait_for_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers anything, failing early if ``proc`` exits."""
    import requests

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering")
        requests.get(url, timeout=2)
        return True

    # Refused while binding, or a worker still booting: not yet.
    wait_for(
        answers,
        timeout,
        0.1,
        message=f"{url} did not answer within {timeout} s",
        ignore=requests.RequestException,
    )


@contextmanager
def gunicorn(
    log_path: Path,
    *,
    env: dict[str, str],
    workers: int = 4,
    threads: int = 4,
    app: str = "example_app:create_app()",
    probe: str = "/orders",
    args: tuple[str, ...] = (),
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Serve ``app`` with gunicorn on a free port (or ``port``); yields its base URL and the master process.

    :param args: more command-line options for gunicorn, such as ``("-c", "example_app/gunicorn_conf.py")``.
    """
    port = port or free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--workers",
                str(workers),
                "--threads",
                str(threads),
                "--bind",
                f"127.0.0.1:{port}",
                "--graceful-timeout",
                "5",
                *args,
                app,
            ],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=log,
            stderr=log,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(base + probe, proc)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def in_thread(app: Any) -> Iterator[int]:
    """Serve the WSGI ``app`` with Werkzeug's threaded server in a thread on 127.0.0.1; yield its port."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.port
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
