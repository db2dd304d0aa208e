"""The documentation builds without a warning, so every docstring it includes is valid reStructuredText;
and its configuration page says what the table of settings says."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flask_idem._settings import REQUIRED, SETTINGS

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


def config_entries() -> dict[str, str]:
    """Each ``.. data:: IDEM_*`` entry of docs/config.rst, by key: its indented text on one line."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (ROOT / "docs" / "config.rst").read_text("utf-8").splitlines():
        if line.startswith(".. data:: "):
            current = entries.setdefault(line.removeprefix(".. data:: ").strip(), [])
        elif current is not None and (not line.strip() or line.startswith(" ")):
            current.append(line.strip() or "\n")
        else:
            current = None
    return {key: " ".join(lines) for key, lines in entries.items()}


def test_config_page_mirrors_the_table_of_settings() -> None:
    """Every key of flask_idem._settings.SETTINGS has an entry in docs/config.rst and every entry a key,
    and each entry's "Default:" shows the table's default (a required key says it has none)."""
    entries = config_entries()
    assert sorted(entries) == sorted(SETTINGS)
    for key, setting in SETTINGS.items():
        found = re.search(r"Default: (.*?)(?: \n|$)", entries[key])
        if setting.default is REQUIRED:
            assert found is None and "There is no default." in entries[key], key
            continue
        assert found is not None, f"{key} shows no default"
        if setting.shown is not None:
            assert found[1].startswith(setting.shown), (key, found[1])
            continue
        literal = re.match(r"``(.+?)``", found[1])
        assert literal is not None, (key, found[1])
        shown = ast.literal_eval(literal[1])
        assert (shown, type(shown) is bool) == (setting.default, type(setting.default) is bool), key
