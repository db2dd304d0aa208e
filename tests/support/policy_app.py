"""An application with one route per policy under test: fingerprint policies (on an atomic route and on a
multi-step one), what a stored response may hold (size, secrets, streams and files), and ``async def``
views. Writes go to the ``notes`` table."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, g, request, send_file, stream_with_context

from flask_idem import Fingerprint, Idempotency
from flask_idem._state import get_state
from flask_idem.flow import Flow, OutcomeUnknown, Run

ORG = {"X-Org": "1"}


def org_from_header() -> int | None:
    value = request.headers.get("X-Org")
    return int(value) if value else None


def build_policy_app(database_url: str, *, deploy: Fingerprint | None = None, **config: Any) -> Flask:
    """The application; ``deploy`` is the fingerprint policy of ``POST /deploy``, to change between two
    builds as a deployment would."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update({"IDEM_DATABASE_URL": database_url, "IDEM_POOL_TIMEOUT": 5.0, **config})
    idem = Idempotency(app, scope=org_from_header)

    def insert(body: str) -> int:
        row = idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, %s) RETURNING id", (org_from_header(), body)
        ).fetchone()
        assert row is not None
        return int(row[0])

    def created() -> tuple[dict[str, Any], int, dict[str, str]]:
        note_id = insert(f"{request.path} {idem.key}")
        return {"id": note_id}, 201, {"Location": f"/notes/{note_id}"}

    # -- what counts as the same request -----------------------------------------------------------------

    @app.post("/volatile")
    @idem.idempotent(fingerprint=Fingerprint(exclude=["/client_ts", "/trace/id"], headers=["X-Currency"]))
    def volatile() -> Any:
        return created()

    @app.post("/picked")
    @idem.idempotent(fingerprint=Fingerprint(include=["/amount", "/currency"]))
    def picked() -> Any:
        return created()

    @app.post("/custom")
    @idem.idempotent(fingerprint=Fingerprint(include=[], custom=lambda: request.args.get("ref")))
    def custom() -> Any:
        return created()

    @app.post("/deploy")
    @idem.idempotent(fingerprint=deploy)
    def deployed() -> Any:
        return created()

    # -- a multi-step route under a policy: its call step, and a finish step whose answer may be large ----

    sent: list[str] = []
    app.config["SENT"] = sent
    transfer = Flow("policies.transfer")

    @transfer.call
    def send(run: Run) -> dict[str, Any]:
        sent.append(run.derived_key("send"))
        if app.config.pop("SEND_UNKNOWN", False):
            raise OutcomeUnknown("the answer was lost")
        return {"sent": len(sent)}

    @transfer.finish
    def done(run: Run) -> Any:
        run.connection.execute("INSERT INTO notes (org_id, body) VALUES (%s, 'finished')", (run.org_id,))
        return Response(b"z" * run.intent["size"], status=201, mimetype="text/plain")

    @app.post("/transfers")
    @idem.idempotent(flow=transfer, fingerprint=Fingerprint(exclude=["/ts"], headers=["X-Currency"]))
    def start_transfer() -> Any:
        insert(f"intent {idem.key}")
        return {"size": int(request.get_json()["size"])}

    # -- what a stored response may hold -----------------------------------------------------------------

    @app.post("/tokens")
    @idem.idempotent(store_response="location")
    def mint_token() -> Any:
        note_id = insert(f"token {idem.key}")
        return {"id": note_id, "token": f"secret-{note_id}"}, 201, {"Location": f"/tokens/{note_id}"}

    @app.post("/tokens/nowhere")
    @idem.idempotent(store_response="location")
    def mint_token_without_location() -> Any:
        insert(f"token {idem.key}")
        return {"token": "secret"}, 201

    @app.post("/tokens/refused")
    @idem.idempotent(store_response="location")
    def refuse_token() -> Any:
        return {"error": "no"}, 403

    @app.post("/secrets")
    @idem.idempotent(store_response="encrypted")
    def mint_secret() -> Any:
        note_id = insert(f"secret {idem.key}")
        return {"id": note_id, "secret": f"s3cr3t-{note_id}"}, 201

    @app.post("/sized")
    @idem.idempotent()
    def sized() -> Any:
        insert(f"sized {idem.key}")
        return Response(b"x" * int(request.get_json()["size"]), status=201, mimetype="text/plain")

    @app.post("/streamed")
    @idem.idempotent()
    def streamed() -> Any:
        insert(f"streamed {idem.key}")
        size = int(request.get_json()["size"])

        def chunks() -> Iterator[bytes]:
            for start in range(0, size, 1000):
                yield b"y" * min(1000, size - start)

        return Response(chunks(), status=201, mimetype="text/plain")

    @app.post("/streamed/rows")
    @idem.idempotent()
    def streamed_rows() -> Any:
        insert(f"rows {idem.key}")

        @stream_with_context
        def rows() -> Iterator[str]:
            cursor = idem.connection.execute("SELECT body FROM notes WHERE body LIKE 'rows %%' ORDER BY id")
            for (body,) in cursor:
                yield body + "\n"

        return Response(rows(), status=201, mimetype="text/plain")

    @app.post("/files")
    @idem.idempotent()
    def file() -> Any:
        insert(f"file {idem.key}")
        size = int(request.get_json()["size"])
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        app.config["OPENED"] = opened = io.BytesIO(data)
        return send_file(opened, mimetype="application/octet-stream")

    # -- async views ---------------------------------------------------------------------------------------

    @app.before_request
    def remember_thread() -> None:
        g.request_thread = threading.get_ident()

    @app.post("/async/notes")
    @idem.idempotent()
    async def create_async() -> Any:
        await asyncio.sleep(0)
        note_id = insert(request.get_json()["body"])
        await asyncio.sleep(0.01)
        # The reservation is held: this runs in the transaction that holds the key's lock (an atomic
        # request's row is written with its COMMIT), or on Citus the transaction that wrote the key's row.
        if get_state().store.write_once:
            held = idem.connection.execute(
                "SELECT count(*) FROM pg_locks"
                " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
            )
        else:
            held = idem.connection.execute(
                "SELECT count(*) FROM idempotency_keys WHERE idem_key = %s AND status = 'processing'",
                (idem.key,),
            )
        (mine,) = held.fetchone() or (0,)
        g.view_thread = threading.get_ident()
        return {
            "id": note_id,
            "key": str(idem.key),
            "reservation_visible": mine == 1,
            "other_thread": g.view_thread != g.request_thread,
        }, 201

    @app.after_request
    def tell_thread(response: Response) -> Response:
        if "view_thread" in g:
            response.headers["X-View-Thread-Seen"] = "true"
        return response

    @app.post("/async/fail")
    @idem.idempotent()
    async def fail_async() -> Any:
        insert("async fail")
        await asyncio.sleep(0)
        raise RuntimeError("the async view broke")

    return app
