"""Idempotent Celery tasks, and the outbox that sends them exactly when a request commits.

Optional (``pip install "flask-idem[celery]"``)::

    from celery import Celery
    from flask_idem.celery import CeleryJobs

    idem = Idempotency(scope=current_org_id)
    jobs = CeleryJobs(idem)

    @jobs.task(name="shop.fulfil")
    def fulfil(job, order_id):
        job.connection.execute(
            "INSERT INTO shipments (org_id, order_id) VALUES (%s, %s)", (job.org_id, order_id)
        )
        return {"order_id": order_id}

    def create_app():
        app = Flask(__name__)
        idem.init_app(app)
        celery_app = Celery(app.name, broker="amqp://guest:guest@127.0.0.1//")
        jobs.init_app(app, celery_app)
        return app

and in a view, in the key's transaction: ``jobs.enqueue(fulfil, order_id)``. ``flask idem relay --loop``
publishes what views enqueued; workers run ``celery -A yourapp.worker worker``. See :doc:`/jobs`.

Each task is a Celery task with late acknowledgement and ``reject_on_worker_lost``: a worker killed in
the middle leaves the message to the broker, which delivers it again. The key table makes that
redelivery (and the relay's own duplicates) harmless: see :mod:`flask_idem.jobs`.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, has_app_context

from . import _jobs
from ._settings import parse_seconds
from ._state import get_state
from ._view import current
from .errors import ConfigurationError
from .flow import Flow
from .jobs import Envelope, JobError, JobPolicy, Message, task_key
from .recovery import backoff

try:
    import celery as _celery
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("flask_idem.celery needs Celery: pip install 'flask-idem[celery]'.") from e

if TYPE_CHECKING:
    from ._extension import Idempotency

__all__ = ["TASK_OPTIONS", "CeleryJobs", "CeleryPublisher"]

logger = logging.getLogger("flask_idem")

#: The options every idempotent task gets (a task's own options may not change the first three): the
#: message is acknowledged after the task ran, and given back to the broker when the worker process
#: running it dies, so a killed task is delivered again; retries are counted by the policy, not Celery.
TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "max_retries": None,
    "typing": False,
}


class CeleryPublisher:
    """The relay's publisher through a Celery application: ``send_task`` with publisher confirms.

    The message's task id is derived from its organisation and key, so every copy of one task's message
    has the same id.
    """

    def __init__(self, celery_app: Any) -> None:
        self.celery = celery_app

    def publish(self, message: Message) -> None:
        """Send ``message``; with ``confirm_publish`` (set by :meth:`CeleryJobs.init_app` unless the
        application chose otherwise) it returns once RabbitMQ has taken it."""
        envelope = message.envelope
        self.celery.send_task(
            message.task,
            args=message.args,
            kwargs=message.kwargs,
            task_id=str(uuid.uuid5(envelope.key, str(envelope.org_id))),
            headers=envelope.headers(),
            retry=False,
        )


class CeleryJobs:
    """Idempotent Celery tasks of the applications ``idem`` is initialised on.

    :param idem: the extension whose key table the tasks reserve their keys in; flows of tasks are made
        known to its recovery job.
    :param policy: the retry policy of every task, unless a task names its own. Default: the
        application's ``IDEM_JOB_*`` configuration (:class:`~flask_idem.jobs.JobPolicy`).
    """

    def __init__(self, idem: Idempotency, *, policy: JobPolicy | None = None) -> None:
        self.idem = idem
        self.policy = policy
        #: The Flask application of each Celery application, alive as long as the Celery application is.
        self._apps: weakref.WeakKeyDictionary[Any, Flask] = weakref.WeakKeyDictionary()
        self._last: weakref.ref[Flask] | None = None
        self._local = threading.local()
        self.tasks: dict[str, _jobs.TaskSpec] = {}

    def init_app(self, app: Flask, celery_app: Any) -> None:
        """Run the tasks of ``celery_app`` in ``app``, and give ``app``'s outbox relay its publisher.

        Call it after ``idem.init_app(app)``. ``celery_app`` becomes ``app.extensions["celery"]`` (as in
        Flask's Celery guide) and the default Celery application, so tasks defined with
        :meth:`task` belong to it.

        :raises ConfigurationError: when flask-idem is not initialised on ``app``, an ``IDEM_JOB_*`` or
            ``IDEM_OUTBOX_*`` value is invalid, or ``app`` already has background jobs.
        """
        try:
            get_state(app)
        except RuntimeError as e:
            raise ConfigurationError(f"{e} Call it before jobs.init_app(app, celery_app).") from None
        if _jobs.EXTENSION_NAME in app.extensions:
            raise ConfigurationError("This application already has background jobs; call init_app once.")
        app.extensions[_jobs.EXTENSION_NAME] = _jobs.JobsState.create(
            app, CeleryPublisher(celery_app), policy=self.policy
        )
        app.extensions.setdefault("celery", celery_app)
        # A publish returns once the broker has the message (py-amqp's publisher confirms): the relay
        # marks a message sent only then.
        options = celery_app.conf.broker_transport_options
        if "confirm_publish" not in options:
            celery_app.conf.broker_transport_options = {**options, "confirm_publish": True}
        celery_app.set_default()
        self._apps[celery_app] = app
        self._last = weakref.ref(app)

    def task(
        self,
        *,
        name: str | None = None,
        flow: Flow | None = None,
        ttl: float | None = None,
        policy: JobPolicy | None = None,
        **options: Any,
    ) -> Callable[[Callable[..., Any]], Any]:
        """Decorate a function to make it an idempotent Celery task (a ``shared_task``).

        The function takes a :class:`~flask_idem.jobs.Job` first, then the task's arguments (JSON
        values); what it returns (JSON too) is stored with its key and returned again to every later
        delivery of the key. It runs in one transaction on :attr:`Job.connection
        <flask_idem.jobs.Job.connection>`, with the key's reservation::

            @jobs.task(name="shop.fulfil")
            def fulfil(job, order_id): ...

        With ``flow``, the function is the flow's first step: it records the intent (and returns it, a
        ``dict``), and the flow's steps do the rest, as for a multi-step route (:doc:`/flows`); a
        worker killed between steps leaves the task to its redelivery or ``flask idem recover``,
        which continue after the last finished step.

        :param name: the task's name; stable, since messages and key rows carry it. Default: the
            function's module and name.
        :param flow: makes the task multi-step.
        :param ttl: how long the key is kept, in seconds. Default: ``IDEM_KEY_TTL``.
        :param policy: the task's retry policy. Default: the one of :class:`CeleryJobs`, or the
            application's.
        :param options: more options of Celery's ``shared_task`` (``queue``, ``time_limit``...).
        :raises ConfigurationError: for a bad option, or a name taken by another task.
        """
        forbidden = set(options) & set(TASK_OPTIONS)
        if forbidden:
            raise ConfigurationError(
                f"Idempotent tasks set {', '.join(sorted(forbidden))} themselves (late acknowledgement,"
                " redelivery of a killed task, retries by the policy); leave them out."
            )
        seconds = None if ttl is None else parse_seconds("ttl", ttl)

        def decorator(func: Callable[..., Any]) -> Any:
            spec = _jobs.TaskSpec(
                name=name or f"{func.__module__}.{func.__qualname__}",
                func=func,
                flow=flow,
                ttl=seconds,
                policy=policy,
            )
            known = self.tasks.setdefault(spec.name, spec)
            if known is not spec:
                raise ConfigurationError(
                    f"Two idempotent tasks are named {spec.name!r}; names must be unique."
                )
            if flow is not None:
                self.idem.add_flow(flow)

            @functools.wraps(func)
            def run(task: Any, *args: Any, **kwargs: Any) -> Any:
                return self._deliver(task, spec, args, kwargs)

            return _celery.shared_task(name=spec.name, **TASK_OPTIONS, **options)(run)

        return decorator

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

        Inside an idempotent view, the defaults are the view's own: its connection (the message commits
        with the key and the view's writes), its organisation, and a key derived from the request's key
        and the task's name (:func:`~flask_idem.jobs.task_key`). Elsewhere, such as in a flow's step,
        pass them: ``conn=run.connection, org_id=run.org_id, key=run.derived_key("fulfil")``.
        The relay (``flask idem relay``) publishes the message once the transaction has committed.

        :param task: the task (or its name); its arguments follow, as JSON values.
        :raises ConfigurationError: outside an idempotent view without ``conn``, ``org_id`` and ``key``.
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
        jobs = _jobs.get_jobs(app)
        jobs.check_outbox(conn, get_state(app).settings.table)
        jobs.outbox.write(conn, org_id=org_id, task=name, key=task_uuid, args=list(args), kwargs=kwargs)
        return task_uuid

    def _flask_app(self, celery_app: Any) -> Flask:
        if has_app_context():
            app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
            return app
        found = self._apps.get(celery_app)
        if found is None and self._last is not None:
            found = self._last()
        if found is None:
            raise ConfigurationError(
                "No Flask application runs these tasks: call jobs.init_app(app, celery_app)."
            )
        return found

    def _rng(self) -> random.Random:
        rng: random.Random | None = getattr(self._local, "rng", None)
        if rng is None:
            rng = self._local.rng = random.Random()
        return rng

    def _deliver(self, task: Any, spec: _jobs.TaskSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run one delivery of ``task`` and turn its outcome into Celery's terms."""
        request = task.request
        envelope = Envelope.from_headers(request.headers)
        delivery = _jobs.Delivery(
            org_id=envelope.org_id,
            key=envelope.key,
            args=tuple(args),
            kwargs=kwargs,
            enqueued_at=envelope.enqueued_at,
            failures=envelope.failures,
        )
        try:
            outcome = _jobs.run_delivery(self._flask_app(task.app), spec, delivery, rng=self._rng())
        except JobError:
            raise
        except Exception as e:
            # The key table away while giving up, say. A task that raises is acknowledged and dropped by
            # Celery, so it is delivered again instead; the policy still counts it.
            logger.warning(
                "Delivery of task %s failed: %s; delivered again later.", spec.name, type(e).__name__
            )
            policy = spec.policy or self.policy or JobPolicy()
            countdown = backoff(
                envelope.failures + 1, base=policy.backoff, cap=policy.backoff_cap, rng=self._rng()
            )
            outcome = _jobs.Defer(countdown, type(e).__name__, failed=True)
        if isinstance(outcome, _jobs.Done):
            return outcome.result
        if isinstance(outcome, _jobs.Dropped):
            return None
        failures = envelope.failures + outcome.failed
        headers = {**(request.headers or {}), "idem_failures": failures}
        raise task.retry(countdown=outcome.countdown, max_retries=None, headers=headers)
