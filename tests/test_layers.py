"""Static checks of the package run in the suite: the layering contract, the public face, and mypy."""

from __future__ import annotations

import ast
import os
import re
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


def http_imports(path: Path) -> list[str]:
    """The Flask and Werkzeug modules ``path`` imports (at any depth of its code)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return sorted(name for name in found if name.split(".")[0] in ("flask", "werkzeug"))


def test_the_protocol_knows_no_http(tmp_path: Path) -> None:
    """The key protocol, its engine and its transactions import neither Flask nor Werkzeug (each door maps
    outcomes to its world); the check finds one planted in a copy."""
    modules = ("_protocol.py", "_steps.py", "_transactions.py", "_records.py", "_store.py")
    assert {m: http_imports(ROOT / "flask_idem" / m) for m in modules} == {m: [] for m in modules}
    planted = tmp_path / "_protocol.py"
    planted.write_text(
        (ROOT / "flask_idem" / "_protocol.py").read_text("utf-8") + "\nfrom flask import Response\n"
    )
    assert http_imports(planted) == ["flask"]


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("_store.py", "from ._extension import Idempotency"),
        ("_view.py", "if TYPE_CHECKING:\n    from ._extension import Idempotency"),
        ("_settings.py", "from ._state import get_state"),
        ("_retry.py", "from .client import IdempotentClient"),
        ("_webhook.py", "from ._view import handle"),
        ("recovery.py", "from ._delivery import run_delivery"),
        ("_http.py", "from ._view import ViewOptions"),
        ("_jobs_state.py", "from ._delivery import run_delivery"),
    ],
    ids=[
        "store-imports-extension",
        "view-imports-extension-for-typing",
        "settings-imports-state",
        "retry-engine-imports-client",
        "webhook-door-imports-request-door",
        "recovery-door-imports-job-door",
        "shared-http-imports-a-door",
        "jobs-state-imports-job-door",
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


def documented_modules() -> set[str]:
    """The modules docs/api.rst lists in its table of modules: flask-idem's public ones."""
    text = (ROOT / "docs" / "api.rst").read_text("utf-8")
    return set(re.findall(r"^``(flask_idem(?:\.\w+)*)``  ", text, re.MULTILINE))


def public_modules() -> set[str]:
    """Every module and package of flask_idem whose dotted name has no part with a leading underscore.

    The revision files in ``flask_idem.migrations`` are Alembic's, documented as that package.
    """
    found = set()
    for path in (ROOT / "flask_idem").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            found.add(".".join(parts))
    return {name for name in found if not name.startswith("flask_idem.migrations.")}


def private_uses(root: Path) -> list[str]:
    """Every import under ``root`` of a flask-idem module whose name starts with an underscore, and every
    look-up of flask-idem's private per-application state (``app.extensions["idem"]``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif _extensions_idem(node):
                names = ['extensions["idem"]']
            else:
                continue
            found += [
                f"{path.relative_to(root)}: {name}"
                for name in names
                if name == 'extensions["idem"]'
                or (name.startswith("flask_idem.") and any(p.startswith("_") for p in name.split(".")[1:]))
            ]
    return found


def _extensions_idem(node: ast.AST) -> bool:
    """Whether ``node`` is ``<something>.extensions["idem"]`` or ``<something>.extensions.get("idem")``."""
    if isinstance(node, ast.Subscript):
        target, key = node.value, node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        target, key = node.func.value, node.args[0] if node.args else None
    else:
        return False
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "extensions"
        and isinstance(key, ast.Constant)
        and key.value == "idem"
    )


def test_the_public_modules_are_the_documented_ones() -> None:
    """A module of flask_idem without a leading underscore in its name is one docs/api.rst lists, and the
    reverse."""
    documented = documented_modules()
    assert "flask_idem.testing" in documented  # the table was found
    assert public_modules() | {"flask_idem"} == documented


def test_the_shop_imports_only_public_api(tmp_path: Path) -> None:
    """The reference shop, which users copy, uses no private module or state of flask-idem; the check
    finds both planted in a copy of it."""
    assert private_uses(ROOT / "example_app") == []
    shutil.copytree(
        ROOT / "example_app", tmp_path / "example_app", ignore=shutil.ignore_patterns("__pycache__")
    )
    planted = tmp_path / "example_app" / "db.py"
    planted.write_text(
        planted.read_text("utf-8")
        + "\nfrom flask_idem import _state\n"
        + "\nSETTINGS = current_app.extensions['idem'].settings\n",
        "utf-8",
    )
    assert private_uses(tmp_path / "example_app") == [
        "db.py: flask_idem._state",
        'db.py: extensions["idem"]',
    ]


def documented_names(module: str) -> set[str]:
    """The names docs/api.rst documents under ``.. module:: <module>``, up to the next module."""
    text = (ROOT / "docs" / "api.rst").read_text("utf-8")
    section = text.split(f".. module:: {module}\n", 1)[1].split(".. module:: ", 1)[0]
    return set(re.findall(r"^\.\. auto(?:class|exception|function|data):: (\w+)", section, re.MULTILINE))


def test_the_jobs_module_exports_what_a_runner_needs() -> None:
    """``flask_idem.jobs`` exports the names docs/api.rst documents for it and no others: the tasks, their
    errors and policy, and what a runner hands over and gets back; about a dozen, not its internals."""
    import flask_idem.jobs

    assert set(flask_idem.jobs.__all__) == documented_names("flask_idem.jobs")
    assert len(flask_idem.jobs.__all__) <= 14
    internals = {"run_delivery", "JobsState", "get_jobs", "Delivery", "Outcome"}
    assert internals.isdisjoint(flask_idem.jobs.__all__)
