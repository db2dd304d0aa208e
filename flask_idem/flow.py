"""Multi-step routes: requests that call something outside the database (:doc:`/flows`).

A payment cannot be charged inside a database transaction: holding it (and its pooled connection) open
while a gateway answers blocks locks and starves the pool, and a crash between the charge and the COMMIT
forgets a charge that happened. So such a route works in steps, each recorded in the key row as it
finishes: the view records the *intent* under a lease, :meth:`Flow.call` steps run with no transaction
open and no connection held, :meth:`Flow.step` steps in a short transaction each, and :meth:`Flow.finish`
stores the response. Every step after the first checks the lease first, a finished step is never run
again, and steps after the first see no request: they get everything from the :class:`Run`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, overload

import psycopg
from psycopg.rows import TupleRow

from ._async import synchronous
from ._settings import parse_seconds
from .errors import ConfigurationError

__all__ = ["Flow", "OutcomeUnknown", "Run"]

#: Name under which the intent (the value the view returns) is recorded.
INTENT = "intent"

_DERIVED_NAMESPACE = uuid.UUID("6b0e6f4e-55a4-4a9c-9f34-1f0c2d6b5a10")


class OutcomeUnknown(Exception):
    """Raised by a :meth:`Flow.call` step that cannot tell whether the outside party acted (a timeout, a
    cut connection, a 5xx). The request answers 503; a retry with the same key or the recovery job
    resolves it. Any other exception from a call step is treated the same way."""


@dataclass
class Run:
    """What a step of a multi-step request sees: who, which key, and what earlier steps recorded.

    ``results`` maps step names to the values they returned; the view's return value is under
    ``"intent"`` (also :attr:`intent`). ``resumed`` is true when this run continues a request that an
    earlier worker started: the outside call may have happened already.
    """

    flow: str
    org_id: int
    key: uuid.UUID
    results: dict[str, Any] = field(default_factory=dict)
    last_step: str | None = None
    resumed: bool = False
    _connection: psycopg.Connection[TupleRow] | None = field(default=None, repr=False)

    @property
    def intent(self) -> Any:
        """The value the view returned: what the request set out to do."""
        return self.results[INTENT]

    @property
    def connection(self) -> psycopg.Connection[TupleRow]:
        """The connection of the running :meth:`Flow.step` or :meth:`Flow.finish` step, in its transaction.

        :raises RuntimeError: in a :meth:`Flow.call` step, which must not hold a connection.
        """
        if self._connection is None:
            raise RuntimeError("Call steps run without a database connection; use a Flow.step.")
        return self._connection

    def derived_key(self, step: str | None = None) -> str:
        """A key for the outside party, the same for every attempt of this request and step.

        It is the text of a UUID derived from the organisation, the idempotency key, the flow and the
        step name, so two organisations using the same key never share one at the outside party.
        """
        name = f"{self.org_id}:{self.key}:{self.flow}:{step or ''}"
        return str(uuid.uuid5(_DERIVED_NAMESPACE, name))


StepFunc = Callable[[Run], Any]
ResolveFunc = Callable[[Run], Any]
F = TypeVar("F", bound=StepFunc)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a :class:`Flow` after the view."""

    name: str
    func: StepFunc
    outside: bool
    resolve: ResolveFunc | None = None


class Flow:
    """The steps of a multi-step route, in the order they are declared.

    :param name: a stable name, stored in the key row so the recovery job can find the flow again after
        a restart. Changing it strands requests in flight.
    :param lease_timeout: how long a worker may hold a request between two steps before another attempt
        may take it over, in seconds or as a ``timedelta``; longer than the slowest outside call.
        Default: ``IDEM_LEASE_TIMEOUT``.
    """

    def __init__(self, name: str, *, lease_timeout: float | timedelta | None = None) -> None:
        if not name:
            raise ConfigurationError("A Flow needs a name.")
        self.name = name
        #: The lease in seconds, or ``None`` for ``IDEM_LEASE_TIMEOUT``.
        self.lease_timeout = None if lease_timeout is None else parse_seconds("lease_timeout", lease_timeout)
        self.steps: list[Step] = []
        self.finisher: StepFunc | None = None

    def _add(self, step: Step) -> None:
        if self.finisher is not None:
            raise ConfigurationError(f"Flow {self.name!r}: declare {step.name!r} before its finish step.")
        if step.name == INTENT or any(s.name == step.name for s in self.steps):
            raise ConfigurationError(f"Flow {self.name!r} already has a step named {step.name!r}.")
        self.steps.append(step)

    def step(self, func: F) -> F:
        """Declare a database step: it runs in a short transaction of its own (:attr:`Run.connection`), in
        which its return value (JSON) is recorded."""
        self._add(Step(func.__name__, synchronous(func, "step"), outside=False))
        return func

    @overload
    def call(self, func: F, *, resolve: ResolveFunc | None = None) -> F: ...

    @overload
    def call(self, func: None = None, *, resolve: ResolveFunc | None = None) -> Callable[[F], F]: ...

    def call(self, func: F | None = None, *, resolve: ResolveFunc | None = None) -> F | Callable[[F], F]:
        """Declare a step that calls outside: it runs with no transaction and no connection; its return
        value (JSON) is recorded afterwards. Raise :class:`OutcomeUnknown` when the outcome is not known.

        :param resolve: asked first when the step is resumed: the outcome the outside party has on
            record, in the same form as the step's, or ``None`` (the call is made again, same key).
        """

        def add(f: F) -> F:
            self._add(
                Step(
                    f.__name__,
                    synchronous(f, "step"),
                    outside=True,
                    resolve=None if resolve is None else synchronous(resolve, "resolver"),
                )
            )
            return f

        return add if func is None else add(func)

    def finish(self, func: F) -> F:
        """Declare the last step: a short transaction that writes the outcome and returns what a view
        returns. A response under 500 is stored; a 5xx rolls the step back for the request to resume."""
        if self.finisher is not None:
            raise ConfigurationError(f"Flow {self.name!r} already has a finish step.")
        self.finisher = synchronous(func, "finish step")
        return func

    def remaining(self, last_step: str | None) -> list[Step]:
        """The steps after ``last_step`` (all of them after the intent)."""
        if last_step in (None, INTENT):
            return list(self.steps)
        names = [s.name for s in self.steps]
        if last_step not in names:
            raise LookupError(f"Flow {self.name!r} has no step {last_step!r}; was it renamed?")
        return self.steps[names.index(last_step) + 1 :]

    def check(self) -> None:
        """Raise :class:`ConfigurationError` unless the flow has a finish step."""
        if self.finisher is None:
            raise ConfigurationError(f"Flow {self.name!r} has no finish step (@flow.finish).")


def run_from_record(
    flow: Flow, *, org_id: int, key: uuid.UUID, step: str | None, state: Mapping[str, Any]
) -> Run:
    """A :class:`Run` resuming a request from what its key row recorded."""
    return Run(flow=flow.name, org_id=org_id, key=key, results=dict(state), last_step=step, resumed=True)
