"""The documentation builds without a warning, so every docstring it includes is valid reStructuredText."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .support.servers import ROOT

pytestmark = pytest.mark.slow


def test_docs_build_cleanly(tmp_path: Path) -> None:
    """sphinx-build -W (warnings are errors) succeeds on docs/."""
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
