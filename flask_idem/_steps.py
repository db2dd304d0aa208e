"""Advancing a multi-step run: the steps after the intent, each guarded by the lease.

Used by every door once a run began or was taken over. Every transaction here is short and no connection
is held during a call step; what the finish step answers is made into a :class:`._records.Final` by the
door (:class:`Door`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.rows import TupleRow

from . import signals, tracing
from ._protocol import LeaseLost, Pending, release
from ._records import Final, Lease
from ._state import IdemState
from ._transactions import entering_app_code, in_transaction
from .flow import Flow, OutcomeUnknown, Run, Step

__all__ = ["Door", "advance"]

logger = logging.getLogger("flask_idem")

T = TypeVar("T")


class Door(Protocol[T]):
    """What a door of the protocol makes of a run's end, in the finish step's transaction."""

    def finish(self, call: Callable[[], Any]) -> Final[T]:
        """The final answer of the run: ``call`` calls its finisher (stored unless failed)."""
        ...

    def refused(self, error: Exception) -> Final[T] | None:
        """The final answer of a database step that raised ``error``, when the door takes it for an
        answer (a request's 4xx); ``None``: a failure, the step is rolled back and the error raised."""
        ...

    def failure(self, final: Final[T]) -> str:
        """What the key's row records as its last error when the finish step's answer ``final`` is a
        failure (a request's ``HTTP 500``)."""
        ...


class _Unknown(Exception):
    """A call step ended without a known outcome."""


def advance(
    state: IdemState, flow: Flow, run: Run, lease: Lease, door: Door[T], *, retry_in: float
) -> Final[T]:
    """Run the steps of ``run`` that have not finished, then its finish step; return its final answer.

    A failed answer (:attr:`._records.Final.failed`) was rolled back and the lease given up: a retry or
    the recovery job finishes the run.

    :param lease: the lease this worker holds on the run.
    :param door: makes the finisher's value (or a database step's refusal) the door's final answer.
    :param retry_in: when the outcome of a call stays unknown, seconds before the recovery job may try.
    :raises LeaseLost: the lease was lost to another attempt, which will finish the run.
    :raises Pending: a call step ended without a known outcome; the lease is given up.
    """
    source = state.source
    try:
        for step in flow.remaining(run.last_step):
            started = time.perf_counter()
            if step.outside:
                try:
                    with tracing.call_span(run, step.name):
                        result = _call_outside(step, run)
                except _Unknown as e:
                    _sent_unknown(run, step, e.__cause__)
                    raise
                duration = time.perf_counter() - started
                state.fire(step.name, None)
                in_transaction(source, partial(_record, state, lease, step.name, result))
                run.results[step.name] = result
            else:
                early = in_transaction(source, partial(_db_step, state, step, run, lease, door))
                if early is not None:
                    _stored(run, early)
                    return early
                duration = time.perf_counter() - started
            signals.send_for(
                signals.step_finished,
                run,
                flow=run.flow,
                step=step.name,
                outside=step.outside,
                duration=duration,
            )
            run.last_step = step.name
        final = in_transaction(source, partial(_finish, state, flow, run, lease, door))
    except LeaseLost:
        signals.send_for(signals.lease_lost, run, flow=run.flow)
        raise
    except _Unknown as e:
        release(state, lease, str(e), retry_in)
        raise Pending() from None
    except BaseException as e:
        release(state, lease, type(e).__name__, retry_in)
        raise
    if final.failed:  # rolled back: let a retry or the recovery job finish it
        release(state, lease, door.failure(final), retry_in)
    else:
        _stored(run, final)
    return final


def _stored(run: Run, final: Final[Any]) -> None:
    signals.send_for(signals.response_stored, run, flow=run.flow, status=final.status)


def _sent_unknown(run: Run, step: Step, cause: BaseException | None) -> None:
    """Signal an unknown outcome, telling :class:`.OutcomeUnknown` apart from any other exception."""
    signal = signals.outcome_unknown if isinstance(cause, OutcomeUnknown) else signals.call_failed
    signals.send_for(signal, run, flow=run.flow, step=step.name, exception=type(cause).__name__)


def _record(
    state: IdemState, lease: Lease, step: str, result: Any, conn: psycopg.Connection[TupleRow]
) -> None:
    """Record the result of a call step, if this worker still holds the lease."""
    if not state.store.record_step(conn, lease, step, result):
        raise LeaseLost()


def _db_step(
    state: IdemState,
    step: Step,
    run: Run,
    lease: Lease,
    door: Door[T],
    conn: psycopg.Connection[TupleRow],
) -> Final[T] | None:
    """One database step in the caller's transaction; an error the door takes for an answer ends the
    run with it (a request's 4xx)."""
    if not state.store.hold(conn, lease):
        raise LeaseLost()
    run._connection = conn
    entering_app_code()
    try:
        result = step.func(run)
    except Exception as e:
        final = door.refused(e)
        if final is None:
            raise
        _store_final(state, conn, lease, final)
        return final
    finally:
        run._connection = None
    _record(state, lease, step.name, result, conn)
    state.fire(step.name, conn)
    run.results[step.name] = result
    return None


def _finish(
    state: IdemState, flow: Flow, run: Run, lease: Lease, door: Door[T], conn: psycopg.Connection[TupleRow]
) -> Final[T]:
    if not state.store.hold(conn, lease):
        raise LeaseLost()
    finisher = flow.finisher
    assert finisher is not None
    run._connection = conn
    try:
        entering_app_code()
        final = door.finish(lambda: finisher(run))
    finally:
        run._connection = None
    if not final.failed:
        _store_final(state, conn, lease, final)
    state.fire("finish", conn)
    return final


def _store_final(
    state: IdemState, conn: psycopg.Connection[TupleRow], lease: Lease, final: Final[Any]
) -> None:
    """Complete the key with the run's final answer, if this worker still holds the lease."""
    if final.document is not None and not state.store.complete(conn, lease, final.document):
        raise LeaseLost()


def _call_outside(step: Step, run: Run) -> Any:
    """Run a call step (asking its resolver first when resuming); any failure means "outcome unknown"."""
    try:
        if run.resumed and step.resolve is not None:
            found = step.resolve(run)
            if found is not None:
                return found
        return step.func(run)
    except OutcomeUnknown as e:
        logger.warning("Outcome of step %r of %s unknown: %s", step.name, run.flow, e or "(no message)")
        raise _Unknown("OutcomeUnknown") from e
    except Exception as e:
        # Not the step saying "I cannot tell": most likely a bug in the step. The outcome is treated as
        # unknown all the same (the call may have happened), and the full traceback is logged.
        logger.error(
            "Step %r of %s failed with %s: %s. This is not OutcomeUnknown, so it may be a bug in the"
            " step; the outcome is treated as unknown and the request will be retried.",
            step.name,
            run.flow,
            type(e).__name__,
            e,
            exc_info=e,
        )
        raise _Unknown(f"{type(e).__name__} (error in step)") from e
