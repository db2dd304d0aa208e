"""SQLAlchemy sessions as the source of the extension's transactions (``Idempotency(sqlalchemy=db)``).

:class:`SessionSource` runs the key store's statements on the session's own connection, inside the
session's transaction, so that ``db.session``'s writes commit with the key; the engine must use psycopg 3
(``postgresql+psycopg://``), and its pool is the key store's. Inside that transaction
``db.session.commit()`` is refused with :class:`SessionCommitRefused` and ``rollback()`` fails the request
the same way; the session's connection is under the request's deadline, and a warning says once when the
engine's connections lack the timeouts that notice a silent database. :doc:`/sqlalchemy` says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import TupleRow
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from . import _deadline
from ._deadline import DeadlineExceeded
from .errors import ConfigurationError

if TYPE_CHECKING:
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

__all__ = ["SessionCommitRefused", "SessionSource", "conninfo_of"]

logger = logging.getLogger("flask_idem")

#: libpq parameters without which a silent database holds a request for minutes (``keepalives`` is on by
#: default in libpq; its idle time is the system's, two hours by default).
_SILENCE_OPTIONS = ("connect_timeout", "keepalives_idle", "tcp_user_timeout")

#: ``session.info`` keys: the root transaction the extension opened, and whether it is ending it itself.
_OPEN = "flask_idem.transaction"
_ENDING = "flask_idem.ending"


class SessionCommitRefused(RuntimeError):
    """Application code committed or rolled back the session inside an idempotent transaction.

    The view's writes, its key and its stored response are committed together by the extension when the
    view returns; a commit of the view's own would make its writes durable without the key (a crash after
    it and a retry make a duplicate), and a rollback would drop the key reservation with the writes.
    """


class SessionSource:
    """The transactions of a SQLAlchemy session, and the connections of its engine's pool.

    :param session: the ``scoped_session`` the application writes through (Flask-SQLAlchemy's
        ``db.session``); calling it gives the session of the current context.
    :param engine: the engine of that session's default bind: the key store's own statements (``init-db``,
        ``purge``, ``stuck``) borrow its connections.
    :param deadline: a request's database time in all (``IDEM_DATABASE_DEADLINE``), kept on the session's
        connection while the extension's transaction is open; ``None``: none.
    """

    def __init__(
        self, session: scoped_session[Any], engine: Engine, *, deadline: float | None = 10.0
    ) -> None:
        if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
            raise ConfigurationError(
                "flask-idem runs its statements on the session's own connection, so the engine must use"
                f" the psycopg 3 driver: use a 'postgresql+psycopg://' URL, not {engine.url.drivername!r}."
            )
        self._session: Callable[[], Session] = session
        self.engine = engine
        self.deadline = deadline
        self._options_checked = False
        for name, listener in (("before_commit", _refuse_commit), ("after_transaction_end", _refuse_end)):
            if not event.contains(session, name, listener):
                event.listen(session, name, listener)

    @classmethod
    def for_app(cls, app: Flask, sqlalchemy: SQLAlchemy | scoped_session[Any]) -> SessionSource:
        """The source for ``app``: Flask-SQLAlchemy's ``db`` (after ``db.init_app(app)``) or a
        ``scoped_session`` whose ``sessionmaker`` is bound to an engine."""
        if isinstance(sqlalchemy, scoped_session):
            bind = sqlalchemy.session_factory.kw.get("bind")
            if not isinstance(bind, Engine):
                raise ConfigurationError(
                    "Pass sqlalchemy= a scoped_session whose sessionmaker is bound to an engine"
                    " (sessionmaker(engine)), or the Flask-SQLAlchemy extension."
                )
            return cls(sqlalchemy, bind)
        if app.extensions.get("sqlalchemy") is not sqlalchemy:
            raise ConfigurationError(
                "Call db.init_app(app) before idem.init_app(app): flask-idem runs on the engine and the"
                " session of the Flask-SQLAlchemy extension passed as sqlalchemy=."
            )
        with app.app_context():
            engine = sqlalchemy.engine
        return cls(sqlalchemy.session, engine)

    @property
    def conninfo(self) -> str:
        """The engine's database as a libpq connection string (what ``IDEM_DATABASE_URL`` would be)."""
        return conninfo_of(self.engine)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[TupleRow]]:
        """A connection of the engine's pool, outside any session, returned to the pool afterwards."""
        with _driver_errors():
            raw = self.engine.raw_connection()
        try:
            conn: psycopg.Connection[TupleRow] = raw.driver_connection  # type: ignore[assignment]
            yield conn
        finally:
            raw.close()

    @contextmanager
    def transaction(self, *, batched: bool = False) -> Iterator[psycopg.Connection[TupleRow]]:
        """The session's transaction (begun now, or the one the request already began), committed with
        ``session.commit()`` when the block ends and rolled back when it raises.

        ``batched`` is ignored: SQLAlchemy sends the session's ``BEGIN`` and ``COMMIT`` itself.

        Anything the session did earlier in the request (an authentication hook's query, say) belongs
        to the same transaction and commits with it.
        """
        session = self._session()
        if _OPEN in session.info:
            raise RuntimeError("An idempotent transaction is already open on this session.")
        started = time.monotonic()
        limit = _deadline.seconds_left(self.deadline)
        if limit is not None and limit <= 0:
            raise DeadlineExceeded("The request's database time (IDEM_DATABASE_DEADLINE) is spent.")
        armed: _deadline.Armed | None = None
        with _driver_errors():
            try:
                dbapi = session.connection().connection
                raw: psycopg.Connection[TupleRow] = dbapi.driver_connection  # type: ignore[assignment]
                self._check_options(raw)
                if limit is not None:
                    armed = _deadline.arm(raw, limit, started=started, on_cut=_invalidated_by_sqlalchemy)
                root = session.info[_OPEN] = session.get_transaction()
                yield raw
                if session.get_transaction() is not root:  # application code caught the error and went on
                    raise SessionCommitRefused("The session's transaction ended inside the view.")
                session.info[_ENDING] = True
                session.commit()
            except BaseException as e:
                session.info[_ENDING] = True
                try:
                    session.rollback()
                except DBAPIError:  # a dead connection (now invalidated): the first error is the news
                    session.close()
                if armed is not None and armed.cut and _is_operational(e):
                    raise armed.error() from e
                raise
            finally:
                if armed is not None:
                    _deadline.disarm(armed)
                session.info.pop(_OPEN, None)
                session.info.pop(_ENDING, None)

    def _check_options(self, conn: psycopg.Connection[Any]) -> None:
        """Warn once if the engine's connections cannot notice a silent database within seconds."""
        if self._options_checked:
            return
        self._options_checked = True
        missing = [name for name in _SILENCE_OPTIONS if name not in conn.info.get_parameters()]
        if missing:
            logger.warning(
                "The SQLAlchemy engine's connections have no %s: a database that goes silent (a dead host,"
                " a hung pooler) holds requests until TCP gives up, for minutes. Pass"
                " connect_args=dict(flask_idem.DEFAULT_CONNECT_OPTIONS) to the engine"
                " (SQLALCHEMY_ENGINE_OPTIONS with Flask-SQLAlchemy).",
                ", ".join(missing),
            )

    def close(self) -> None:
        """Nothing to do: the engine and its pool belong to the application (Flask-SQLAlchemy)."""

    def connection_lost(self, conn: psycopg.Connection[Any]) -> None:
        """Nothing to do: the session's rollback met the dead connection, and SQLAlchemy's pool
        invalidated it then, with every connection opened before it."""


def _invalidated_by_sqlalchemy(conn: psycopg.Connection[Any]) -> None:
    """Nothing to do for a cut connection: SQLAlchemy invalidates it when the error reaches it."""


def _is_operational(error: BaseException) -> bool:
    if isinstance(error, DBAPIError):
        error = error.orig  # type: ignore[assignment]
    return isinstance(error, psycopg.OperationalError)


def conninfo_of(engine: Engine) -> str:
    """The libpq connection string of ``engine``'s URL, password included (never display it)."""
    url = engine.url
    params: dict[str, Any] = url.translate_connect_args(username="user", database="dbname")
    params.update(url.query)
    return make_conninfo("", **params)


@contextmanager
def _driver_errors() -> Iterator[None]:
    """SQLAlchemy's wrapper of a psycopg error is replaced by the psycopg error itself.

    The extension translates driver errors into HTTP errors at one boundary (503 for a database that
    cannot be reached, 500 otherwise), which knows psycopg's classes.
    """
    try:
        yield
    except DBAPIError as e:
        if isinstance(e.orig, psycopg.Error):
            # SQLAlchemy raised ``e`` from ``e.orig``: cut that link, or the chain of causes is a cycle.
            e.__cause__ = None
            raise e.orig from e
        raise


def _refuse_commit(session: Session) -> None:
    """``before_commit``: refuse a commit of the root transaction the extension opened."""
    if _OPEN in session.info and not session.info.get(_ENDING) and not session.in_nested_transaction():
        raise SessionCommitRefused(
            "db.session.commit() inside an @idem.idempotent() view or a flow step: the view's writes,"
            " its idempotency key and its stored response are committed together when it returns."
            " Remove the commit; use db.session.flush() where you need generated ids, and"
            " db.session.begin_nested() for a savepoint."
        )


def _refuse_end(session: Session, transaction: SessionTransaction) -> None:
    """``after_transaction_end``: the root transaction the extension opened ended without it."""
    if session.info.get(_OPEN) is transaction and not session.info.get(_ENDING):
        session.info[_ENDING] = True  # the transaction is gone: nothing is left to commit
        raise SessionCommitRefused(
            "db.session.rollback() (or close()) inside an @idem.idempotent() view or a flow step undid"
            " the idempotency key's reservation with the view's writes; the request failed. To fail a"
            " request, raise an exception or abort(); to undo part of the work, use"
            " db.session.begin_nested()."
        )
