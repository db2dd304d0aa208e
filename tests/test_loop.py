"""The loop of the recovery job and the outbox relay (flask_idem._loop): errors, pauses, reports, logs.

The passes here are functions of the test, so that each kind of failure happens exactly when wanted;
tests/test_recovery.py and tests/test_jobs.py run the same loop on the real passes, against PostgreSQL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
import pytest

from flask_idem._loop import run_passes
from flask_idem.errors import ConfigurationError


class Pauses(threading.Event):
    """A stop event that records each pause the loop asks for instead of waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.asked.append(timeout)
        return self.is_set()


def passes(outcomes: list[int | BaseException], stop: threading.Event) -> Callable[[], int]:
    """A pass that answers (or raises) each outcome in turn, and sets ``stop`` after the last."""
    left = list(outcomes)

    def one_pass() -> int:
        outcome = left.pop(0)
        if not left:
            stop.set()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return one_pass


def run(outcomes: list[int | BaseException], *, limit: int = 3) -> tuple[Pauses, list[int]]:
    stop = Pauses()
    reported: list[int] = []
    run_passes(
        passes(outcomes, stop),
        what="Test",
        interval=7.0,
        limit=limit,
        stop=stop,
        on_pass=reported.append,
        handled=lambda n: n,
        describe=lambda n: f"{n} handled",
    )
    return stop, reported


def test_each_kind_of_failure_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A database error (WARNING, class and SQLSTATE), a configuration error (ERROR, its message) and any
    other exception (ERROR, class only) each end their pass; the next runs after the pause."""
    failures: list[int | BaseException] = [
        psycopg.errors.AdminShutdown("terminating connection; password=hunter2"),
        ConfigurationError("The key table keys does not exist."),
        ValueError("card 4242 4242 4242 4242"),
        1,
    ]
    with caplog.at_level(logging.INFO, logger="flask_idem"):
        stop, reported = run(failures)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "Test pass failed: AdminShutdown (SQLSTATE 57P01)."),
        ("ERROR", "Test pass skipped: The key table keys does not exist."),
        ("ERROR", "Test pass failed unexpectedly: ValueError."),
        ("INFO", "Test: 1 handled."),
    ]
    assert "hunter2" not in caplog.text and "4242" not in caplog.text
    assert stop.asked == [7.0, 7.0, 7.0, 7.0]
    assert reported == [1]


def test_a_full_pass_is_followed_by_the_next_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """A pass that handled ``limit`` items runs the next at once; one that handled fewer, or nothing,
    pauses; only passes that handled something are reported and logged."""
    with caplog.at_level(logging.INFO, logger="flask_idem"):
        stop, reported = run([3, 3, 1, 0, 3, 0])
    assert stop.asked == [7.0, 7.0, 7.0]  # after the 1, the first 0, and the last 0
    assert reported == [3, 3, 1, 3]
    assert [r.getMessage() for r in caplog.records] == ["Test: 3 handled."] * 2 + [
        "Test: 1 handled.",
        "Test: 3 handled.",
    ]


@pytest.mark.parametrize(
    "stopper", [KeyboardInterrupt(), SystemExit(3)], ids=["keyboard-interrupt", "system-exit"]
)
def test_keyboard_interrupt_ends_the_loop(stopper: BaseException) -> None:
    """KeyboardInterrupt and SystemExit are not caught: the loop ends at once and they propagate."""
    stop = Pauses()
    ran: list[int] = []

    def one_pass() -> int:
        ran.append(1)
        raise stopper

    with pytest.raises(type(stopper)):
        run_passes(
            one_pass,
            what="Test",
            interval=7.0,
            limit=3,
            stop=stop,
            on_pass=None,
            handled=lambda n: n,
            describe=str,
        )
    assert ran == [1] and stop.asked == []


def test_a_set_stop_runs_no_pass() -> None:
    """A loop whose stop event is already set returns without running a pass."""
    stop = Pauses()
    stop.set()
    reported: list[int] = []
    run_passes(
        passes([1], Pauses()),
        what="Test",
        interval=7.0,
        limit=3,
        stop=stop,
        on_pass=reported.append,
        handled=lambda n: n,
        describe=str,
    )
    assert reported == [] and stop.asked == []
