"""The extension's transactions: application code run inside one, committed unless it failed.

Shared by the key protocol (:mod:`._protocol`), the multi-step engine (:mod:`._steps`) and every door. It
knows no door: whether the work failed (and is rolled back) is what the work answers, a failed
:class:`._records.Final`, never a response.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import pq
from psycopg.rows import TupleRow

from ._pool import ConnectionSource
from ._records import Final
from .errors import DatabaseFailed

__all__ = ["CommitOutcomeUnknown", "entering_app_code", "in_transaction"]

logger = logging.getLogger("flask_idem")

T = TypeVar("T")


@dataclass
class _Progress:
    """How far the transaction of :func:`in_transaction` got: what a retry would repeat."""

    app_code_ran: bool = False
    committing: bool = False


_progress: ContextVar[_Progress | None] = ContextVar("flask_idem_progress", default=None)


def entering_app_code() -> None:
    """Note that application code runs now in the current transaction: from here on it is not retried."""
    progress = _progress.get()
    if progress is not None:
        progress.app_code_ran = True


_INERROR = pq.TransactionStatus.INERROR


class _Discard(Exception):
    """Ends a transaction with a ROLLBACK and carries the result out of it (a failed Final)."""

    def __init__(self, result: Any) -> None:
        self.result = result


def in_transaction(
    source: ConnectionSource, body: Callable[[psycopg.Connection[TupleRow]], T], *, batched: bool = False
) -> T:
    """Run ``body`` in one transaction of ``source`` and commit, unless it fails.

    With ``batched``, ``body``'s first statement (one of the key store's) is sent with ``BEGIN``, and
    what it defers with ``COMMIT``, where the source can (:class:`._pool.Batched`).

    Rolled back instead when ``body`` raises, returns a failed :class:`._records.Final`, or swallowed a
    database error (whatever success it reports is then false: :class:`.DatabaseFailed`). The result is
    returned only after COMMIT succeeded. A connection found dead before any application code ran
    (:func:`entering_app_code`) is replaced and the transaction run once more: nothing it sent could
    have taken effect. After that, or when COMMIT itself fails, the error propagates.
    """
    for attempt in range(2):
        progress = _Progress()
        token = _progress.set(progress)
        conn: psycopg.Connection[TupleRow] | None = None
        try:
            with source.transaction(batched=batched) as conn:
                result = body(conn)
                if conn.pgconn.transaction_status == _INERROR:  # conn.info makes an object per use
                    logger.error(
                        "Application code went on after a database error inside its transaction;"
                        " the transaction was rolled back."
                    )
                    raise DatabaseFailed()
                if isinstance(result, Final) and result.failed:
                    raise _Discard(result)
                progress.committing = True
            return result
        except _Discard as discarded:
            kept: T = discarded.result
            return kept
        except psycopg.OperationalError:
            if (
                attempt
                or conn is None  # no connection to be had (PoolTimeout): retrying would wait again
                or not (conn.closed or conn.broken)
                or progress.app_code_ran
                or progress.committing
            ):
                raise
            source.connection_lost(conn)
            logger.info("A pooled connection was dead before any work was done; running again.")
        except psycopg.Error as e:
            # A COMMIT that failed without a definite answer (not a deferred constraint): the transaction
            # may have committed or not, as when the connection drops during COMMIT. Citus reports a
            # node lost while committing as SQLSTATE XX000. A retry with the same key settles it.
            if progress.committing and not (e.sqlstate or "").startswith("23"):
                raise CommitOutcomeUnknown(f"COMMIT failed with SQLSTATE {e.sqlstate}") from e
            raise
        finally:
            _progress.reset(token)
    raise AssertionError("unreachable: the second attempt returns or raises")


class CommitOutcomeUnknown(psycopg.OperationalError):
    """COMMIT failed without saying that the transaction was rolled back: answered 503, to be retried."""
