"""The outbox relay: publish the messages views wrote into the outbox, and mark each sent.

Each pass claims unsent messages under a lease (``IDEM_OUTBOX_LEASE``), publishes each through the
application's publisher, and marks it sent once the broker confirmed it. A relay that dies in between
leaves the message to be published again: at least once, and the task's key makes it exactly once in
effect. Several relays may run at once (:doc:`/jobs`).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from flask import Flask

from . import signals
from ._jobs_state import get_jobs
from ._loop import run_passes
from ._retry import backoff
from ._state import get_state
from ._task import Message

__all__ = ["RelayReport", "relay", "relay_forever"]

logger = logging.getLogger("flask_idem")


# -- the relay --------------------------------------------------------------------------------------------


@dataclass
class RelayReport:
    """What one relay pass did."""

    published: int = 0
    #: Published, but another relay had taken the message over: it is published again by that one.
    lost: int = 0
    failed: int = 0
    purged: int = 0
    #: Why each failed message could not be published, one sentence each (as logged).
    errors: list[str] = field(default_factory=list)


#: The user information of a URL (``amqp://user:password@``), left out of an error's message.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s/@]*@")


def _reason(error: BaseException) -> str:
    """``error``'s class and message, without the credentials of any URL in it."""
    text = _USERINFO.sub(r"\g<scheme>", str(error)).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def relay(
    app: Flask,
    *,
    limit: int = 100,
    rng: random.Random | None = None,
    after_publish: Callable[[Message], None] | None = None,
) -> RelayReport:
    """Publish up to ``limit`` unsent messages of ``app``'s outbox and mark each sent; purge old sent ones.

    :param after_publish: called with each message between its publish and its mark (a test's fault point).
    """
    jobs = get_jobs(app)
    rng = rng or random.Random()
    report = RelayReport()
    token = uuid.uuid4()
    with app.app_context():
        if not jobs.outbox_found.is_set():
            state = get_state(app)
            with state.source.connection() as conn:
                jobs.check_outbox(conn, state.settings.table)
        messages = jobs.outbox.claim(token=token, lease=jobs.relay_lease, limit=limit)
        for message in messages:
            try:
                jobs.publisher.publish(message)
            except Exception as e:  # the broker is away: the message waits for a later pass
                retry_in = backoff(1, base=1.0, cap=jobs.relay_lease, rng=rng)
                jobs.outbox.release(message, token=token, error=type(e).__name__, retry_in=retry_in)
                where = getattr(jobs.publisher, "destination", None)
                said = (
                    f"Relay could not publish the message of task {message.task}"
                    f"{'' if where is None else f' to the broker at {where}'}: {_reason(e)}."
                )
                logger.warning("%s It is tried again in %.1f s.", said, retry_in)
                report.errors.append(said)
                report.failed += 1
                continue
            if after_publish is not None:
                after_publish(message)
            if jobs.outbox.mark_sent(message, token=token):
                report.published += 1
                signals.send_for(signals.message_relayed, message.envelope, task=message.task)
            else:
                report.lost += 1
        report.purged = jobs.outbox.purge(older_than=jobs.retention)
    return report


def relay_forever(
    app: Flask,
    *,
    interval: float,
    limit: int = 100,
    stop: threading.Event | None = None,
    on_pass: Callable[[RelayReport], None] | None = None,
) -> None:
    """Run :func:`relay` until ``stop`` is set, in the loop of :func:`flask_idem.recovery.run_forever`: a
    pass every ``interval`` seconds, or at once after one that found ``limit`` messages.

    :param on_pass: called with the report of every pass that published or failed something.
    """
    rng = random.Random()
    run_passes(
        lambda: relay(app, limit=limit, rng=rng),
        what="Relay",
        interval=interval,
        limit=limit,
        stop=stop,
        on_pass=on_pass,
        handled=lambda report: report.published + report.failed + report.lost,
        describe=lambda report: (
            f"{report.published} published, {report.failed} failed, {report.lost} taken over;"
            f" {report.purged} purged"
        ),
    )
