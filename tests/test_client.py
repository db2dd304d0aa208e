"""Tests of flask_idem.client, the retry helper for callers. None of them needs PostgreSQL."""

from __future__ import annotations

import email.utils
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from flask import Flask, request
from werkzeug.exceptions import HTTPException, ServiceUnavailable, UnprocessableEntity

from flask_idem._keys import HEADER
from flask_idem.client import (
    AttemptInfo,
    FlaskTransport,
    IdempotentClient,
    Rejected,
    RequestsTransport,
    RetriesExhausted,
    RetryBudget,
    RetryPolicy,
    is_testing,
    parse_retry_after,
    retryable_member,
    set_testing,
)
from flask_idem.errors import DatabaseUnavailable, KeyMismatch, problem

from .support.servers import in_thread

# A fake transport and clock for the pure backoff logic; the tests at the end use real HTTP.


class FakeClock:
    """A monotonic clock that only moves when told to, and a sleep that moves it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class FakeResponse:
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Call:
    headers: dict[str, str]
    timeout: float | None
    started: float


class Script:
    """A transport that plays scripted outcomes in order (the last one repeats)."""

    def __init__(
        self, *outcomes: int | FakeResponse | Exception, clock: FakeClock, duration: float = 0.0
    ) -> None:
        self.outcomes = list(outcomes)
        self.clock = clock
        self.duration = duration
        self.calls: list[Call] = []

    def __call__(
        self, method: str, url: str, *, headers: dict[str, str], json: Any, timeout: float | None
    ) -> FakeResponse:
        self.calls.append(Call(dict(headers), timeout, self.clock.now))
        self.clock.now += self.duration
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return FakeResponse(outcome) if isinstance(outcome, int) else outcome

    @property
    def keys(self) -> list[str]:
        return [call.headers[HEADER] for call in self.calls]


def make_client(
    script: Script, *, seed: int = 0, budget: RetryBudget | None = None, on_attempt: Any = None, **policy: Any
) -> IdempotentClient[FakeResponse]:
    return IdempotentClient(
        script,
        policy=RetryPolicy(**policy),
        budget=budget,
        on_attempt=on_attempt,
        rng=random.Random(seed),
        clock=script.clock,
        sleep=script.clock.sleep,
    )


def full_jitter(seed: int, count: int, *, base: float, cap: float) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.0, min(cap, base * 2**n)) for n in range(count)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_one_key_for_every_attempt(clock: FakeClock) -> None:
    """Every attempt of one operation carries the same UUID key."""
    script = Script(503, 503, 201, clock=clock)
    response = make_client(script).post("/orders", json={"amount": 1})
    assert response.status_code == 201
    assert len(script.calls) == 3
    assert len(set(script.keys)) == 1
    assert uuid.UUID(script.keys[0]).version == 4


def test_new_key_for_each_operation(clock: FakeClock) -> None:
    """Two operations through the same client get two different keys."""
    script = Script(201, clock=clock)
    client = make_client(script)
    client.post("/orders")
    client.post("/orders")
    assert script.keys[0] != script.keys[1]


def test_given_key_is_sent(clock: FakeClock) -> None:
    """A key passed in is sent, in canonical form, on every attempt."""
    key = uuid.uuid4()
    script = Script(503, 201, clock=clock)
    make_client(script).post("/orders", key=str(key).upper())
    assert script.keys == [str(key), str(key)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"key": "order-17"}, "badly formed", id="key-not-a-uuid"),
        pytest.param({"headers": {"idempotency-key": str(uuid.uuid4())}}, "key=", id="key-header"),
    ],
)
def test_bad_key_is_refused_before_sending(clock: FakeClock, kwargs: Any, message: str) -> None:
    """A key that is not a UUID, or one smuggled in as a header, is refused before any attempt."""
    script = Script(201, clock=clock)
    with pytest.raises(ValueError, match=message):
        make_client(script).post("/orders", **kwargs)
    assert script.calls == []


@pytest.mark.parametrize("seed", [0, 1, 12345], ids=["seed-0", "seed-1", "seed-12345"])
def test_waits_follow_full_jitter_within_cap(clock: FakeClock, seed: int) -> None:
    """Each wait is the seeded draw from [0, min(cap, base * 2**n)], so it never exceeds the cap."""
    script = Script(503, clock=clock)
    with pytest.raises(RetriesExhausted):
        make_client(script, seed=seed, attempts=10, deadline=1e6, base=0.1, cap=2.0).post("/o")
    assert clock.sleeps == full_jitter(seed, 9, base=0.1, cap=2.0)
    for n, wait in enumerate(clock.sleeps):
        assert 0.0 <= wait <= min(2.0, 0.1 * 2**n)


def test_same_seed_same_waits() -> None:
    """Two clients seeded alike wait alike; another seed waits differently."""

    def waits(seed: int) -> list[float]:
        clock = FakeClock()
        with pytest.raises(RetriesExhausted):
            make_client(Script(503, clock=clock), seed=seed, attempts=6, deadline=1e6).post("/o")
        return clock.sleeps

    assert waits(7) == waits(7)
    assert waits(7) != waits(8)


@pytest.mark.parametrize("duration", [0.0, 0.7, 2.5], ids=["instant", "slow", "very-slow"])
def test_deadline_is_respected(clock: FakeClock, duration: float) -> None:
    """No attempt starts and no wait ends after the deadline, and each timeout fits before it."""
    start = clock.now
    script = Script(503, clock=clock, duration=duration)
    with pytest.raises(RetriesExhausted) as info:
        make_client(script, attempts=1000, deadline=10.0, base=0.5, cap=3.0, attempt_timeout=4.0).post("/o")
    assert info.value.reason == "deadline"
    assert info.value.attempts == len(script.calls) > 1
    assert sum(clock.sleeps) + duration * len(script.calls) == pytest.approx(clock.now - start)
    for call in script.calls:
        assert call.started < start + 10.0
        assert call.timeout == pytest.approx(min(4.0, start + 10.0 - call.started))


def test_gives_up_rather_than_sleep_past_deadline(clock: FakeClock) -> None:
    """When Retry-After asks for more time than is left, the helper gives up without sleeping."""
    script = Script(FakeResponse(503, {"Retry-After": "5"}), clock=clock)
    with pytest.raises(RetriesExhausted) as info:
        make_client(script, deadline=3.0, cap=10.0).post("/o")
    assert info.value.reason == "deadline"
    assert len(script.calls) == 1
    assert clock.sleeps == []


def test_overlong_sleep_does_not_start_a_late_attempt(clock: FakeClock) -> None:
    """When a sleep overruns the deadline, the helper gives up instead of sending a late attempt."""
    script = Script(503, clock=clock)
    client = IdempotentClient(
        script,
        policy=RetryPolicy(deadline=3.0, base=1.0, cap=1.0),
        clock=clock,
        sleep=lambda seconds: clock.sleep(seconds + 5.0),
    )
    with pytest.raises(RetriesExhausted) as info:
        client.post("/o")
    assert (info.value.reason, info.value.attempts, info.value.status) == ("deadline", 1, 503)
    assert len(script.calls) == 1


def test_attempts_run_out(clock: FakeClock) -> None:
    """After the last allowed attempt the error carries the key, the count and the last answer."""
    script = Script(503, 502, 504, 201, clock=clock)
    with pytest.raises(RetriesExhausted) as info:
        make_client(script, attempts=3).post("/o")
    error = info.value
    assert error.reason == "attempts"
    assert error.attempts == 3 == len(script.calls)
    assert error.key == script.keys[0]
    assert error.status == 504
    assert error.error is None
    assert error.key in str(error)


@pytest.mark.parametrize(
    ("retry_after", "cap", "expected"),
    [
        pytest.param("2", 10.0, 2.0, id="seconds"),
        pytest.param(" 3 ", 10.0, 3.0, id="seconds-padded"),
        pytest.param("60", 4.0, 4.0, id="seconds-above-cap"),
        pytest.param("0", 10.0, None, id="zero-keeps-jitter"),
        pytest.param("soon", 10.0, None, id="malformed-ignored"),
    ],
)
def test_retry_after_seconds_within_cap(
    clock: FakeClock, retry_after: str, cap: float, expected: float | None
) -> None:
    """Retry-After raises the wait to what it asks for, but never above the cap."""
    script = Script(FakeResponse(429, {"Retry-After": retry_after}), 201, clock=clock)
    make_client(script, seed=3, base=0.5, cap=cap).post("/o")
    jitter = full_jitter(3, 1, base=0.5, cap=cap)
    assert clock.sleeps == ([expected] if expected is not None else jitter)


def test_retry_after_http_date(clock: FakeClock) -> None:
    """A Retry-After HTTP date sets the wait to the time left until that date."""
    when = email.utils.formatdate(int(time.time()) + 3, usegmt=True)
    script = Script(FakeResponse(503, {"Retry-After": when}), 201, clock=clock)
    make_client(script, base=0.01, cap=10.0).post("/o")
    assert 1.5 < clock.sleeps[0] <= 3.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("120", 120.0, id="delta-seconds"),
        pytest.param("Wed, 21 Oct 2015 07:28:00 GMT", 90.0, id="imf-fixdate"),
        pytest.param("Wednesday, 21-Oct-15 07:28:00 GMT", 90.0, id="rfc850-date"),
        pytest.param("Wed Oct 21 07:28:00 2015", 90.0, id="asctime-date"),
        pytest.param("Wed, 21 Oct 2015 07:25:00 GMT", 0.0, id="date-in-the-past"),
        pytest.param("-5", None, id="negative"),
        pytest.param("1.5", None, id="fraction"),
        pytest.param("tomorrow", None, id="garbage"),
        pytest.param("", None, id="empty"),
        pytest.param(None, None, id="absent"),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    """Delta-seconds and the three HTTP date forms are understood; anything else is ignored."""
    now = email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:26:30 GMT").timestamp()
    assert parse_retry_after(value, now=now) == expected


@pytest.mark.parametrize("status", [400, 401, 403, 404, 418, 422, 500, 501], ids=lambda s: f"status-{s}")
def test_final_status_stops_at_once(clock: FakeClock, status: int) -> None:
    """An answer no retry would change ends the operation after one attempt, without waiting."""
    script = Script(status, 201, clock=clock)
    with pytest.raises(Rejected) as info:
        make_client(script).post("/o")
    assert len(script.calls) == 1
    assert clock.sleeps == []
    assert (info.value.status, info.value.attempts) == (status, 1)
    assert info.value.key == script.keys[0]


@pytest.mark.parametrize("status", [409, 429, 502, 503, 504], ids=lambda s: f"status-{s}")
def test_retryable_status_is_retried(clock: FakeClock, status: int) -> None:
    """409, 429, 502, 503 and 504 are retried until the 2xx."""
    script = Script(status, status, 200, clock=clock)
    assert make_client(script).post("/o").status_code == 200
    assert len(script.calls) == 3


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(ConnectionRefusedError(111, "refused"), id="connection-refused"),
        pytest.param(ConnectionResetError(104, "reset"), id="connection-reset"),
        pytest.param(TimeoutError("timed out"), id="timeout"),
        pytest.param(requests.ConnectionError("down"), id="requests-connection-error"),
        pytest.param(requests.ConnectTimeout("slow connect"), id="requests-connect-timeout"),
        pytest.param(requests.ReadTimeout("slow read"), id="requests-read-timeout"),
    ],
)
def test_transport_error_is_retried(clock: FakeClock, error: Exception) -> None:
    """Connection errors and timeouts, built-in or from requests, count as retryable attempts."""
    script = Script(error, 201, clock=clock)
    assert make_client(script).post("/o").status_code == 201
    assert len(script.calls) == 2


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(ValueError("bug"), id="value-error"),
        pytest.param(requests.exceptions.InvalidURL("no host"), id="requests-invalid-url"),
        pytest.param(PermissionError(13, "denied"), id="other-oserror"),
    ],
)
def test_other_error_propagates(clock: FakeClock, error: Exception) -> None:
    """Any other exception, even requests' OSError-based ones, propagates from the first attempt."""
    script = Script(error, 201, clock=clock)
    with pytest.raises(type(error)) as info:
        make_client(script).post("/o")
    assert info.value is error
    assert len(script.calls) == 1


def test_transient_errors_option(clock: FakeClock) -> None:
    """An exception type listed in transient_errors is retried like a connection error."""

    class TransportError(Exception):
        pass

    script = Script(TransportError(), 201, clock=clock)
    client = IdempotentClient(script, transient_errors=(TransportError,), clock=clock, sleep=clock.sleep)
    assert client.post("/o").status_code == 201


def test_exhausted_by_errors_carries_last_error(clock: FakeClock) -> None:
    """When every attempt raised, the error carries the last exception as its cause."""
    errors = [ConnectionResetError(104, f"reset {n}") for n in range(3)]
    script = Script(*errors, clock=clock)
    with pytest.raises(RetriesExhausted) as info:
        make_client(script, attempts=3).post("/o")
    assert info.value.error is errors[-1]
    assert info.value.__cause__ is errors[-1]
    assert info.value.status is None and info.value.response is None
    assert "ConnectionResetError" in str(info.value)


def test_on_attempt_reports_each_attempt(clock: FakeClock) -> None:
    """on_attempt sees every attempt with its key, status or error, and the wait that follows."""
    seen: list[AttemptInfo] = []
    reset = ConnectionResetError()
    script = Script(503, reset, 201, clock=clock)
    make_client(script, on_attempt=seen.append).post("/o")
    key = script.keys[0]
    assert seen == [
        AttemptInfo(key, 1, 503, None, clock.sleeps[0]),
        AttemptInfo(key, 2, None, reset, clock.sleeps[1]),
        AttemptInfo(key, 3, 201, None, None),
    ]


def test_testing_switch_removes_waits(clock: FakeClock) -> None:
    """In test mode nothing sleeps, even for Retry-After, and the previous mode comes back after."""
    seen: list[AttemptInfo] = []
    script = Script(FakeResponse(503, {"Retry-After": "30"}), 503, 201, clock=clock)
    with set_testing(True):
        assert is_testing()
        make_client(script, on_attempt=seen.append, cap=60.0).post("/o")
    assert not is_testing()
    assert len(script.calls) == 3
    assert clock.sleeps == []
    assert [info.wait for info in seen] == [0.0, 0.0, None]


def test_testing_switch_keeps_limits(clock: FakeClock) -> None:
    """Test mode still stops at the attempt limit."""
    set_testing(True)
    try:
        with pytest.raises(RetriesExhausted) as info:
            make_client(Script(503, clock=clock), attempts=4).post("/o")
    finally:
        set_testing(False)
    assert info.value.attempts == 4


def test_budget_limits_retries(clock: FakeClock) -> None:
    """With a budget of half a retry per operation, a failing fleet retries far less."""
    budget = RetryBudget(ratio=0.5, min_per_second=0.0, window=10.0, clock=clock)
    script = Script(503, clock=clock)
    client = make_client(script, budget=budget, attempts=5)
    attempts = []
    for _ in range(4):
        with pytest.raises(RetriesExhausted) as info:
            client.post("/o")
        attempts.append((info.value.attempts, info.value.reason))
    assert attempts == [(2, "budget"), (1, "budget"), (2, "budget"), (1, "budget")]


def test_budget_forgets_old_traffic() -> None:
    """Retries and operations older than the window no longer count."""
    clock = FakeClock()
    budget = RetryBudget(ratio=1.0, min_per_second=0.0, window=10.0, clock=clock)
    budget.record_operation()
    assert budget.try_retry()
    assert not budget.try_retry()
    clock.now += 10.0
    assert not budget.try_retry()
    budget.record_operation()
    assert budget.try_retry()


def test_budget_reserve() -> None:
    """min_per_second allows a few retries even with no operations recorded."""
    budget = RetryBudget(ratio=0.0, min_per_second=0.5, window=10.0, clock=FakeClock())
    assert [budget.try_retry() for _ in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"attempts": 0}, id="no-attempts"),
        pytest.param({"attempts": 2.5}, id="fractional-attempts"),
        pytest.param({"deadline": 0}, id="zero-deadline"),
        pytest.param({"base": -1.0}, id="negative-base"),
        pytest.param({"base": 2.0, "cap": 1.0}, id="cap-below-base"),
        pytest.param({"attempt_timeout": 0}, id="zero-timeout"),
        pytest.param({"retry_statuses": frozenset({503, 422})}, id="retry-422"),
        pytest.param({"retry_statuses": frozenset({200})}, id="retry-200"),
    ],
)
def test_policy_refuses_bad_values(kwargs: Any) -> None:
    """A policy that could not work is refused when it is built."""
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_policy_is_keyword_only() -> None:
    """RetryPolicy takes keywords only."""
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[call-arg]


def test_import_does_not_import_requests() -> None:
    """Importing flask_idem.client leaves requests unimported."""
    code = "import sys, flask_idem.client; sys.exit('requests' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_requests_transport_without_requests_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without requests installed, RequestsTransport() says which extra brings it."""
    monkeypatch.setitem(sys.modules, "requests", None)  # `import requests` now fails as if not installed
    with pytest.raises(ImportError, match=r"flask-idem\[client\]") as info:
        RequestsTransport()
    assert info.value.name == "requests"


# Real HTTP: a tiny Flask app that answers with the extension's own problem+json errors.


class NotYet(UnprocessableEntity):
    """A 422, final by the status table, whose problem document says that a retry may succeed."""

    retryable = True


class ClosedForGood(ServiceUnavailable):
    """A 503, retried by the status table, whose problem document says that no retry will succeed."""

    retryable = False


def tiny_app() -> Flask:
    app = Flask(__name__)
    app.register_error_handler(HTTPException, problem)
    app.config["FAILURES"] = 2
    attempts: dict[str, int] = {}
    app.extensions["attempts"] = attempts

    def count() -> int:
        key = request.headers[HEADER]
        attempts[key] = attempts.get(key, 0) + 1
        return attempts[key]

    @app.post("/orders")
    def create_order() -> tuple[dict[str, Any], int]:
        if count() <= app.config["FAILURES"]:
            raise DatabaseUnavailable(retry_after=1)
        return {"key": request.headers[HEADER], "amount": request.get_json()["amount"]}, 201

    @app.post("/busy")
    def busy() -> tuple[str, int, dict[str, str]]:
        if count() == 1:
            when = email.utils.formatdate(int(time.time()) + 3, usegmt=True)
            return "", 503, {"Retry-After": when}
        return "", 204, {}

    @app.post("/slow")
    def slow() -> tuple[str, int]:
        if count() == 1:
            time.sleep(0.5)
        return "", 201

    @app.post("/mismatch")
    def mismatch() -> str:
        count()
        raise KeyMismatch()

    @app.post("/not-yet")
    def not_yet() -> tuple[str, int]:
        if count() <= 2:
            raise NotYet()
        return "", 201

    @app.post("/closed")
    def closed() -> str:
        count()
        raise ClosedForGood()

    @app.post("/plain-json")
    def plain_json() -> tuple[dict[str, Any], int]:
        count()
        return {"retryable": True}, 422

    return app


def test_flask_test_client_retries_with_one_key(clock: FakeClock) -> None:
    """Through Flask's test client, two 503s with Retry-After: 1 are retried with one key."""
    app = tiny_app()
    client = IdempotentClient(FlaskTransport(app.test_client()), clock=clock, sleep=clock.sleep)
    response = client.post("/orders", json={"amount": 5})
    assert response.status_code == 201
    key = response.get_json()["key"]
    assert app.extensions["attempts"] == {key: 3}
    assert len(clock.sleeps) == 2 and all(1.0 <= wait <= 5.0 for wait in clock.sleeps)


def test_flask_test_client_http_date(clock: FakeClock) -> None:
    """Through Flask's test client, a Retry-After date three seconds ahead sets the wait."""
    client = IdempotentClient(
        FlaskTransport(tiny_app().test_client()),
        policy=RetryPolicy(base=0.01, cap=10.0),
        clock=clock,
        sleep=clock.sleep,
    )
    assert client.post("/busy").status_code == 204
    assert len(clock.sleeps) == 1 and 1.5 < clock.sleeps[0] <= 3.0


def test_flask_test_client_rejected_carries_problem(clock: FakeClock) -> None:
    """A 422 problem answer raises Rejected at once, with the problem document at hand."""
    app = tiny_app()
    client = IdempotentClient(FlaskTransport(app.test_client()), clock=clock, sleep=clock.sleep)
    with pytest.raises(Rejected) as info:
        client.post("/mismatch", json={})
    assert info.value.status == 422
    assert info.value.response is not None
    assert info.value.response.get_json()["type"] == KeyMismatch.problem_type  # type: ignore[attr-defined]
    assert app.extensions["attempts"] == {info.value.key: 1}


@pytest.fixture
def server() -> Iterator[tuple[str, Flask]]:
    app = tiny_app()
    with in_thread(app) as port:
        yield f"http://127.0.0.1:{port}", app


def test_requests_over_real_http(server: tuple[str, Flask]) -> None:
    """Through requests and a real HTTP server, the operation converges with one key."""
    url, app = server
    seen: list[AttemptInfo] = []
    with requests.Session() as session, set_testing(True):
        client = IdempotentClient(RequestsTransport(session), on_attempt=seen.append)
        response = client.post(f"{url}/orders", json={"amount": 7})
    assert response.status_code == 201
    assert response.json() == {"key": seen[0].key, "amount": 7}
    assert app.extensions["attempts"] == {seen[0].key: 3}
    assert [(info.number, info.status) for info in seen] == [(1, 503), (2, 503), (3, 201)]


def test_retryable_true_beats_a_final_status(server: tuple[str, Flask]) -> None:
    """A 422 problem saying "retryable": true is retried with the same key until the 201."""
    url, app = server
    seen: list[AttemptInfo] = []
    with requests.Session() as session, set_testing(True):
        client = IdempotentClient(RequestsTransport(session), on_attempt=seen.append)
        assert client.post(f"{url}/not-yet", json={}).status_code == 201
    assert [(info.number, info.status) for info in seen] == [(1, 422), (2, 422), (3, 201)]
    assert app.extensions["attempts"] == {seen[0].key: 3}


def test_retryable_false_beats_a_retried_status(server: tuple[str, Flask]) -> None:
    """A 503 problem saying "retryable": false raises Rejected after the one attempt."""
    url, app = server
    with requests.Session() as session, set_testing(True):
        client = IdempotentClient(RequestsTransport(session))
        with pytest.raises(Rejected, match="the server says is final") as info:
            client.post(f"{url}/closed", json={})
    assert info.value.status == 503
    assert app.extensions["attempts"] == {info.value.key: 1}


def test_retryable_outside_a_problem_is_ignored(server: tuple[str, Flask]) -> None:
    """A "retryable" member of a plain JSON body is not a problem's: the 422 stays final."""
    url, app = server
    with requests.Session() as session, set_testing(True):
        client = IdempotentClient(RequestsTransport(session))
        with pytest.raises(Rejected, match="no retry would change") as info:
            client.post(f"{url}/plain-json", json={})
    assert app.extensions["attempts"] == {info.value.key: 1}


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/not-yet", True), ("/closed", False), ("/mismatch", False), ("/plain-json", None), ("/busy", None)],
    ids=["true", "false", "flask-idem-422", "plain-json", "empty-503"],
)
def test_retryable_member(server: tuple[str, Flask], path: str, expected: bool | None) -> None:
    """retryable_member reads a problem's member from requests and from Flask's test client alike."""
    url, app = server
    headers = {HEADER: str(uuid.uuid4())}
    with requests.Session() as session:
        assert retryable_member(session.post(f"{url}{path}", json={}, headers=headers)) is expected
    assert retryable_member(app.test_client().post(path, json={}, headers=headers)) is expected


def test_requests_read_timeout_is_retried(server: tuple[str, Flask]) -> None:
    """A real read timeout is retried with the same key, which the server sees twice."""
    url, app = server
    seen: list[AttemptInfo] = []
    with requests.Session() as session, set_testing(True):
        client = IdempotentClient(
            RequestsTransport(session), on_attempt=seen.append, policy=RetryPolicy(attempt_timeout=0.2)
        )
        assert client.post(f"{url}/slow").status_code == 201
    assert isinstance(seen[0].error, requests.ReadTimeout)
    assert app.extensions["attempts"] == {seen[0].key: 2}


def test_requests_connection_refused_exhausts() -> None:
    """Against a closed port, every attempt fails to connect and the error says so."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with RequestsTransport().session as session, set_testing(True):
        client = IdempotentClient(RequestsTransport(session), policy=RetryPolicy(attempts=3))
        with pytest.raises(RetriesExhausted) as info:
            client.post(f"http://127.0.0.1:{port}/orders", json={})
    assert info.value.attempts == 3
    assert isinstance(info.value.error, requests.ConnectionError)
