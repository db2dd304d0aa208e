"""The calling side: send an operation with one ``Idempotency-Key`` until it succeeds or time is up.

The server can answer a retry with the first result only if every attempt of an operation carries
the same key. :class:`IdempotentClient` creates that key (a random UUID), sends it on every attempt,
waits between attempts with capped exponential backoff and full jitter, honours ``Retry-After``, and
gives up at the first of a number of attempts and a total deadline::

    import requests
    from flask_idem.client import IdempotentClient, RequestsTransport, RetryPolicy

    with requests.Session() as session:
        shop = IdempotentClient(RequestsTransport(session), policy=RetryPolicy(deadline=20.0))
        order = shop.post("https://shop.example/orders", json={"amount": 1200, "currency": "EUR"})

Importing this module needs neither ``requests`` nor Flask's test client; each has a small adapter,
and any callable shaped like a :class:`Transport` works. :class:`RequestsTransport` needs ``requests``,
which flask-idem does not install by itself: install ``flask-idem[client]`` (or ``requests``).
"""

from __future__ import annotations

import datetime
import email.utils
import random
import re
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from ._keys import HEADER

if TYPE_CHECKING:
    import requests
    from flask.testing import FlaskClient
    from werkzeug.test import TestResponse

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "AttemptInfo",
    "CallFailed",
    "FlaskTransport",
    "HeadersLike",
    "IdempotentClient",
    "Rejected",
    "RequestsTransport",
    "ResponseLike",
    "RetriesExhausted",
    "RetryBudget",
    "RetryPolicy",
    "Transport",
    "is_testing",
    "parse_retry_after",
    "set_testing",
]

#: Answers worth another attempt with the same key: 409 (the first attempt is still in flight), 429,
#: and the gateway and availability errors 502, 503 and 504. Every other 4xx and 5xx is final.
DEFAULT_RETRY_STATUSES = frozenset({409, 429, 502, 503, 504})

# Answers that say the request itself is wrong: the same request with the same key gets them again.
_NEVER_RETRIED = frozenset({400, 401, 403, 404, 422})

_DELTA_SECONDS = re.compile(r"[0-9]+")


class HeadersLike(Protocol):
    """Response headers as both adapters expose them: case-insensitive lookup by name."""

    def get(self, key: str, /) -> str | None:
        """Return the value of the header *key*, or ``None``."""


class ResponseLike(Protocol):
    """What the helper reads from an answer; ``requests.Response`` and ``TestResponse`` fit."""

    @property
    def status_code(self) -> int:
        """The HTTP status code."""

    @property
    def headers(self) -> HeadersLike:
        """The response headers."""


R = TypeVar("R", bound=ResponseLike)
R_co = TypeVar("R_co", bound=ResponseLike, covariant=True)


class Transport(Protocol[R_co]):
    """Sends one attempt and returns its response; an exception it raises is the attempt's outcome.

    :param method: the HTTP method.
    :param url: the URL, passed through unchanged.
    :param headers: the request headers, ``Idempotency-Key`` among them.
    :param json: the JSON body, or ``None`` for no body.
    :param timeout: the seconds this attempt may take, never beyond the deadline. Transports that
        cannot time out (Flask's test client) ignore it.
    """

    def __call__(
        self, method: str, url: str, *, headers: dict[str, str], json: Any, timeout: float | None
    ) -> R_co:
        """Send the request once."""


class RequestsTransport:
    """A :class:`Transport` over ``requests``; the library is imported only if no session is given.

    ``requests`` comes with the ``client`` extra: ``flask-idem[client]``.

    :param session: the session to send through; a new one when omitted.
    :raises ImportError: when no session is given and ``requests`` is not installed.
    """

    def __init__(self, session: requests.Session | None = None) -> None:
        if session is None:
            try:
                import requests
            except ImportError as e:
                raise ImportError(
                    "RequestsTransport needs the 'requests' library, which flask-idem does not install"
                    " by itself: install the 'client' extra, flask-idem[client] (or requests).",
                    name="requests",
                ) from e

            session = requests.Session()
        self.session = session

    def __call__(
        self, method: str, url: str, *, headers: dict[str, str], json: Any, timeout: float | None
    ) -> requests.Response:
        """Send the request with ``session.request``."""
        return self.session.request(method, url, headers=headers, json=json, timeout=timeout)


class FlaskTransport:
    """A :class:`Transport` over Flask's test client, for tests and for calling an app in-process.

    :param client: the test client, as ``app.test_client()`` returns it.
    """

    def __init__(self, client: FlaskClient) -> None:
        self.client = client

    def __call__(
        self, method: str, url: str, *, headers: dict[str, str], json: Any, timeout: float | None
    ) -> TestResponse:
        """Send the request with ``client.open``; *timeout* does not apply in-process."""
        return self.client.open(url, method=method, headers=headers, json=json)


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
    :param retry_statuses: the status codes worth another attempt. 400, 401, 403, 404 and 422 are
        refused: the same request with the same key gets the same answer again.
    :raises ValueError: when a value is out of range.
    """

    attempts: int = 5
    deadline: float = 30.0
    base: float = 0.25
    cap: float = 5.0
    attempt_timeout: float | None = 10.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ValueError(f"attempts must be a positive integer, not {self.attempts!r}.")
        if self.attempts < 1:
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


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    """One finished attempt, as :class:`IdempotentClient` reports it to ``on_attempt``."""

    #: The ``Idempotency-Key`` of the operation.
    key: str
    #: The number of this attempt, 1 for the first.
    number: int
    #: The status code of the answer, or ``None`` when the attempt raised.
    status: int | None
    #: The exception the transport raised, or ``None`` when an answer arrived.
    error: BaseException | None
    #: The seconds until the next attempt, or ``None`` when there will be none.
    wait: float | None


class CallFailed(Exception):
    """An operation ended without a 2xx answer: a :class:`Rejected` or a :class:`RetriesExhausted`.

    :param message: what happened, for people.
    :param key: the ``Idempotency-Key`` every attempt carried; retrying later with it is safe.
    :param attempts: how many attempts were made.
    :param response: the last answer, or ``None`` when the last attempt raised.
    :param error: the exception of the last attempt, or ``None`` when it was answered.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str,
        attempts: int,
        response: ResponseLike | None,
        error: BaseException | None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.attempts = attempts
        self.response = response
        self.error = error

    @property
    def status(self) -> int | None:
        """The status code of the last answer, or ``None`` when the last attempt raised."""
        return None if self.response is None else self.response.status_code


class Rejected(CallFailed):
    """The server answered in a way no retry would change: a 4xx other than 409 and 429, or a 5xx
    outside the policy's ``retry_statuses``. Raised right after that answer, which ``response``
    holds with its problem details.
    """


class RetriesExhausted(CallFailed):
    """Every attempt failed in a retryable way and the helper stopped trying.

    :param reason: ``"attempts"`` (the policy's maximum was made), ``"deadline"`` (the next wait
        would end past it) or ``"budget"`` (the :class:`RetryBudget` refused another retry).

    The other parameters are those of :class:`CallFailed`.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str,
        attempts: int,
        response: ResponseLike | None,
        error: BaseException | None,
        reason: Literal["attempts", "deadline", "budget"],
    ) -> None:
        super().__init__(message, key=key, attempts=attempts, response=response, error=error)
        self.reason = reason


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


class _RestoreTesting:
    def __init__(self, previous: bool) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        set_testing(self._previous)


def set_testing(testing: bool) -> AbstractContextManager[None]:
    """Turn test mode on or off for the whole process.

    In test mode every wait is 0 and nothing sleeps; attempts, deadline and budget still apply. Call
    it plainly, or as a context manager that restores the previous mode on exit::

        with flask_idem.client.set_testing(True):
            ...
    """
    global _testing
    previous, _testing = _testing, bool(testing)
    return _RestoreTesting(previous)


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


def _is_transient(error: BaseException, extra: tuple[type[BaseException], ...]) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError, *extra)):
        return True
    # requests' errors derive from OSError, not from the built-in ConnectionError. Looking requests
    # up in sys.modules avoids importing it: if nothing imported it, none of its errors was raised.
    requests = sys.modules.get("requests")
    if requests is not None:
        return isinstance(error, (requests.ConnectionError, requests.Timeout))
    return False


class IdempotentClient(Generic[R]):
    """Sends each operation with its own ``Idempotency-Key`` and retries it with that same key.

    :param transport: sends one attempt: a :class:`RequestsTransport`, a :class:`FlaskTransport`, or
        any callable shaped like a :class:`Transport`.
    :param policy: attempts, deadline and waits; :class:`RetryPolicy`'s defaults when omitted.
    :param budget: a :class:`RetryBudget` shared with other clients, or ``None`` for no budget.
    :param on_attempt: called with an :class:`AttemptInfo` after every attempt, once its wait is
        chosen and before the helper sleeps; a command-line tool can print it.
    :param transient_errors: further exception types that count as a retryable attempt, beside
        :exc:`ConnectionError`, :exc:`TimeoutError`, ``requests.ConnectionError`` and
        ``requests.Timeout``. Any other exception from the transport propagates at once.
    :param rng: the source of the jitter; ``random.Random(seed)`` makes the waits reproducible.
    :param clock: a monotonic clock in seconds, for the deadline.
    :param sleep: the function that waits.
    """

    def __init__(
        self,
        transport: Transport[R],
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        on_attempt: Callable[[AttemptInfo], None] | None = None,
        transient_errors: tuple[type[BaseException], ...] = (),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.transport = transport
        self.policy = policy or RetryPolicy()
        self.budget = budget
        self.on_attempt = on_attempt
        self.transient_errors = transient_errors
        # Jitter spreads retries out; it is no secret, so a non-cryptographic generator is right.
        self.rng = rng or random.Random()  # noqa: S311
        self.clock = clock
        self.sleep = sleep

    def post(
        self,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        key: uuid.UUID | str | None = None,
    ) -> R:
        """Send a ``POST``: ``request("POST", url, ...)``."""
        return self.request("POST", url, json=json, headers=headers, key=key)

    def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        key: uuid.UUID | str | None = None,
    ) -> R:
        """Send one operation and retry it with the same key until a 2xx answer, or give up.

        :param method: the HTTP method.
        :param url: the URL, handed to the transport unchanged.
        :param json: the JSON body, the same on every attempt.
        :param headers: further request headers, without ``Idempotency-Key``.
        :param key: the key to send; a new random UUID when omitted. Pass a key stored before the
            first attempt to resume an operation after the calling process died.
        :return: the first 2xx response.
        :raises Rejected: at once, on an answer that no retry would change.
        :raises RetriesExhausted: when the attempts, the deadline or the budget run out.
        :raises ValueError: when *key* is not a UUID or *headers* already carry a key.
        """
        key = str(uuid.uuid4() if key is None else uuid.UUID(str(key)))
        if headers and any(name.lower() == HEADER.lower() for name in headers):
            raise ValueError(f"Pass the key as key=..., not as an {HEADER} header.")
        headers = {**(headers or {}), HEADER: key}
        policy = self.policy
        deadline = self.clock() + policy.deadline
        if self.budget is not None:
            self.budget.record_operation()
        number = 0
        response: R | None = None
        error: Exception | None = None
        while True:
            left = deadline - self.clock()
            if number and left <= 0:
                # The sleep overran the deadline: no attempt starts after it.
                raise self._exhausted(method, key, number, response, error, "deadline") from error
            number += 1
            timeout = left if policy.attempt_timeout is None else min(policy.attempt_timeout, left)
            response, error = None, None
            try:
                response = self.transport(method, url, headers=headers, json=json, timeout=timeout)
            except Exception as exc:
                if not _is_transient(exc, self.transient_errors):
                    raise
                error = exc
            status = None if response is None else response.status_code
            if response is not None and 200 <= response.status_code < 300:
                self._report(AttemptInfo(key, number, status, None, None))
                return response
            if status is not None and status not in policy.retry_statuses:
                self._report(AttemptInfo(key, number, status, None, None))
                raise Rejected(
                    f"{method} was answered {status}, which no retry would change; {HEADER}: {key}",
                    key=key,
                    attempts=number,
                    response=response,
                    error=None,
                )
            wait = self._wait(number, response)
            reason: Literal["attempts", "deadline", "budget"] | None = None
            if number >= policy.attempts:
                reason = "attempts"
            elif self.clock() + wait >= deadline:
                reason = "deadline"
            elif self.budget is not None and not self.budget.try_retry():
                reason = "budget"
            if reason is not None:
                self._report(AttemptInfo(key, number, status, error, None))
                raise self._exhausted(method, key, number, response, error, reason) from error
            self._report(AttemptInfo(key, number, status, error, wait))
            if wait > 0:
                self.sleep(wait)

    @staticmethod
    def _exhausted(
        method: str,
        key: str,
        number: int,
        response: ResponseLike | None,
        error: Exception | None,
        reason: Literal["attempts", "deadline", "budget"],
    ) -> RetriesExhausted:
        last = type(error).__name__ if response is None else str(response.status_code)
        return RetriesExhausted(
            f"{method} gave up after {number} attempt{'s' * (number > 1)} ({reason}); "
            f"last outcome: {last}; {HEADER}: {key}",
            key=key,
            attempts=number,
            response=response,
            error=error,
            reason=reason,
        )

    def _wait(self, number: int, response: ResponseLike | None) -> float:
        """The seconds to wait after failed attempt *number*: full jitter, raised to Retry-After."""
        policy = self.policy
        try:
            ceiling = min(policy.cap, policy.base * 2.0 ** (number - 1))
        except OverflowError:
            ceiling = policy.cap
        # Drawn even when Retry-After wins, so one seed gives one sequence whatever the answers.
        wait = self.rng.uniform(0.0, ceiling)
        if response is not None:
            asked = parse_retry_after(response.headers.get("Retry-After"))
            if asked is not None:
                wait = min(policy.cap, max(wait, asked))
        return 0.0 if _testing else wait

    def _report(self, info: AttemptInfo) -> None:
        if self.on_attempt is not None:
            self.on_attempt(info)
