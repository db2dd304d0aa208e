"""The short history check: load with faults against real processes, then prove nothing was duplicated."""

from __future__ import annotations

from pathlib import Path

import pytest

from .history import run

pytestmark = pytest.mark.slow


def test_no_duplicates_no_losses_under_faults(tmp_path: Path) -> None:
    """Orders and payments under worker kills, PostgreSQL restarts and gateway faults stay exactly-once."""
    report = run(tmp_path, duration=15.0, clients=4, seed=7, fault_interval=2.0, max_faults=8)
    print(report.summary())
    assert report.faults, "the nemesis injected nothing"
    assert report.operations, "the clients did nothing"
    assert report.ok, report.summary()
