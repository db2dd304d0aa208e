"""Tests of flask_idem._retry, the policy engine, on its own: no transport, no key, no HTTP.

tests/test_client.py covers the same rules through the client; these pin down what only the engine
can show: the order of the limits, and a seed that gives one sequence whatever the server asks.
"""

from __future__ import annotations

import random

import pytest

from flask_idem._retry import Attempts, GiveUp, RetryBudget, RetryPolicy


class Clock:
    """A monotonic clock that moves only when told to, and a sleep that moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def schedule(policy: RetryPolicy, *, seed: int = 0, budget: RetryBudget | None = None) -> Attempts:
    clock = Clock()
    return Attempts(policy, budget=budget, rng=random.Random(seed), clock=clock, sleep=clock.sleep)


def waits(attempts: Attempts, asked: list[float | None]) -> list[float]:
    """Fail one attempt per entry of *asked* (the Retry-After of its answer) and collect the waits."""
    seen = []
    for value in asked:
        attempts.start()
        wait = attempts.backoff(value)
        attempts.wait(wait)
        seen.append(wait)
    return seen


def test_retry_after_does_not_shift_the_seeded_sequence() -> None:
    """A Retry-After that overrides one wait leaves the draws of the later waits as they were."""
    policy = RetryPolicy(attempts=10, deadline=1e6, base=0.5, cap=60.0)
    plain = waits(schedule(policy, seed=4), [None] * 6)
    asked = waits(schedule(policy, seed=4), [None, 30.0, None, 30.0, None, None])
    assert asked[1] == asked[3] == 30.0
    assert [asked[n] for n in (0, 2, 4, 5)] == [plain[n] for n in (0, 2, 4, 5)]


def test_last_attempt_does_not_spend_the_budget() -> None:
    """When the attempts have run out, the budget is not asked, so the refused retry costs nothing."""
    budget = RetryBudget(ratio=0.0, min_per_second=0.1, window=10.0, clock=Clock())  # one retry
    attempts = schedule(RetryPolicy(attempts=1), budget=budget)
    attempts.start()
    with pytest.raises(GiveUp) as info:
        attempts.backoff()
    assert info.value.reason == "attempts"
    assert budget.try_retry()


def test_deadline_before_budget() -> None:
    """A wait that would end past the deadline gives up as "deadline" without spending the budget."""
    budget = RetryBudget(ratio=0.0, min_per_second=0.1, window=10.0, clock=Clock())  # one retry
    attempts = schedule(RetryPolicy(attempts=5, deadline=2.0, cap=10.0), budget=budget)
    attempts.start()
    with pytest.raises(GiveUp) as info:
        attempts.backoff(asked=5.0)
    assert info.value.reason == "deadline"
    assert budget.try_retry()


def test_start_refuses_after_an_overlong_wait() -> None:
    """start() counts attempts and timeouts within the deadline, and refuses once a wait overran it."""
    attempts = schedule(RetryPolicy(attempts=5, deadline=3.0, base=1.0, cap=1.0, attempt_timeout=2.0))
    assert (attempts.start(), attempts.number) == (2.0, 1)
    attempts.wait(2.5)
    assert attempts.start() == pytest.approx(0.5)
    attempts.wait(1.0)
    with pytest.raises(GiveUp) as info:
        attempts.start()
    assert (info.value.reason, attempts.number) == ("deadline", 2)
