"""Idempotent background jobs, whatever runs them: the tasks, the outbox, and one delivery at a time.

An idempotent task reserves its key in the key table, in the same transaction as its own writes, as an
idempotent route does (:doc:`/jobs`). :class:`Jobs` keeps the tasks and writes their messages into the
outbox; a runner builds on it (:class:`flask_idem.celery.CeleryJobs` for Celery): it gives the relay a
:class:`Publisher`, carries each message's :class:`Envelope`, hands every delivery to
:meth:`Jobs.deliver`, and acts on the outcome (:class:`Done`, :class:`Defer`, :class:`Dropped`).
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, has_request_context

from ._delivery import Defer, Delivery, Done, Dropped, run_delivery
from ._http import current
from ._jobs_state import EXTENSION_NAME, JobsState, TaskSpec, get_jobs
from ._retry import backoff
from ._settings import parse_seconds
from ._state import get_state
from ._task import (
    Envelope,
    Job,
    JobError,
    JobGivenUp,
    JobMismatch,
    JobPolicy,
    Message,
    Publisher,
    task_key,
)
from .errors import ConfigurationError, DatabaseUnavailable
from .flow import Flow

if TYPE_CHECKING:
    from ._extension import Idempotency

__all__ = [
    "Defer",
    "Done",
    "Dropped",
    "Envelope",
    "Job",
    "JobError",
    "JobGivenUp",
    "JobMismatch",
    "JobPolicy",
    "Jobs",
    "Message",
    "Publisher",
    "TaskSpec",
    "task_key",
]

logger = logging.getLogger("flask_idem")


class Jobs:
    """Idempotent tasks of the applications ``idem`` is initialised on, whatever runner carries them.

    A runner subclasses it: its ``init_app`` calls this one's with the relay's :class:`Publisher`, it
    may override :meth:`make_task`, and its workers call :meth:`deliver` (:doc:`/jobs`).

    :param idem: the extension whose key table the tasks reserve their keys in.
    :param policy: the retry policy of every task, unless a task names its own. Default: the
        application's ``IDEM_JOB_*`` configuration (:class:`JobPolicy`).
    """

    def __init__(self, idem: Idempotency, *, policy: JobPolicy | None = None) -> None:
        self.idem = idem
        self.policy = policy
        #: Every task, by name.
        self.tasks: dict[str, TaskSpec] = {}
        self._local = threading.local()

    def init_app(self, app: Flask, publisher: Publisher) -> None:
        """Set up background jobs on ``app`` (after ``idem.init_app(app)``), with ``publisher`` for its relay.

        :raises ConfigurationError: when flask-idem is not initialised on ``app``, an ``IDEM_JOB_*`` or
            ``IDEM_OUTBOX_*`` value is invalid, or ``app`` already has background jobs.
        """
        try:
            get_state(app)
        except RuntimeError as e:
            raise ConfigurationError(f"{e} Call it before jobs.init_app(app, ...).") from None
        if EXTENSION_NAME in app.extensions:
            raise ConfigurationError("This application already has background jobs; call init_app once.")
        app.extensions[EXTENSION_NAME] = JobsState.create(app, publisher, policy=self.policy)

    def task(
        self,
        *,
        name: str | None = None,
        flow: Flow | None = None,
        ttl: float | None = None,
        policy: JobPolicy | None = None,
        **options: Any,
    ) -> Callable[[Callable[..., Any]], Any]:
        """Decorate a function to make it an idempotent task; the decorator returns :meth:`make_task`'s
        answer (the runner's task).

        The function takes a :class:`Job` first, then the task's arguments (JSON values); what it
        returns (JSON too) is stored with its key for every later delivery. It runs in one transaction
        on :attr:`Job.connection`, with the key's reservation. With ``flow``, it records the intent (a
        ``dict``) and the flow's steps do the rest, as for a multi-step route (:doc:`/flows`).

        :param name: the task's name; stable, since messages and key rows carry it. Default: the
            function's module and name.
        :param ttl: how long the key is kept, in seconds. Default: ``IDEM_KEY_TTL``.
        :param policy: the task's retry policy. Default: the one of this object, or the application's.
        :param options: the runner's own options for the task, passed to :meth:`make_task`.
        :raises ConfigurationError: for a bad option, or a name taken by another task.
        """
        seconds = None if ttl is None else parse_seconds("ttl", ttl)

        def decorator(func: Callable[..., Any]) -> Any:
            spec = TaskSpec(
                name=name or f"{func.__module__}.{func.__qualname__}",
                func=func,
                flow=flow,
                ttl=seconds,
                policy=policy,
            )
            if spec.name in self.tasks:
                raise ConfigurationError(
                    f"Two idempotent tasks are named {spec.name!r}; names must be unique."
                )
            made = self.make_task(spec, **options)
            self.tasks[spec.name] = spec
            if flow is not None:
                self.idem.add_flow(flow)
            return made

        return decorator

    def make_task(self, spec: TaskSpec, **options: Any) -> Any:
        """What :meth:`task` returns for ``spec``: here ``spec`` itself. A runner returns its own task
        (it must have the task's name as ``name``, which :meth:`enqueue` reads).

        :raises ConfigurationError: for any option (this class takes none).
        """
        if options:
            raise ConfigurationError(f"This runner takes no task options: {', '.join(sorted(options))}.")
        return spec

    def enqueue(
        self,
        task: Any,
        *args: Any,
        conn: Any = None,
        org_id: int | None = None,
        key: uuid.UUID | str | None = None,
        **kwargs: Any,
    ) -> uuid.UUID:
        """Write a message for ``task`` into the outbox, in the current transaction; return the task's key.

        In an idempotent view the defaults are its connection, its organisation and the key
        :func:`task_key` derives; elsewhere pass them (``conn=run.connection``, ...).

        :param task: the task (or its name); its arguments follow, as JSON values.
        :raises ConfigurationError: outside an idempotent view without ``conn``, ``org_id`` and ``key``;
            and outside a request when the outbox does not exist yet, naming the command that makes it.
        :raises DatabaseUnavailable: in a request, when the outbox does not exist yet (503).
        """
        name = task if isinstance(task, str) else task.name
        if conn is None or org_id is None or key is None:
            try:
                view = current()
            except RuntimeError:
                raise ConfigurationError(
                    "jobs.enqueue() outside an idempotent view needs conn=, org_id= and key= (in a flow's"
                    " step: conn=run.connection, org_id=run.org_id, key=run.derived_key(...))."
                ) from None
            conn = view.connection if conn is None else conn
            org_id = view.org_id if org_id is None else org_id
            if key is None and view.key is not None and org_id is not None:
                key = task_key(org_id, view.key, name)
        if org_id is None or key is None:
            raise ConfigurationError(
                "An idempotent task needs an organisation and a key: pass org_id= and key=."
            )
        task_uuid = key if isinstance(key, uuid.UUID) else uuid.UUID(key)
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        jobs, settings = get_jobs(app), get_state(app).settings
        try:
            jobs.check_outbox(conn, settings.table)
        except ConfigurationError as e:
            if not has_request_context():
                raise
            # As a missing key table at the first request (_http.ready): the deployment's problem, over
            # once the migration has run; the client retries with its key, and nothing was recorded.
            logger.error("%s Answered 503 until then.", e)
            raise DatabaseUnavailable(retry_after=settings.retry_after) from None
        jobs.outbox.write(conn, org_id=org_id, task=name, key=task_uuid, args=list(args), kwargs=kwargs)
        return task_uuid

    def deliver(
        self,
        app: Flask,
        spec: TaskSpec,
        envelope: Envelope,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> Done | Defer | Dropped:
        """Run one delivery of ``spec`` in ``app``: the message's ``envelope`` and arguments.

        The runner acts on the outcome: :class:`Done`, :class:`Defer` (any other failure of the
        delivery too, counted as a failure) or :class:`Dropped`.

        :raises JobError: the task must not run, and will not run again: :class:`JobMismatch`,
            :class:`JobGivenUp`.
        """
        delivery = Delivery.of(envelope, args, kwargs)
        try:
            return run_delivery(app, spec, delivery, rng=self._rng())
        except JobError:
            raise
        except Exception as e:
            logger.warning(
                "Delivery of task %s failed: %s; delivered again later.", spec.name, type(e).__name__
            )
            policy = spec.policy or self.policy or JobPolicy()
            failures = envelope.failures + 1
            countdown = backoff(failures, base=policy.backoff, cap=policy.backoff_cap, rng=self._rng())
            return Defer(countdown, type(e).__name__, True, replace(envelope, failures=failures))

    def _rng(self) -> random.Random:
        rng: random.Random | None = getattr(self._local, "rng", None)
        if rng is None:
            rng = self._local.rng = random.Random()
        return rng
