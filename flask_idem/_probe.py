"""Asking the server whether a connection that waits for an answer will ever get one.

To the client a slow statement and a silent connection look the same; the server tells them apart: in
``pg_stat_activity`` a process is ``active`` while it works on a statement, ``idle`` (in transaction or
not) while it waits for the client. A :class:`Prober` asks, with a connection of its own, about each lent
connection that has waited :data:`PROBE_AFTER` seconds; said twice, :data:`PROBE_INTERVAL` apart, that
nobody works for it, the connection is cut as its deadline would have cut it later, and its server
process terminated (it may hold the vanished client's transaction and key). A prober that cannot connect
tells the pool the database is unreachable. Only direct connections are probed: behind PgBouncer the
process id the client knows is the pooler's. ``docs/timeouts.rst`` tells the whole story.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq

from . import _deadline
from ._connection import PooledConnection
from ._timeouts import DEFAULT_CONNECT_OPTIONS, with_connect_options

__all__ = ["PROBE_AFTER", "PROBE_INTERVAL", "Prober", "ignore_cut"]

logger = logging.getLogger("flask_idem")

#: Seconds a connection must have been lent and waiting before the server is asked about it.
PROBE_AFTER = 2.0
#: Seconds between two rounds of questions.
PROBE_INTERVAL = 1.0
#: Seconds the prober's own connection may take to answer, and to open unless the URL or
#: ``IDEM_CONNECT_OPTIONS`` set a ``connect_timeout`` (never shorter than what the user asked for: a
#: connection slower to open would make the pool believe the database gone).
_PROBE_TIMEOUT = 2

_STATES = "SELECT pid, state FROM pg_stat_activity WHERE pid = ANY(%s)"
_TERMINATE = "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid"


class Prober:
    """The prober of one pool in one process (its thread is started on first use and after a fork).

    :param conninfo: where to open the prober's own connections (the pool's URL, as given).
    :param connect_options: the pool's connection options over :data:`DEFAULT_CONNECT_OPTIONS`
        (``IDEM_CONNECT_OPTIONS``). The URL's parameters win over both, as on the pool's connections;
        the connect timeout is :data:`_PROBE_TIMEOUT` where neither sets one.
    :param lent: the pool's connections lent out now.
    :param unreachable: called when the prober cannot connect.
    """

    def __init__(
        self,
        conninfo: str,
        connect_options: Mapping[str, str | int | None],
        lent: Callable[[], Collection[PooledConnection]],
        unreachable: Callable[[], None],
    ) -> None:
        options = {**DEFAULT_CONNECT_OPTIONS, **connect_options}
        options["connect_timeout"] = connect_options.get("connect_timeout") or _PROBE_TIMEOUT
        self._conninfo = with_connect_options(conninfo, options)
        self._lent = lent
        self._unreachable = unreachable
        self._pid = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: How many rounds in a row the server said it was not working for a lent connection.
        self._strikes: dict[_deadline.Armed, int] = {}

    def ensure_running(self) -> None:
        """Start this process's prober thread if it has none."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                self._stop = threading.Event()
                self._strikes = {}
                thread = threading.Thread(target=self._run, name="flask-idem-prober", daemon=True)
                thread.start()
                self._pid = os.getpid()

    def stop(self) -> None:
        """Stop this process's prober thread (a later :meth:`ensure_running` starts a new one)."""
        with self._lock:
            self._stop.set()
            self._pid = 0

    def _run(self) -> None:
        stop = self._stop
        while not stop.wait(PROBE_INTERVAL):
            try:
                self.round()
            except Exception:  # the prober must outlive whatever goes wrong in one round
                logger.exception("The database prober failed; it goes on.")

    def round(self) -> None:
        """One round: ask the server about every connection waiting too long; cut the silent ones."""
        now = time.monotonic()
        waiting = {
            armed: conn.info.backend_pid
            for conn in self._lent()
            if (armed := conn._idem_armed) is not None
            and conn._idem_direct
            and now - armed.started >= PROBE_AFTER
            and _waiting(conn)
        }
        self._strikes = {armed: self._strikes.get(armed, 0) for armed in waiting}
        if not waiting:
            return
        try:
            with self._connection() as conn:
                states = dict(conn.execute(_STATES, (list(waiting.values()),)).fetchall())
                cut = [pid for armed, pid in waiting.items() if self._cut_if_silent(armed, states.get(pid))]
                if cut:
                    _terminate(conn, cut)
        except psycopg.OperationalError:
            self._unreachable()

    def _cut_if_silent(self, armed: _deadline.Armed, state: str | None) -> bool:
        """Cut ``armed`` when the server said, for the second round in a row, that it is not working for
        it; return whether it was cut."""
        if state == "active" or not _waiting(armed.conn):
            self._strikes[armed] = 0
            return False
        self._strikes[armed] += 1
        if self._strikes[armed] < 2:
            return False
        seen = f"its server process was {state!r}" if state else "it had no server process"
        return _deadline.cut(armed, seen + " while it waited for an answer")

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the prober's own, opened within its connect timeout and then under a deadline
        of :data:`_PROBE_TIMEOUT` for its answers: the path to the server may be hung for new connections
        too."""
        with psycopg.connect(self._conninfo, autocommit=True) as conn:
            armed = _deadline.arm(conn, _PROBE_TIMEOUT, started=time.monotonic(), on_cut=ignore_cut)
            try:
                yield conn
            finally:
                _deadline.disarm(armed)


def _terminate(conn: psycopg.Connection[Any], pids: list[int]) -> None:
    """End these server processes, which may hold a vanished client's transaction, locks and key until
    ``idle_in_transaction_session_timeout``. A role may end its own processes only."""
    try:
        conn.execute(_TERMINATE, (pids,))
    except psycopg.errors.InsufficientPrivilege:
        logger.info("Could not end the server processes of cut connections: not allowed to.")


def ignore_cut(conn: object) -> None:
    """Nothing more for a cut connection whose owner lets go of it anyway: a probe's (its ``with`` block
    closes it), or one the pool is configuring (psycopg_pool discards it)."""


def _waiting(conn: psycopg.Connection[object]) -> bool:
    """Whether ``conn`` waits for an answer that has not begun to arrive: a command is in progress and
    its socket has nothing to read."""
    try:
        if conn.pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
            return False
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (psycopg.Error, OSError, ValueError):  # closed meanwhile: not waiting any more
        return False
