"""The ``flask idem`` commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from cryptography.fernet import Fernet
from flask import Flask
from psycopg import sql

from flask_idem import Idempotency, _partitions
from flask_idem.cli import idem_cli

from .support.helpers import close_pool
from .support.partitions import holding, insert, passed_table
from .support.servers import ROOT


def test_init_db_is_idempotent(app: Flask) -> None:
    """`flask idem init-db` can run twice."""
    runner = app.test_cli_runner()
    for _ in range(2):
        result = runner.invoke(args=["idem", "init-db"])
        assert result.exit_code == 0
        assert "idempotency_keys is ready" in result.output


def test_purge_reports_its_count(app: Flask) -> None:
    """`flask idem purge` prints the partitions it dropped and made, the tombstones it wrote and the
    flagged rows it moved (tests/test_cli.py::test_stats_shows_partitions_and_what_purge_waits_for has
    each count at work)."""
    result = app.test_cli_runner().invoke(args=["idem", "purge"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(
        r"Dropped 0 partition\(s\), wrote 0 tombstone\(s\), moved 0 flagged row\(s\); made \d+"
        r" partition\(s\) ahead.\n",
        result.output,
    ), result.output


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
    """`flask idem stats` counts rows by status and by flow and step, flagged rows and tombstones, and
    names the oldest processing request; its partitions follow."""
    table = "idempotency_keys"
    stranded = uuid.uuid4()
    db.execute(
        sql.SQL(
            "INSERT INTO {} (org_id, idem_key, request_sha, method, path, status, response,"
            " expires_at, flow, step, lease_token, lease_expires_at, needs_attention, created_at, attempts,"
            " last_error) VALUES"
            " (1, gen_random_uuid(), sha256('a'), 'POST', '/orders', 'completed', '{{}}',"
            "  now() + interval '1 day', NULL, NULL, NULL, NULL, false, now(), 0, NULL),"
            " (1, gen_random_uuid(), sha256('b'), 'POST', '/orders', 'completed', '{{}}',"
            "  now() - interval '1 h', NULL, NULL, NULL, NULL, false, now() - interval '1 day', 0, NULL),"
            " (2, %s, sha256('c'), 'POST', '/payments', 'processing', NULL, now() + interval '1 day',"
            "  'shop.payments.create', 'intent', gen_random_uuid(), now() - interval '1 minute', false,"
            "  now() - interval '300 seconds', 2, 'OutcomeUnknown'),"
            " (2, gen_random_uuid(), sha256('d'), 'POST', '/payments', 'failed', '{{}}',"
            "  now() + interval '1 day', 'shop.payments.create', 'charge', NULL, NULL, true, now(), 5,"
            "  'recovery deadline passed')"
        ).format(sql.Identifier(table)),
        (stranded,),
    )
    result = app.test_cli_runner().invoke(args=["idem", "stats"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert re.fullmatch(rf"Key table {table}: [\d.]+ kB with indexes \([\d.]+ kB of indexes\)", lines[0])
    end = 10
    assert lines[1:end] == [
        "Rows by status:",
        "  completed             2",
        "  failed                1",
        "  processing            1",
        "Multi-step rows by flow, status and last finished step:",
        "  shop.payments.create  failed       charge                    1",
        "  shop.payments.create  processing   intent                    1",
        "Flagged for a person: 1",
        "Tombstones: 0",
    ]
    oldest = re.fullmatch(
        f"Oldest processing request: org=2 key={stranded} flow=shop.payments.create step=intent attempts=2"
        r" age=(\d+)s last_error=OutcomeUnknown",
        lines[end],
    )
    assert oldest is not None, lines[end]
    assert 299 <= int(oldest[1]) <= 400
    assert lines[end + 1].startswith("Partitions of idempotency_keys: ")
    rows = sum(rows for *_, rows in partition_lines(result.output, "idempotency_keys"))
    assert rows == 4


def test_stats_of_an_empty_table(app: Flask) -> None:
    """On an empty table, stats says so line by line."""
    output = app.test_cli_runner().invoke(args=["idem", "stats"]).output
    assert "  (none)                0" in output
    assert "Multi-step rows" not in output
    assert "Oldest processing request: none\n" in output
    assert "Passed partitions waiting for purge: none" in output


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


def partition_lines(output: str, table: str) -> list[tuple[str, str, str, int]]:
    """The partitions stats lists under "Partitions of <table>:": name, range and rows."""
    section = output.split(f"Partitions of {table}: ", 1)[1].split("\nPartitions of ", 1)[0]
    section = section.split("\nPassed partitions", 1)[0]
    row = r"^  (\S+)  +(MINVALUE|[\d-]+ [\d:]+)  +([\d-]+ [\d:]+|MAXVALUE)  +(\d+)  +[\d.]+ (?:bytes|kB|MB)$"
    return [(m[1], m[2], m[3], int(m[4])) for m in re.finditer(row, section, flags=re.MULTILINE)]


def catalog_lines(
    db: psycopg.Connection[Any], table: str, rows: dict[str, int]
) -> list[tuple[str, str, str, int]]:
    """What partition_lines should read: the catalog's partitions of ``table``, with ``rows`` by name."""

    def moment(value: datetime | None, unbounded: str) -> str:
        return unbounded if value is None else f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S}"

    return [
        (p.name, moment(p.lower, "MINVALUE"), moment(p.upper, "MAXVALUE"), rows.get(p.name, 0))
        for p in _partitions.partitions(db, table)
    ]


def test_stats_shows_partitions_and_what_purge_waits_for(
    make_app: Callable[..., Flask], direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Stats lists both tables' partitions with their ranges and rows, the passed ones waiting
    for purge and why (a multi-step request in progress keeps one), and warns, naming purge, while the key
    table has no partition ahead; purge makes them, and drops the passed one once the request finished."""
    with passed_table(direct_database_url, "stats_keys") as table:
        insert(db, table, "done")
        insert(db, table, "flagged", status="failed", flagged=True)
        insert(db, table, "running", status="processing", response=None, flow="notes.transfer")
        first = _partitions.partitions(db, table)[0]
        assert first.name == "stats_keys_p0" and first.upper is not None
        ended = f"{first.upper.astimezone(UTC):%Y-%m-%d %H:%M:%S}"
        runner = make_app(IDEM_TABLE=table).test_cli_runner()

        def stats() -> str:
            result = runner.invoke(args=["idem", "stats"])
            assert result.exit_code == 0, result.output
            return result.output

        # Nothing ahead: the passed first partition is all there is, and requests would fail.
        output = stats()
        assert partition_lines(output, table) == [("stats_keys_p0", "MINVALUE", ended, 3)]
        assert f"Partitions of {table}: 1; stats_keys_p0, ends {ended} UTC (2.0 h ago)\n" in output
        assert f"Partitions of {table}_tombstones: 0\n" in output
        waiting = output.split("Passed partitions waiting for purge:\n", 1)[1].splitlines()
        assert waiting[0] == (
            "  stats_keys_p0 (ended 2.0 h ago): kept while 1 multi-step request(s) are in progress; dropped"
            " by the first purge after they finish"
        )
        assert waiting[1] == (
            f"Warning: The newest partition of the key table {table} ends at {ended} UTC, which passed: less"
            " than the longest retention (24.0 h): requests whose key would expire after it fail now. Run"
            " 'flask idem purge' as the tables' owner (it makes partitions ahead), and run it daily."
        )
        assert len(waiting) == 2

        # Purge makes partitions ahead and keeps the passed one while the request runs: no warning.
        purged = runner.invoke(args=["idem", "purge"])
        assert purged.exit_code == 0, purged.output
        assert "Kept stats_keys_p0: 1 multi-step request(s) still in progress" in purged.output
        output = stats()
        keys = catalog_lines(db, table, {"stats_keys_p0": 3})
        # The passed one, a day each until a day past the longest retention, then a spare one until 8 days
        # ahead (IDEM_PARTITION_AHEAD). They follow one another from the passed one's end, or from the
        # start of today's interval when it ended before that (no row can expire in the past).
        assert len(keys) >= 4
        assert [line[2] for line in keys[1:-1]] == [line[1] for line in keys[2:]]
        [(now,)] = db.execute("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')").fetchall()
        assert keys[0][2] <= keys[1][1] <= now < keys[1][2]
        assert partition_lines(output, table) == keys
        assert partition_lines(output, f"{table}_tombstones") == catalog_lines(db, f"{table}_tombstones", {})
        newest = _partitions.partitions(db, table)[-1]
        assert newest.upper is not None
        # Eight days ahead (IDEM_KEY_TTL and IDEM_PARTITION_AHEAD), to the next midnight: up to nine.
        left = _partitions.duration((newest.upper - datetime.fromisoformat(now + "+00:00")).total_seconds())
        assert left.startswith(("8.", "9.0")), left
        assert f"the newest, {newest.name}, ends {keys[-1][2]} UTC (in {left})" in output
        assert "Passed partitions waiting for purge:\n  stats_keys_p0 (ended 2.0 h ago): kept while" in output
        assert "Warning" not in output

        # Once it finished, purge writes the tombstones, moves the flagged row and drops the partition.
        db.execute(
            sql.SQL(
                "UPDATE {} SET status = 'completed', response = '{{}}', lease_token = NULL"
                " WHERE flow IS NOT NULL"
            ).format(sql.Identifier(table))
        )
        purged = runner.invoke(args=["idem", "purge"])
        assert "Dropped 1 partition(s), wrote 2 tombstone(s), moved 1 flagged row(s)" in purged.output
        output = stats()
        [(moved,)] = db.execute(sql.SQL("SELECT expires_at FROM {}").format(sql.Identifier(table))).fetchall()
        keys = catalog_lines(db, table, {holding(db, table, moved).name: 1})
        assert keys[0][0] != "stats_keys_p0" and partition_lines(output, table) == keys
        tombstones = partition_lines(output, f"{table}_tombstones")
        assert sum(rows for *_, rows in tombstones) == 2
        assert [line[:3] for line in tombstones] == [
            line[:3] for line in catalog_lines(db, f"{table}_tombstones", {})
        ]
        assert "Tombstones: 2\n" in output
        assert "Passed partitions waiting for purge: none\n" in output
