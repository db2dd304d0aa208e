"""Idempotent Celery tasks, and the outbox that sends them exactly when a request commits.

Optional (``pip install "flask-idem[celery]"``): ``jobs = CeleryJobs(idem)``, ``@jobs.task(name=...)``,
``jobs.init_app(app, celery_app)``, and ``jobs.enqueue(task, ...)`` in a view; ``flask idem relay
--loop`` publishes what views enqueued. See :doc:`/jobs`.

Each task has late acknowledgement and ``reject_on_worker_lost``: a worker killed in the middle leaves
the message to the broker, which delivers it again; the key table makes that redelivery (and the relay's
own duplicates) harmless: see :mod:`flask_idem.jobs`.
"""

from __future__ import annotations

import functools
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, has_app_context

from .errors import ConfigurationError
from .jobs import Done, Dropped, Envelope, JobPolicy, Jobs, Message, TaskSpec

try:
    import celery as _celery
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("flask_idem.celery needs Celery: pip install 'flask-idem[celery]'.") from e

if TYPE_CHECKING:
    from ._extension import Idempotency

__all__ = ["TASK_OPTIONS", "CeleryJobs", "CeleryPublisher"]

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

    @functools.cached_property
    def destination(self) -> str | None:
        """The broker's ``host:port`` (the first of a failover list), which the relay names when a
        publish fails; ``None`` for a broker with no host (``memory://``) or a URL that cannot be read."""
        try:
            with self.celery.connection_for_write() as conn:  # not connected: read from the URL
                host = conn.hostname
                port = conn.port or conn.transport.default_port
        except Exception:
            return None
        if not host:
            return None
        return f"{host}:{port}" if port else str(host)

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


class CeleryJobs(Jobs):
    """Idempotent Celery tasks of the applications ``idem`` is initialised on: the runner-neutral
    :class:`~flask_idem.jobs.Jobs` (its :meth:`~flask_idem.jobs.Jobs.enqueue` included), carried by Celery.

    :param idem: the extension whose key table the tasks reserve their keys in; flows of tasks are made
        known to its recovery job.
    :param policy: the retry policy of every task, unless a task names its own. Default: the
        application's ``IDEM_JOB_*`` configuration (:class:`~flask_idem.jobs.JobPolicy`).
    """

    def __init__(self, idem: Idempotency, *, policy: JobPolicy | None = None) -> None:
        super().__init__(idem, policy=policy)
        #: The Flask application of each Celery application, alive as long as the Celery application is.
        self._apps: weakref.WeakKeyDictionary[Any, Flask] = weakref.WeakKeyDictionary()
        self._last: weakref.ref[Flask] | None = None

    def init_app(self, app: Flask, celery_app: Any) -> None:
        """Run the tasks of ``celery_app`` in ``app``, and give ``app``'s outbox relay its publisher.

        Call it after ``idem.init_app(app)``. ``celery_app`` becomes ``app.extensions["celery"]`` (as in
        Flask's Celery guide) and the default Celery application, so tasks defined with
        :meth:`task` belong to it.

        :raises ConfigurationError: when flask-idem is not initialised on ``app``, an ``IDEM_JOB_*`` or
            ``IDEM_OUTBOX_*`` value is invalid, or ``app`` already has background jobs.
        """
        super().init_app(app, CeleryPublisher(celery_app))
        app.extensions.setdefault("celery", celery_app)
        # A publish returns once the broker has the message (py-amqp's publisher confirms): the relay
        # marks a message sent only then.
        options = celery_app.conf.broker_transport_options
        if "confirm_publish" not in options:
            celery_app.conf.broker_transport_options = {**options, "confirm_publish": True}
        celery_app.set_default()
        self._apps[celery_app] = app
        self._last = weakref.ref(app)

    def task(self, **options: Any) -> Callable[[Callable[..., Any]], Any]:
        """Decorate a function to make it an idempotent Celery task (a ``shared_task``).

        As :meth:`Jobs.task <flask_idem.jobs.Jobs.task>`::

            @jobs.task(name="shop.fulfil")
            def fulfil(job, order_id): ...

        :param options: the parameters of :meth:`Jobs.task <flask_idem.jobs.Jobs.task>` (``name``,
            ``flow``, ``ttl``, ``policy``), and more options of Celery's ``shared_task`` (``queue``,
            ``time_limit``...), except those of :data:`TASK_OPTIONS`.
        :raises ConfigurationError: for a bad option, or a name taken by another task.
        """
        forbidden = set(options) & set(TASK_OPTIONS)
        if forbidden:
            raise ConfigurationError(
                f"Idempotent tasks set {', '.join(sorted(forbidden))} themselves (late acknowledgement,"
                " redelivery of a killed task, retries by the policy); leave them out."
            )
        return super().task(**options)

    def make_task(self, spec: TaskSpec, **options: Any) -> Any:
        """The Celery task of ``spec``: a ``shared_task`` with :data:`TASK_OPTIONS` and ``options``."""

        @functools.wraps(spec.func)
        def run(task: Any, *args: Any, **kwargs: Any) -> Any:
            return self._deliver(task, spec, args, kwargs)

        return _celery.shared_task(name=spec.name, **TASK_OPTIONS, **options)(run)

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

    def _deliver(self, task: Any, spec: TaskSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run one delivery of ``task`` and turn its outcome into Celery's terms: a deferred delivery is
        retried with the outcome's envelope in its headers (its failures and deferrals counted)."""
        request = task.request
        envelope = Envelope.from_headers(request.headers)
        outcome = self.deliver(self._flask_app(task.app), spec, envelope, args, kwargs)
        if isinstance(outcome, Done):
            return outcome.result
        if isinstance(outcome, Dropped):
            return None
        headers = {**(request.headers or {}), **outcome.envelope.headers()}
        raise task.retry(countdown=outcome.countdown, max_retries=None, headers=headers)
