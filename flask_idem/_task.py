"""What an idempotent task is, whatever runs it: its key, its envelope, what it sees, its policy, its errors.

The ground floor of background jobs; :mod:`flask_idem.jobs` is their public face and says what they
promise (:doc:`/jobs`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from psycopg.rows import TupleRow

from ._fingerprint import canonical_json
from ._records import Final, KeyedRequest
from ._settings import SETTINGS, parse_seconds
from .errors import ConfigurationError
from .flow import Run

_HEADERS = ("idem_org", "idem_key", "idem_enqueued_at")
_COUNTS = ("idem_failures", "idem_deferrals")


#: The first part of a task's fingerprint: lower-case, so that no request's (an upper-case HTTP method,
#: :func:`flask_idem._fingerprint.fingerprint`) begins the same.
_TASK_PART = b"task"


def task_fingerprint(name: str, args: Any, kwargs: Any) -> bytes:
    """The 32-byte SHA-256 fingerprint of a call of task ``name``: its name and its arguments as
    canonical JSON (member names sorted), each part length-prefixed as a request's are, after a first
    part that no request's has. A key used again with other arguments, or by another task, is refused.

    :raises TypeError: the arguments are not JSON.
    """
    body = canonical_json(json.dumps({"args": list(args), "kwargs": dict(kwargs)}).encode("utf-8"))
    digest = hashlib.sha256()
    for part in (_TASK_PART, name.encode("utf-8", "surrogateescape"), body):
        digest.update(b"%d:" % len(part))
        digest.update(part)
    return digest.digest()


def task_request(org_id: int, key: uuid.UUID, name: str, request_sha: bytes) -> KeyedRequest:
    """What a reservation of task ``name``'s key records: a row that names its task, with no method or
    path."""
    return KeyedRequest(org_id, key, request_sha, None, None, task=name)


def task_key(org_id: int, key: uuid.UUID, task: str, *, flow: str | None = None) -> uuid.UUID:
    """The key of task ``task`` enqueued by the request of key ``key``: the same for every attempt of it.

    It is :meth:`Run.derived_key <flask_idem.Run.derived_key>` with the task's name as the step.
    """
    return uuid.UUID(Run(flow=flow or "", org_id=org_id, key=key).derived_key(task))


class JobError(Exception):
    """A delivery of an idempotent task that must not run, and will not run again (the runner gives up)."""


class JobMismatch(JobError):
    """The task's key was used before with other arguments: refused, as a route answers 422."""


class JobGivenUp(JobError):
    """The task failed past its :class:`JobPolicy` (attempts or deadline), or was given up before.

    Its key row is ``failed`` and flagged for a person (``flask idem stuck``); no delivery runs it again.
    """


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every message of an idempotent task carries besides its arguments (as message headers).

    :param enqueued_at: when the message was first written (epoch seconds, the database's clock), which
        the deadline of :class:`JobPolicy` counts from.
    :param failures: attempts that failed so far.
    :param deferrals: times it was put off because another delivery held its key.
    """

    org_id: int
    key: uuid.UUID
    enqueued_at: float
    failures: int = 0
    deferrals: int = 0

    def headers(self) -> dict[str, Any]:
        """The envelope as message headers."""
        return {
            "idem_org": self.org_id,
            "idem_key": str(self.key),
            "idem_enqueued_at": self.enqueued_at,
            "idem_failures": self.failures,
            "idem_deferrals": self.deferrals,
        }

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any] | None) -> Envelope:
        """Read the envelope of a delivered message (a missing count is 0).

        :raises JobError: the message has none (the task was called directly, not enqueued through
            the outbox with :meth:`Jobs.enqueue <flask_idem.jobs.Jobs.enqueue>`), or a malformed one.
        """
        found = headers or {}
        if not all(name in found for name in _HEADERS):
            raise JobError(
                "This message carries no idempotency envelope (organisation and key): an idempotent task"
                " must be enqueued through the outbox (jobs.enqueue, then the relay), not with .delay()."
            )
        try:
            org_id, enqueued_at = found["idem_org"], float(found["idem_enqueued_at"])
            failures, deferrals = (found.get(name, 0) for name in _COUNTS)
            counts_ok = all(type(n) is int and n >= 0 for n in (failures, deferrals))
            if type(org_id) is not int or not counts_ok or not math.isfinite(enqueued_at):
                raise ValueError
            return cls(org_id, uuid.UUID(str(found["idem_key"])), enqueued_at, failures, deferrals)
        except (TypeError, ValueError):
            raise JobError("This message's idempotency envelope is malformed.") from None


@dataclass(frozen=True, slots=True)
class Message:
    """A message of the outbox, as the relay hands it to a :class:`Publisher`."""

    #: The message's own id (one enqueue); not the task's key.
    id: uuid.UUID
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    envelope: Envelope


class Publisher(Protocol):
    """What the relay publishes through: one runner's way of sending a message to its broker. It may have
    a ``destination`` attribute (the broker's ``host:port``), which the relay names when a publish fails."""

    def publish(self, message: Message) -> None:
        """Send ``message``; return only once the broker holds it (a publisher confirm), raise otherwise.

        The relay marks the message sent after this returns (a duplicate publish is absorbed by the key).
        """
        ...


@dataclass
class Job:
    """What an idempotent task's function sees as its first argument: who, which key, which attempt."""

    #: The task's name.
    name: str
    org_id: int
    key: uuid.UUID
    #: Failed attempts before this one.
    failures: int = 0
    _connection: psycopg.Connection[TupleRow] | None = field(default=None, repr=False)

    @property
    def connection(self) -> psycopg.Connection[TupleRow]:
        """The connection of the task's transaction: its writes commit with its key, or not at all.

        :raises RuntimeError: once the function has returned.
        """
        if self._connection is None:
            raise RuntimeError("Job.connection is only available while the task's function runs.")
        return self._connection

    def derived_key(self, name: str) -> str:
        """A key for an outside party this task calls, or for a task it enqueues in its turn: the same for
        every delivery of this task and ``name``.

        It is :meth:`Run.derived_key <flask_idem.Run.derived_key>` of the task's key with ``name`` as the
        step: the text of a UUID, :func:`task_key`'s when ``name`` is the enqueued task's.
        """
        return Run(flow=self.name, org_id=self.org_id, key=self.key).derived_key(name)


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """How often and how long a failing task is retried before it is flagged for a person.

    A failed attempt is retried after ``uniform(0, min(backoff_cap, backoff * 2**failures))`` seconds,
    until ``attempts`` attempts failed or ``deadline`` seconds passed since the message was enqueued (a
    duplicate deferred meanwhile is not a failure, but stops at the deadline too). Defaults:
    ``IDEM_JOB_ATTEMPTS``, ``IDEM_JOB_DEADLINE``, ``IDEM_JOB_BACKOFF``, ``IDEM_JOB_BACKOFF_CAP``.
    """

    attempts: int = SETTINGS["IDEM_JOB_ATTEMPTS"].default
    deadline: float = SETTINGS["IDEM_JOB_DEADLINE"].default
    backoff: float = SETTINGS["IDEM_JOB_BACKOFF"].default
    backoff_cap: float = SETTINGS["IDEM_JOB_BACKOFF_CAP"].default

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigurationError(f"A job's attempts must be a positive integer, not {self.attempts!r}.")
        for name in ("deadline", "backoff", "backoff_cap"):
            object.__setattr__(self, name, parse_seconds(name, getattr(self, name)))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> JobPolicy:
        """The policy of an application's ``IDEM_JOB_*`` configuration.

        :raises ConfigurationError: for a value out of range, naming the key.
        """
        return cls(**{name: SETTINGS[f"IDEM_JOB_{name.upper()}"].read(config) for name in _JOB_KEYS})


_JOB_KEYS = ("attempts", "deadline", "backoff", "backoff_cap")


class TaskDoor:
    """What a task's run makes of its end (:class:`flask_idem._steps.Door`): its finisher's value is the
    task's result (:func:`task_final`); the job door's and the recovery door's."""

    __slots__ = ()

    def finish(self, call: Callable[[], Any]) -> Final[Any]:
        return task_final(call())

    def refused(self, error: Exception) -> Final[Any] | None:
        """A database step's error is the task's failure: rolled back, and the delivery retried."""
        return None

    def failure(self, final: Final[Any]) -> str:
        """A task's finish step never answers a failure (it raises instead); named all the same."""
        return "the finish step failed"


#: A NUL character escaped in JSON text (``\u0000`` after an even number of backslashes), which
#: ``jsonb`` cannot hold.
_NUL = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u0000")


def task_final(result: Any) -> Final[Any]:
    """A task's ``result`` as the key table stores it: ``{"result": <result>}``, read back by
    :func:`task_result`.

    Stored as ``jsonb``, a result comes back as JSON does (tuples as lists, keys as strings).

    :raises TypeError: the result is not JSON (also: a float that is not finite, or a string with a NUL
        character, which ``jsonb`` cannot hold).
    """
    try:
        body = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"An idempotent task must return a JSON-serialisable value: {e}") from None
    if _NUL.search(body):
        raise TypeError("An idempotent task's result cannot hold a NUL character (jsonb cannot store one).")
    return Final(result, {"result": result}, 200)


def task_failure(reason: str) -> dict[str, Any]:
    """What the key table stores for a task given up (flagged for a person): the reason."""
    return {"error": reason}


def task_result(document: Mapping[str, Any]) -> Any:
    """The result stored in ``document`` (``{"result": ...}``, :func:`task_final`)."""
    return document.get("result")
