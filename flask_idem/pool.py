"""The per-process connection pool: one psycopg pool in each process, opened on first use.

Shared by the key store and by an application's own database work (:attr:`.Idempotency.pool`); the
shop's payment gateway simulator uses it too.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import DictRow, TupleRow
from psycopg_pool import ConnectionPool

__all__ = ["Connection", "ProcessPool"]


class Connection(psycopg.Connection[TupleRow]):
    """The connections of a :class:`ProcessPool`: psycopg connections that keep one cursor for the store.

    psycopg gives every new cursor an empty cache of parameter adapters, so the first statement on a new
    cursor looks up how to send each parameter again. The store's statements run on every write request,
    so they share one cursor per connection, which keeps that cache warm.
    """

    _store_cursor: psycopg.Cursor[DictRow] | None = None


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
                self._pool = ConnectionPool(
                    self._conninfo, connection_class=Connection, open=False, **self._pool_args
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

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """Borrow a connection from the pool for the duration of a ``with`` block."""
        with self.pool.connection() as conn:
            yield conn
