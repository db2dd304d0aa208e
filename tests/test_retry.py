"""Tests of flask_idem._retry, the policy engine, on its own: no transport, no key, no HTTP; and of its
backoff, the one jittered wait of the package.

tests/test_client.py covers the same rules through the client; these pin down what only the engine
can show: the order of the limits, and a seed that gives one sequence whatever the server asks.
"""

from __future__ import annotations

import random
from typing import Literal

import pytest

from flask_idem._retry import Attempts, GiveUp, RetryBudget, RetryPolicy, backoff


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


@pytest.mark.parametrize(
    ("jitter", "low"), [("full", 0.0), ("equal", 0.5)], ids=["full-jitter", "equal-jitter"]
)
def test_backoff_stays_within_its_ceiling_and_grows(jitter: Literal["full", "equal"], low: float) -> None:
    """Each wait lies in [low * ceiling, ceiling], ceiling = min(cap, base * 2**attempt), and spreads."""
    rng = random.Random(3)
    for attempt in range(10):
        ceiling = min(40.0, 0.5 * 2**attempt)
        drawn = [backoff(attempt, base=0.5, cap=40.0, rng=rng, jitter=jitter) for _ in range(300)]
        assert all(low * ceiling <= w <= ceiling for w in drawn)
        assert min(drawn) < (low + 0.1) * ceiling and max(drawn) > 0.9 * ceiling  # not bunched
    assert backoff(3, base=1.0, cap=100.0, rng=random.Random(1), jitter=jitter) > backoff(
        0, base=1.0, cap=100.0, rng=random.Random(1), jitter=jitter
    )  # one draw, a ceiling eight times higher


@pytest.mark.parametrize("attempt", [63, 1100, 10**6], ids=["past-2**62", "past-float-range", "huge"])
def test_backoff_is_capped_however_many_attempts(attempt: int) -> None:
    """A count of attempts too large for a float still gives a wait within the cap, not an error."""
    rng = random.Random(5)
    assert all(0 <= backoff(attempt, base=2.0, cap=60.0, rng=rng) <= 60.0 for _ in range(100))
    assert 30.0 <= backoff(attempt, base=2.0, cap=60.0, rng=rng, jitter="equal") <= 60.0


def test_backoff_repeats_under_a_seed_and_draws_once() -> None:
    """One seed gives one sequence, and each call takes exactly one draw of the generator."""
    first = [backoff(n, base=0.25, cap=5.0, rng=random.Random(9)) for n in range(8)]
    assert first == [backoff(n, base=0.25, cap=5.0, rng=random.Random(9)) for n in range(8)]
    rng, twin = random.Random(9), random.Random(9)
    for n in range(8):
        backoff(n, base=0.25, cap=5.0, rng=rng, jitter="equal" if n % 2 else "full")
        twin.random()
    assert rng.random() == twin.random()


def test_the_client_recovery_and_migration_draw_from_the_one_backoff() -> None:
    """Attempts' n-th wait, recovery's backoff and a migration's lock pause are backoff()'s draws."""
    from flask_idem import _migrate, recovery

    policy = RetryPolicy(attempts=10, deadline=1e6, base=0.5, cap=60.0)
    seen = waits(schedule(policy, seed=2), [None] * 5)
    rng = random.Random(2)
    assert seen == [backoff(n, base=0.5, cap=60.0, rng=rng) for n in range(5)]
    assert recovery.backoff is backoff
    assert _migrate.backoff is backoff
