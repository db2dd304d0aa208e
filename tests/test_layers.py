"""Static checks of the package run in the suite: the layering contract, and mypy on the public API."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .servers import ROOT

pytestmark = pytest.mark.slow


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter with the setup.cfg in ``cwd`` on the flask_idem package found there."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )


def test_layers_contract_is_kept() -> None:
    """No module of flask_idem imports a module on a floor above its own (setup.cfg's layers contract)."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("store.py", "from .extension import Idempotency"),
        ("_view.py", "if TYPE_CHECKING:\n    from .extension import Idempotency"),
        ("settings.py", "from .state import get_state"),
        ("_retry.py", "from .client import IdempotentClient"),
    ],
    ids=[
        "store-imports-extension",
        "view-imports-extension-for-typing",
        "settings-imports-state",
        "retry-engine-imports-client",
    ],
)
def test_layers_contract_catches_an_upward_import(tmp_path: Path, module: str, line: str) -> None:
    """The same contract fails on a copy of the package where a lower module imports a higher one."""
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    package = tmp_path / "flask_idem"
    shutil.copytree(ROOT / "flask_idem", package, ignore=shutil.ignore_patterns("__pycache__"))
    source = package / module
    text = source.read_text("utf-8")
    if "TYPE_CHECKING" in line:
        text = text.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n",
            1,
        )
    source.write_text(text + "\n" + line + "\n", "utf-8")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout, result.stdout + result.stderr


def test_mypy_strict_on_the_package_and_the_typing_checks() -> None:
    """mypy --strict passes on flask_idem, the shop and tests/typing (the public API as users type it)."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
