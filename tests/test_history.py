"""The short history check: load with faults against real processes, then prove nothing was duplicated."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .history import run
from .support import citus

pytestmark = pytest.mark.slow


def test_no_duplicates_no_losses_under_faults() -> None:
    """Orders and payments under worker kills, PostgreSQL restarts and gateway faults stay exactly-once.

    With FLASK_IDEM_TEST_CITUS=1 on a Citus cluster of its own, whose worker nodes are restarted.
    """
    # Outside pytest's 0700 directories: the embedded server runs as a user of its own.
    with tempfile.TemporaryDirectory(prefix="flask-idem-history-") as workdir:
        report = run(
            Path(workdir),
            duration=15.0,
            clients=4,
            seed=7,
            fault_interval=2.0,
            max_faults=8,
            citus=citus.ENABLED,
        )
    print(report.summary())
    assert report.faults, "the nemesis injected nothing"
    assert report.operations, "the clients did nothing"
    assert report.ok, report.summary()
