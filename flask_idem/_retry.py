"""The retry policy engine: how many attempts, how long to wait between them, and when to give up.

:func:`backoff` is the one jittered, capped exponential wait of the package: the client's retries, the
recovery job, background jobs, the outbox relay and a migration's lock retries all draw from it.
:class:`Attempts` runs one operation's schedule under a :class:`RetryPolicy` and a shared
:class:`RetryBudget`; :func:`set_testing` makes every wait 0. Keys, transports and answers are
:mod:`flask_idem.client`'s, which re-exports the public names.

Why not stamina: its backoff adds a bounded jitter to a fixed schedule instead of drawing the whole
wait (full jitter), it draws from the module-level :mod:`random`, a backoff returned for
``Retry-After`` bypasses its cap, its timeout lets the last wait end past the deadline, and the sleep
and the clock cannot be replaced; ``docs/calling.rst`` ("What the client depends on") has the
measurements.
"""

from __future__ import annotations

import datetime
import email.utils
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Literal

#: Answers worth another attempt with the same key: 409 (the first attempt is still in flight), 429,
#: and the gateway and availability errors 502, 503 and 504. Every other 4xx and 5xx is final.
DEFAULT_RETRY_STATUSES = frozenset({409, 429, 502, 503, 504})

# Answers that say the request itself is wrong: the same request with the same key gets them again.
_NEVER_RETRIED = frozenset({400, 401, 403, 404, 422})

_DELTA_SECONDS = re.compile(r"[0-9]+")

#: Why an operation stopped before a 2xx: the attempts, the deadline or the budget ran out.
StopReason = Literal["attempts", "deadline", "budget"]

#: How a wait is drawn below its ceiling: anywhere from 0 ("full"), or from half of it ("equal").
Jitter = Literal["full", "equal"]


def backoff(attempt: int, *, base: float, cap: float, rng: random.Random, jitter: Jitter = "full") -> float:
    """Seconds to wait before attempt ``attempt + 1``: capped exponential backoff with jitter.

    The ceiling is ``min(cap, base * 2**attempt)``. Full jitter (the default) draws the wait from
    ``uniform(0, ceiling)``: the waits of many callers that failed together spread over the whole
    interval instead of arriving together. Equal jitter draws from ``uniform(ceiling / 2, ceiling)``:
    never much shorter than the ceiling, for a caller that waits for something (a lock) to be let go.

    :param attempt: the attempts so far (or failures, or deferrals): the ceiling doubles with each.
    :param base: the ceiling at ``attempt`` 0.
    :param cap: the longest wait.
    :param rng: the source of the draw, which the caller may seed; one draw per call.
    :param jitter: ``"full"`` or ``"equal"``.
    """
    try:
        ceiling = min(cap, base * 2.0**attempt)
    except OverflowError:
        ceiling = cap
    return rng.uniform(ceiling / 2 if jitter == "equal" else 0.0, ceiling)


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """When to retry and how long to wait; durations are in seconds.

    The wait before retry *n* (the first retry is 1) is drawn uniformly from
    ``[0, min(cap, base * 2 ** (n - 1))]``, "full jitter". A ``Retry-After`` header raises the wait
    to the delay it asks for, but never above *cap*.

    :param attempts: the most attempts of one operation, the first one included.
    :param deadline: the most time one operation may take from its first attempt, waits included. No
        wait ends and no attempt starts after it.
    :param base: the ceiling of the first wait; it doubles with each retry.
    :param cap: the longest single wait, ``Retry-After`` included.
    :param attempt_timeout: the longest single attempt, handed to the transport and lowered to the
        time left before the deadline; ``None`` leaves only the deadline.
    :param retry_statuses: the status codes worth another attempt, for an answer that does not say
        itself (a problem document's ``retryable`` member, which :class:`~flask_idem.client.IdempotentClient`
        follows when present). 400, 401, 403, 404 and 422 are refused: the same request with the same key
        gets the same answer again.
    :raises ValueError: when a value is out of range.
    """

    attempts: int = 5
    deadline: float = 30.0
    base: float = 0.25
    cap: float = 5.0
    attempt_timeout: float | None = 10.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be a positive integer, not {self.attempts!r}.")
        for name in ("deadline", "base", "cap", "attempt_timeout"):
            value = getattr(self, name)
            if value is None and name == "attempt_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}.")
        if self.cap < self.base:
            raise ValueError(f"cap ({self.cap!r}) must not be less than base ({self.base!r}).")
        wrong = sorted(s for s in self.retry_statuses if not 400 <= s <= 599 or s in _NEVER_RETRIED)
        if wrong:
            raise ValueError(
                f"retry_statuses may hold 4xx and 5xx codes other than 400, 401, 403, 404 and 422, "
                f"not {wrong}."
            )


class RetryBudget:
    """Allows retries only as a share of recent operations, so that a fleet of clients whose calls
    all fail does not multiply the load on a struggling server (after Finagle's ``RetryBudget``).

    A retry is allowed while the retries of the last *window* seconds stay below
    ``ratio * operations + min_per_second * window``. Share one budget among the clients of a
    process that call the same service; it is thread-safe.

    :param ratio: the retries allowed per operation started, on average.
    :param min_per_second: a reserve of retries per second, so that a quiet client can still retry.
    :param window: the seconds over which operations and retries are counted.
    :param clock: a monotonic clock in seconds.
    """

    def __init__(
        self,
        *,
        ratio: float = 0.2,
        min_per_second: float = 1.0,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ratio < 0 or min_per_second < 0 or window <= 0:
            raise ValueError("ratio and min_per_second must be >= 0, and window must be > 0.")
        self.ratio = ratio
        self.min_per_second = min_per_second
        self.window = window
        self._clock = clock
        self._operations: deque[float] = deque()
        self._retries: deque[float] = deque()
        self._lock = threading.Lock()

    def _forget(self, now: float) -> None:
        for times in (self._operations, self._retries):
            while times and times[0] <= now - self.window:
                times.popleft()

    def record_operation(self) -> None:
        """Count the first attempt of an operation."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            self._operations.append(now)

    def try_retry(self) -> bool:
        """Count a retry and return ``True`` if the budget allows it; otherwise return ``False``."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            allowed = self.ratio * len(self._operations) + self.min_per_second * self.window
            if len(self._retries) >= allowed:
                return False
            self._retries.append(now)
            return True


_testing = False


def set_testing(testing: bool) -> AbstractContextManager[object]:
    """Turn test mode on or off for the whole process.

    In test mode every wait is 0 and nothing sleeps; attempts, deadline and budget still apply. Call
    it plainly, or as a context manager that restores the previous mode on exit::

        with flask_idem.client.set_testing(True):
            ...
    """
    global _testing
    previous, _testing = _testing, bool(testing)
    restore = ExitStack()
    restore.callback(set_testing, previous)
    return restore


def is_testing() -> bool:
    """Return whether test mode is on (see :func:`set_testing`)."""
    return _testing


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Return the delay a ``Retry-After`` header asks for, in seconds from *now*.

    :param value: the header value: delta-seconds (``"120"``) or an HTTP date
        (``"Wed, 21 Oct 2015 07:28:00 GMT"``).
    :param now: the current wall-clock time as a Unix timestamp; ``time.time()`` when omitted.
    :return: the delay (0 for a past date), or ``None`` when the header is absent or malformed.
    """
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        # An HTTP date is always GMT; parsedate_to_datetime leaves "-0000" naive.
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class GiveUp(Exception):
    """Raised by :class:`Attempts` when the operation must stop; *reason* says which limit ran out."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason)
        self.reason: StopReason = reason


class Attempts:
    """The schedule of one operation's attempts under *policy*: counts them, times them, spaces them.

    The caller makes an attempt after each :meth:`start`, and after a failure that may be retried asks
    :meth:`backoff` for the wait and passes it to :meth:`wait`. Creating one fixes the deadline and
    counts the operation in *budget*; *rng*, *clock* and *sleep* are the client's (:mod:`.client`).
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        budget: RetryBudget | None,
        rng: random.Random,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.rng = rng
        self.clock = clock
        self.sleep = sleep
        #: The attempts started so far.
        self.number = 0
        self.deadline = clock() + policy.deadline
        if budget is not None:
            budget.record_operation()

    def start(self) -> float:
        """Count the next attempt and return the seconds it may take: the policy's
        ``attempt_timeout`` lowered to the time left before the deadline.

        :raises GiveUp: ``"deadline"``, when the last wait overran the deadline; no attempt starts
            after it.
        """
        left = self.deadline - self.clock()
        if self.number and left <= 0:
            raise GiveUp("deadline")
        self.number += 1
        timeout = self.policy.attempt_timeout
        return left if timeout is None else min(timeout, left)

    def backoff(self, asked: float | None = None) -> float:
        """Return the seconds to wait after the current attempt failed in a way worth a retry.

        The wait is the full-jitter draw, raised to *asked* but never above the policy's cap, and 0
        in test mode.

        :param asked: the delay the server asked for (``Retry-After``), or ``None``.
        :raises GiveUp: ``"attempts"`` when this was the last attempt allowed, ``"deadline"`` when
            the wait would end past the deadline, ``"budget"`` when the budget refuses the retry.
        """
        wait = self._draw(asked)
        if self.number >= self.policy.attempts:
            raise GiveUp("attempts")
        if self.clock() + wait >= self.deadline:
            raise GiveUp("deadline")
        if self.budget is not None and not self.budget.try_retry():
            raise GiveUp("budget")
        return wait

    def wait(self, seconds: float) -> None:
        """Sleep for *seconds*, as :meth:`backoff` returned them (nothing when 0)."""
        if seconds > 0:
            self.sleep(seconds)

    def _draw(self, asked: float | None) -> float:
        policy = self.policy
        # Drawn even when Retry-After wins, so one seed gives one sequence whatever the answers.
        wait = backoff(self.number - 1, base=policy.base, cap=policy.cap, rng=self.rng)
        if asked is not None:
            wait = min(policy.cap, max(wait, asked))
        return 0.0 if _testing else wait
