"""A small application with one idempotent route per behaviour the extension tests look at."""

from __future__ import annotations

import io
import os
import threading
import uuid
from typing import Any

import psycopg
from flask import Flask, abort, current_app, request, send_file

from flask_idem import Idempotency

ORG = {"X-Org": "1"}


def org_from_header() -> int | None:
    value = request.headers.get("X-Org")
    return int(value) if value else None


def build_app(database_url: str, **config: Any) -> tuple[Flask, Idempotency]:
    """A minimal application with one decorated route per behaviour under test."""
    app = Flask(__name__)
    app.config.from_prefixed_env()  # as a user's app would: FLASK_IDEM_* settings apply
    app.config.update({"IDEM_DATABASE_URL": database_url, "IDEM_POOL_TIMEOUT": 5.0, **config})
    idem = Idempotency(app, scope=org_from_header)

    def insert(body: str) -> int:
        row = idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, %s) RETURNING id",
            (org_from_header(), body),
        ).fetchone()
        assert row is not None
        return int(row[0])

    @app.post("/notes")
    @idem.idempotent()
    def create() -> Any:
        note_id = insert(request.get_json()["body"])
        return {"id": note_id, "key": str(idem.key)}, 201, {"Location": f"/notes/{note_id}"}

    @app.post("/notes/form")
    @idem.idempotent(key_from=lambda: request.form.getlist("idempotency_key"))
    def create_from_form() -> Any:
        note_id = insert(request.form["body"])
        return {"id": note_id, "key": str(idem.key)}, 201

    @app.get("/notes")
    @idem.idempotent()
    def listing() -> Any:
        with idem.pool.connection() as conn:
            return {"count": conn.execute("SELECT count(*) FROM notes").fetchone()[0]}

    @app.post("/notes/raise")
    @idem.idempotent()
    def fail_with_exception() -> Any:
        insert("raise")
        if current_app.config.get("FAIL", True):
            raise RuntimeError("the view broke")
        return {"ok": True}, 201

    @app.post("/notes/500")
    @idem.idempotent()
    def fail_with_500() -> Any:
        insert("500")
        return {"error": "boom"}, 500

    @app.post("/notes/404")
    @idem.idempotent()
    def fail_with_abort() -> Any:
        insert("404")
        abort(404)

    @app.post("/notes/202")
    @idem.idempotent()
    def accepted() -> Any:
        insert("202")
        resp = current_app.make_response(({"queued": True}, 202))
        resp.set_cookie("session", "first-caller-secret")
        resp.headers["X-Request-Id"] = str(uuid.uuid4())
        return resp

    @app.post("/notes/swallow")
    @idem.idempotent()
    def swallow() -> Any:
        insert("dup")
        try:
            insert("dup")
        except psycopg.errors.UniqueViolation:
            pass
        return {"ok": True}, 201

    @app.post("/notes/savepoint")
    @idem.idempotent()
    def savepoint() -> Any:
        insert("dup")
        try:
            with idem.connection.transaction():
                insert("dup")
        except psycopg.errors.UniqueViolation:
            pass
        return {"ok": True}, 201

    @app.post("/notes/binary")
    @idem.idempotent()
    def binary() -> Any:
        insert("binary")
        return current_app.response_class(
            b"\x00\xff\xfe" + uuid.uuid4().bytes, status=201, mimetype="application/octet-stream"
        )

    @app.post("/notes/file")
    @idem.idempotent()
    def file() -> Any:
        return send_file(io.BytesIO(b"%PDF-\x00\xff receipt"), mimetype="application/pdf")

    @app.post("/notes/optional")
    @idem.idempotent(required=False)
    def optional() -> Any:
        return {"id": insert(str(uuid.uuid4())), "key": str(idem.key)}, 201

    @app.post("/notes/replayable")
    @idem.idempotent(on_mismatch="replay")
    def replayable() -> Any:
        return {"id": insert(request.get_json()["body"])}, 201

    @app.post("/notes/block")
    @idem.idempotent()
    def block() -> Any:
        note_id = insert("blocked")
        entered: threading.Event = current_app.config["ENTERED"]
        release: threading.Event = current_app.config["RELEASE"]
        entered.set()
        release.wait(10)
        return {"id": note_id}, 201

    @app.post("/notes/secret")
    @idem.idempotent()
    def secret() -> Any:
        value = request.get_json()["body"]
        insert(value)
        insert(value)  # unique violation: PostgreSQL quotes the value in the error's DETAIL
        return {}, 201

    @app.post("/notes/terminate")
    @idem.idempotent()
    def terminate() -> Any:
        idem.connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return {}, 201

    return app, idem


def create_app() -> Flask:
    """The notes app for ``flask --app tests.support.notes_app:create_app``, on the database of
    ``FLASK_IDEM_DATABASE_URL`` (and the other ``FLASK_IDEM_*`` settings of the environment)."""
    return build_app(os.environ["FLASK_IDEM_DATABASE_URL"])[0]


def post(app: Flask, path: str, key: uuid.UUID | str | None, json: Any = None, **headers: str) -> Any:
    hdrs = {**ORG, **headers}
    if key is not None:
        hdrs["Idempotency-Key"] = str(key)
    return app.test_client().post(path, json=json, headers=hdrs)
