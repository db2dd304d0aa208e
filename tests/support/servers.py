"""Real server processes for tests and for the history checker: free ports, readiness, gunicorn."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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


def wait_for_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers anything, failing early if ``proc`` exits."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering")
        try:
            requests.get(url, timeout=2)
            return
        except requests.RequestException:  # refused while binding, or a worker still booting
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


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
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Serve ``app`` with gunicorn on a free port; yields its base URL and the master process.

    :param args: more command-line options for gunicorn, such as ``("-c", "example_app/gunicorn_conf.py")``.
    """
    port = free_port()
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
