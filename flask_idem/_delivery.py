"""Running one delivery of an idempotent task, whatever the runner: reserve, run, store, or put off.

The runner (through :meth:`flask_idem.jobs.Jobs.deliver`) hands over a delivery and gets an outcome
back: :class:`Done` (return the result), :class:`Defer` (deliver it again in ``countdown`` seconds, with
the envelope it gives), :class:`Dropped` (end quietly), or a :class:`~flask_idem.jobs.JobError` that
ends the task for good. An atomic task's writes commit with its key; a task with a
:class:`~flask_idem.Flow` is advanced step by step (:mod:`._steps`), as a request's is.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from flask import Flask
from psycopg.rows import TupleRow

from . import _grants, _protocol, _steps, signals
from ._jobs_state import TaskSpec, get_jobs
from ._records import Final, Lease
from ._retry import backoff
from ._state import IdemState, get_state
from ._task import (
    Envelope,
    Job,
    JobGivenUp,
    JobMismatch,
    JobPolicy,
    TaskDoor,
    task_failure,
    task_final,
    task_fingerprint,
    task_request,
    task_result,
)
from ._transactions import entering_app_code
from .flow import Flow, Run

__all__ = ["Defer", "Delivery", "Done", "Dropped", "Outcome", "run_delivery"]

logger = logging.getLogger("flask_idem")


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a task's message: who, which key, what arguments, how many failures and
    deferrals before (the counts of its :class:`~flask_idem.jobs.Envelope`)."""

    org_id: int
    key: uuid.UUID
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    enqueued_at: float
    failures: int = 0
    deferrals: int = 0

    @classmethod
    def of(cls, envelope: Envelope, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Delivery:
        """The delivery of a message that carries ``envelope`` and these arguments."""
        return cls(
            envelope.org_id,
            envelope.key,
            tuple(args),
            kwargs,
            envelope.enqueued_at,
            envelope.failures,
            envelope.deferrals,
        )

    @property
    def envelope(self) -> Envelope:
        """The envelope this delivery's message carried."""
        return Envelope(self.org_id, self.key, self.enqueued_at, self.failures, self.deferrals)


@dataclass(frozen=True, slots=True)
class Done:
    """The task's work is committed: ``result`` is what it returned (``replayed``: by an earlier delivery)."""

    result: Any
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Defer:
    """Deliver the message again in ``countdown`` seconds, carrying ``envelope`` (one failure more when
    this attempt ``failed``, one deferral more when another delivery held the key)."""

    countdown: float
    reason: str
    failed: bool
    envelope: Envelope


@dataclass(frozen=True, slots=True)
class Dropped:
    """Nothing to do for this delivery, for ``reason``; the task is not run."""

    reason: str


Outcome = Done | Defer | Dropped


def run_delivery(app: Flask, spec: TaskSpec, delivery: Delivery, *, rng: random.Random) -> Outcome:
    """Run one delivery of ``spec`` in ``app``; see the module's docstring for the outcomes.

    :raises JobMismatch: the key was used with other arguments.
    :raises JobGivenUp: the task is past its policy, now or before; its key row is flagged.
    """
    with app.app_context(), signals.running_task(spec.name):
        state = get_state(app)
        run = _Delivery(state, spec, delivery, spec.policy or get_jobs(app).policy, rng)
        try:
            state.check_layout()  # once per process: the key table exists in a layout this code runs on
            return run.once()
        except psycopg.Error as e:
            return run.unreachable(e)


class _Delivery:
    def __init__(
        self, state: IdemState, spec: TaskSpec, delivery: Delivery, policy: JobPolicy, rng: random.Random
    ) -> None:
        self.state, self.spec, self.delivery, self.policy, self.rng = state, spec, delivery, policy, rng
        sha = task_fingerprint(spec.name, delivery.args, delivery.kwargs)
        self.keyed = task_request(delivery.org_id, delivery.key, spec.name, sha)
        self.claim = _protocol.Claim(
            self.keyed, state.settings.key_ttl if spec.ttl is None else spec.ttl, reported=_reported
        )
        self.overdue = time.time() - delivery.enqueued_at > policy.deadline
        self.door = TaskDoor()

    # -- outcomes ------------------------------------------------------------------------------------------

    def unreachable(self, error: psycopg.Error) -> Outcome:
        """The key table could not be reached: this attempt failed."""
        _protocol.unavailable(self.state, error, self.keyed.org_id, self.keyed.key)
        logger.warning(
            "Task %s could not reach the key table: %s (SQLSTATE %s).",
            self.spec.name,
            type(error).__name__,
            error.sqlstate,
        )
        _grants.report(
            error,
            f"task {self.spec.name}",
            "the task is delivered again later",
            key_table=self.state.settings.table,
        )
        return self.failed(f"{type(error).__name__} (database)")

    def failed(self, reason: str) -> Outcome:
        """This attempt failed: deliver again after the backoff, or give up past the policy."""
        failures = self.delivery.failures + 1
        if failures >= self.policy.attempts or self.overdue:
            return self.give_up(f"{reason}; gave up after {failures} failed attempt(s)")
        return self._deferred(reason, failures, replace(self.delivery.envelope, failures=failures))

    def busy(self, reason: str) -> Outcome:
        """Another delivery holds the key: try again later, after a longer backoff each time, until the
        deadline (:meth:`once`)."""
        deferrals = self.delivery.deferrals + 1
        return self._deferred(reason, deferrals, replace(self.delivery.envelope, deferrals=deferrals))

    def _deferred(self, reason: str, count: int, envelope: Envelope) -> Defer:
        """Deliver again after the backoff of the ``count``-th failure or deferral, carrying ``envelope``."""
        countdown = backoff(count, base=self.policy.backoff, cap=self.policy.backoff_cap, rng=self.rng)
        keyed, failures = self.keyed, envelope.failures
        signals.send_for(
            signals.job_deferred, keyed, reason=reason, countdown=round(countdown, 3), failures=failures
        )
        return Defer(countdown, reason, failures > self.delivery.failures, envelope)

    def give_up(self, reason: str) -> Outcome:
        """Mark the key failed and flagged for a person, and raise :class:`JobGivenUp`.

        The key is reserved and marked in one transaction, or its stranded run taken over and marked
        (:func:`._protocol.give_up`). When another delivery holds or finished the key, nothing is
        written: one that holds it decides (this delivery is dropped, with a warning).
        """
        flow = self.spec.flow
        document = task_failure(reason)
        lease = Lease(self.keyed.org_id, self.keyed.key, uuid.uuid4(), self._lease_seconds)
        name = flow.name if flow else self.spec.name
        marked = _protocol.give_up(self.state, self.claim, name, lease, document, reason)
        if isinstance(marked, _protocol.InFlight):
            logger.warning(
                "Task %s (org %s, key %s): %s; this delivery stops, the one holding the key (or flask"
                " idem recover) finishes it.",
                self.spec.name,
                self.keyed.org_id,
                self.keyed.key,
                reason,
            )
            return Dropped(f"{reason}; another delivery holds the key and decides")
        if not isinstance(marked, bool):
            return self._existing(marked)
        if marked:
            signals.send_for(
                signals.given_up,
                self.keyed,
                flow=flow.name if flow else None,
                reason=reason,
                attempts=self.delivery.failures + 1,
            )
        raise JobGivenUp(f"Task {self.spec.name} given up: {reason}. It is flagged for a person.")

    # -- one attempt ---------------------------------------------------------------------------------------

    def once(self) -> Outcome:
        if self.overdue:
            # Never run: the key is reserved (or its stranded run taken over) and given up in one
            # transaction, unless another delivery holds or finished it (:meth:`give_up`).
            return self.give_up("deadline passed before it ran")
        outcome: Outcome | Final[Any] | _protocol.Existing
        try:
            if self.spec.flow is None:
                outcome = _protocol.atomic(self.state, self.claim, self._run)
            else:
                outcome = self._multistep(self.spec.flow)
        except psycopg.Error:
            raise
        except Exception as e:  # the task's own failure: its writes and its reservation rolled back
            logger.warning("Task %s failed: %s.", self.spec.name, type(e).__name__, exc_info=e)
            return self.failed(type(e).__name__)
        if isinstance(outcome, Final):
            return Done(outcome.value)
        if isinstance(outcome, (Done, Defer, Dropped)):
            return outcome
        return self._existing(outcome)

    def _call(self, conn: psycopg.Connection[TupleRow]) -> Any:
        job = Job(self.spec.name, self.keyed.org_id, self.keyed.key, self.delivery.failures, conn)
        entering_app_code()
        try:
            return self.spec.func(job, *self.delivery.args, **self.delivery.kwargs)
        finally:
            job._connection = None

    def _run(self, conn: psycopg.Connection[TupleRow]) -> Final[Any]:
        return task_final(self._call(conn))

    @property
    def _lease_seconds(self) -> float:
        return _protocol.lease_seconds(self.state.settings, self.spec.flow)

    def _multistep(self, flow: Flow) -> Outcome | Final[Any] | _protocol.Existing:
        lease = Lease(self.keyed.org_id, self.keyed.key, uuid.uuid4(), self._lease_seconds)
        try:
            started: Run | Final[Any] | _protocol.Existing = _protocol.begin(
                self.state, self.claim, flow, lease, self._call
            )
        except _protocol.LeaseLost:
            return self.busy("the reserved row was not found again")
        if not isinstance(started, Run):
            return started
        retry_in = backoff(
            self.delivery.failures + 1, base=self.policy.backoff, cap=self.policy.backoff_cap, rng=self.rng
        )
        try:
            return _steps.advance(self.state, flow, started, lease, self.door, retry_in=retry_in)
        except _protocol.LeaseLost:
            return self.busy("lease lost to another delivery")
        except _protocol.Pending:
            return self.failed("outcome unknown")

    def _existing(self, outcome: _protocol.Existing) -> Outcome:
        """The outcome of a delivery whose key is taken: the stored result, a refusal, or later."""
        keyed = self.keyed
        if isinstance(outcome, _protocol.InFlight):
            return self.busy("in flight in another delivery")
        if isinstance(outcome, _protocol.Mismatch):
            raise JobMismatch(
                f"Task {self.spec.name}: key {keyed.key} was used before with other arguments (or by another"
                " task); refused. Give each distinct piece of work its own key."
            )
        if isinstance(outcome, _protocol.Tombstone):
            return Dropped("done long ago: its stored result has expired")
        if outcome.failed:
            raise JobGivenUp(f"Task {self.spec.name} was given up before and is flagged for a person.")
        return Done(task_result(outcome.document), replayed=True)


def _reported(outcome: _protocol.Replay | _protocol.Tombstone) -> int | None:
    """The status the signals report for a task's key already taken: a stored result's ``200`` (``500``
    when given up), as its :class:`~flask_idem._records.Final` had; none for a tombstone (dropped)."""
    if isinstance(outcome, _protocol.Tombstone):
        return None
    status: int | None = outcome.document.get("status")
    if status is None:
        return 500 if outcome.failed else 200
    return status
