"""Signals: one for each outcome flask-idem decides, sent with blinker as Flask sends its own
(:doc:`/observing`).

Every signal is sent with the application as sender and keyword arguments only: the organisation
(``org_id``), the idempotency key (``key``, a :class:`uuid.UUID`), the route (``endpoint``) and the
figures of the outcome; never anything of the request body. Receivers run synchronously, some while a
short transaction is open: keep them fast, let them not raise, and accept ``**extra``. Each outcome is
also logged, once, on the ``flask_idem`` logger, with a hash of the key, never the key itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from blinker import NamedSignal, Namespace
from flask import current_app, has_app_context, has_request_context, request

__all__ = [
    "OUTCOMES",
    "call_failed",
    "given_up",
    "job_deferred",
    "key_hash",
    "key_in_flight",
    "key_reserved",
    "lease_lost",
    "lease_taken_over",
    "message_relayed",
    "mismatch_rejected",
    "mismatch_replayed",
    "outcome_unknown",
    "recovered",
    "response_replayed",
    "response_stored",
    "running_task",
    "serving",
    "step_finished",
    "store_operation",
    "store_unavailable",
    "tombstone_hit",
    "webhook_duplicate",
    "webhook_handled",
    "webhook_rejected",
    "webhook_verified",
]

logger = logging.getLogger("flask_idem")

_signals = Namespace()

# docs/observing.rst has the table of every signal, when it is sent and its arguments beyond ``org_id``,
# ``key`` and ``endpoint``.

# -- a request's key -------------------------------------------------------------------------------------

#: A first attempt reserved its key; the view runs next. Also: ``flow``.
key_reserved = _signals.signal("key-reserved")

#: A final response was stored and committed (by a request, or by the recovery job). Also: ``flow``,
#: ``status``.
response_stored = _signals.signal("response-stored")

#: A retry was answered with the stored response. Also: ``status``.
response_replayed = _signals.signal("response-replayed")

#: A key was reused with a different request and refused (422).
mismatch_rejected = _signals.signal("mismatch-rejected")

#: A key was reused with a different request, answered with the original response. Also: ``status``.
mismatch_replayed = _signals.signal("mismatch-replayed")

#: A duplicate arrived while the first attempt was still running (409).
key_in_flight = _signals.signal("key-in-flight")

#: A retry after the stored response's retention found the key's tombstone. Also: ``status``.
tombstone_hit = _signals.signal("tombstone-hit")

#: The key table could not be reached; sent by every door. Also: ``error``, ``sqlstate``.
store_unavailable = _signals.signal("store-unavailable")

# -- multi-step requests -------------------------------------------------------------------------------

#: A step of a flow finished and its result was committed. Also: ``flow``, ``step``, ``outside``,
#: ``duration``.
step_finished = _signals.signal("step-finished")

#: A retry found its request stranded and took it over. Also: ``flow``, ``step``.
lease_taken_over = _signals.signal("lease-taken-over")

#: A worker found its request taken over, and stopped. Also: ``flow``.
lease_lost = _signals.signal("lease-lost")

#: A call step raised :class:`~flask_idem.OutcomeUnknown`. Also: ``flow``, ``step``, ``exception``.
outcome_unknown = _signals.signal("outcome-unknown")

#: A call step raised another exception, handled as an unknown outcome. Also: ``flow``, ``step``,
#: ``exception``.
call_failed = _signals.signal("call-failed")

#: The recovery job finished a stranded request. Also: ``flow``, ``status``, ``attempts``.
recovered = _signals.signal("recovered")

#: A request or a task was given up: failed, and flagged for a person. Also: ``flow``, ``reason``,
#: ``attempts``.
given_up = _signals.signal("given-up")

# -- background jobs (flask_idem.jobs): a delivery sends the signals above too, with ``task`` -----------

#: A delivery of an idempotent task was put off. Also: ``task``, ``reason``, ``countdown``, ``failures``.
job_deferred = _signals.signal("job-deferred")

#: The outbox relay published a message to the broker and marked it sent. Also: ``task``.
message_relayed = _signals.signal("message-relayed")

# -- inbound webhooks (flask_idem.webhooks) ------------------------------------------------------------

#: A webhook delivery passed its source's verification. Also: ``source``, ``event_id``.
webhook_verified = _signals.signal("webhook-verified")

#: A webhook delivery failed verification (400). Also: ``source``, ``check``.
webhook_rejected = _signals.signal("webhook-rejected")

#: A redelivered event was answered without running its handler. Also: ``source``, ``event_id``,
#: ``status``.
webhook_duplicate = _signals.signal("webhook-duplicate")

#: An event's handler ran and its answer committed with its writes. Also: ``source``, ``event_id``,
#: ``status``.
webhook_handled = _signals.signal("webhook-handled")

# -- the key table -------------------------------------------------------------------------------------

#: A key-table operation of :class:`~flask_idem._store.Store` finished; sent only to receivers, never
#: logged. Arguments: ``operation``, ``duration``.
store_operation = _signals.signal("store-operation")

_DEBUG, _INFO, _ERROR = logging.DEBUG, logging.INFO, logging.ERROR

#: The level and the sentence of each outcome's log record.
_LOG: dict[str, tuple[int, str]] = {
    "key-reserved": (_DEBUG, "Key reserved"),
    "response-stored": (_DEBUG, "Response stored"),
    "response-replayed": (_DEBUG, "Stored response replayed"),
    "mismatch-rejected": (_INFO, "Key reused with a different request; refused"),
    "mismatch-replayed": (_INFO, "Key reused with a different request; original response replayed"),
    "key-in-flight": (_INFO, "Key in flight; duplicate refused"),
    "tombstone-hit": (_INFO, "Retry after the retention period answered from the key's tombstone"),
    "store-unavailable": (_INFO, "Key table unavailable"),
    "step-finished": (_DEBUG, "Step finished"),
    "lease-taken-over": (_INFO, "Stranded request taken over by a retry"),
    "lease-lost": (_INFO, "Lease lost to another attempt"),
    "outcome-unknown": (_INFO, "Outcome of a call step unknown"),
    "call-failed": (_INFO, "Call step failed with an exception; handled as outcome unknown"),
    "recovered": (_INFO, "Stranded request finished by the recovery job"),
    "given-up": (_ERROR, "Gave up; request or task failed and flagged for a person"),
    "job-deferred": (_INFO, "Task delivery put off"),
    "message-relayed": (_DEBUG, "Outbox message published"),
    "webhook-verified": (_DEBUG, "Webhook delivery verified"),
    "webhook-rejected": (_INFO, "Webhook delivery rejected; answered 400"),
    "webhook-duplicate": (_INFO, "Webhook event delivered again; handler not run"),
    "webhook-handled": (_DEBUG, "Webhook event handled"),
}

#: The outcome signals, in the order above: each is logged when sent (:data:`store_operation` is not
#: an outcome).
OUTCOMES: tuple[NamedSignal, ...] = tuple(_signals[name] for name in _LOG)

_task: ContextVar[str | None] = ContextVar("flask_idem_task", default=None)
_endpoint: ContextVar[str | None] = ContextVar("flask_idem_endpoint", default=None)


@contextmanager
def running_task(name: str) -> Iterator[None]:
    """Within the block, every outcome signal is sent with ``task=name`` (a delivery of that task)."""
    token = _task.set(name)
    try:
        yield
    finally:
        _task.reset(token)


@contextmanager
def serving(endpoint: str | None) -> Iterator[None]:
    """Within the block, outcome signals sent outside a request name ``endpoint`` (the recovery job
    finishing a request of that route)."""
    token = _endpoint.set(endpoint)
    try:
        yield
    finally:
        _endpoint.reset(token)


def wanted(signal: NamedSignal) -> bool:
    """Whether sending ``signal`` would reach anyone: a receiver, or the log at the outcome's level."""
    return bool(signal.receivers) or logger.isEnabledFor(_LOG[signal.name][0])


def send(signal: NamedSignal, **data: Any) -> None:
    """Send an outcome signal with the current application as sender, and log it; nothing more when
    neither a receiver nor the log would hear it (:func:`wanted`), as Flask's own signals do.

    ``endpoint`` is added from the current request when the caller does not give it (outside a
    request: the one :func:`serving` names, or ``None``).
    """
    if not wanted(signal):
        return
    if "endpoint" not in data:
        data["endpoint"] = request.endpoint if has_request_context() else _endpoint.get()
    task = _task.get()
    if task is not None and "task" not in data:
        data["task"] = task
    if signal.receivers:
        signal.send(current_app._get_current_object(), **data)  # type: ignore[attr-defined]
    level, text = _LOG[signal.name]
    if logger.isEnabledFor(level):
        # The key itself stays out of the logs (whoever reads them must not be able to use it); its
        # hash lets a reader follow one key through its records.
        logged = {
            ("key_hash" if name == "key" else name): key_hash(v) if isinstance(v, uuid.UUID) else v
            for name, v in data.items()
        }
        fields = " ".join(f"{name}={value}" for name, value in logged.items() if value is not None)
        extra = {"idem_outcome": signal.name.replace("-", "_")}
        extra.update(("idem_" + name, value) for name, value in logged.items())
        logger.log(level, "%s: %s.", text, fields, extra=extra)


def send_for(signal: NamedSignal, ref: Any, **data: Any) -> None:
    """:func:`send` ``signal`` about the key of ``ref`` (a record with ``org_id`` and ``key``)."""
    send(signal, org_id=ref.org_id, key=ref.key, **data)


def key_hash(key: uuid.UUID) -> str:
    """The 12 hex digits the logs show for an idempotency key: the same for every record of the key,
    and no use to anyone who reads them."""
    return hashlib.blake2b(key.bytes, digest_size=6, person=b"flask-idem-log").hexdigest()


F = TypeVar("F", bound=Callable[..., Any])


def timed(operation: str) -> Callable[[F], F]:
    """Decorate a key-table method so that it sends :data:`store_operation` with its duration.

    With no receiver connected, the method runs as it is, after one check.
    """

    def decorator(method: F) -> F:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not store_operation.receivers:
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                duration = time.perf_counter() - start
                sender = current_app._get_current_object() if has_app_context() else None  # type: ignore[attr-defined]
                store_operation.send(sender, operation=operation, duration=duration)

        return wrapper  # type: ignore[return-value]

    return decorator
