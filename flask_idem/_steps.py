"""Advancing a multi-step request: the steps after the intent, each guarded by the lease.

Used by the view (right after the intent is recorded, or when a retry takes a request over) and by the
recovery job. Every transaction here is short and no connection is held during a call step.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from functools import partial
from typing import Any

import psycopg
from flask import Response, current_app
from psycopg.rows import TupleRow
from werkzeug.exceptions import HTTPException

from . import signals, tracing
from ._records import Lease
from ._replay import record_response
from ._state import IdemState
from ._transactions import entering_app_code, in_transaction, render
from .errors import KeyInUse, OutcomePending, ResponseNotStored
from .flow import Flow, OutcomeUnknown, Run, Step

__all__ = ["advance", "sent_stored"]

logger = logging.getLogger("flask_idem")

#: The detail of the 500 when a flow's answer is over ``IDEM_MAX_RESPONSE_BYTES``: unlike an atomic
#: request's, the earlier steps stand (an outside call may have been made) and the request stays open.
_FLOW_NOT_STORED = (
    "This request was started and its earlier steps were carried out (a call to another service may have"
    " been made), but its answer is larger than the server keeps for retries, so the last step was undone"
    " and the request is not finished. Do not send it again under a new Idempotency-Key: that would carry"
    " the operation out a second time. A retry with the same key does not repeat the finished steps, but"
    " meets the same server-side limit until the server is changed; until then the server keeps trying to"
    " finish it, and after its recovery deadline marks it failed for a person to look at."
)


class _LeaseLost(Exception):
    """Another attempt or the recovery job took the request over; this worker must stop."""


class _Unknown(Exception):
    """A call step ended without a known outcome."""


def advance(
    state: IdemState,
    flow: Flow,
    run: Run,
    lease: Lease,
    *,
    retry_in: float,
    request: Mapping[str, Any] | None = None,
) -> Response:
    """Run the steps of ``run`` that have not finished, then its finish step; return the response.

    :param lease: the lease this worker holds on the request.
    :param retry_in: when the outcome of a call stays unknown, seconds before the recovery job may try.
    :param request: what the route's fingerprint policy keeps of the request (its part digests), stored
        with the answer; ``None`` for the default policy and for the recovery job, which has no request.
    :raises KeyInUse: the lease was lost to another attempt, which will finish the request.
    :raises OutcomePending: a call step ended without a known outcome; the lease is given up.
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
                early = in_transaction(source, partial(_db_step, state, step, run, lease, request))
                if early is not None:
                    sent_stored(run.org_id, run.key, run.flow, early)
                    return early
                duration = time.perf_counter() - started
            signals.send(
                signals.step_finished,
                org_id=run.org_id,
                key=run.key,
                flow=run.flow,
                step=step.name,
                outside=step.outside,
                duration=duration,
            )
            run.last_step = step.name
        response = in_transaction(source, partial(_finish, state, flow, run, lease, request))
    except _LeaseLost:
        signals.send(signals.lease_lost, org_id=run.org_id, key=run.key, flow=run.flow)
        raise KeyInUse(retry_after=state.settings.retry_after) from None
    except _Unknown as e:
        _release(state, lease, str(e), retry_in)
        raise OutcomePending(retry_after=state.settings.retry_after) from None
    except BaseException as e:
        _release(state, lease, type(e).__name__, retry_in)
        raise
    if response.status_code >= 500:  # rolled back: let a retry or the recovery job finish it
        _release(state, lease, f"HTTP {response.status_code}", retry_in)
    else:
        sent_stored(run.org_id, run.key, run.flow, response)
    return response


def sent_stored(org_id: int, key: uuid.UUID, flow: str | None, response: Response) -> None:
    """Send :data:`.signals.response_stored` for a response committed just now."""
    signals.send(signals.response_stored, org_id=org_id, key=key, flow=flow, status=response.status_code)


def _sent_unknown(run: Run, step: Step, cause: BaseException | None) -> None:
    """Signal an unknown outcome, telling :class:`.OutcomeUnknown` apart from any other exception."""
    signal = signals.outcome_unknown if isinstance(cause, OutcomeUnknown) else signals.call_failed
    signals.send(
        signal,
        org_id=run.org_id,
        key=run.key,
        flow=run.flow,
        step=step.name,
        exception=type(cause).__name__,
    )


def _record(
    state: IdemState, lease: Lease, step: str, result: Any, conn: psycopg.Connection[TupleRow]
) -> None:
    """Record the result of a call step, if this worker still holds the lease."""
    if not state.store.record_step(conn, lease, step, result):
        raise _LeaseLost()


def _db_step(
    state: IdemState,
    step: Step,
    run: Run,
    lease: Lease,
    request: Mapping[str, Any] | None,
    conn: psycopg.Connection[TupleRow],
) -> Response | None:
    """One database step in the caller's transaction; a 4xx it raises ends the request with that answer."""
    if not state.store.hold(conn, lease):
        raise _LeaseLost()
    run._connection = conn
    entering_app_code()
    try:
        result = step.func(run)
    except HTTPException as e:
        if e.code is None or e.code >= 500:
            raise
        response = current_app.make_response(current_app.handle_user_exception(e))
        _store_final(state, conn, lease, response, request)
        return response
    finally:
        run._connection = None
    if not state.store.record_step(conn, lease, step.name, result):
        raise _LeaseLost()
    state.fire(step.name, conn)
    run.results[step.name] = result
    return None


def _finish(
    state: IdemState,
    flow: Flow,
    run: Run,
    lease: Lease,
    request: Mapping[str, Any] | None,
    conn: psycopg.Connection[TupleRow],
) -> Response:
    if not state.store.hold(conn, lease):
        raise _LeaseLost()
    assert flow.finisher is not None
    finisher = flow.finisher
    run._connection = conn
    try:
        response: Response = current_app.make_response(render(lambda: finisher(run)))
    finally:
        run._connection = None
    if response.status_code < 500:
        _store_final(state, conn, lease, response, request)
    state.fire("finish", conn)
    return response


def _store_final(
    state: IdemState,
    conn: psycopg.Connection[TupleRow],
    lease: Lease,
    response: Response,
    request: Mapping[str, Any] | None,
) -> None:
    """Store the flow's answer and complete the key, or refuse an answer over the size limit (its step
    is rolled back; the steps before it stand)."""
    settings = state.settings
    try:
        document = record_response(
            response, settings.replay_headers, max_bytes=settings.max_response_bytes, request=request
        )
    except ResponseNotStored as e:
        logger.warning(
            "That answer is a multi-step request's: only its last step was rolled back; the steps before"
            " it stand, and the request stays in progress until the limit or the answer changes or its"
            " recovery deadline passes."
        )
        raise ResponseNotStored(_FLOW_NOT_STORED) from e
    if not state.store.complete(conn, lease, document):
        raise _LeaseLost()


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


def _release(state: IdemState, lease: Lease, error: str, retry_in: float) -> None:
    """Give the lease up so a retry can take over at once; best effort (the lease expires anyway)."""
    try:
        in_transaction(
            state.source, lambda conn: state.store.release(conn, lease, error=error, retry_in=retry_in)
        )
    except psycopg.Error as e:
        logger.warning("Could not release a lease: %s (SQLSTATE %s).", type(e).__name__, e.sqlstate)
