"""Checked by mypy (``files`` in setup.cfg), never run: the public API reads well to a type checker."""

from __future__ import annotations

import uuid

from flask import Flask
from psycopg import Connection
from psycopg.rows import TupleRow

from flask_idem import HEADER, Idempotency, IdempotencyError


def org() -> int | None:
    return 1


idem = Idempotency(scope=org)
app = Flask(__name__)
idem.init_app(app)


@app.post("/orders")
@idem.idempotent(ttl=3600, on_mismatch="replay", required=True)
def create() -> tuple[dict[str, str], int]:
    conn: Connection[TupleRow] = idem.connection
    key: uuid.UUID | None = idem.key
    conn.execute("SELECT 1")
    return {"key": str(key)}, 201


header: str = HEADER
error: type[Exception] = IdempotencyError
