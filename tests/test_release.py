"""What a release would ship: ``uv build`` makes an sdist and, from it, a wheel that twine accepts, both
versioned from git, and the wheel installed alone in a fresh virtual environment runs docs/quickstart.rst.

The wheel is installed with the versions of the environment running the suite (uv's cache has them,
so the install works offline), and the quickstart runs in a temporary directory with no path to the
checkout: ``import flask_idem`` finds the installed wheel.
"""

from __future__ import annotations

import email.parser
import http.client
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .support import citus
from .support.servers import ROOT, free_port, wait_for
from .test_quickstart import Command, curl_request, documented_answer, follow_quickstart, quickstart_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(citus.ENABLED, reason="the quickstart runs on one PostgreSQL server, not Citus"),
]

#: The version setuptools-scm makes before the first tag (pyproject.toml's [tool.hatch.version]): the
#: number of commits, the commit, and the date when the working tree has uncommitted changes.
UNTAGGED_VERSION = re.compile(r"0\.1\.0\.dev(?P<commits>\d+)\+g(?P<node>[0-9a-f]{7,})(?:\.d(?P<date>\d{8}))?")


def _uv() -> str:
    """The uv binary: the one running the suite (``uv run`` names it in ``UV``), else the one on PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv is not on PATH; the README's test command runs the suite through it"
    return found


def _run_uv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run uv offline, from its cache, and online (from the package registry) only if that fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    tries = []
    for offline in (["--offline"], []):
        result = subprocess.run(
            [_uv(), *args, *offline], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        if result.returncode == 0:
            return result
        tries.append(f"$ uv {' '.join([*args, *offline])}\n{result.stdout}{result.stderr}")
    raise AssertionError("\n".join(tries))


@dataclass
class Artifacts:
    """The sdist and the wheel of one ``uv build``."""

    sdist: Path
    wheel: Path

    @property
    def version(self) -> str:
        """The version in the wheel's name."""
        return self.wheel.name.split("-")[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    """``uv build`` of the checkout: the sdist, then the wheel built from the sdist (which has no .git)."""
    out = tmp_path_factory.mktemp("dist")
    _run_uv("build", "--out-dir", str(out), str(ROOT), cwd=out)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Artifacts(sdist, wheel)


def test_twine_check_passes(built: Artifacts) -> None:
    """``twine check --strict`` passes on both artifacts (metadata, and the README as the description)."""
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built.sdist), str(built.wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_wheel_holds_the_package_and_nothing_else(built: Artifacts) -> None:
    """The wheel has every file of flask_idem/ (its .sql files, migrations, py.typed, the test kit), the
    license, the ``flask idem`` entry point and the README as the description; nothing of tests/,
    example_app/, docs/ or bench/."""
    package = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "flask_idem").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert {"flask_idem/py.typed", "flask_idem/_store.sql"} <= package
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        dist_info = f"flask_idem-{built.version}.dist-info"
        assert {n for n in names if not n.startswith(dist_info + "/")} == package
        assert f"{dist_info}/licenses/LICENSE" in names
        entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
        metadata = email.parser.Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    assert "[flask.commands]\nidem = flask_idem.cli:idem_cli" in entry_points
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()


def test_sdist_holds_what_the_suite_and_the_docs_need(built: Artifacts) -> None:
    """The sdist has the package, the docs, the tests and the examples with the files that configure
    them (setup.cfg has pytest's and mypy's settings), and not CI's script or the benchmarks."""
    with tarfile.open(built.sdist) as sdist:
        top = {name.split("/")[1] for name in sdist.getnames() if "/" in name}
    assert top == {
        *("flask_idem", "docs", "tests", "example_app"),
        *("pyproject.toml", "setup.cfg", "README.md", "LICENSE", "CHANGES.rst", "PKG-INFO", ".gitignore"),
    }


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_version_is_the_commit(built: Artifacts) -> None:
    """Both artifacts carry the version made from git: the count of commits, the commit, and a date
    exactly when tracked files have uncommitted changes (in an unpacked sdist: the version it carries)."""
    assert built.sdist.name == f"flask_idem-{built.version}.tar.gz"
    if not (ROOT / ".git").exists():
        pkg_info = email.parser.HeaderParser().parsestr((ROOT / "PKG-INFO").read_text())
        assert built.version == pkg_info["Version"]
        return
    assert _git("tag", "--list") == "", "a tag changes the version's base: update UNTAGGED_VERSION"
    version = UNTAGGED_VERSION.fullmatch(built.version)
    assert version is not None, built.version
    assert int(version["commits"]) == int(_git("rev-list", "--count", "HEAD"))
    assert _git("rev-parse", "HEAD").startswith(version["node"])
    assert (version["date"] is not None) == bool(_git("status", "--porcelain", "--untracked-files=no"))


@pytest.fixture(scope="module")
def venv(built: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and its ``binary`` extra, and nothing of the checkout."""
    work = tmp_path_factory.mktemp("venv")
    _run_uv("venv", "--quiet", "--python", sys.executable, str(work / "venv"), cwd=work)
    pins = work / "constraints.txt"
    pins.write_text(
        "".join(
            f"{dist.metadata['Name']}=={dist.version}\n"
            for dist in importlib.metadata.distributions()
            if dist.metadata["Name"] != "flask-idem"
        )
    )
    python = work / "venv" / "bin" / "python"
    _run_uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(python),
        "-c",
        str(pins),
        f"{built.wheel}[binary]",
        cwd=work,
    )
    return work / "venv"


def test_installed_wheel_is_imported(built: Artifacts, venv: Path, tmp_path: Path) -> None:
    """From a directory outside the checkout, the environment imports flask_idem from its own
    site-packages, and the package and ``flask idem --version`` report the wheel's version."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import flask_idem; print(flask_idem.__file__, flask_idem.__version__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    path, version = found.stdout.split()
    assert Path(path).is_relative_to(venv) and not Path(path).is_relative_to(ROOT), path
    assert version == built.version
    cli = subprocess.run(
        [str(venv / "bin" / "flask"), "idem", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.stdout == f"flask-idem, version {built.version}\n", cli.stdout + cli.stderr


def test_installed_wheel_runs_the_quickstart(
    venv: Path, tmp_path: Path, server_url: str, app_server_url: str, direct_database_url: str
) -> None:
    """The quickstart, followed with the environment's ``flask``, then served by ``flask --app quickstart
    run`` as the page says, answers its curl commands as the page shows."""
    name = conninfo_to_dict(direct_database_url)["dbname"] + "_release"
    env = quickstart_env(venv / "bin", server_url, make_conninfo(app_server_url, dbname=name))
    env.pop("PYTHONPATH", None)
    env["VIRTUAL_ENV"] = str(venv)
    port = free_port()
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    try:
        requests = follow_quickstart(tmp_path, env, name)
        assert requests, "the page has no curl commands"
        log = (tmp_path / "server.log").open("w")
        server = subprocess.Popen(
            ["flask", "--app", "quickstart", "run", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: _answers(port, server),
                60,
                0.1,
                message=lambda: (tmp_path / "server.log").read_text(),
                ignore=ConnectionRefusedError,
            )
            for command in requests:
                _check_answer(port, command)
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _answers(port: int, server: subprocess.Popen[bytes]) -> bool:
    assert server.poll() is None, f"flask run exited with {server.returncode}"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/")
        connection.getresponse().read()
    finally:
        connection.close()
    return True


#: Headers of the connection, not of the answer: the page leaves them out.
TRANSPORT_HEADERS = {"Server", "Date", "Content-Length", "Connection"}


def _check_answer(port: int, command: Command) -> None:
    """Send a documented curl command to the server and compare its answer with the page's."""
    method, path, headers, data = curl_request(command.line)
    status, documented, body = documented_answer(command)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        answer = response.read().decode()
    finally:
        connection.close()
    assert f"HTTP/1.1 {response.status} {response.reason}" == status, command.line
    assert documented == {k: v for k, v in response.getheaders() if k not in TRANSPORT_HEADERS}
    assert answer.strip() == body
