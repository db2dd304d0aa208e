"""Fixtures of the hostile-input suite: captured logs, the notes app, the shop on a real server."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from flask import Flask

from ..support.helpers import gunicorn
from .checks import Reached, serve


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """Every log record at DEBUG and above, with Werkzeug's ANSI colours (control characters) turned off."""
    monkeypatch.setattr("werkzeug.serving._log_add_style", False)
    caplog.set_level(logging.DEBUG)
    return caplog


@pytest.fixture
def notes(make_app: Callable[..., Flask]) -> Flask:
    """The notes app, refusing bodies over 1 KiB."""
    return make_app(MAX_CONTENT_LENGTH=1024)


@pytest.fixture
def shop_port(app: Flask) -> Iterator[tuple[int, Reached]]:
    """The shop served by Werkzeug on loopback: its port, and how many requests reached it."""
    with serve(app) as served:
        yield served


@pytest.fixture(scope="module")
def gunicorn_port(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """The shop under gunicorn (one worker), shared by a module's tests: its port and its log file."""
    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    env = {"FLASK_DATABASE_URL": database_url, "FLASK_IDEM_POOL_MAX_SIZE": "2"}
    with gunicorn(log, env=env, workers=1, threads=2) as (base, _):
        yield int(base.rsplit(":", 1)[1]), log
