"""Browser fixtures: Debian's Chromium driven by Playwright, one browser per test process.

Nothing is downloaded: Playwright (a PyPI package that carries its own driver) starts the system's
``/usr/bin/chromium``. Without it the browser tests are skipped, saying how to install it. Under
``pytest -n auto`` every xdist worker is its own process with its own browser, so none is shared.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from ..support.servers import ROOT

#: Where each browser test leaves a screenshot of the page's final state.
SCREENSHOTS = ROOT / "build" / "screenshots"

INSTALL = "apt-get install -y chromium chromium-driver"


def chromium_path() -> str | None:
    """The system Chromium, if installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """A headless system Chromium for this test process."""
    executable = chromium_path()
    if executable is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail(f"Chromium is not installed; .ci/run should have run: {INSTALL}")
        pytest.skip(f"Chromium is not installed; install it with: {INSTALL}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def screenshot_path(request: pytest.FixtureRequest) -> Path:
    """The file this test's final screenshot goes to."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    return SCREENSHOTS / f"{name}.png"
