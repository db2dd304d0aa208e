"""The extension's psycopg connections, and the transaction that sends BEGIN and COMMIT with statements.

The attributes :class:`PooledConnection` adds to psycopg's class start with ``_idem_``, so that they cannot
meet psycopg's own; the one psycopg hook it overrides, ``_deallocate``, is named with the other internals
in :mod:`._wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, Self

import psycopg
from psycopg import pq
from psycopg.abc import Transformer
from psycopg.rows import DictRow, TupleRow

from . import _deadline, _wire

__all__ = ["OWNER", "Batched", "PooledConnection", "batched"]

_IDLE = pq.TransactionStatus.IDLE

#: The key of a pool's connection options under which a new connection learns which pool asked for it.
OWNER = "_flask_idem_owner"


class _Owner(Protocol):
    def connect_failed(self) -> None: ...


class PooledConnection(psycopg.Connection[TupleRow]):
    """The connections of a :class:`._pool.ForkSafeConnectionPool`: psycopg connections with one cursor
    for the store (a new cursor's cache of parameter adapters starts empty; one cursor keeps it warm),
    that refuse ``commit()`` and ``rollback()`` inside the extension's transaction and tell their pool
    whether connecting worked.
    """

    _idem_store_cursor: psycopg.Cursor[DictRow] | None = None
    #: When the pool opened it (``time.monotonic()``), to tell stale connections from fresh ones.
    _idem_opened_at: float = 0.0
    #: Its deadline while it is lent out (:mod:`._deadline`).
    _idem_armed: _deadline.Armed | None = None
    #: Whether it talks to the server itself, not through a pooler (its server process can be probed).
    _idem_direct: bool = False
    #: The batched transaction open on it, if any (:meth:`ForkSafeConnectionPool.transaction`).
    _idem_batched: Batched | None = None
    #: What batches need of it: adapters, and the names of the statements they prepared on it.
    _idem_transformer: Transformer | None = None
    _idem_batch_names: set[bytes] | None = None

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        """Connect as psycopg does, telling the :class:`._pool.ForkSafeConnectionPool` that asked whether
        it worked."""
        owner: _Owner | None = kwargs.pop(OWNER, None)
        try:
            return super().connect(conninfo, **kwargs)
        except psycopg.OperationalError:
            if owner is not None:
                owner.connect_failed()
            raise

    def _deallocate(self, name: bytes | None) -> Any:
        """psycopg's hook for deallocating its prepared statements; ``None`` stands for all of them.

        psycopg sends ``DEALLOCATE ALL`` after a rollback (a savepoint's included) and after it saw
        ``DISCARD ALL`` or ``DEALLOCATE ALL`` go by: the statements batches prepared go with it, so the
        batches forget their names at that moment (:mod:`flask_idem._wire`).
        """
        if name is None and self._idem_batch_names:
            self._idem_batch_names.clear()
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
        if self._idem_batched is not None:
            # psycopg's own words inside a Transaction context, which this transaction stands for.
            raise psycopg.ProgrammingError(
                f"Explicit {action}() forbidden within a Transaction context: flask-idem commits the"
                " view's writes together with its key when the view returns, and rolls them back when it"
                " raises. Use a nested 'with conn.transaction():' block for a savepoint."
            )


def batched(conn: psycopg.Connection[Any]) -> Batched | None:
    """The batched transaction open on ``conn``, if it is one (:meth:`ForkSafeConnectionPool.transaction`)."""
    return conn._idem_batched if isinstance(conn, PooledConnection) else None


class Batched:
    """A transaction whose ``BEGIN`` travels with its first statement, and its ``COMMIT`` with its last.

    The store sends ``BEGIN`` with the reservation (:meth:`begin`) and defers the completion to ``COMMIT``
    (:meth:`defer`), in batches (:mod:`flask_idem._wire`); ``docs/transactions.rst`` ("Round trips") says
    what that keeps. Until :meth:`begin` the connection is out of autocommit, so that a statement sent
    first through psycopg opens the transaction itself and nothing runs outside it.
    """

    def __init__(self, conn: PooledConnection, *, prepare: bool) -> None:
        self.conn = conn
        self._prepare = prepare
        self._deferred: list[_wire.Item] = []
        #: What the key store keeps for the end of the transaction (the row it writes with COMMIT).
        self.pending: Any = None

    def __enter__(self) -> Batched:
        conn = self.conn
        if conn._idem_transformer is None:
            conn._idem_transformer = _wire.adapters(conn)
            conn._idem_batch_names = set()
        conn.autocommit = False
        conn._idem_batched = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        conn = self.conn
        try:
            if exc is None and self.begun:
                deferred, self._deferred = self._deferred, []
                conn._idem_batched = None
                if deferred:
                    self._run([*deferred, _wire.COMMIT], prepare=self._prepare)
                else:
                    conn.commit()  # psycopg's own COMMIT: a simple query
        finally:
            conn._idem_batched = None
            self._deferred.clear()
            self._end()

    @property
    def begun(self) -> bool:
        """Whether the transaction has begun on the server."""
        return self.conn.pgconn.transaction_status != _IDLE

    def begin(self, statement: _wire.Statement, params: Mapping[str, Any]) -> _wire.Result:
        """Send ``BEGIN`` and the transaction's first statement in one round trip; return its result."""
        return self.begin_all([(statement, params)])[0]

    def begin_all(self, statements: list[tuple[_wire.Statement, Mapping[str, Any]]]) -> list[_wire.Result]:
        """Send ``BEGIN`` and the transaction's first statements in one round trip; return their results.

        A prepared statement found deallocated (SQLSTATE 26000, after a ``DEALLOCATE ALL`` the batch did
        not see) is prepared again, and the batch sent once more: nothing had run.
        """
        if self.begun:
            raise RuntimeError("The batched transaction has begun already.")
        try:
            return self._run([_wire.BEGIN, *statements], prepare=self._prepare)[1:]
        except psycopg.errors.InvalidSqlStatementName:
            self._run([_wire.ROLLBACK], prepare=False)
            return self._run([_wire.BEGIN, *statements], prepare=self._prepare)[1:]

    def defer(self, statement: _wire.Statement, params: Mapping[str, Any]) -> None:
        """Run ``statement`` with ``COMMIT``, in its round trip, after every statement sent before it.

        Its result is not seen; should it fail, the transaction is rolled back and its error raised.
        """
        if not self.begun:
            raise RuntimeError("A statement can only be deferred to COMMIT once the transaction has begun.")
        self._deferred.append((statement, params))

    def _run(self, items: list[_wire.Item], *, prepare: bool) -> list[_wire.Result]:
        conn = self.conn
        assert conn._idem_transformer is not None
        prepared = conn._idem_batch_names if prepare else None
        return _wire.run(conn, items, transformer=conn._idem_transformer, prepared=prepared)

    def _end(self) -> None:
        """Leave the connection as the pool lends it: idle and in autocommit, or closed."""
        conn = self.conn
        if conn.closed or conn.broken:
            return
        try:
            if conn.pgconn.transaction_status != _IDLE:
                conn.rollback()  # through psycopg, which deallocates its prepared statements (and ours)
            conn.autocommit = True
        except psycopg.Error:
            conn.close()  # the pool discards it
