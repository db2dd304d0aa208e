"""The ``flask idem`` commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import psycopg
from cryptography.fernet import Fernet
from flask import Flask

from flask_idem import Idempotency
from flask_idem.cli import idem_cli

from .support.helpers import close_pool
from .support.servers import ROOT


def test_init_db_is_idempotent(app: Flask) -> None:
    """`flask idem init-db` can run twice."""
    runner = app.test_cli_runner()
    for _ in range(2):
        result = runner.invoke(args=["idem", "init-db"])
        assert result.exit_code == 0
        assert "idempotency_keys is ready" in result.output


def test_purge_reports_its_count(app: Flask, db: psycopg.Connection[Any]) -> None:
    """`flask idem purge` prints how many keys it removed and how many it turned into tombstones."""
    result = app.test_cli_runner().invoke(args=["idem", "purge", "--batch-size", "10"])
    assert result.exit_code == 0
    assert result.output.strip() == "Purged 0 expired key(s); 0 turned into tombstones."


def test_recover_and_stuck_with_nothing_to_do(app: Flask) -> None:
    """With no stranded requests, recover and stuck say so."""
    runner = app.test_cli_runner()
    assert "Claimed 0" in runner.invoke(args=["idem", "recover"]).output
    assert runner.invoke(args=["idem", "stuck"]).output.strip() == "0 row(s)."


def test_unreachable_database_is_one_clean_message() -> None:
    """A command that cannot reach the database says why in libpq's words, without the password."""
    app = Flask(__name__)
    app.config.update(
        IDEM_DATABASE_URL="postgresql://idem:s3cr3t-pw@127.0.0.1:1/secretdb?connect_timeout=1",
        IDEM_POOL_TIMEOUT=0.5,
    )
    Idempotency(app, scope=lambda: 1)
    try:
        result = app.test_cli_runner().invoke(args=["idem", "init-db"])
    finally:
        close_pool(app)
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot connect to the database: ")
    assert "port 1 failed: Connection refused" in result.output
    assert "s3cr3t" not in result.output


def test_stats_shows_the_table_at_a_glance(app: Flask, db: psycopg.Connection[Any]) -> None:
    """`flask idem stats` counts rows by status and by flow and step, flagged and purgeable rows, and
    names the oldest processing request."""
    import re
    import uuid

    stranded = uuid.uuid4()
    db.execute(
        "INSERT INTO idempotency_keys (org_id, idem_key, request_sha, method, path, status, response,"
        " expires_at, flow, step, lease_token, lease_expires_at, needs_attention, created_at, attempts,"
        " last_error) VALUES"
        " (1, gen_random_uuid(), sha256('a'), 'POST', '/orders', 'completed', '{}', now() + interval '1 day',"
        "  NULL, NULL, NULL, NULL, false, now(), 0, NULL),"
        " (1, gen_random_uuid(), sha256('b'), 'POST', '/orders', 'completed', '{}', now() - interval '1 h',"
        "  NULL, NULL, NULL, NULL, false, now() - interval '1 day', 0, NULL),"
        " (2, %s, sha256('c'), 'POST', '/payments', 'processing', NULL, now() + interval '1 day',"
        "  'shop.payments.create', 'intent', gen_random_uuid(), now() - interval '1 minute', false,"
        "  now() - interval '300 seconds', 2, 'OutcomeUnknown'),"
        " (2, gen_random_uuid(), sha256('d'), 'POST', '/payments', 'failed', '{}', now() + interval '1 day',"
        "  'shop.payments.create', 'charge', NULL, NULL, true, now(), 5, 'recovery deadline passed')",
        (stranded,),
    )
    result = app.test_cli_runner().invoke(args=["idem", "stats"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert re.fullmatch(
        r"Key table idempotency_keys: [\d.]+ kB with indexes \([\d.]+ kB of indexes\)", lines[0]
    )
    assert lines[1:-1] == [
        "Rows by status:",
        "  completed             2",
        "  failed                1",
        "  processing            1",
        "Multi-step rows by flow, status and last finished step:",
        "  shop.payments.create  failed       charge                    1",
        "  shop.payments.create  processing   intent                    1",
        "Flagged for a person: 1",
        "Tombstones: 0",
        "Waiting for purge: 1 to become tombstones, 0 to delete",
    ]
    oldest = re.fullmatch(
        f"Oldest processing request: org=2 key={stranded} flow=shop.payments.create step=intent attempts=2"
        r" age=(\d+)s last_error=OutcomeUnknown",
        lines[-1],
    )
    assert oldest is not None, lines[-1]
    assert 299 <= int(oldest[1]) <= 400


def test_stats_of_an_empty_table(app: Flask) -> None:
    """On an empty table, stats says so line by line."""
    output = app.test_cli_runner().invoke(args=["idem", "stats"]).output
    assert "  (none)                0" in output
    assert "Multi-step rows" not in output
    assert output.endswith("Oldest processing request: none\n")


def test_the_docs_table_lists_every_command() -> None:
    """docs/cli.rst's table of commands names each command of the group, in the group's order, and no
    other, so that a page read as a file (where sphinx-click renders nothing) lists what there is."""
    text = (ROOT / "docs" / "cli.rst").read_text("utf-8")
    table = text.split(".. list-table::", 1)[1].split(".. click::", 1)[0]
    listed = re.findall(r"^    \*   - ``([a-z-]+)``$", table, flags=re.MULTILINE)
    assert listed == list(idem_cli.commands)


def test_new_response_key_runs_when_the_keys_keep_the_application_from_loading(database_url: str) -> None:
    """With a malformed IDEM_RESPONSE_KEYS the application does not load, and its error names `flask idem
    new-response-key`: that command runs all the same (it needs no application) through the real
    `flask` CLI, and the key it prints lets the application load."""

    def flask(keys: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "FLASK_DATABASE_URL": database_url,
            "FLASK_IDEM_DATABASE_URL": database_url,
            "FLASK_IDEM_RESPONSE_KEYS": keys,
        }
        command = [sys.executable, "-m", "flask", "--app", "example_app", "idem", *args]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    broken = flask("not-a-key", "stats")
    assert broken.returncode != 0
    assert "make one with 'flask idem new-response-key'" in broken.stderr
    made = flask("not-a-key", "new-response-key")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    Fernet(key)  # a key Fernet takes
    fixed = flask(key, "stats")
    assert fixed.returncode == 0, fixed.stderr
    assert "Key table idempotency_keys" in fixed.stdout


def test_a_command_on_an_application_without_flask_idem_says_so() -> None:
    """The idem group reaches every Flask application through its entry point: on one without flask-idem a
    command exits 1 with one line naming init_app, not a traceback."""
    result = Flask("plain").test_cli_runner().invoke(idem_cli, ["stats"])
    assert result.exit_code == 1
    assert "flask-idem is not initialised on this application" in result.output
    assert "Traceback" not in result.output
