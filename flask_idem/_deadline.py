"""Deadlines on the database, kept by the client's own clock: a connection lent too long is cut
(:doc:`/timeouts`).

Keepalives notice a dead host, not a hung server process or pooler whose kernel still acknowledges:
only a deadline on the client's own waits does, as JDBC's socket timeout. Every connection the extension
lends is *armed* while lent (:func:`arm`, :func:`disarm`); one watchdog thread per process shuts down
the socket of one whose deadline passed (``shutdown(2)`` on a duplicate of its descriptor taken when it
was armed, so a descriptor number reused by then is never touched), and the pool discards it. A request
shares one deadline among all its waits, not counting time it holds no connection
(:class:`RequestDeadline`); :func:`budget` gives a block another allowance.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

import psycopg

__all__ = ["Armed", "DeadlineExceeded", "RequestDeadline", "arm", "budget", "cut", "disarm", "seconds_left"]

logger = logging.getLogger("flask_idem")


class DeadlineExceeded(psycopg.OperationalError):
    """A request's database time ran out (``IDEM_DATABASE_DEADLINE``): its connection was cut, or none
    was asked for. Answered 503 with ``Retry-After``; when COMMIT had been sent, its outcome is unknown
    and a retry with the same key settles it."""


class Armed:
    """A connection lent out under a deadline."""

    __slots__ = ("conn", "cut", "deadline", "fd", "on_cut", "seconds", "started", "why")

    def __init__(
        self, conn: psycopg.Connection[Any], seconds: float, started: float, on_cut: Callable[[Any], None]
    ) -> None:
        self.conn = conn
        self.seconds = seconds
        self.started = started
        self.deadline = started + seconds
        self.on_cut = on_cut
        #: A duplicate of the connection's socket, for the watchdog's shutdown; closed by :func:`disarm`.
        self.fd = os.dup(conn.fileno())
        #: Whether it was cut, and why.
        self.cut = False
        self.why = ""

    def error(self) -> DeadlineExceeded:
        """The error of a request whose connection was cut."""
        return DeadlineExceeded(f"The database connection was cut: {self.why}.")


class _Watchdog:
    """The thread that cuts connections whose deadline passed; one per process, started on first use."""

    def __init__(self) -> None:
        self._init()
        os.register_at_fork(after_in_child=self._init)  # the thread and the lock's state do not survive fork

    def _init(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._armed: set[Armed] = set()
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    def add(self, armed: Armed) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flask-idem-deadlines", daemon=True)
                self._thread.start()
            self._armed.add(armed)
            if armed.deadline < self._wake_at:
                self._wake_at = armed.deadline
                self._changed.notify()

    def remove(self, armed: Armed) -> None:
        with self._lock:
            self._armed.discard(armed)

    def cut_now(self, armed: Armed, why: str) -> bool:
        """Cut ``armed`` at once, if it is still lent; return whether it was."""
        with self._lock:
            if armed not in self._armed:
                return False
            self._cut(armed, why)
        _cut_done(armed)
        return True

    def _cut(self, armed: Armed, why: str) -> None:
        """Under the lock, so that :func:`disarm` cannot close the descriptor meanwhile."""
        self._armed.discard(armed)
        armed.cut, armed.why = True, why
        _shutdown(armed.fd)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    now = time.monotonic()
                    due = [armed for armed in self._armed if armed.deadline <= now]
                    if due:
                        break
                    self._wake_at = min((armed.deadline for armed in self._armed), default=math.inf)
                    self._changed.wait(None if self._wake_at == math.inf else self._wake_at - now)
                for armed in due:
                    self._cut(armed, f"no answer within its deadline of {armed.seconds:.1f} s")
            for armed in due:
                _cut_done(armed)


def _cut_done(armed: Armed) -> None:
    logger.warning(
        "A database connection was cut (%s); the request waiting on it is answered 503.", armed.why
    )
    try:
        armed.on_cut(armed.conn)
    except Exception:  # the watchdog must survive whatever a callback does
        logger.exception("Error in the callback of a cut connection.")


def _shutdown(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer, or not connected any more
        pass
    finally:
        sock.detach()  # the descriptor stays Armed's, closed by disarm()


_watchdog = _Watchdog()


def arm(
    conn: psycopg.Connection[Any], seconds: float, *, started: float, on_cut: Callable[[Any], None]
) -> Armed:
    """Put ``conn`` under a deadline ``seconds`` after ``started`` (``time.monotonic()``).

    :param on_cut: called with ``conn`` from the watchdog's thread once it was cut.
    """
    armed = Armed(conn, seconds, started, on_cut)
    _watchdog.add(armed)
    return armed


def cut(armed: Armed, why: str) -> bool:
    """Cut a lent connection now, before its deadline (``why`` goes in the log); return whether it was
    still lent."""
    return _watchdog.cut_now(armed, why)


def disarm(armed: Armed) -> bool:
    """Take the connection out from under its deadline, charge its time to the request's budget, and
    return whether it was cut."""
    _watchdog.remove(armed)
    os.close(armed.fd)
    spend(time.monotonic() - armed.started)
    return armed.cut


@dataclass
class _Budget:
    remaining: float


_budget: ContextVar[_Budget | None] = ContextVar("flask_idem_database_budget", default=None)


class RequestDeadline:
    """WSGI middleware that gives each request its database time (``IDEM_DATABASE_DEADLINE``): every
    connection the request borrows, in a ``before_request`` function as in the view, draws from it.

    ``init_app`` wraps the application's ``wsgi_app`` with it, as Flask's documentation wraps
    middleware; it costs one context variable set and reset per request.
    """

    __slots__ = ("seconds", "wsgi_app")

    def __init__(self, wsgi_app: Callable[..., Any], seconds: float) -> None:
        self.wsgi_app = wsgi_app
        self.seconds = seconds

    def __call__(self, environ: Any, start_response: Any) -> Any:
        token = _budget.set(_Budget(self.seconds))
        try:
            return self.wsgi_app(environ, start_response)
        finally:
            _budget.reset(token)


class budget:  # noqa: N801  # a context manager, named as one; a class, as it may run on every request
    """Give the code in the ``with`` block ``seconds`` of database time in all; ``None``: no budget
    (each connection it borrows gets the pool's own deadline).

    Inside another budget (a request's, :class:`RequestDeadline`), a budget gets what is left of the
    outer one when that is less (``math.inf``, no deadline at all, excepted), and what it spends is
    charged to the outer one.
    """

    __slots__ = ("_mine", "_outer", "_seconds", "_start", "_token")

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._token: Token[_Budget | None] | None = None

    def __enter__(self) -> None:
        seconds = self._seconds
        if seconds is None:
            return
        outer = _budget.get()
        if outer is not None and seconds != math.inf:
            seconds = min(seconds, outer.remaining)
        self._outer, self._start = outer, seconds
        self._mine = _Budget(seconds)
        self._token = _budget.set(self._mine)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _budget.reset(self._token)
            self._token = None
            if self._outer is not None and self._start != math.inf:
                self._outer.remaining -= self._start - self._mine.remaining


def seconds_left(default: float | None) -> float | None:
    """The database time left to the current request or :func:`budget`, or ``default`` outside both."""
    current = _budget.get()
    return default if current is None else current.remaining


def spend(seconds: float) -> None:
    """Charge ``seconds`` of database time to the current request's or budget's, if there is one."""
    current = _budget.get()
    if current is not None:
        current.remaining -= seconds
