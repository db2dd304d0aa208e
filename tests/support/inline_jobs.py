"""A second runner of idempotent tasks, in this process, and a small application that uses it.

:class:`InlineJobs` is a runner built on :class:`flask_idem.jobs.Jobs` and nothing else (no Celery, no
broker): it is its own publisher, keeping what the relay publishes in a list, and :meth:`InlineJobs.run`
delivers those messages one at a time, as a worker would, carrying each one's envelope; a deferred
delivery goes to the back of the list with the envelope its outcome gives, after its countdown.

The application has one view, ``POST /orders`` (enqueues ``inline.add`` with the view's defaults, and
fails after it when asked), an atomic task ``inline.add``, and a flow task ``inline.notify`` whose call
never learns its outcome.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any

from flask import Flask, current_app, request

from flask_idem import Flow, Idempotency, OutcomeUnknown, Run
from flask_idem.jobs import Defer, Done, Dropped, Job, JobError, Jobs, Message

from .notes_app import org_from_header

__all__ = ["SCHEMA", "InlineJobs", "build_inline_app", "inline"]

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS inline_effects ("
    " org_id bigint NOT NULL, idem_key uuid NOT NULL, value bigint NOT NULL)"
)


class InlineJobs(Jobs):
    """Idempotent tasks delivered synchronously in this process: the whole of a runner."""

    def __init__(self, idem: Idempotency) -> None:
        super().__init__(idem)
        #: What the relay published and is not delivered yet, in order.
        self.queue: deque[Message] = deque()

    def init_app(self, app: Flask) -> None:
        super().init_app(app, self)

    def publish(self, message: Message) -> None:
        """The publisher of the relay: the message is on the queue once this returns."""
        self.queue.append(message)

    def run(self, app: Flask, *, limit: int = 50) -> list[Done | Defer | Dropped | JobError]:
        """Deliver queued messages until none is left (or ``limit`` deliveries); return each outcome."""
        outcomes: list[Done | Defer | Dropped | JobError] = []
        while self.queue and len(outcomes) < limit:
            message = self.queue.popleft()
            spec = self.tasks[message.task]
            try:
                outcome = self.deliver(app, spec, message.envelope, message.args, message.kwargs)
            except JobError as e:  # the task ends for good
                outcomes.append(e)
                continue
            outcomes.append(outcome)
            if isinstance(outcome, Defer):
                time.sleep(outcome.countdown)
                self.queue.append(replace(message, envelope=outcome.envelope))
        return outcomes


idem = Idempotency(scope=org_from_header)
inline = InlineJobs(idem)
notifying = Flow("inline.notify")


@inline.task(name="inline.add")
def add(job: Job, value: int) -> dict[str, Any]:
    """One row per run, so that a second run would show."""
    job.connection.execute(
        "INSERT INTO inline_effects (org_id, idem_key, value) VALUES (%s, %s, %s)",
        (job.org_id, job.key, value),
    )
    return {"value": value, "org_id": job.org_id}


@inline.task(name="inline.notify", flow=notifying)
def notify(job: Job, url: str) -> dict[str, Any]:
    """The intent: where the notification goes."""
    return {"url": url}


@notifying.call
def post(run: Run) -> dict[str, Any]:
    """The webhook that never answers: every call's outcome is unknown."""
    current_app.config["INLINE_CALLS"].append(run.intent["url"])
    raise OutcomeUnknown("the webhook did not answer")


@notifying.finish
def notified(run: Run) -> dict[str, Any]:
    return {"notified": run.intent["url"]}


def build_inline_app(database_url: str, **config: Any) -> Flask:
    """The application, with background jobs run by :data:`inline`."""
    app = Flask(__name__)
    app.config.update(
        {
            "IDEM_DATABASE_URL": database_url,
            "IDEM_JOB_ATTEMPTS": 3,
            "IDEM_JOB_BACKOFF": 0.05,
            "IDEM_JOB_BACKOFF_CAP": 0.2,
            "INLINE_CALLS": [],
            **config,
        }
    )
    app.config.from_prefixed_env()  # as a user's app would: FLASK_IDEM_* settings apply (Citus mode)
    idem.init_app(app)
    inline.init_app(app)

    @app.post("/orders")
    @idem.idempotent()
    def order() -> Any:
        body = request.get_json()
        key = inline.enqueue(add, body["value"])  # the view's connection, organisation and derived key
        if body.get("fail"):
            raise RuntimeError("the view failed after enqueueing")
        return {"task_key": str(key)}, 201

    return app
