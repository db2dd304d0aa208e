"""The calling side: send an operation with one ``Idempotency-Key`` until it succeeds or time is up.

:class:`IdempotentClient` creates the key (a random UUID), sends it on every attempt, waits between
attempts with capped exponential backoff and full jitter, honours ``Retry-After``, and gives up at the
first of a number of attempts and a total deadline. An answer is worth another attempt when its
``application/problem+json`` body says ``"retryable": true``; for an answer that does not say, its status
decides (``RetryPolicy.retry_statuses``)::

    with requests.Session() as session:
        shop = IdempotentClient(RequestsTransport(session), policy=RetryPolicy(deadline=20.0))
        order = shop.post("https://shop.example/orders", json={"amount": 1200, "currency": "EUR"})

Importing this module needs neither ``requests`` nor Flask; :class:`RequestsTransport` needs ``requests``
(``flask-idem[client]``). The retry policy (:class:`RetryPolicy`, :class:`RetryBudget`,
:func:`set_testing`, :func:`parse_retry_after`) lives in ``flask_idem._retry`` and is imported from here.
"""

from __future__ import annotations

import json as jsonlib
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._keys import HEADER
from ._retry import (
    DEFAULT_RETRY_STATUSES,
    Attempts,
    GiveUp,
    RetryBudget,
    RetryPolicy,
    StopReason,
    is_testing,
    parse_retry_after,
    set_testing,
)
from .errors import PROBLEM_JSON

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
    "retryable_member",
    "set_testing",
]


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
    """The server answered in a way no retry would change: a problem document with ``"retryable":
    false``, or, for an answer that does not say, a 4xx other than 409 and 429 or a 5xx outside the
    policy's ``retry_statuses``. Raised right after that answer, which ``response`` holds with its
    problem details.
    """


class RetriesExhausted(CallFailed):
    """Every attempt failed in a retryable way and the helper stopped trying.

    :param reason: ``"attempts"`` (the policy's maximum was made), ``"deadline"`` (the next wait
        would end past it) or ``"budget"`` (the :class:`RetryBudget` refused another retry).

    The other parameters are those of :class:`CallFailed`.
    """

    def __init__(self, message: str, *, reason: StopReason, **failed: Any) -> None:
        super().__init__(message, **failed)
        self.reason = reason


def _keyed(key: uuid.UUID | str | None, headers: dict[str, str] | None) -> tuple[str, dict[str, str]]:
    """The key every attempt carries (a new random UUID without one), and the headers with it.

    :raises ValueError: when ``key`` is not a UUID or ``headers`` already carry a key.
    """
    key = str(uuid.uuid4() if key is None else uuid.UUID(str(key)))
    if headers and any(name.lower() == HEADER.lower() for name in headers):
        raise ValueError(f"Pass the key as key=..., not as an {HEADER} header.")
    return key, {**(headers or {}), HEADER: key}


def _is_transient(error: BaseException, extra: tuple[type[BaseException], ...]) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError, *extra)):
        return True
    # requests' errors derive from OSError, not from the built-in ConnectionError. Looking requests
    # up in sys.modules avoids importing it: if nothing imported it, none of its errors was raised.
    requests = sys.modules.get("requests")
    if requests is not None:
        return isinstance(error, (requests.ConnectionError, requests.Timeout))
    return False


def retryable_member(response: ResponseLike) -> bool | None:
    """The ``retryable`` member of an ``application/problem+json`` answer, or ``None`` when it has none.

    The body is read from the response's ``content`` (``requests``) or ``data`` (Flask's test client);
    a response with neither, a body that is not a JSON object, or a member that is not a boolean gives
    ``None``, and the status decides.
    """
    content_type = response.headers.get("Content-Type") or ""
    if content_type.partition(";")[0].strip().lower() != PROBLEM_JSON:
        return None
    body = getattr(response, "content", None)
    if body is None:
        body = getattr(response, "data", None)
    if not isinstance(body, (bytes, str)):
        return None
    try:
        document = jsonlib.loads(body)
    except ValueError:
        return None
    said = document.get("retryable") if isinstance(document, dict) else None
    return said if isinstance(said, bool) else None


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
        :raises Rejected: at once, on an answer that no retry would change: a problem document that
            says ``"retryable": false``, or an answer that does not say whose status is not in the
            policy's ``retry_statuses``.
        :raises RetriesExhausted: when the attempts, the deadline or the budget run out.
        :raises ValueError: when *key* is not a UUID or *headers* already carry a key.
        """
        key, keyed = _keyed(key, headers)
        attempts = Attempts(self.policy, budget=self.budget, rng=self.rng, clock=self.clock, sleep=self.sleep)
        response: R | None = None
        error: Exception | None = None
        while True:
            try:
                timeout = attempts.start()
            except GiveUp as stop:
                raise self._exhausted(method, key, attempts.number, response, error, stop.reason) from error
            number = attempts.number
            response, error = self._send(method, url, keyed, json, timeout)
            status = None if response is None else response.status_code
            if response is not None and 200 <= response.status_code < 300:
                self._report(AttemptInfo(key, number, status, None, None))
                return response
            if response is not None:
                self._refuse_final(method, key, number, response)
            asked = None if response is None else parse_retry_after(response.headers.get("Retry-After"))
            try:
                wait = attempts.backoff(asked)
            except GiveUp as stop:
                self._report(AttemptInfo(key, number, status, error, None))
                raise self._exhausted(method, key, number, response, error, stop.reason) from error
            self._report(AttemptInfo(key, number, status, error, wait))
            attempts.wait(wait)

    def _send(
        self, method: str, url: str, headers: dict[str, str], json: Any, timeout: float
    ) -> tuple[R | None, Exception | None]:
        """One attempt: its answer, or the transient error it raised (any other error propagates)."""
        try:
            return self.transport(method, url, headers=headers, json=json, timeout=timeout), None
        except Exception as exc:
            if not _is_transient(exc, self.transient_errors):
                raise
            return None, exc

    def _refuse_final(self, method: str, key: str, number: int, response: R) -> None:
        """Raise :class:`Rejected` when ``response`` is one no retry would change: a problem document that
        says ``"retryable": false``, or, for one that does not say, a status outside ``retry_statuses``."""
        status, said = response.status_code, retryable_member(response)
        if status in self.policy.retry_statuses if said is None else said:
            return
        self._report(AttemptInfo(key, number, status, None, None))
        why = "which no retry would change" if said is None else "which the server says is final"
        raise Rejected(
            f"{method} was answered {status}, {why}; {HEADER}: {key}",
            key=key,
            attempts=number,
            response=response,
            error=None,
        )

    @staticmethod
    def _exhausted(
        method: str,
        key: str,
        number: int,
        response: ResponseLike | None,
        error: Exception | None,
        reason: StopReason,
    ) -> RetriesExhausted:
        last = type(error).__name__ if response is None else str(response.status_code)
        return RetriesExhausted(
            f"{method} gave up after {number} attempt{'s' * (number > 1)} ({reason}); "
            f"last outcome: {last}; {HEADER}: {key}",
            reason=reason,
            key=key,
            attempts=number,
            response=response,
            error=error,
        )

    def _report(self, info: AttemptInfo) -> None:
        if self.on_attempt is not None:
            self.on_attempt(info)
