"""Running one delivery of an idempotent task, whatever the runner: reserve, run, store, or put off.

The runner (through :meth:`flask_idem.jobs.Jobs.deliver`) hands over a delivery (its envelope and
arguments) and gets an outcome back: :class:`Done` (return the result), :class:`Defer` (deliver it again
in ``countdown`` seconds, with the envelope it gives), :class:`Dropped` (end quietly: the key is another
delivery's, or its result has expired), or a :class:`~flask_idem.jobs.JobError` that ends the task for
good. The key table does what it does for a
request: an atomic task's writes commit with its key; a task with a :class:`~flask_idem.Flow` records its
intent under a lease, then the engine advances it step by step (:mod:`._steps`), and a redelivery (or
``flask idem recover``) resumes it after its last finished step.
"""

from __future__ import annotations

import hmac
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from flask import Flask, Response
from psycopg.rows import TupleRow

from . import _layout, _steps, signals
from ._fingerprint import fingerprint
from ._outbox import Outbox
from ._records import KeyedRequest, KeyRecord, Lease
from ._retry import backoff
from ._settings import SETTINGS
from ._state import IdemState, get_state
from ._task import TASK_METHOD, Envelope, Job, JobGivenUp, JobMismatch, JobPolicy, Publisher, task_path
from ._transactions import entering_app_code, in_transaction
from .errors import ConfigurationError, KeyInUse, OperationFailed, OutcomePending
from .flow import INTENT, Flow, Run, run_from_record

__all__ = [
    "EXTENSION_NAME",
    "Defer",
    "Delivery",
    "Done",
    "Dropped",
    "JobsState",
    "Outcome",
    "TaskSpec",
    "get_jobs",
    "run_delivery",
]

logger = logging.getLogger("flask_idem")

#: The key of the background jobs' state in ``app.extensions``.
EXTENSION_NAME = "idem_jobs"


@dataclass(frozen=True, slots=True)
class JobsState:
    """What :meth:`Jobs.init_app <flask_idem.jobs.Jobs.init_app>` keeps for one application
    (``app.extensions["idem_jobs"]``): the policy, the outbox, the relay's publisher."""

    policy: JobPolicy
    outbox: Outbox
    publisher: Publisher
    #: Seconds a relay holds the messages it claimed (``IDEM_OUTBOX_LEASE``).
    relay_lease: float
    #: Seconds sent messages are kept before the relay deletes them (``IDEM_OUTBOX_RETENTION``).
    retention: float
    #: Set once the outbox was found there (:meth:`check_outbox`).
    outbox_found: threading.Event = field(default_factory=threading.Event)

    def check_outbox(self, conn: psycopg.Connection[Any], table: str) -> None:
        """Make sure, once, that the key table's layout has the outbox (layout 3), on ``conn``.

        :raises ConfigurationError: naming ``flask idem migrate`` when it has not.
        """
        if not self.outbox_found.is_set():
            _layout.check_jobs(_layout.read(conn, table), table)
            self.outbox_found.set()

    @classmethod
    def create(cls, app: Flask, publisher: Publisher, policy: JobPolicy | None = None) -> JobsState:
        """The state of ``app`` (whose flask-idem is initialised), from its ``IDEM_JOB_*`` configuration."""
        state = get_state(app)
        config = app.config
        return cls(
            policy=policy or JobPolicy.from_config(config),
            outbox=Outbox.of(state.source, state.settings),
            publisher=publisher,
            relay_lease=SETTINGS["IDEM_OUTBOX_LEASE"].read(config),
            retention=SETTINGS["IDEM_OUTBOX_RETENTION"].read(config),
        )


def get_jobs(app: Flask) -> JobsState:
    """The background jobs' state of ``app``.

    :raises ConfigurationError: when no runner was set up on the application.
    """
    found: JobsState | None = app.extensions.get(EXTENSION_NAME)
    if found is None:
        raise ConfigurationError(
            "Background jobs are not set up on this application: call jobs.init_app(app, celery_app)"
            " (flask_idem.celery.CeleryJobs, or another runner's init_app) after idem.init_app(app)."
        )
    return found


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One idempotent task as :meth:`Jobs.task <flask_idem.jobs.Jobs.task>` registered it: its name, its
    function, and its options (``None``: the application's)."""

    name: str
    func: Callable[..., Any]
    flow: Flow | None = None
    ttl: float | None = None
    policy: JobPolicy | None = None
    lease_timeout: float | None = None


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


class _GiveUp(Exception):
    """The delivery is past its policy: the key row is to be marked failed and flagged."""


def run_delivery(app: Flask, spec: TaskSpec, delivery: Delivery, *, rng: random.Random) -> Outcome:
    """Run one delivery of ``spec`` in ``app``; see the module's docstring for the outcomes.

    :raises JobMismatch: the key was used with other arguments.
    :raises JobGivenUp: the task is past its policy, now or before; its key row is flagged.
    """
    with app.app_context(), signals.running_task(spec.name):
        state = get_state(app)
        policy = spec.policy or get_jobs(app).policy
        run = _Delivery(app, state, spec, delivery, policy, rng)
        try:
            return run.once()
        except psycopg.Error as e:
            logger.warning(
                "Task %s could not reach the key table: %s (SQLSTATE %s).",
                spec.name,
                type(e).__name__,
                e.sqlstate,
            )
            return run.failed(f"{type(e).__name__} (database)")


class _Delivery:
    def __init__(
        self,
        app: Flask,
        state: IdemState,
        spec: TaskSpec,
        delivery: Delivery,
        policy: JobPolicy,
        rng: random.Random,
    ) -> None:
        self.app, self.state, self.spec = app, state, spec
        self.delivery, self.policy, self.rng = delivery, policy, rng
        body = json.dumps({"args": list(delivery.args), "kwargs": dict(delivery.kwargs)}).encode("utf-8")
        path = task_path(spec.name)
        sha = fingerprint(method=TASK_METHOD, path=path, query=b"", mimetype="application/json", body=body)
        self.keyed = KeyedRequest(delivery.org_id, delivery.key, sha, TASK_METHOD, path)
        self.ttl = state.settings.key_ttl if spec.ttl is None else spec.ttl
        self.overdue = time.time() - delivery.enqueued_at > policy.deadline

    # -- outcomes ------------------------------------------------------------------------------------------

    def failed(self, reason: str) -> Outcome:
        """This attempt failed: deliver again after the backoff, or give up past the policy."""
        failures = self.delivery.failures + 1
        if failures >= self.policy.attempts or self.overdue:
            return self.give_up(f"{reason}; gave up after {failures} failed attempt(s)")
        countdown = backoff(failures, base=self.policy.backoff, cap=self.policy.backoff_cap, rng=self.rng)
        envelope = replace(self.delivery.envelope, failures=failures)
        return self._deferred(Defer(countdown, reason, failed=True, envelope=envelope))

    def busy(self, reason: str) -> Outcome:
        """Another delivery holds the key: try again later, each time after a longer backoff (with full
        jitter, up to the cap), until the deadline; past it, give up as a failure does."""
        if self.overdue:
            return self.give_up(f"{reason}; still waiting at the deadline")
        deferrals = self.delivery.deferrals + 1
        countdown = backoff(deferrals, base=self.policy.backoff, cap=self.policy.backoff_cap, rng=self.rng)
        envelope = replace(self.delivery.envelope, deferrals=deferrals)
        return self._deferred(Defer(countdown, reason, failed=False, envelope=envelope))

    def _deferred(self, defer: Defer) -> Defer:
        signals.send(
            signals.job_deferred,
            org_id=self.keyed.org_id,
            key=self.keyed.key,
            reason=defer.reason,
            countdown=round(defer.countdown, 3),
            failures=self.delivery.failures + defer.failed,
        )
        return defer

    def give_up(self, reason: str) -> Outcome:
        """Mark the key failed and flagged for a person, and raise :class:`JobGivenUp`.

        The row is reserved anew (an atomic task's attempts left none) or taken over (a flow's whose
        lease lapsed). When another delivery holds or finished the key meanwhile, nothing is written and
        the outcome is that of any delivery finding the key taken; one that holds it decides (this
        delivery is dropped, with a warning).
        """
        flow = self.spec.flow
        flow_name = flow.name if flow else self.spec.name
        lease = Lease(self.keyed.org_id, self.keyed.key, uuid.uuid4(), self._lease_seconds())
        error = OperationFailed()
        record = {
            "status": error.code,
            "headers": [["Content-Type", "application/problem+json"]],
            "body": error.get_body(),
        }

        def mark(conn: psycopg.Connection[TupleRow]) -> bool | _Existing:
            # An atomic task's row is a leased one named after the task: reserved and failed at once.
            found = self.state.store.reserve(conn, self.keyed, ttl=self.ttl, flow=flow_name, lease=lease)
            existing = found.record
            if not found.reserved and not _take_over_stranded(
                self.state, conn, existing, self.keyed, flow_name, lease
            ):
                return _Existing(existing)
            return self.state.store.complete(conn, lease, record, failed=reason)

        marked = in_transaction(self.state.source, mark, batched=True)
        if isinstance(marked, _Existing):
            if marked.record is None or marked.record.response is None:
                logger.warning(
                    "Task %s (org %s, key %s): %s; this delivery stops, the one holding the key (or flask"
                    " idem recover) finishes it.",
                    self.spec.name,
                    self.keyed.org_id,
                    self.keyed.key,
                    reason,
                )
                return Dropped(f"{reason}; another delivery holds the key and decides")
            return self._existing(marked.record)
        if marked:
            signals.send(
                signals.given_up,
                org_id=self.keyed.org_id,
                key=self.keyed.key,
                flow=flow.name if flow else None,
                reason=reason,
                attempts=self.delivery.failures + 1,
            )
        raise JobGivenUp(f"Task {self.spec.name} given up: {reason}. It is flagged for a person.")

    # -- one attempt ---------------------------------------------------------------------------------------

    def once(self) -> Outcome:
        if self.spec.flow is None:
            return self._atomic()
        with self.app.test_request_context(self.keyed.path, method=TASK_METHOD):
            return self._multistep(self.spec.flow)

    def _job(self, conn: psycopg.Connection[TupleRow]) -> Job:
        return Job(self.spec.name, self.keyed.org_id, self.keyed.key, self.delivery.failures, conn)

    def _call(self, conn: psycopg.Connection[TupleRow]) -> Any:
        job = self._job(conn)
        entering_app_code()
        try:
            return self.spec.func(job, *self.delivery.args, **self.delivery.kwargs)
        finally:
            job._connection = None

    def _atomic(self) -> Outcome:
        keyed = self.keyed

        def body(conn: psycopg.Connection[TupleRow]) -> Outcome | _Existing:
            found = self.state.store.reserve(conn, keyed, ttl=self.ttl)
            if not found.reserved:
                return _Existing(found.record)
            signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=None)
            if self.overdue:
                raise _GiveUp("deadline passed before it ran")
            result = self._call(conn)
            self.state.store.complete(conn, keyed, _result_record(result))
            return Done(result)

        try:
            outcome = in_transaction(self.state.source, body, batched=True)
        except _GiveUp as e:
            return self.give_up(str(e))
        except psycopg.Error:
            raise
        except Exception as e:  # the task's own failure: its writes and its reservation rolled back
            logger.warning("Task %s failed: %s.", self.spec.name, type(e).__name__, exc_info=e)
            return self.failed(type(e).__name__)
        if isinstance(outcome, _Existing):
            return self._existing(outcome.record)
        if isinstance(outcome, Done):
            signals.send(signals.response_stored, org_id=keyed.org_id, key=keyed.key, flow=None, status=200)
        return outcome

    def _lease_seconds(self) -> float:
        flow = self.spec.flow
        return (
            self.spec.lease_timeout
            or (flow.lease_timeout if flow else None)
            or self.state.settings.lease_timeout
        )

    def _multistep(self, flow: Flow) -> Outcome:
        flow.check()
        keyed, store = self.keyed, self.state.store
        lease = Lease(keyed.org_id, keyed.key, uuid.uuid4(), self._lease_seconds())

        def begin(conn: psycopg.Connection[TupleRow]) -> Run | _Existing:
            found = store.reserve(conn, keyed, ttl=self.ttl, flow=flow.name, lease=lease)
            if found.reserved:
                signals.send(signals.key_reserved, org_id=keyed.org_id, key=keyed.key, flow=flow.name)
                if self.overdue:
                    raise _GiveUp("deadline passed before it ran")
                intent = self._call(conn)
                store.record_step(conn, lease, INTENT, intent)
                self.state.fire("view", conn)
                return Run(
                    flow=flow.name,
                    org_id=keyed.org_id,
                    key=keyed.key,
                    results={INTENT: intent},
                    last_step=INTENT,
                )
            record = found.record
            if _take_over_stranded(self.state, conn, record, keyed, flow.name, lease):
                assert record is not None
                if self.overdue:
                    raise _GiveUp("deadline passed")
                return run_from_record(
                    flow, org_id=keyed.org_id, key=keyed.key, step=record.step, state=record.state
                )
            return _Existing(record)

        try:
            started = in_transaction(self.state.source, begin, batched=True)
        except _GiveUp as e:
            return self.give_up(str(e))
        except psycopg.Error:
            raise
        except Exception as e:
            logger.warning("Task %s failed: %s.", self.spec.name, type(e).__name__, exc_info=e)
            return self.failed(type(e).__name__)
        if isinstance(started, _Existing):
            return self._existing(started.record)
        if started.resumed:
            signals.send(
                signals.lease_taken_over,
                org_id=keyed.org_id,
                key=keyed.key,
                flow=flow.name,
                step=started.last_step,
            )
        retry_in = backoff(
            self.delivery.failures + 1, base=self.policy.backoff, cap=self.policy.backoff_cap, rng=self.rng
        )
        try:
            response = _steps.advance(self.state, flow, started, lease, retry_in=retry_in)
        except KeyInUse:
            return self.busy("lease lost to another delivery")
        except OutcomePending:
            return self.failed("outcome unknown")
        except psycopg.Error:
            raise
        except Exception as e:  # released by the engine
            logger.warning("Task %s failed in a step: %s.", self.spec.name, type(e).__name__, exc_info=e)
            return self.failed(type(e).__name__)
        if response.status_code >= 500:
            return self.failed(f"finish step answered {response.status_code}")
        return Done(_response_result(response))

    def _existing(self, record: KeyRecord | None) -> Outcome:
        """The outcome of a delivery whose key is taken: the stored result, a refusal, or later."""
        keyed = self.keyed
        if record is None:
            signals.send(signals.key_in_flight, org_id=keyed.org_id, key=keyed.key)
            return self.busy("in flight in another delivery")
        if not hmac.compare_digest(record.request_sha, keyed.request_sha):
            signals.send(signals.mismatch_rejected, org_id=keyed.org_id, key=keyed.key)
            raise JobMismatch(
                f"Task {self.spec.name}: key {keyed.key} was used before with other arguments (or by another"
                " task); refused. Give each distinct piece of work its own key."
            )
        if record.response is None:
            signals.send(signals.key_in_flight, org_id=keyed.org_id, key=keyed.key)
            return self.busy("in flight in another delivery")
        if record.status == "failed":
            raise JobGivenUp(f"Task {self.spec.name} was given up before and is flagged for a person.")
        if record.stale:
            signals.send(
                signals.tombstone_hit,
                org_id=keyed.org_id,
                key=keyed.key,
                status=record.response["status"],
            )
            return Dropped("done long ago: its stored result has expired")
        signals.send(
            signals.response_replayed,
            org_id=keyed.org_id,
            key=keyed.key,
            status=record.response["status"],
        )
        return Done(_record_result(record.response), replayed=True)


def _take_over_stranded(
    state: IdemState,
    conn: psycopg.Connection[TupleRow],
    record: KeyRecord | None,
    keyed: KeyedRequest,
    flow: str,
    lease: Lease,
) -> bool:
    """Take the task ``record`` is over, under ``lease``, if it is stranded: processing in ``flow``, its
    lease lapsed, and the same arguments (as a retry takes a request over in :mod:`._view`)."""
    return (
        record is not None
        and record.status == "processing"
        and record.flow == flow
        and not record.lease_live
        and hmac.compare_digest(record.request_sha, keyed.request_sha)
        and state.store.take_over(conn, lease)
    )


@dataclass(frozen=True, slots=True)
class _Existing:
    """The key was taken: what the reservation found (carried out of the transaction, which commits)."""

    record: KeyRecord | None


def _result_record(result: Any) -> dict[str, Any]:
    """An atomic task's result as the key table stores a response: a 200 with a JSON body."""
    try:
        body = json.dumps(result)
    except (TypeError, ValueError) as e:
        raise TypeError(f"An idempotent task must return a JSON-serialisable value: {e}") from None
    return {"status": 200, "headers": [["Content-Type", "application/json"]], "body": body}


def _record_result(record: Mapping[str, Any]) -> Any:
    """The result stored in ``record`` (a task's, or a flow's finish step's answer)."""
    body = record.get("body")
    if body is None:
        return None
    headers = {name.lower(): value for name, value in record.get("headers", ())}
    if headers.get("content-type", "").split(";")[0].strip().endswith("json"):
        return json.loads(body)
    return body


def _response_result(response: Response) -> Any:
    if response.is_json:
        return response.get_json()
    return response.get_data(as_text=True)
