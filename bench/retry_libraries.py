"""What stamina does with the retry contract of flask_idem.client: the figures in docs/calling.rst.

stamina is no dependency of flask-idem; run this with it added for the one run::

    uv run --with stamina python bench/retry_libraries.py

It prints, for each promise of the client's policy (full jitter, a seedable source, Retry-After within
the cap, a deadline no attempt starts after, a test mode that keeps the attempts), what stamina does.
Nothing here asserts.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version

import stamina  # type: ignore[import-not-found]  # not a dependency: `uv run --with stamina`


class Boom(Exception):
    pass


waits: list[tuple[int, float]] = []
stamina.instrumentation.set_on_retry_hooks([lambda retry: waits.append((retry.retry_num, retry.wait_for))])


@contextmanager
def no_sleep() -> Iterator[None]:
    """Make time.sleep return at once: stamina has no parameter for the sleep (one of the findings)."""
    real = time.sleep
    time.sleep = lambda seconds: None
    try:
        yield
    finally:
        time.sleep = real


def fail(on: type[Exception] | Callable[[Exception], bool | float], **policy: float | None) -> int:
    """Run one operation whose every attempt raises; return the attempts made."""
    made = 0
    try:
        for attempt in stamina.retry_context(on=on, **policy):
            with attempt:
                made += 1
                raise Boom
    except Boom:
        pass
    return made


def main() -> None:
    print(f"stamina {version('stamina')}, tenacity {version('tenacity')}")

    print("\n1. jitter: the waits of 2,000 operations, wait_initial=0.25 wait_jitter=0.25 wait_max=5")
    with no_sleep():
        for _ in range(2000):
            fail(Boom, attempts=4, timeout=None, wait_initial=0.25, wait_max=5.0, wait_jitter=0.25)
    for n in (1, 2, 3):
        drawn = [wait for number, wait in waits if number == n]
        print(
            f"   retry {n}: min {min(drawn):.3f}  mean {statistics.mean(drawn):.3f}  max {max(drawn):.3f}"
            f"    full jitter: uniform over [0, {min(5.0, 0.25 * 2 ** (n - 1)):.2f}]"
        )

    print("\n2. seeding: the only source is the module-level random")
    runs = []
    with no_sleep():
        for _ in range(2):
            waits.clear()
            random.seed(7)
            fail(Boom, attempts=4, timeout=None)
            runs.append([wait for _, wait in waits])
    print(f"   random.seed(7) twice gives the same waits: {runs[0] == runs[1]}; retry_context takes no rng")

    print("\n3. Retry-After: the on hook returns a backoff of 30 s, wait_max=5")
    waits.clear()
    with no_sleep():
        fail(lambda error: 30.0, attempts=2, timeout=None, wait_max=5.0)
    print(f"   scheduled wait: {[wait for _, wait in waits]} s")

    print("\n4. deadline: timeout=1.0 s, every wait 0.8 s (real sleeps)")
    start = time.monotonic()
    starts: list[float] = []

    def timed(error: Exception) -> float:
        return 0.8

    try:
        for attempt in stamina.retry_context(on=timed, attempts=None, timeout=1.0):
            with attempt:
                starts.append(time.monotonic() - start)
                raise Boom
    except Boom:
        pass
    print(f"   attempts started at {', '.join(f'{t:.2f}' for t in starts)} s")

    print("\n5. test mode: stamina.set_testing(True), a loop of attempts=5")
    with stamina.set_testing(True):
        made = fail(Boom, attempts=5)
    print(f"   attempts made: {made}")


if __name__ == "__main__":
    main()
