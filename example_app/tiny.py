"""The smallest whole application with flask-idem: one module to copy from, beside the shop.

An organisation invites people by e-mail. ``POST /invites`` is atomic: the invite is written in the
key's transaction and commits with it. ``POST /invites/<id>/send`` is multi-step: it mails the invite
through an outside service, here :class:`Mailer`, a stand-in that writes one file per message. Create
its tables, then run it::

    uv run flask --app example_app.tiny init-db
    uv run flask --app example_app.tiny run

It uses the PostgreSQL named by ``FLASK_DATABASE_URL``, or else an embedded one with its data in
``instance/tiny`` (:func:`flask_idem.testing.embedded_server_url`, for development). Then, with a key of
your own for each operation::

    curl -i localhost:5000/invites -H 'Authorization: Bearer tiny-key' -H 'Content-Type: application/json' \\
        -H 'Idempotency-Key: 7d6b4c1e-0a1f-4f4e-9a59-3c3f7e8b2d10' -d '{"email": "ada@example.com"}'
    curl -i -X POST localhost:5000/invites/1/send -H 'Authorization: Bearer tiny-key' \\
        -H 'Idempotency-Key: 0b7e6f0c-5d0e-4d8b-8f57-91f0b4c4a6e2'

Send either again with the same key: the first answer comes back (``Idempotent-Replayed: true``) and
nothing is created or mailed twice. A send that a crash interrupts is finished by the next retry, or
by ``flask --app example_app.tiny idem recover``. A retry after the answer's retention
(``IDEM_KEY_TTL``, a day) is told ``410 Gone``: the invite was made, its answer is no longer kept. Past
``IDEM_TOMBSTONE_TTL`` too (30 days more) flask-idem has forgotten the key, and the view answers from
the invite the key made: the same invite again, or ``422`` for another address.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import click
from flask import Blueprint, Flask, current_app, g, request
from flask.cli import with_appcontext
from werkzeug.exceptions import BadRequest, HTTPException, NotFound, UnprocessableEntity

from flask_idem import Flow, Idempotency, Run
from flask_idem.errors import problem

__all__ = ["Mailer", "bp", "create_app", "idem"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS invites (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id           bigint NOT NULL,
    idempotency_key  uuid   NOT NULL,
    email            text   NOT NULL,
    message_id       text,
    UNIQUE (org_id, idempotency_key)
);
"""


def current_org_id() -> int | None:
    """flask-idem's scope: keys belong to the organisation that :func:`authenticate` found."""
    org_id: int | None = g.get("org_id")
    return org_id


idem = Idempotency(scope=current_org_id)
bp = Blueprint("tiny", __name__)
send = Flow("tiny.invites.send")


@bp.before_request
def authenticate() -> None:
    """The organisation of the request's API key, or ``None``: flask-idem then answers 401."""
    api_key = request.headers.get("Authorization", "").removeprefix("Bearer ")
    g.org_id = current_app.config["API_KEYS"].get(api_key)


class Mailer:
    """A stand-in for a mail service's API, which takes an idempotency key as real ones do: it sends one
    message per key, however often it is asked, and says whether it has sent one under a key.

    Sending writes the message to ``<directory>/<key>.eml``, all at once (a hard link fails if the file
    exists), so a crash leaves either the whole message or none.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def send(self, key: str, to: str, text: str) -> str:
        """Send ``text`` to ``to`` once for ``key``; the message's id (the key)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        draft = self.directory / f"{key}.{uuid.uuid4().hex}.tmp"
        draft.write_text(f"To: {to}\nSubject: You are invited\n\n{text}\n", "utf-8")
        try:
            os.link(draft, self.directory / f"{key}.eml")
        except FileExistsError:
            pass  # sent before under this key: once is enough
        finally:
            draft.unlink()
        return key

    def find(self, key: str) -> str | None:
        """The id of the message sent under ``key``, or ``None`` if there is none."""
        return key if (self.directory / f"{key}.eml").exists() else None


def mailer() -> Mailer:
    return Mailer(current_app.config["MAIL_DIR"])


@bp.post("/invites")
@idem.idempotent()
def create_invite() -> tuple[dict[str, Any], int]:
    """Invite the ``email`` of the JSON body; the invite commits with the key, or neither does."""
    data = request.get_json(silent=True)
    if not isinstance(data, dict) or not isinstance(data.get("email"), str) or "@" not in data["email"]:
        raise BadRequest('The body must be a JSON object with an "email" address.')
    row = idem.connection.execute(
        "INSERT INTO invites (org_id, idempotency_key, email) VALUES (%s, %s, %s)"
        " ON CONFLICT (org_id, idempotency_key) DO NOTHING RETURNING id",
        (g.org_id, idem.key, data["email"]),
    ).fetchone()
    if row is not None:
        return {"id": row[0], "email": data["email"]}, 201
    # The key made an invite before, and flask-idem has forgotten it: past IDEM_KEY_TTL a retry is told
    # 410 without running this view, and only past IDEM_TOMBSTONE_TTL too (30 days) does it run again.
    first = idem.connection.execute(
        "SELECT id, email FROM invites WHERE org_id = %s AND idempotency_key = %s", (g.org_id, idem.key)
    ).fetchone()
    assert first is not None  # the INSERT met this row; invites are never deleted
    if first[1] != data["email"]:
        raise UnprocessableEntity(
            f"This Idempotency-Key made invite {first[0]}, for another address; use a new key."
        )
    return {"id": first[0], "email": first[1]}, 200  # the same request, made long ago: its invite


@bp.post("/invites/<int:invite_id>/send")
@idem.idempotent(flow=send)
def send_invite(invite_id: int) -> dict[str, Any]:
    """Mail an invite. This view is the flow's first step: it finds the invite and returns the intent."""
    row = idem.connection.execute(
        "SELECT email FROM invites WHERE id = %s AND org_id = %s", (invite_id, g.org_id)
    ).fetchone()
    if row is None:
        raise NotFound("There is no such invite.")
    return {"invite_id": invite_id, "email": row[0]}


def find_message(run: Run) -> dict[str, Any] | None:
    """Whether the mailer already sent this request's message (asked when a send is resumed)."""
    message_id = mailer().find(run.derived_key("mail"))
    return None if message_id is None else {"message_id": message_id}


@send.call(resolve=find_message)
def mail(run: Run) -> dict[str, Any]:
    """Mail the invite with no transaction open, under a key derived from the request's."""
    text = f"You are invited (invite {run.intent['invite_id']})."
    return {"message_id": mailer().send(run.derived_key("mail"), run.intent["email"], text)}


@send.finish
def record(run: Run) -> tuple[dict[str, Any], int]:
    """Record the message on the invite, in a short transaction, and answer."""
    message_id = run.results["mail"]["message_id"]
    run.connection.execute(
        "UPDATE invites SET message_id = %s WHERE id = %s AND org_id = %s",
        (message_id, run.intent["invite_id"], run.org_id),
    )
    return {"id": run.intent["invite_id"], "message_id": message_id}, 201


@click.command("init-db")
@with_appcontext
def init_db() -> None:
    """Create the key table (as ``flask idem init-db`` does) and the invites table; safe to run again."""
    idem.create_table()
    with idem.pool.connection() as conn, conn.transaction():
        conn.execute(SCHEMA)
    click.echo("The key table and the invites table are ready.")


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """Create the application: configuration from ``FLASK_*`` variables, then ``test_config``. Its
    tables are made by ``flask --app example_app.tiny init-db``, not here."""
    app = Flask(__name__)
    app.config.from_mapping(
        API_KEYS={"tiny-key": 1},  # API key -> organisation; stands in for real authentication
        MAIL_DIR=os.path.join(app.instance_path, "tiny", "mail"),
        MAX_CONTENT_LENGTH=64 * 1024,  # flask-idem reads a keyed request's whole body: refuse a larger one
    )
    app.config.from_prefixed_env()
    if test_config is not None:
        app.config.update(test_config)
    if not app.config.get("IDEM_DATABASE_URL"):
        app.config["IDEM_DATABASE_URL"] = app.config.get("DATABASE_URL") or _embedded(app)
    idem.init_app(app)
    app.register_blueprint(bp)
    app.register_error_handler(HTTPException, problem)  # every error as application/problem+json
    app.cli.add_command(init_db)
    return app


def _embedded(app: Flask) -> str:
    """For development with no database server: an embedded PostgreSQL (``pip install
    flask-idem[testing]``) with its data in the instance folder. In production, set the URL."""
    from flask_idem.testing import embedded_server_url

    return embedded_server_url(Path(app.instance_path) / "tiny" / "pgdata")
