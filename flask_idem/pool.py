"""Where the extension's connections and transactions come from, and the per-process pool that gives them.

:class:`ConnectionSource` is what the rest of the extension asks for a connection or a transaction. The
default source is :class:`ProcessPool`: one psycopg pool in each process, opened on first use, shared by the
key store and by an application's own database work (:attr:`.Idempotency.pool`); the shop's payment
gateway simulator uses it too. An application built on SQLAlchemy uses :class:`.sqla.SessionSource`
instead, so that the key and the view's ORM work share the session's transaction.

A database restart (or a failover, or a PgBouncer restart) leaves every idle pooled connection dead. The
pool notices that without a round trip: an idle connection has nothing to read, so a socket that is
readable when the connection is handed out means the server closed it or is closing it
(:func:`_usable`, one ``poll()`` system call). Such a connection is replaced before anyone uses it, and
the first one found makes the pool drop its other idle connections of that age at once
(:meth:`ProcessPool.connection_lost`).
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import pq
from psycopg.rows import DictRow, TupleRow
from psycopg_pool import ConnectionPool

__all__ = ["Connection", "ConnectionSource", "ProcessPool"]


class ConnectionSource(Protocol):
    """Where the extension gets its connections: a pool of its own, or an application's SQLAlchemy session.

    Every connection is a psycopg 3 connection; the key store's statements run on any of them.
    """

    def connection(self) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection for the duration of a ``with`` block, with no transaction of the caller's open.

        The caller opens its own with ``conn.transaction()`` when it needs one.
        """
        ...

    def transaction(self) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection inside a new transaction, committed when the block ends and rolled back when it
        raises. Application code in the block writes through the same transaction."""
        ...

    def close(self) -> None:
        """Let go of this process's connections; a later use opens new ones."""
        ...

    def connection_lost(self, conn: psycopg.Connection[Any]) -> None:
        """Note that ``conn`` was found closed by the server (a restart): replace the others of its age."""
        ...


logger = logging.getLogger("flask_idem")


class Connection(psycopg.Connection[TupleRow]):
    """The connections of a :class:`ProcessPool`: psycopg connections that keep one cursor for the store.

    psycopg gives every new cursor an empty cache of parameter adapters, so the first statement on a new
    cursor looks up how to send each parameter again. The store's statements run on every write request,
    so they share one cursor per connection, which keeps that cache warm.
    """

    _store_cursor: psycopg.Cursor[DictRow] | None = None
    #: When the pool opened it (``time.monotonic()``), to tell stale connections from fresh ones.
    _opened_at: float = 0.0


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


class _Pool(ConnectionPool[Connection]):
    """psycopg's pool, which hands out no connection that the server has already closed."""

    def __init__(self, *args: Any, on_lost: Callable[[Connection], None], **kwargs: Any) -> None:
        self._on_lost = on_lost
        super().__init__(*args, **kwargs)

    def getconn(self, timeout: float | None = None) -> Connection:
        """A connection from the pool; dead ones are closed and replaced, without a round trip."""
        conn = super().getconn(timeout)
        while not _usable(conn):
            self._on_lost(conn)
            conn.close()
            self.putconn(conn)  # a closed connection is discarded and a new one opened in its place
            conn = super().getconn(timeout)
        return conn


def _stamp(conn: Connection) -> None:
    conn._opened_at = time.monotonic()


class ProcessPool:
    """A psycopg :class:`~psycopg_pool.ConnectionPool` per process, opened on first use.

    The pool is created on first use and created again when the process id changes, so a pre-fork server
    (gunicorn) that imports the application in its master still gives every worker its own connections.
    Its connections are :class:`Connection` objects in autocommit mode; every transaction is an explicit
    ``with conn.transaction():`` block.

    :param conninfo: a libpq connection string or URL.
    :param name: the pool's name in psycopg's logs.
    :param min_size: connections the pool keeps open.
    :param max_size: most connections the pool opens.
    :param timeout: seconds a request waits for a free connection before the pool gives up.
    :param prepare_threshold: psycopg's server-side prepared statements after this many runs of a
        statement; ``None`` turns them off (PgBouncer in transaction mode before 1.21).
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
    ) -> None:
        self._conninfo = conninfo
        self._pool_args: dict[str, Any] = {
            "name": name,
            "min_size": min_size,
            "max_size": max_size,
            "timeout": timeout,
            "kwargs": {"autocommit": True, "prepare_threshold": prepare_threshold},
        }
        self._pool: ConnectionPool[Connection] | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._drained_at = 0.0
        atexit.register(self.close)

    @property
    def pool(self) -> ConnectionPool[Connection]:
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
                    connection_class=Connection,
                    open=False,
                    configure=_stamp,
                    on_lost=self.connection_lost,
                    **self._pool_args,
                )
                self._pool.open(wait=False)
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Close this process's pool, if it has one. A later use opens a new one."""
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None

    def connection_lost(self, conn: psycopg.Connection[Any]) -> None:
        """Note that ``conn`` was found dead: the first time, drop the pool's other idle connections.

        A restart kills every connection opened before it, so once one of them is found dead the others
        are closed and replaced together, instead of one failure per pooled connection. Connections that
        are out of the pool are replaced when they come back. A connection opened after the last drain
        starts no new one, so many threads finding dead connections at once drain the pool once.
        """
        opened_at = getattr(conn, "_opened_at", 0.0)
        with self._lock:
            pool = self._pool
            if pool is None or self._pid != os.getpid() or opened_at < self._drained_at:
                return
            self._drained_at = time.monotonic()
        logger.warning("A pooled connection was closed by the server; replacing the idle ones.")
        pool.drain()

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """Borrow a connection from the pool for the duration of a ``with`` block."""
        with self.pool.connection() as conn:
            yield conn

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Borrow a connection and run the ``with`` block in one transaction on it.

        A connection found dead at BEGIN (the server closed it since it was opened) is replaced once:
        nothing was sent on it that could have taken effect.
        """
        with ExitStack() as stack:
            conn = stack.enter_context(self.pool.connection())
            try:
                stack.enter_context(conn.transaction())
            except psycopg.OperationalError:
                if not (conn.closed or conn.broken):
                    raise
                self.connection_lost(conn)
                logger.info("A pooled connection was dead before any work was done; running again.")
                stack.close()  # the dead connection goes back to the pool, which discards it
                conn = stack.enter_context(self.pool.connection())
                stack.enter_context(conn.transaction())
            yield conn
