"""Turning wrk runs into the rows and notes ``bench/run.py`` prints, and printing them."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.harness import Result, WrkRun

__all__ = [
    "capacity",
    "cpu_per_request",
    "judge",
    "machine",
    "ms",
    "others_share",
    "paired",
    "print_table",
    "rps",
    "summary",
]


def summary(name: str, runs: list[WrkRun]) -> Result:
    """One row from the rounds of a scenario: each figure the median of the rounds', errors summed.

    The median keeps a round that other processes on the machine disturbed from moving the figure.
    """
    return Result(
        name,
        statistics.median(r.rps for r in runs),
        statistics.median(r.p50_us for r in runs) / 1000,
        statistics.median(r.p99_us for r in runs) / 1000,
        sum(r.status_errors for r in runs),
        sum(r.socket_errors for r in runs),
        sum(r.requests for r in runs),
        cpu_ms=statistics.median(cpu_per_request([r], "app") + cpu_per_request([r], "db") for r in runs),
    )


def judge(result: Result, ratio: Paired, what: str, goal: str, at_least: float) -> None:
    """Fill in the ratio to the baseline, the goal, and whether the median ratio meets it."""
    result.ratio, result.goal = f"{what} {ratio} × (a)", goal
    result.verdict = "met" if ratio.median >= at_least else "MISSED"


def paired(first: list[WrkRun], second: list[WrkRun], value: Callable[[WrkRun], float]) -> Paired:
    """The median and quartiles of ``value(second) / value(first)`` over the rounds, round by round.

    The two runs of a round run at the same time, so whatever the machine does to one it does to the
    other: the ratio of a round is far steadier than either figure, and the median of the rounds' ratios
    is the figure to read.
    """
    ratios = sorted(value(y) / value(x) for x, y in zip(first, second, strict=True))
    if len(ratios) < 4:
        return Paired(statistics.median(ratios), ratios[0], ratios[-1])
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return Paired(median, q1, q3)


@dataclass(frozen=True)
class Paired:
    """A ratio measured round by round: the median of the rounds' ratios and its quartiles."""

    median: float
    q1: float
    q3: float

    def __str__(self) -> str:
        return f"{self.median:.2f} (quartiles {self.q1:.2f}-{self.q3:.2f})"


def rps(run: WrkRun) -> float:
    """Requests per second of one run."""
    return run.rps


def capacity(run: WrkRun) -> float:
    """Requests per CPU millisecond of one run (the server's workers' and its backends' CPU)."""
    return 1.0 / (cpu_per_request([run], "app") + cpu_per_request([run], "db"))


def cpu_per_request(runs: list[WrkRun], group: str) -> float:
    """CPU milliseconds that ``group`` used per request over ``runs``."""
    return 1000 * sum(r.cpu.get(group, 0.0) for r in runs) / max(1, sum(r.requests for r in runs))


def others_share(runs: list[WrkRun]) -> str:
    """How busy the rest of the machine was during each run: CPU of processes other than the shop's
    workers, their backends and wrk, as a percentage of all CPUs."""
    cpus = os.cpu_count() or 1
    shares = [100 * max(0.0, r.cpu.get("others", 0.0)) / (cpus * r.duration_us / 1e6) for r in runs]
    return ", ".join(f"{share:.0f}%" for share in shares)


def print_table(rows: list[Result], notes: list[str]) -> None:
    """The Markdown table of every scenario, then the notes as a list."""
    header = ["scenario", "req/s", "p50 ms", "p99 ms", "non-2xx", "errors", "CPU ms/req", "ratio", "goal",
              "verdict"]  # fmt: skip
    print("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for r in sorted(rows, key=lambda r: r.scenario):
        cells = [
            r.scenario,
            f"{r.rps:.0f}",
            ms(r.p50),
            ms(r.p99),
            str(r.non2xx),
            str(r.errors),
            ms(r.cpu_ms, 2),
        ]
        print("| " + " | ".join([*cells, r.ratio, r.goal, r.verdict]) + " |")
    print()
    for note in notes:
        print(f"- {note}")


def machine(version: str, workers: int, threads: int) -> str:
    """One line on the machine, the database server and the gunicorn setup."""
    cpu = next(_cpuinfo("model name"), platform.processor())
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"machine: {os.cpu_count()} CPUs ({cpu}), {mem_kib / 2**20:.1f} GiB RAM, {platform.system()}"
        f" {platform.release()}, Python {platform.python_version()}, PostgreSQL {version};"
        f" gunicorn {workers} workers × {threads} threads ({'gthread' if threads > 1 else 'sync'}), a pool of"
        f" {threads} connections per worker; wrk, gunicorn and PostgreSQL share the machine; load average at"
        f" the start {load}"
    )


def _cpuinfo(name: str) -> Iterator[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(name):
            yield line.split(":", 1)[1].strip()


def ms(value: float | None, decimals: int = 1) -> str:
    """Milliseconds with one decimal (or ``decimals``), or "-" when there is no figure."""
    return "-" if value is None else f"{value:.{decimals}f}"
