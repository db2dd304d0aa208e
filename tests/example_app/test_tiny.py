"""The tiny example (``example_app/tiny.py``): its two routes, its commands, and that it stands alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient

from example_app.tiny import Mailer, create_app
from flask_idem.testing import Rows, check_in_flight, crash_between_steps

from ..support.helpers import ROOT, close_pool, count, free_port, wait_for_http

AUTH = {"Authorization": "Bearer tiny-key"}
ADA = {"email": "ada@example.com"}


@pytest.fixture
def tiny(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> Iterator[Flask]:
    """The tiny example on this worker's database, mailing into a directory of the test's own."""
    app = create_app({"TESTING": True, "DATABASE_URL": database_url, "MAIL_DIR": str(tmp_path / "mail")})
    created = app.test_cli_runner().invoke(args=["init-db"])
    assert created.exit_code == 0, created.output
    yield app
    close_pool(app)


@pytest.fixture
def client(tiny: Flask) -> FlaskClient:
    return tiny.test_client()


def post(client: FlaskClient, path: str, key: uuid.UUID, json: Any = None) -> Any:
    return client.post(path, json=json, headers={**AUTH, "Idempotency-Key": str(key)})


def mails(app: Flask) -> list[str]:
    """The messages the stand-in mailer has sent, as their files' texts."""
    directory = Path(app.config["MAIL_DIR"])
    return [path.read_text("utf-8") for path in sorted(directory.glob("*.eml"))]


def invite(client: FlaskClient) -> int:
    answer = post(client, "/invites", uuid.uuid4(), ADA)
    assert answer.status_code == 201, answer.get_data(as_text=True)
    return int(answer.json["id"])


def test_an_invite_is_created_once_per_key(client: FlaskClient, db: psycopg.Connection[Any]) -> None:
    """A fresh key creates the invite (201) with the key; the same request again is replayed (200)."""
    key = uuid.uuid4()
    first = post(client, "/invites", key, ADA)
    assert first.status_code == 201 and first.json == {"id": 1, "email": "ada@example.com"}
    again = post(client, "/invites", key, ADA)
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json == first.json
    assert db.execute("SELECT org_id, idempotency_key, email FROM invites").fetchall() == [
        (1, key, "ada@example.com")
    ]


def test_a_retry_the_key_table_forgot_answers_from_the_invite(
    client: FlaskClient, db: psycopg.Connection[Any]
) -> None:
    """Past both retention periods flask-idem has forgotten the key (here: its record deleted, as after
    IDEM_TOMBSTONE_TTL), so the view runs again: the same request gets its invite again (200), another
    address under that key 422 naming the invite; still one invite."""
    key = uuid.uuid4()
    first = post(client, "/invites", key, ADA)
    assert first.status_code == 201
    db.execute("DELETE FROM idempotency_keys")
    late = post(client, "/invites", key, ADA)
    assert (late.status_code, late.json) == (200, first.json)
    db.execute("DELETE FROM idempotency_keys")
    other = post(client, "/invites", key, {"email": "bob@example.com"})
    assert (other.status_code, other.mimetype) == (422, "application/problem+json")
    assert f"made invite {first.json['id']}, for another address" in other.json["detail"]
    assert count(db, "invites") == 1


def test_the_factory_touches_no_database(tmp_path: Path) -> None:
    """``create_app`` makes no connection and no table: it succeeds on a server that is not there; the
    tables are ``init-db``'s."""
    app = create_app({"TESTING": True, "DATABASE_URL": "postgresql://127.0.0.1:1/none"})
    try:
        assert "init-db" in app.cli.commands
    finally:
        close_pool(app)


def test_init_db_makes_both_tables_and_may_run_again(tiny: Flask, db: psycopg.Connection[Any]) -> None:
    """``flask --app example_app.tiny init-db`` (the fixture ran it once) makes the key table and the
    invites table, and changes nothing when run again."""
    again = tiny.test_cli_runner().invoke(args=["init-db"])
    assert again.exit_code == 0, again.output
    assert again.output == "The key table and the invites table are ready.\n"
    found = db.execute(
        "SELECT count(*) FROM pg_tables WHERE tablename IN ('invites', 'idempotency_keys')"
    ).fetchone()
    assert found == (2,)


def test_it_can_be_copied_alone() -> None:
    """tiny.py imports nothing of the shop (no relative import, no ``example_app``): it is one file."""
    tree = ast.parse((ROOT / "example_app" / "tiny.py").read_text("utf-8"))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if not (isinstance(node, ast.ImportFrom) and node.level)
    ]
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []
    assert "flask_idem.testing" in imported  # the walk finds the import inside a function too
    assert [name for name in imported if name and name.split(".")[0] == "example_app"] == []


def test_a_reused_key_with_another_email_is_422(client: FlaskClient, db: psycopg.Connection[Any]) -> None:
    """The same key with another body: 422 problem+json, and still one invite."""
    key = uuid.uuid4()
    assert post(client, "/invites", key, ADA).status_code == 201
    changed = post(client, "/invites", key, {"email": "bob@example.com"})
    assert (changed.status_code, changed.mimetype) == (422, "application/problem+json")
    assert Rows(db, "invites")() == 1


def test_a_duplicate_in_flight_is_409(tiny: Flask, db: psycopg.Connection[Any]) -> None:
    """While the first request is inside its transaction, the duplicate is told 409 with Retry-After."""
    first, duplicate = check_in_flight(
        tiny, "POST", "/invites", json=ADA, headers=AUTH, effect=Rows(db, "invites")
    )
    assert first.status_code == 201 and duplicate.status_code == 409


@pytest.mark.parametrize(
    ("headers", "json", "status"),
    [({}, ADA, 401), (AUTH, {"email": 5}, 400), (AUTH, ["ada@example.com"], 400)],
    ids=["no-api-key", "email-not-a-string", "not-an-object"],
)
def test_mistakes_are_problems(
    client: FlaskClient, db: psycopg.Connection[Any], headers: dict[str, str], json: Any, status: int
) -> None:
    """No API key is 401, a body without an e-mail address 400; both problem+json, no invite."""
    answer = client.post("/invites", json=json, headers={**headers, "Idempotency-Key": str(uuid.uuid4())})
    assert (answer.status_code, answer.mimetype) == (status, "application/problem+json")
    assert Rows(db, "invites")() == 0


def test_sending_mails_once_and_replays(
    tiny: Flask, client: FlaskClient, db: psycopg.Connection[Any]
) -> None:
    """The flow mails the invite once, records the message on it and answers 201; the retry is a replay
    and mails nothing more."""
    invite_id, key = invite(client), uuid.uuid4()
    first = post(client, f"/invites/{invite_id}/send", key)
    assert first.status_code == 201, first.get_data(as_text=True)
    message_id = first.json["message_id"]
    assert mails(tiny) == [
        f"To: ada@example.com\nSubject: You are invited\n\nYou are invited (invite {invite_id}).\n"
    ]
    assert db.execute("SELECT message_id FROM invites").fetchall() == [(message_id,)]
    again = post(client, f"/invites/{invite_id}/send", key)
    assert (again.status_code, again.headers["Idempotent-Replayed"]) == (200, "true")
    assert again.json == first.json and len(mails(tiny)) == 1


def test_sending_an_unknown_invite_is_404(tiny: Flask, client: FlaskClient) -> None:
    """Another organisation's invite, or none, is 404 problem+json, and nothing is mailed."""
    answer = post(client, "/invites/999/send", uuid.uuid4())
    assert (answer.status_code, answer.mimetype) == (404, "application/problem+json")
    assert mails(tiny) == []


def test_sending_survives_a_crash_after_each_step(tiny: Flask, client: FlaskClient) -> None:
    """Killed in the view, after the mail or in the finish step: each request still mails once."""
    invite_id = invite(client)
    points = crash_between_steps(
        tiny, "POST", f"/invites/{invite_id}/send", headers=AUTH, outside=lambda: len(mails(tiny))
    )
    assert points == ["view", "mail", "finish"]


def test_the_mailer_sends_once_per_key(tmp_path: Path) -> None:
    """The stand-in mail service: a second send under one key keeps the first message, and leaves no
    draft behind; find knows the key."""
    mailer = Mailer(tmp_path)
    assert mailer.find("k") is None
    assert mailer.send("k", "ada@example.com", "first") == mailer.send("k", "bob@example.com", "second")
    assert mailer.find("k") == "k"
    assert [path.name for path in tmp_path.iterdir()] == ["k.eml"]
    assert "first" in (tmp_path / "k.eml").read_text("utf-8")


@pytest.mark.slow
def test_the_commands_serve_it(database_url: str, db: psycopg.Connection[Any], tmp_path: Path) -> None:
    """``flask --app example_app.tiny init-db`` then ``run``, as the module's docstring and the README
    say, with FLASK_DATABASE_URL: the tables are made and an invite is answered."""
    import requests

    port = free_port()
    env = {**os.environ, "FLASK_DATABASE_URL": database_url, "FLASK_MAIL_DIR": str(tmp_path / "mail")}
    flask = [sys.executable, "-m", "flask", "--app", "example_app.tiny"]
    made = subprocess.run([*flask, "init-db"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    with (tmp_path / "server.log").open("wb") as log:
        server = subprocess.Popen(
            [*flask, "run", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(base + "/invites", server)
        answer = requests.post(
            base + "/invites", json=ADA, headers={**AUTH, "Idempotency-Key": str(uuid.uuid4())}, timeout=10
        )
        assert answer.status_code == 201, answer.text
    finally:
        server.terminate()
        server.wait(10)
    assert db.execute("SELECT email FROM invites").fetchall() == [("ada@example.com",)]
