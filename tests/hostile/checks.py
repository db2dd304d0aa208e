"""What every hostile request must leave behind (see :mod:`tests.hostile`), and raw HTTP over sockets."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem.errors import PROBLEM_JSON

from ..support.helpers import count
from ..support.servers import in_thread

#: Control characters, C0 and C1, but not LF (a traceback in a log message has line breaks of its own).
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
EXTENSION_PROBLEM = "urn:flask-idem:problem:"
#: Errors only a view answers. Flask's ``about:blank`` 400 is not among them: reading a body the client cut
#: short raises it before the view, and ``get_json()`` of an empty body raises it inside.
VIEW_ANSWERS = (402, 404, 415, 422)


def clean(db: psycopg.Connection[Any]) -> None:
    db.execute("DELETE FROM payments; DELETE FROM orders; DELETE FROM notes; DELETE FROM idempotency_keys")


def problem_document(status: int, content_type: str | None, body: bytes) -> dict[str, Any]:
    """The problem document of an error answer, checked to be one."""
    assert content_type is not None and content_type.split(";")[0].strip() == PROBLEM_JSON, (status, body)
    document: dict[str, Any] = json.loads(body)
    assert document["status"] == status
    assert isinstance(document["type"], str) and isinstance(document["title"], str)
    assert isinstance(document["retryable"], bool), document  # a client needs no table of statuses
    return document


def assert_sound(
    db: psycopg.Connection[Any], status: int, content_type: str | None, body: bytes, *, table: str
) -> None:
    """No 5xx, every error a problem, and no partial row: the rows left are exactly what ``status`` allows.

    :param table: where the route writes: ``orders``, ``payments`` or ``notes``.
    """
    assert status < 500, body
    keys = db.execute("SELECT status, response FROM idempotency_keys").fetchall()
    written = count(db, table)
    others = sum(count(db, t) for t in ("orders", "payments", "notes") if t != table)
    assert others == 0
    assert all(row_status == "completed" for row_status, _ in keys), keys
    if status < 400:
        assert status == 201
        assert len(keys) == 1 and keys[0][1]["status"] == 201
        assert written == 1
        return
    problem = problem_document(status, content_type, body)
    assert written == 0
    if problem["type"].startswith(EXTENSION_PROBLEM) or status in (401, 413):
        assert keys == [], problem
    elif status in VIEW_ANSWERS or keys:  # the view answered: that answer is stored, and nothing else
        assert len(keys) == 1, problem
        assert keys[0][1]["status"] == status
        assert keys[0][1]["body"].encode() == body


def assert_not_echoed(caplog: pytest.LogCaptureFixture, *inputs: str | bytes) -> None:
    """No log message holds a control character, nor a line break of the input with its neighbours."""
    texts = [s.decode("latin-1") if isinstance(s, bytes) else s for s in inputs]
    fragments = [
        text[max(0, at - 4) : at + 5]
        for text in texts
        for at in (m.start() for m in re.finditer("\n", text))
        if 0 < at < len(text) - 1
    ]
    for record in caplog.records:
        message = record.getMessage()
        assert not CONTROL.search(message), message
        for fragment in fragments:
            assert fragment not in message, message


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # the server closed with part of an oversized body unread
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    fields = dict(line.split(":", 1) for line in lines[1:])
    response_headers = {name.strip().lower(): value.strip() for name, value in fields.items()}
    if response_headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return status, response_headers, body


def _dechunk(data: bytes) -> bytes:
    body = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body, data = body + data[:size], data[size + 2 :]
    return body


def send_raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` byte for byte on a new connection and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):  # answered before the whole body was sent
            pass
        return _read_response(sock)


def raw_post(
    path: str, fields: list[tuple[bytes, bytes]], body: bytes, *, length: int | None = None
) -> bytes:
    """A POST request as bytes; ``length`` overrides the Content-Length, and ``-1`` sends none."""
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in fields]
    size = len(body) if length is None else length
    if size >= 0:
        lines.append(b"Content-Length: %d" % size)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class Reached:
    """WSGI middleware counting the requests that got through the server to the application."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    def __call__(self, environ: Any, start_response: Any) -> Any:
        self.calls += 1
        return self.app(environ, start_response)


@contextmanager
def serve(app: Flask) -> Iterator[tuple[int, Reached]]:
    """Serve ``app`` with Werkzeug's server in a thread; yields its port and the request counter."""
    reached = Reached(app.wsgi_app)
    app.wsgi_app = reached  # type: ignore[method-assign]
    with in_thread(app) as port:
        yield port, reached
