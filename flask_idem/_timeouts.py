"""The timeouts every connection of the extension gets: TCP's at connect (:func:`with_connect_options`),
the server's once connected (:func:`server_timeouts`); ``docs/timeouts.rst`` says why."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["DEFAULT_CONNECT_OPTIONS", "server_timeouts", "with_connect_options"]

logger = logging.getLogger("flask_idem")

#: libpq connection parameters every connection of the extension gets where its URL does not set them
#: (``IDEM_CONNECT_OPTIONS`` overrides them one by one): give up connecting after 5 s, probe an idle
#: connection after 3 s of silence (then every second, 3 times), and give up on a connection whose sent
#: data stays unacknowledged for 5 s. A peer that stopped answering at the TCP level (a dead host, an
#: address that moved in a failover) is then noticed within seconds instead of TCP's fifteen minutes.
DEFAULT_CONNECT_OPTIONS: Mapping[str, str | int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 3,
    "keepalives_interval": 1,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
}


def with_connect_options(conninfo: str, options: Mapping[str, str | int | None]) -> str:
    """``conninfo`` with the libpq parameters ``options`` where it does not set them itself.

    A value of ``None`` adds nothing. ``connect_timeout`` is not added either when ``PGCONNECT_TIMEOUT``
    is set in the environment, which libpq reads instead.
    """
    given = conninfo_to_dict(conninfo)
    extra = {
        name: value
        for name, value in options.items()
        if value is not None
        and name not in given
        and not (name == "connect_timeout" and os.environ.get("PGCONNECT_TIMEOUT"))
    }
    return make_conninfo(conninfo, **extra) if extra else conninfo


#: What a new connection reads of the server: whether it talks to the server itself (a pooler in
#: between shows the client a process id of its own), and the two timeouts the server may already have.
_SERVER_SETTINGS = (
    "SELECT pg_backend_pid(), current_setting('statement_timeout'),"
    " current_setting('idle_in_transaction_session_timeout')"
)
_SERVER_TIMEOUTS = ("statement_timeout", "idle_in_transaction_session_timeout")
_pooler_noted = False


def server_timeouts(conn: psycopg.Connection[Any], deadline: float) -> bool:
    """Give the server ``deadline`` as its statement and idle-transaction timeouts on ``conn``, where it
    has none of its own; return whether ``conn`` reaches the server itself.

    Behind a pooler (its process id is not the server's) nothing is set: the setting would stay on a
    server connection that other clients of the pooler use next.
    """
    row = conn.execute(_SERVER_SETTINGS).fetchone()
    assert row is not None
    pid, *current = row
    if pid != conn.info.backend_pid:
        _note_pooler()
        return False
    unset = [name for name, value in zip(_SERVER_TIMEOUTS, current, strict=True) if value == "0"]
    if unset:
        millis = str(round(deadline * 1000))
        calls = ", ".join(["set_config(%s, %s, false)"] * len(unset))
        conn.execute(f"SELECT {calls}", [value for name in unset for value in (name, millis)])
    return True


def _note_pooler() -> None:
    global _pooler_noted
    if not _pooler_noted:
        _pooler_noted = True
        logger.info(
            "The database is reached through a connection pooler (its process id is not the server's):"
            " the server-side statement and idle-transaction timeouts are not set per connection. Set the"
            " pooler's own (PgBouncer: query_timeout, idle_transaction_timeout)."
        )
