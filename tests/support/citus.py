"""A local Citus cluster for the suite (FLASK_IDEM_TEST_CITUS=1) and for the history checker.

A coordinator and two workers: three PostgreSQL 15 clusters of Debian's ``postgresql-15`` with the Citus
extension (built by ``shared/vendor/citus/build.sh``), each on a loopback port of its own, started with
``initdb`` and ``pg_ctl`` in a scratch directory and stopped at the end. Every xdist worker gets its own
cluster: no lock file, no reference counting, and one worker's node restarts hurt nobody else.

Citus works per database: each database needs ``CREATE EXTENSION citus`` on every node, and the
coordinator's copy must be told where its workers are. :meth:`Cluster.create_database` does all of it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .servers import free_port, wait_for

ENV = "FLASK_IDEM_TEST_CITUS"
ENABLED = os.environ.get(ENV) == "1"

#: Debian's PostgreSQL 15, into which build.sh installs Citus.
PG_BIN = Path("/usr/lib/postgresql/15/bin")
CITUS_SO = Path("/usr/lib/postgresql/15/lib/citus.so")

#: Settings of every node: Citus first in shared_preload_libraries (it insists), no fsync (a test cluster is
#: thrown away, and a crash of a node's processes, which the history checker causes, keeps what the OS was
#: given), small memory, and enough connections for the suite's gunicorn servers. synchronous_commit stays
#: on: off, a node killed with `-m immediate` forgets commits it had acknowledged a moment before, and the
#: history checker rightly reports those orders lost.
_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{socket_dir}'
shared_preload_libraries = 'citus'
max_connections = 300
shared_buffers = 32MB
fsync = off
synchronous_commit = on
full_page_writes = off
max_wal_size = 256MB
citus.log_distributed_deadlock_detection = off
citus.shard_count = 8
citus.node_conninfo = 'sslmode=disable'
"""


def configure_environment() -> None:
    """Make every application the suite starts (this process and its children) use the distributed layout."""
    os.environ["FLASK_IDEM_DISTRIBUTED"] = "true"


def available() -> None:
    """Fail with how to install Citus when it is missing."""
    if not (PG_BIN / "pg_ctl").exists() or not CITUS_SO.exists():
        raise RuntimeError(
            f"{ENV}=1 needs PostgreSQL 15 with Citus: run 'bash ../shared/vendor/citus/build.sh'"
            " (as root; it installs postgresql-15 and builds Citus into it)."
        )


def _run_as() -> dict[str, Any]:
    """``subprocess`` arguments that run a PostgreSQL program as a user that is not root.

    PostgreSQL refuses to run as root; CI runs as root, so the servers run as Debian's ``postgres`` user.
    """
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam("postgres")
    env = {**os.environ, "HOME": user.pw_dir}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": env}


@dataclass
class Node:
    """One PostgreSQL server of the cluster."""

    name: str
    pgdata: Path
    port: int

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL of this node (loopback TCP, trust authentication)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def pg_ctl(self, *args: str, timeout: float = 60) -> None:
        """Run ``pg_ctl`` on this node's data directory."""
        subprocess.run(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.pgdata), "-l", str(self.pgdata / "log"), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=timeout,
            **_run_as(),
        )

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        """An autocommit connection to this node."""
        return psycopg.connect(self.url(dbname), autocommit=True)


@dataclass
class Cluster:
    """A running coordinator and its workers."""

    workdir: Path
    coordinator: Node
    workers: list[Node]
    databases: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> list[Node]:
        """The coordinator first, then the workers."""
        return [self.coordinator, *self.workers]

    def create_database(self, name: str) -> str:
        """Create database ``name`` on every node with Citus in it, and add the workers; its URL."""
        for node in self.nodes:
            with node.connect() as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            with node.connect(name) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
        with self.coordinator.connect(name) as conn:
            conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (self.coordinator.port,))
            for worker in self.workers:
                conn.execute("SELECT citus_add_node('127.0.0.1', %s)", (worker.port,))
        self.databases.append(name)
        return self.coordinator.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` on every node."""
        for node in self.nodes:
            with node.connect() as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def restart_worker(self, index: int, mode: str = "fast") -> None:
        """Restart worker node ``index`` with ``pg_ctl -m fast`` or ``-m immediate`` (a crash)."""
        self.workers[index].pg_ctl("-w", "-m", mode, "restart")

    def stop(self) -> None:
        """Stop every node (immediately: the data is thrown away) and delete the cluster's directory."""
        for node in self.nodes:
            if (node.pgdata / "postmaster.pid").exists():
                try:
                    node.pg_ctl("-w", "-m", "immediate", "stop")
                except subprocess.CalledProcessError:
                    pass
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(workdir: Path, *, workers: int = 2) -> Cluster:
    """Initialise and start a coordinator and ``workers`` workers under ``workdir`` (created, 0755).

    ``initdb`` runs once; the workers start from copies of that data directory.
    """
    available()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)  # the servers run as 'postgres' when we are root
    template = workdir / "template"
    as_user = _run_as()
    if as_user:
        os.chown(workdir, as_user["user"], as_user["group"])
    subprocess.run(
        [
            str(PG_BIN / "initdb"),
            "-D",
            str(template),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        **as_user,
    )
    nodes = []
    for name in ["coordinator", *(f"worker{i}" for i in range(1, workers + 1))]:
        pgdata = workdir / name
        subprocess.run(["cp", "-a", str(template), str(pgdata)], check=True, **as_user)
        node = Node(name, pgdata, free_port())
        with (pgdata / "postgresql.conf").open("a") as conf:
            conf.write(_CONF.format(port=node.port, socket_dir=pgdata))
        nodes.append(node)
    shutil.rmtree(template)
    cluster = Cluster(workdir, nodes[0], nodes[1:])
    try:
        for node in nodes:
            node.pg_ctl("-w", "start")
        for node in nodes:
            _wait_until_ready(node)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_until_ready(node: Node, timeout: float = 30.0) -> None:
    def ready() -> bool:
        with node.connect():
            return True

    wait_for(
        ready,
        timeout,
        0.1,
        message=f"Citus node {node.name} did not accept connections",
        ignore=psycopg.OperationalError,
    )
