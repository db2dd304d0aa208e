"""Finishing multi-step requests that were stranded by a crash, and giving up on them in time
(:doc:`/recovery`).

:func:`recover` claims the rows whose lease expired (``FOR UPDATE SKIP LOCKED``, a new lease, COMMIT: no
row lock is held while it works) and resumes each after its last finished step; one older than
``IDEM_RECOVERY_DEADLINE`` is given up and flagged for a person. Recovery is a door of its own and opens
no request context: a run is finished in the application context with what its row recorded, its answer
made a stored response as a request's is (:class:`._http.ResponseDoor`), a client error its finish step
raises rendered by the application's own error handlers. Signals name the route the row's method and
path match.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from flask import Flask, current_app
from psycopg.rows import TupleRow
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RoutingException

from . import _protocol, _steps, signals, tracing
from ._http import ResponseDoor
from ._loop import run_passes
from ._protocol import LeaseLost, Pending, give_up_leased
from ._records import Lease, Stranded
from ._replay import failure_document
from ._retry import backoff as backoff
from ._state import IdemState, get_state
from ._task import TaskDoor, task_failure
from ._transactions import in_transaction
from .flow import run_from_record

__all__ = ["RecoveryReport", "backoff", "recover", "run_forever"]

logger = logging.getLogger("flask_idem")

T = TypeVar("T")


@dataclass
class RecoveryReport:
    """What one :func:`recover` pass did, by outcome. Each entry is ``(org_id, key, detail)``."""

    completed: list[tuple[int, uuid.UUID, str]] = field(default_factory=list)
    pending: list[tuple[int, uuid.UUID, str]] = field(default_factory=list)
    failed: list[tuple[int, uuid.UUID, str]] = field(default_factory=list)
    lost: list[tuple[int, uuid.UUID, str]] = field(default_factory=list)

    @property
    def claimed(self) -> int:
        """How many stranded requests this pass claimed."""
        return len(self.completed) + len(self.pending) + len(self.failed) + len(self.lost)


def recover(app: Flask, *, limit: int = 100, rng: random.Random | None = None) -> RecoveryReport:
    """Claim and finish up to ``limit`` stranded multi-step requests of ``app``, one at a time.

    Each request is claimed just before it is worked on, so no lease runs out while earlier ones are
    finished, and only if this application knows its flow. Safe to run in several processes at once.

    :raises ConfigurationError: when the key table is missing or in a layout this code cannot run on.
    """
    state = get_state(app)
    settings = state.settings
    rng = rng or random.Random()
    # The longest lease of any flow: a claimed request must not lapse in the middle of a slow call.
    lease = max(_protocol.lease_seconds(settings, flow) for flow in (None, *state.flows.values()))
    report, flows, deadline = RecoveryReport(), list(state.flows), settings.recovery_deadline
    with app.app_context():
        _reachable(state, state.check_layout)
        for _ in range(limit):
            token = uuid.uuid4()

            def claim(conn: psycopg.Connection[TupleRow], token: uuid.UUID = token) -> list[Stranded]:
                return state.store.claim_stranded(
                    conn, token=token, lease=lease, limit=1, deadline=deadline, flows=flows
                )

            claimed = _reachable(state, lambda: in_transaction(state.source, claim))
            if not claimed:
                break
            row = claimed[0]
            with (
                signals.serving(_endpoint(app, row)),
                tracing.recovery_span(row.flow, row.org_id, row.key, row.attempts),
            ):
                _recover_one(state, row, Lease(row.org_id, row.key, token, lease), report, rng)
    return report


def _reachable(state: IdemState, call: Callable[[], T]) -> T:
    """``call``'s answer; a database error it raises ends the pass, announced as
    :data:`.signals.store_unavailable` when the key table is out of reach."""
    try:
        return call()
    except psycopg.Error as e:
        _protocol.unavailable(state, e, None, None)
        raise


def _recover_one(
    state: IdemState, row: Stranded, lease: Lease, report: RecoveryReport, rng: random.Random
) -> None:
    settings = state.settings
    entry = (row.org_id, row.key)
    flow = state.flows[row.flow]
    if row.overdue:
        reason = "recovery deadline passed"
        _give_up(state, row, lease, reason)
        report.failed.append((*entry, reason))
        return
    run = run_from_record(flow, org_id=row.org_id, key=row.key, step=row.step, state=row.state)
    retry_in = backoff(
        row.attempts, base=settings.recovery_backoff, cap=settings.recovery_backoff_cap, rng=rng
    )
    door: _steps.Door[Any] = (
        ResponseDoor(settings, handle=_handled_by_app) if row.task is None else TaskDoor()
    )
    try:
        final = _steps.advance(state, flow, run, lease, door, retry_in=retry_in)
    except Pending:
        report.pending.append((*entry, f"outcome unknown; next try within {retry_in:.1f} s"))
    except LeaseLost:
        report.lost.append((*entry, "taken over by another attempt"))
    except Exception as e:  # one bad row must not stop the pass
        if isinstance(e, psycopg.Error):
            _protocol.unavailable(state, e, row.org_id, row.key)
        logger.error("Recovery of a %s request failed: %s.", row.flow, type(e).__name__)
        report.pending.append((*entry, f"{type(e).__name__}; will be retried"))
    else:
        if final.failed:  # rolled back and released by the engine: still to be done
            report.pending.append((*entry, f"finish step answered {final.status}; will be retried"))
        else:
            report.completed.append((*entry, f"answered {final.status}"))
            signals.send_for(
                signals.recovered, row, flow=row.flow, status=final.status, attempts=row.attempts
            )


def _endpoint(app: Flask, row: Stranded) -> str | None:
    """The route a stranded request's method and path match, which its signals name; ``None`` for a
    task's row, or when no route matches any more."""
    if row.method is None or row.path is None or row.task is not None:
        return None
    try:
        endpoint, _ = app.url_map.bind("").match(row.path, method=row.method)
    except (HTTPException, RoutingException):
        return None
    return str(endpoint)


def _handled_by_app(error: HTTPException) -> Any:
    """A client error a finish step raised, as the application's own error handlers answer it (those
    registered on the application, by status first, then by class), else as the exception itself does.

    The recovery job has no request: a blueprint's handlers (found by a request's blueprints) are not
    asked, and a handler must not read ``request``.
    """
    handlers = current_app.error_handler_spec[None]
    for code in (error.code, None):
        found = handlers.get(code)
        if not found:
            continue
        for cls in type(error).__mro__:
            handler = found.get(cls)
            if handler is not None:
                return current_app.ensure_sync(handler)(error)
    return error.get_response()


def _give_up(state: IdemState, row: Stranded, lease: Lease, reason: str) -> None:
    """Mark the request failed, store the answer a retry will get, and flag it for a person."""
    give_up_leased(state, lease, failure_document() if row.task is None else task_failure(reason), reason)
    # Sent (and logged at ERROR) once the row is marked: a person is needed.
    signals.send_for(signals.given_up, row, flow=row.flow, reason=reason, attempts=row.attempts)


def run_forever(
    app: Flask,
    *,
    interval: float,
    limit: int = 100,
    stop: threading.Event | None = None,
    on_pass: Callable[[RecoveryReport], None] | None = None,
) -> None:
    """Run :func:`recover` until ``stop`` is set (a worker process): a pass every ``interval`` seconds, or
    at once after a pass that claimed ``limit`` requests (more are waiting).

    A pass that fails is logged and the loop goes on; ``KeyboardInterrupt`` ends it.

    :param on_pass: called with the report of every pass that claimed something.
    """
    rng = random.Random()
    run_passes(
        lambda: recover(app, limit=limit, rng=rng),
        what="Recovery",
        interval=interval,
        limit=limit,
        stop=stop,
        on_pass=on_pass,
        handled=lambda report: report.claimed,
        describe=lambda report: (
            f"{len(report.completed)} completed, {len(report.pending)} pending,"
            f" {len(report.failed)} failed, {len(report.lost)} lost"
        ),
    )
