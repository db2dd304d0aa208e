"""The loop of a worker that runs passes until told to stop: the recovery job's and the outbox relay's.

One loop, so that both handle trouble the same way: a pass that handled ``limit`` items is followed by
the next at once, any other after ``interval`` seconds or when ``stop`` is set. A database error is
logged with its class and SQLSTATE, never its message (which may quote values), a missing grant with
the command that gives it, a :class:`~flask_idem.errors.ConfigurationError` with its message, any other
exception with its class only; the loop goes on after the pause, since a worker thread must not die
silently while its application serves. ``KeyboardInterrupt`` and ``SystemExit`` end it (the CLI turns
SIGINT and SIGTERM into ``stop``, so that the pass under way finishes first).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import psycopg

from . import _grants
from .errors import ConfigurationError

__all__ = ["run_passes"]

logger = logging.getLogger("flask_idem")

R = TypeVar("R")


def run_passes(
    one_pass: Callable[[], R],
    *,
    what: str,
    interval: float,
    limit: int,
    stop: threading.Event | None,
    on_pass: Callable[[R], None] | None,
    handled: Callable[[R], int],
    describe: Callable[[R], str],
) -> None:
    """Run ``one_pass`` until ``stop`` is set, as the module says.

    :param what: the job's name in the log ("Recovery", "Relay").
    :param handled: how many items a pass's report says it handled.
    :param describe: the report in words, for the ``INFO`` line ("Recovery: <describe>.").
    """
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            report = one_pass()
        except psycopg.Error as e:
            logger.warning("%s pass failed: %s (SQLSTATE %s).", what, type(e).__name__, e.sqlstate)
            _grants.report(e, f"a {what.lower()} pass", "the next pass tries again")
        except ConfigurationError as e:
            logger.error("%s pass skipped: %s", what, e)
        except Exception as e:  # the loop outlives one bad pass; the class only, as for a database error
            logger.error("%s pass failed unexpectedly: %s.", what, type(e).__name__)
        else:
            count = handled(report)
            if count:
                if on_pass is not None:
                    on_pass(report)
                logger.info("%s: %s.", what, describe(report))
            if count >= limit:
                continue
        stop.wait(interval)
