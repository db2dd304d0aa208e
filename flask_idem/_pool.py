"""Where the extension's connections and transactions come from, and the per-process pool that gives them.

:class:`ConnectionSource` is what the rest of the extension asks for a connection or a transaction: by
default a :class:`ForkSafeConnectionPool`, shared by the key store and the application's own work
(:attr:`.Idempotency.pool`); with SQLAlchemy a :class:`.sqla.SessionSource`, so that the key and the
view's ORM work share the session's transaction.

A restart (of the database, a failover, PgBouncer) leaves every idle pooled connection dead: the pool
notices without a round trip, since an idle connection has nothing to read (:func:`_usable`, one
``poll()``), replaces it, and drops the other idle connections of that age at once
(:meth:`ForkSafeConnectionPool.connection_lost`). How a database that goes silent is noticed (connect
options, the deadline of a lent connection, the server's own timeouts, a brief wait while connecting
fails) is ``docs/timeouts.rst``'s subject.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import select
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import pq
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from . import _deadline, _wire
from ._connection import OWNER, Batched, PooledConnection, batched
from ._deadline import DeadlineExceeded
from ._probe import Prober, ignore_cut
from ._timeouts import DEFAULT_CONNECT_OPTIONS, server_timeouts, with_connect_options

__all__ = [
    "DEFAULT_CONNECT_OPTIONS",
    "Batched",
    "PooledConnection",
    "ConnectionSource",
    "DeadlineExceeded",
    "ForkSafeConnectionPool",
    "batched",
    "with_connect_options",
]

#: Seconds a request waits for a connection while new connections to the database fail.
FAIL_FAST_TIMEOUT = 1.0

#: Seconds psycopg_pool keeps retrying a connection it failed to open (with backoff) before giving up on
#: it; the next request that needs a connection then starts a new attempt at once. Short, so that a
#: database that is back is used within a second or two rather than after a long backoff.
RECONNECT_TIMEOUT = 2.0


class ConnectionSource(Protocol):
    """Where the extension gets its connections: a pool of its own, or an application's SQLAlchemy session.

    Every connection is a psycopg 3 connection; the key store's statements run on any of them.
    """

    def connection(self) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection for the duration of a ``with`` block, with no transaction of the caller's open.

        The caller opens its own with ``conn.transaction()`` when it needs one.
        """

    def transaction(self, *, batched: bool = False) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection inside a new transaction, committed when the block ends and rolled back when it
        raises. Application code in the block writes through the same transaction.

        With ``batched``, a source that can (:class:`ForkSafeConnectionPool`) sends ``BEGIN`` together with
        the transaction's first statement and ``COMMIT`` together with the statements deferred to it
        (:func:`batched`); others ignore it.
        """

    def close(self) -> None:
        """Let go of this process's connections; a later use opens new ones."""

    def connection_lost(self, conn: psycopg.Connection[Any]) -> None:
        """Note that ``conn`` was found closed by the server (a restart): replace the others of its age."""


logger = logging.getLogger("flask_idem")


def _usable(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is still open on the server's side, asked of the socket alone.

    An idle connection receives nothing unless the server closes it (a restart, a terminated backend)
    or sends a notification. A readable socket is read: an end of file or a closed connection means the
    connection is dead. Costs one non-blocking ``poll()``; no round trip to the server.
    """
    pgconn = conn.pgconn
    if pgconn.status != pq.ConnStatus.OK:
        return False
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        for _ in range(2):  # a FATAL message may come first, the end of file right after it
            if not poller.poll(0):
                return True
            pgconn.consume_input()
            if pgconn.status != pq.ConnStatus.OK:
                return False
    except (psycopg.OperationalError, OSError):
        return False
    return True


class _Pool(ConnectionPool[PooledConnection]):
    """psycopg's pool, which hands out no connection that the server has already closed, lends each one
    under a deadline, and waits for one only briefly while the database cannot be reached."""

    def __init__(self, *args: Any, owner: ForkSafeConnectionPool, **kwargs: Any) -> None:
        self._owner = owner
        super().__init__(*args, **kwargs)

    def getconn(self, timeout: float | None = None) -> PooledConnection:
        """A live connection, armed with the request's remaining database time (:mod:`._deadline`).

        The wait for it counts: it is bounded by ``timeout`` (the pool's), by that remaining time, and
        by :data:`FAIL_FAST_TIMEOUT` while new connections fail.
        """
        owner = self._owner
        started = time.monotonic()
        limit = _deadline.seconds_left(owner.deadline)
        wait = self.timeout if timeout is None else timeout
        if limit is not None:
            if limit <= 0:
                raise DeadlineExceeded("The request's database time (IDEM_DATABASE_DEADLINE) is spent.")
            wait = min(wait, limit)
        if owner.failing:
            wait = min(wait, FAIL_FAST_TIMEOUT)
        try:
            conn = self._live(started + wait)
        except BaseException:
            _deadline.spend(time.monotonic() - started)
            raise
        if limit is not None:
            conn._idem_armed = _deadline.arm(conn, limit, started=started, on_cut=owner.connection_lost)
            owner.lent.add(conn)
        return conn

    def _live(self, until: float) -> PooledConnection:
        """A connection from the pool; dead ones are closed and replaced, without a round trip.

        So is one opened before the pool's last drain: still being opened when a silent database drained
        the pool, it joined the pool afterwards, as silent as the ones the drain closed.
        """
        conn = super().getconn(max(0.0, until - time.monotonic()))
        while conn._idem_opened_at < self._owner._drained_at or not _usable(conn):
            self._owner.connection_lost(conn)
            conn.close()
            self.putconn(conn)  # a closed connection is discarded and a new one opened in its place
            conn = super().getconn(max(0.0, until - time.monotonic()))
        return conn

    def putconn(self, conn: PooledConnection) -> None:
        """Take the connection out from under its deadline and give it back."""
        armed = conn._idem_armed
        if armed is not None:
            self._owner.lent.discard(conn)
            conn._idem_armed = None
            _deadline.disarm(armed)
        if self._owner.failing and not conn.closed:
            self._owner.answered()
        super().putconn(conn)


class ForkSafeConnectionPool:
    """A psycopg :class:`~psycopg_pool.ConnectionPool` per process, opened on first use.

    The pool is created on first use and created again when the process id changes, so a pre-fork server
    (gunicorn) that imports the application in its master still gives every worker its own connections.
    Its connections are psycopg connections in autocommit mode; every transaction is an explicit
    ``with conn.transaction():`` block. Every connection gets flask-idem's connection options and is lent
    under its deadline (:doc:`/timeouts`); the reference shop's payment gateway simulator uses one for its
    own tables.

    :param conninfo: a libpq connection string or URL.
    :param name: the pool's name in psycopg's logs.
    :param min_size: connections the pool keeps open.
    :param max_size: most connections the pool opens.
    :param timeout: seconds a request waits for a free connection before the pool gives up.
    :param prepare_threshold: psycopg's server-side prepared statements after this many runs of a
        statement; ``None`` turns them off (PgBouncer in transaction mode before 1.21).
    :param connect_options: libpq parameters over :data:`DEFAULT_CONNECT_OPTIONS` (``None`` removes
        one); the URL's own win over both.
    :param deadline: seconds a connection may stay lent out (a request's database time in all, within
        a :func:`._deadline.budget`) before it is cut; also the server's ``statement_timeout`` and
        ``idle_in_transaction_session_timeout`` on direct connections where the server has none.
        ``None``: no deadline.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        name: str = "flask-idem",
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 5.0,
        prepare_threshold: int | None = 5,
        connect_options: Mapping[str, str | int | None] | None = None,
        deadline: float | None = 10.0,
    ) -> None:
        self._conninfo = with_connect_options(
            conninfo, {**DEFAULT_CONNECT_OPTIONS, **(connect_options or {})}
        )
        self.deadline = deadline
        #: Batches prepare their statements when psycopg may prepare its own and :func:`._wire.can_prepare`.
        self._prepare = prepare_threshold is not None and _wire.can_prepare()
        self._pool_args: dict[str, Any] = {
            "name": name,
            "min_size": min_size,
            "max_size": max_size,
            "timeout": timeout,
            "reconnect_timeout": RECONNECT_TIMEOUT,
            "kwargs": {"autocommit": True, "prepare_threshold": prepare_threshold, OWNER: self},
        }
        self._pool: ConnectionPool[PooledConnection] | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._drained_at = 0.0
        self._failing_since: float | None = None
        #: Whether batched transactions can run with this psycopg (:func:`._wire.usable`), found out on the
        #: first connection of the process; until then, and when not, transactions are plain.
        self._batches = False
        #: Connections lent out now, under a deadline; the prober asks the server about the slow ones.
        self.lent: set[PooledConnection] = set()
        self._prober = Prober(conninfo, connect_options or {}, lambda: list(self.lent), self.connect_failed)
        atexit.register(self.close)

    @property
    def pool(self) -> ConnectionPool[PooledConnection]:
        """This process's connection pool, opened on first use."""
        pool = self._pool
        if pool is not None and self._pid == os.getpid():
            return pool
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # A pool inherited through fork() is dropped, not closed: its sockets are shared with
                # the parent, and closing them here would cut the parent's connections.
                self._pool = _Pool(
                    self._conninfo,
                    connection_class=PooledConnection,
                    open=False,
                    configure=self._configure,
                    owner=self,
                    **self._pool_args,
                )
                self._pool.open(wait=False)
                self._pid = os.getpid()
                self._failing_since = None
                self.lent = set()
                if self.deadline is not None:
                    self._prober.ensure_running()
            return self._pool

    @property
    def failing(self) -> bool:
        """Whether the last news of the database was a failure to connect to it (its own connection's or
        the prober's), and no connection opened or came back in working order since."""
        return self._failing_since is not None

    def connect_failed(self) -> None:
        """Note that opening a connection failed: requests stop waiting long for one."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            logger.warning(
                "Cannot open a connection to the database; requests wait at most %.1f s for one"
                " until a connection opens again.",
                FAIL_FAST_TIMEOUT,
            )

    def answered(self) -> None:
        """Note that the database answered (a connection opened, or one came back in working order)."""
        if self._failing_since is not None:
            self._failing_since = None
            logger.info("The database answers again.")

    def _configure(self, conn: PooledConnection) -> None:
        """Stamp a new connection, and give the server our deadline where it has no timeouts of its own.

        Its two round trips are under the deadline too: a path that hangs right after connecting must not
        hold one of the pool's worker threads for good.
        """
        conn._idem_opened_at = time.monotonic()
        self.answered()
        seconds = self.deadline or math.inf
        armed = _deadline.arm(conn, seconds, started=conn._idem_opened_at, on_cut=ignore_cut)
        try:
            self._batches = _wire.usable(conn)  # a trial batch, on the first connection of the process
            if self.deadline is not None:
                conn._idem_direct = server_timeouts(conn, self.deadline)
        finally:
            _deadline.disarm(armed)

    def close(self) -> None:
        """Close this process's pool, if it has one. A later use opens a new one."""
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None
        self._prober.stop()

    def connection_lost(self, conn: psycopg.Connection[Any]) -> None:
        """Note that ``conn`` was found dead or cut: the first time, drop the pool's other idle connections.

        A restart kills (and a silent database silences) every connection opened before it, so they are
        replaced together rather than one failure each; those out of the pool are replaced when they come
        back. A connection opened after the last drain starts no new one: many threads drain once.
        """
        opened_at = getattr(conn, "_idem_opened_at", 0.0)
        with self._lock:
            pool = self._pool
            if pool is None or self._pid != os.getpid() or opened_at < self._drained_at:
                return
            self._drained_at = time.monotonic()
        logger.warning("A pooled connection was lost; replacing the idle ones.")
        pool.drain()

    @contextmanager
    def connection(self) -> Iterator[PooledConnection]:
        """Borrow a connection from the pool for the duration of a ``with`` block."""
        with self.pool.connection() as conn, _deadline_errors(conn):
            yield conn

    @contextmanager
    def transaction(self, *, batched: bool = False) -> Iterator[PooledConnection]:
        """Borrow a connection and run the ``with`` block in one transaction on it.

        A connection found dead at BEGIN (the server closed it since it was opened) is replaced once:
        nothing was sent on it that could have taken effect. With ``batched`` the transaction is a
        :class:`Batched` one: its ``BEGIN`` waits for its first statement (a dead connection is then found
        there, and the caller runs the block again: :func:`flask_idem._transactions.in_transaction`).
        """
        if batched and self._batches:  # every decorated route's path: _deadline_errors inlined
            with self.pool.connection() as conn:
                try:
                    with Batched(conn, prepare=self._prepare):
                        yield conn
                except psycopg.OperationalError as e:
                    _raise_if_cut(conn, e)
                    raise
            return
        with ExitStack() as stack:
            yield self._begin(stack)

    def _begin(self, stack: ExitStack) -> PooledConnection:
        """Borrow a connection into ``stack`` and begin a transaction on it, replacing one found dead."""
        conn = stack.enter_context(self.pool.connection())
        stack.enter_context(_deadline_errors(conn))  # around COMMIT too: it is left after the transaction
        try:
            stack.enter_context(conn.transaction())
        except psycopg.OperationalError:
            if not (conn.closed or conn.broken) or _cut(conn):
                raise
            self.connection_lost(conn)
            logger.info("A pooled connection was dead before any work was done; running again.")
            stack.close()  # the dead connection goes back to the pool, which discards it
            conn = stack.enter_context(self.pool.connection())
            stack.enter_context(_deadline_errors(conn))
            stack.enter_context(conn.transaction())
        return conn


def _cut(conn: PooledConnection) -> bool:
    armed = conn._idem_armed
    return armed is not None and armed.cut


@contextmanager
def _deadline_errors(conn: PooledConnection) -> Iterator[None]:
    """An error on a connection the watchdog cut becomes :class:`DeadlineExceeded`."""
    try:
        yield
    except psycopg.OperationalError as e:
        _raise_if_cut(conn, e)
        raise


def _raise_if_cut(conn: PooledConnection, error: psycopg.OperationalError) -> None:
    """Raise the :class:`DeadlineExceeded` that ``error`` on ``conn`` stands for when the watchdog cut it."""
    armed = conn._idem_armed
    if armed is not None and armed.cut and not isinstance(error, DeadlineExceeded):
        raise armed.error() from error
