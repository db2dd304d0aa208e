"""The plain Alembic project of the upgrades page (``tests/support/plain_alembic``), copied into a folder
of the test's own with a quickstart-like application, and the ``alembic`` command run in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import citus
from .servers import ROOT

__all__ = ["PLAIN_ALEMBIC", "QUICKSTART", "alembic", "plain_project"]

#: The plain Alembic project of the upgrades page: alembic.ini, migrations/env.py, script.py.mako.
PLAIN_ALEMBIC = ROOT / "tests" / "support" / "plain_alembic"

#: The application the plain project's env.py imports: the quickstart's shape, plain psycopg.
QUICKSTART = """
from flask import Flask, g, request

from flask_idem import Idempotency

idem = Idempotency(scope=lambda: g.get("org_id"))


def create_app():
    app = Flask(__name__)
    app.config["IDEM_DATABASE_URL"] = "postgresql://localhost/shop"
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    app.config.from_prefixed_env()
    idem.init_app(app)

    @app.before_request
    def authenticate():
        g.org_id = 1

    @app.post("/orders")
    @idem.idempotent()
    def create_order():
        row = idem.connection.execute(
            "INSERT INTO orders (org_id, note) VALUES (%s, %s) RETURNING id",
            (g.org_id, request.get_json()["note"]),
        ).fetchone()
        return {"id": row[0]}, 201

    return app
"""


def plain_project(directory: Path, *, ini: str | None = None) -> Path:
    """The plain Alembic project copied into ``directory``, with the quickstart-like application."""
    shutil.copytree(PLAIN_ALEMBIC, directory)
    (directory / "migrations" / "versions").mkdir()
    (directory / "quickstart").mkdir()
    (directory / "quickstart" / "__init__.py").write_text(QUICKSTART)
    if ini is not None:
        (directory / "alembic.ini").write_text(ini)
    return directory


def alembic(
    project: Path, conninfo: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``alembic ARGS`` run in ``project``, the application pointed at ``conninfo`` as a deployment
    would (``FLASK_IDEM_DATABASE_URL``), with more ``FLASK_IDEM_*`` settings in ``env``."""
    return deployed(project, conninfo, "alembic", *args, env=env)


def deployed(
    cwd: Path, conninfo: str, module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in a process of its own, in ``cwd``, pointed at ``conninfo`` as a
    deployment would (``FLASK_IDEM_DATABASE_URL``, and ``FLASK_IDEM_DISTRIBUTED`` on Citus), with more
    ``FLASK_IDEM_*`` settings in ``env``."""
    environment = {**os.environ, "FLASK_IDEM_DATABASE_URL": conninfo, **(env or {})}
    if citus.ENABLED:
        environment["FLASK_IDEM_DISTRIBUTED"] = "true"
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
