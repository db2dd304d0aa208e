"""The machinery of ``bench/run.py``: a throw-away database, gunicorn, wrk, pgbench, and percentiles.

Nothing here measures anything by itself; ``run.py`` decides what runs and prints the table.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from io import BytesIO
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # types-psutil is not in the dev group
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flask_idem._state import get_state

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/test"
#: The body every scenario sends; replays must repeat it exactly (its fingerprint is stored with the key).
BODY = b'{"amount": 1250, "currency": "EUR"}'


@dataclass
class Result:
    """One row of the printed table. Latencies in milliseconds; ``None`` where not measured."""

    scenario: str
    rps: float
    p50: float | None
    p99: float | None
    non2xx: int
    errors: int
    requests: int = 0
    #: CPU milliseconds per request used by the gunicorn workers and their PostgreSQL backends together.
    cpu_ms: float | None = None
    #: The ratio this scenario is judged by, the goal from issue 5, and "met" / "MISSED" / "".
    ratio: str = ""
    goal: str = ""
    verdict: str = ""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` by the nearest-rank method; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100)
    return ordered[int(rank) - 1]


def ensure_tool(command: str, package: str) -> str:
    """The path of ``command``, installing Debian's ``package`` with apt-get when it is missing."""
    found = shutil.which(command)
    if found:
        return found
    print(f"# {command} not found: apt-get install -y {package}", flush=True)
    install = ["apt-get", "install", "-y", "-q", package]
    if subprocess.run(install, stdout=subprocess.DEVNULL).returncode != 0:
        print("# apt-get install failed; running apt-get update first", flush=True)
        subprocess.run(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL, check=True)
        subprocess.run(install, stdout=subprocess.DEVNULL, check=True)
    found = shutil.which(command)
    if not found:
        raise SystemExit(f"{command} is still missing after installing {package}")
    return found


# -- the database ---------------------------------------------------------------------------------------


@contextmanager
def scratch_database(server_url: str, name: str) -> Iterator[str]:
    """Create database ``name`` afresh on ``server_url``, yield its URL, and drop it at the end."""
    ident = sql.Identifier(name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


@contextmanager
def citus_database(name: str = "flask_idem_bench") -> Iterator[str]:
    """Start a local Citus cluster (coordinator + 2 workers), yield the URL of database ``name`` on its
    coordinator, with Citus on every node, and stop the cluster at the end."""
    from tests.support import citus

    cluster = citus.start(Path(tempfile.mkdtemp(prefix="flask-idem-bench-citus-")))
    try:
        yield cluster.create_database(name)
    finally:
        cluster.stop()


def set_up_shop(url: str) -> tuple[int, str]:
    """Create the shop's tables and the key table in ``url``, and one organisation: (org id, API key)."""
    from bench.app import create_app
    from example_app.cli import create_org
    from example_app.db import init_db

    app = create_app({"DATABASE_URL": url, "METRICS": False})  # no receivers left on the signals
    try:
        with app.app_context():
            init_db()
            return create_org("bench")
    finally:
        get_state(app).source.close()


def daily_table(url: str, table: str, *, ahead: float = 7 * 86_400.0) -> None:
    """A key table of this checkout in daily partitions as ``flask idem purge`` keeps them with the
    defaults (one day's retention, seven days ahead in a spare partition), its first partition gone.

    :param ahead: ``IDEM_PARTITION_AHEAD`` in seconds (0: a partition per day all the way, no spare).
    """
    from flask_idem._migrate import upgrade
    from flask_idem._partitions import maintain

    day = 86_400.0
    upgrade(url, table=table, horizon=1.0, echo=lambda _: None)  # the first partition ends in a second
    with psycopg.connect(url) as conn:
        moment = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    # Then a run two minutes on, past the first partition's range and grace: it is retired (empty), as
    # on the table in its steady state, and the partitions ahead are made.
    maintain(
        url,
        table=table,
        interval=day,
        horizon=8 * day,
        tombstone_ttl=30 * day,
        ahead=ahead,
        now=lambda: moment + timedelta(minutes=2),
        echo=lambda _: None,
    )


def server_version(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


# -- gunicorn -------------------------------------------------------------------------------------------


def snapshot(ref: str, into: Path) -> Path:
    """The files of commit ``ref`` (flask_idem, example_app, bench), extracted under ``into``."""
    archive = subprocess.run(
        ["git", "archive", ref, "flask_idem", "example_app", "bench"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Server:
    """A running gunicorn: its base URL and its master's process id."""

    base: str
    pid: int

    def worker_pids(self) -> list[int]:
        return [child.pid for child in psutil.Process(self.pid).children(recursive=True)]


@contextmanager
def gunicorn(
    url: str,
    *,
    workers: int,
    threads: int,
    log: Path,
    access_log: Path | None = None,
    env: dict[str, str] | None = None,
    app: str = "bench.app:create_app()",
    root: Path = ROOT,
) -> Iterator[Server]:
    """Serve ``app`` on a free loopback port until the ``with`` block ends.

    Each worker's pool keeps ``threads`` connections open (min = max), so no request waits for a
    connection and none is opened during a measurement. The code served is the one under ``root``
    (this checkout, or a :func:`snapshot` of another commit).
    """
    port = free_port()
    command = [
        sys.executable, "-m", "gunicorn",
        "--workers", str(workers), "--threads", str(threads),
        "--bind", f"127.0.0.1:{port}", "--backlog", "2048", "--graceful-timeout", "5",
    ]  # fmt: skip
    if access_log is not None:
        # %(s)s status, %(D)s microseconds from the worker reading the request to writing the response.
        command += ["--access-logfile", str(access_log), "--access-logformat", "%(s)s %(D)s"]
    command.append(app)
    environ = {
        # The shop's Prometheus metrics are off unless FLASK_METRICS=true is set for the run: the
        # scenarios measure the extension (bench/signals.py measures what the metrics add).
        "FLASK_METRICS": "false",
        **os.environ,
        "FLASK_DATABASE_URL": url,
        "FLASK_IDEM_POOL_MIN_SIZE": str(threads),
        "FLASK_IDEM_POOL_MAX_SIZE": str(threads),
        **(env or {}),
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, cwd=root, env=environ, stdout=out, stderr=out, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(base, proc, log)
        yield Server(base, proc.pid)
    finally:
        stop_process_group(proc)


def _wait_until_serving(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    import requests

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gunicorn exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            requests.post(base + "/orders", timeout=2)  # 401 from any worker means "serving"
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise SystemExit(f"gunicorn did not answer within 30 s:\n{log.read_text()[-3000:]}")


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process (gunicorn stops its workers), then SIGKILL its own process group if needed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group it leads: stray workers, nothing else
    except ProcessLookupError:
        pass
    proc.wait()


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU seconds used so far by the processes ``pids`` (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _machine_busy() -> float:
    """CPU seconds all processes of the machine have used since boot (every state but idle)."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def backend_pids(url: str, application_name: str | None = None) -> list[int]:
    """The server processes of the other connections to ``url``'s database (the shop's pools), or of
    those that gave ``application_name`` only."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name = coalesce(%s, application_name)",
            (application_name,),
        ).fetchall()
    return [pid for (pid,) in rows]


# -- load generators ------------------------------------------------------------------------------------


@dataclass
class WrkRun:
    """What a wrk script's ``done()`` printed on its ``BENCH`` line (latencies in microseconds), and
    the CPU seconds used during the run by wrk and by each group of processes watched."""

    requests: int
    duration_us: int
    p50_us: int
    p99_us: int
    status_errors: int
    socket_errors: int
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / (self.duration_us / 1e6)


@dataclass(frozen=True)
class WrkJob:
    """One wrk process: ``bench/<script>`` against ``url``; ``args`` go to the script's ``init()``.

    ``watch`` names groups of processes (a server's workers, its backends) whose CPU time the run
    reports.
    """

    script: str
    url: str
    args: Sequence[str]
    threads: int
    connections: int
    watch: Mapping[str, Sequence[int]] = field(default_factory=dict)


def wrk(
    script: str,
    url: str,
    args: Sequence[str],
    *,
    threads: int,
    connections: int,
    seconds: float,
    watch: Mapping[str, Sequence[int]] | None = None,
) -> WrkRun:
    """Run one wrk job for ``seconds`` (:func:`wrk_together`)."""
    job = WrkJob(script, url, args, threads=threads, connections=connections, watch=dict(watch or {}))
    return wrk_together([job], seconds)[0]


def wrk_together(jobs: Sequence[WrkJob], seconds: float) -> list[WrkRun]:
    """Run the ``jobs`` at the same time for ``seconds``; one :class:`WrkRun` each, in order.

    Each run's ``cpu`` holds the CPU seconds of its own watched groups and of its wrk process over the
    whole run, and ``others``: what every other process on the machine used meanwhile.
    """
    before = [{name: cpu_seconds(pids) for name, pids in job.watch.items()} for job in jobs]
    machine = _machine_busy()
    procs = []
    for job in jobs:
        command = [
            "wrk", "-t", str(job.threads), "-c", str(job.connections), "-d", f"{seconds:g}s",
            "--timeout", "10s", "-s", str(BENCH / job.script), job.url, "--", *job.args,
        ]  # fmt: skip
        out = tempfile.TemporaryFile("w+")
        procs.append(
            (subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT), out)
        )
    wrk_cpu = []
    for proc, _ in procs:
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it: its own CPU time, not every child's
        proc.returncode = os.waitstatus_to_exitcode(status)
        wrk_cpu.append(usage.ru_utime + usage.ru_stime)
    cpu = [{name: cpu_seconds(pids) - was[name] for name, pids in job.watch.items()} for job, was in
           zip(jobs, before, strict=True)]  # fmt: skip
    others = _machine_busy() - machine - sum(wrk_cpu) - sum(sum(groups.values()) for groups in cpu)
    runs = []
    for (proc, out), groups, own in zip(procs, cpu, wrk_cpu, strict=True):
        with out:
            out.seek(0)
            output = out.read()
        match = re.search(r"^BENCH (.*)$", output, re.MULTILINE)
        if proc.returncode != 0 or match is None:
            raise SystemExit(f"wrk failed ({proc.returncode}):\n{output}")
        fields = dict(pair.split("=") for pair in match[1].split())
        runs.append(
            WrkRun(**{k: int(v) for k, v in fields.items()}, cpu={**groups, "wrk": own, "others": others})
        )
    return runs


@dataclass
class PgbenchRun:
    tps: float
    latencies_us: list[int]
    failed: int


def pgbench(
    url: str,
    script: Path,
    *,
    clients: int,
    seconds: float,
    warmup: float,
    logdir: Path,
    variables: dict[str, str],
) -> PgbenchRun:
    """Run a custom pgbench ``script`` with prepared statements (as psycopg does after 5 runs)."""
    result: PgbenchRun | None = None
    for duration in [r for r in (warmup, seconds) if r > 0]:
        for old in logdir.glob("pgbench_log*"):
            old.unlink()
        command = [
            "pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
            "-T", str(max(1, round(duration))), "-f", str(script),
            "-l", "--log-prefix", str(logdir / "pgbench_log"),
            *(f"--define={name}={value}" for name, value in variables.items()), url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        tps = re.search(r"^tps = ([\d.]+)", done.stdout, re.MULTILINE)
        if done.returncode != 0 or tps is None:
            raise SystemExit(f"pgbench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        failed = re.search(r"number of failed transactions: (\d+)", done.stdout)
        # Per-transaction log: client, transaction number, latency (us), ... ("failed" instead when failed).
        latencies = [
            int(cols[2])
            for log in logdir.glob("pgbench_log*")
            for cols in (line.split() for line in log.read_text().splitlines())
            if len(cols) > 2 and cols[2].isdigit()
        ]
        result = PgbenchRun(float(tps[1]), latencies, int(failed[1]) if failed else 0)
    assert result is not None
    return result
