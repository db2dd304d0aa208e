"""Static checks of the package run in the suite: the layering contract, the public face, and mypy."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .support.servers import ROOT

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
        ("_store.py", "from ._extension import Idempotency"),
        ("_view.py", "if TYPE_CHECKING:\n    from ._extension import Idempotency"),
        ("_settings.py", "from ._state import get_state"),
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


#: flask-idem's public modules, as docs/api.rst lists them; every other module's name starts with "_".
PUBLIC_MODULES = {
    "alembic", "celery", "cli", "client", "errors", "flow", "jobs", "metrics", "migrations", "openapi",
    "recovery", "relay", "signals", "sqla", "testing", "tracing",
}  # fmt: skip


def private_imports(root: Path) -> list[str]:
    """Every import under ``root`` of a flask-idem module whose name starts with an underscore."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [
                f"{path.relative_to(root)}: {name}"
                for name in names
                if name.startswith("flask_idem.") and any(p.startswith("_") for p in name.split(".")[1:])
            ]
    return found


def test_the_public_modules_are_the_documented_ones() -> None:
    """A module of flask_idem without a leading underscore is one docs/api.rst lists, and the reverse."""
    on_disk = {
        path.stem if path.suffix == ".py" else path.name
        for path in (ROOT / "flask_idem").iterdir()
        if not path.name.startswith(("_", ".")) and (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert on_disk == PUBLIC_MODULES
    documented = (ROOT / "docs" / "api.rst").read_text("utf-8")
    assert all(f"``flask_idem.{name}``" in documented for name in PUBLIC_MODULES)


def test_the_shop_imports_only_public_api(tmp_path: Path) -> None:
    """The reference shop, which users copy, imports no private module of flask-idem; the check finds one
    planted in a copy of it."""
    assert private_imports(ROOT / "example_app") == []
    shutil.copytree(
        ROOT / "example_app", tmp_path / "example_app", ignore=shutil.ignore_patterns("__pycache__")
    )
    planted = tmp_path / "example_app" / "db.py"
    planted.write_text(planted.read_text("utf-8") + "\nfrom flask_idem import _state\n", "utf-8")
    assert private_imports(tmp_path / "example_app") == ["db.py: flask_idem._state"]
