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
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import pq
from psycopg.abc import Transformer
from psycopg.adapt import Transformer as Adapters
from psycopg.rows import DictRow, TupleRow
from psycopg_pool import ConnectionPool

from . import wire

__all__ = ["Batched", "Connection", "ConnectionSource", "ProcessPool", "batched"]


class ConnectionSource(Protocol):
    """Where the extension gets its connections: a pool of its own, or an application's SQLAlchemy session.

    Every connection is a psycopg 3 connection; the key store's statements run on any of them.
    """

    def connection(self) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection for the duration of a ``with`` block, with no transaction of the caller's open.

        The caller opens its own with ``conn.transaction()`` when it needs one.
        """
        ...

    def transaction(self, *, batched: bool = False) -> AbstractContextManager[psycopg.Connection[TupleRow]]:
        """A connection inside a new transaction, committed when the block ends and rolled back when it
        raises. Application code in the block writes through the same transaction.

        With ``batched``, a source that can (:class:`ProcessPool`) sends ``BEGIN`` together with the
        transaction's first statement and ``COMMIT`` together with the statements deferred to it
        (:func:`batched`); others ignore it.
        """
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
    #: The batched transaction open on it, if any (:meth:`ProcessPool.transaction`).
    _batched: Batched | None = None
    #: What batches need of it: adapters, and the names of the statements they prepared on it.
    _transformer: Transformer | None = None
    _batch_names: set[bytes] | None = None

    def _deallocate(self, name: bytes | None) -> Any:
        """psycopg's hook for deallocating its prepared statements; ``None`` stands for all of them.

        psycopg sends ``DEALLOCATE ALL`` after a rollback (a savepoint's included) and after it saw
        ``DISCARD ALL`` or ``DEALLOCATE ALL`` go by: the statements batches prepared go with it, so the
        batches forget their names at that moment (:mod:`flask_idem.wire`).
        """
        if name is None and self._batch_names:
            self._batch_names.clear()
        return super()._deallocate(name)

    def commit(self) -> None:
        """Commit, unless flask-idem's transaction is open: it commits with the key, or not at all."""
        self._refuse("commit")
        super().commit()

    def rollback(self) -> None:
        """Roll back, unless flask-idem's transaction is open: it decides when its transaction ends."""
        self._refuse("rollback")
        super().rollback()

    def _refuse(self, action: str) -> None:
        if self._batched is not None:
            # psycopg's own words inside a Transaction context, which this transaction stands for.
            raise psycopg.ProgrammingError(
                f"Explicit {action}() forbidden within a Transaction context: flask-idem commits the"
                " view's writes together with its key when the view returns, and rolls them back when it"
                " raises. Use a nested 'with conn.transaction():' block for a savepoint."
            )


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
        #: Batches prepare their statements when psycopg may prepare its own, libpq can close them, and
        #: psycopg tells when it deallocates them all (Connection._deallocate).
        self._prepare = (
            prepare_threshold is not None
            and wire.can_prepare()
            and callable(getattr(psycopg.Connection, "_deallocate", None))
        )
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
    def transaction(self, *, batched: bool = False) -> Iterator[Connection]:
        """Borrow a connection and run the ``with`` block in one transaction on it.

        A connection found dead at BEGIN (the server closed it since it was opened) is replaced once:
        nothing was sent on it that could have taken effect. With ``batched`` the transaction is a
        :class:`Batched` one: its ``BEGIN`` waits for its first statement (a dead connection is then found
        there, and the caller runs the block again: :func:`flask_idem._calls.in_transaction`).
        """
        if batched:
            with self.pool.connection() as conn, Batched(conn, prepare=self._prepare):
                yield conn
            return
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


def batched(conn: psycopg.Connection[Any]) -> Batched | None:
    """The batched transaction open on ``conn``, if it is one (:meth:`ProcessPool.transaction`)."""
    return conn._batched if isinstance(conn, Connection) else None


class Batched:
    """A transaction whose ``BEGIN`` travels with its first statement, and its ``COMMIT`` with its last.

    A fresh key's transaction is the reservation, the view's statements and the completion. Sent as
    psycopg sends them, ``BEGIN`` and ``COMMIT`` each cost a round trip of their own; here the store sends
    ``BEGIN`` together with the reservation (:meth:`begin`), and defers the completion to ``COMMIT``
    (:meth:`defer`), in batches of the extended protocol (:mod:`flask_idem.wire`): the view's own
    round trips and two more, as without the extension.

    Until :meth:`begin`, the connection is out of autocommit: should any statement run first through
    psycopg, psycopg opens the transaction itself, so nothing ever runs outside it. While the transaction
    is open, ``commit()`` and ``rollback()`` on the connection are refused as inside psycopg's own
    ``transaction()`` block; savepoints (nested ``conn.transaction()`` blocks) work as there. A
    rollback goes through psycopg, which then forgets (and deallocates) its prepared statements; the
    batches' names are forgotten with them.
    """

    def __init__(self, conn: Connection, *, prepare: bool) -> None:
        self.conn = conn
        self._prepare = prepare
        self._deferred: list[wire.Item] = []

    def __enter__(self) -> Batched:
        conn = self.conn
        if conn._transformer is None:
            conn._transformer = Adapters(conn)
            conn._batch_names = set()
        conn.autocommit = False
        conn._batched = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        conn = self.conn
        try:
            if exc is None and self.begun:
                deferred, self._deferred = self._deferred, []
                conn._batched = None
                if deferred:
                    self._run([*deferred, wire.COMMIT], prepare=self._prepare)
                else:
                    conn.commit()  # psycopg's own COMMIT: a simple query
        finally:
            conn._batched = None
            self._deferred.clear()
            self._end()

    @property
    def begun(self) -> bool:
        """Whether the transaction has begun on the server."""
        return self.conn.pgconn.transaction_status != pq.TransactionStatus.IDLE

    def begin(self, statement: wire.Statement, params: Mapping[str, Any]) -> wire.Result:
        """Send ``BEGIN`` and the transaction's first statement in one round trip; return its result.

        A prepared statement found deallocated (SQLSTATE 26000, after a ``DEALLOCATE ALL`` the batch did
        not see) is prepared again, and the two sent once more: nothing had run.
        """
        if self.begun:
            raise RuntimeError("The batched transaction has begun already.")
        try:
            return self._run([wire.BEGIN, (statement, params)], prepare=self._prepare)[1]
        except psycopg.errors.InvalidSqlStatementName:
            self._run([wire.ROLLBACK], prepare=False)
            return self._run([wire.BEGIN, (statement, params)], prepare=self._prepare)[1]

    def defer(self, statement: wire.Statement, params: Mapping[str, Any]) -> None:
        """Run ``statement`` with ``COMMIT``, in its round trip, after every statement sent before it.

        Its result is not seen; should it fail, the transaction is rolled back and its error raised.
        """
        if not self.begun:
            raise RuntimeError("A statement can only be deferred to COMMIT once the transaction has begun.")
        self._deferred.append((statement, params))

    def _run(self, items: list[wire.Item], *, prepare: bool) -> list[wire.Result]:
        conn = self.conn
        assert conn._transformer is not None
        prepared = conn._batch_names if prepare else None
        return wire.run(conn, items, transformer=conn._transformer, prepared=prepared)

    def _end(self) -> None:
        """Leave the connection as the pool lends it: idle and in autocommit, or closed."""
        conn = self.conn
        if conn.closed or conn.broken:
            return
        try:
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.rollback()  # through psycopg, which deallocates its prepared statements (and ours)
            conn.autocommit = True
        except psycopg.Error:
            conn.close()  # the pool discards it
