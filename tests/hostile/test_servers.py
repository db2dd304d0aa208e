"""Hostile input that only a server can carry, over raw sockets: CR and LF in header values, NUL bytes,
non-UTF-8 bytes, lying Content-Length, chunked bodies; under Werkzeug's server and gunicorn."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flask_idem.errors import PROBLEM_JSON

from ..support.helpers import count
from ..support.shop_actions import ORDER
from .checks import (
    CONTROL,
    Reached,
    assert_not_echoed,
    assert_sound,
    clean,
    problem_document,
    raw_post,
    send_raw,
)
from .strategies import (
    BODIES,
    RAW_VALUES,
    SETTINGS,
    SHOP_MAX_BODY,
)


@SETTINGS
@given(
    header=st.sampled_from([b"Idempotency-Key", b"Authorization", b"Content-Type", b"X-Anything"]),
    value=RAW_VALUES,
    body=BODIES,
)
def test_raw_header_values(
    shop_port: tuple[int, Reached],
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    header: bytes,
    value: bytes,
    body: bytes,
) -> None:
    """Raw bytes in a header value get a sound answer from the server or the shop, never a 5xx or an echo."""
    clean(db)
    logs.clear()
    port, reached = shop_port
    fields = {
        b"Authorization": b"Bearer " + api_key.encode(),
        b"Idempotency-Key": str(uuid.uuid4()).encode(),
        b"Content-Type": b"application/json",
    }
    fields[header] = value
    calls = reached.calls
    status, answer_headers, answer = send_raw(port, raw_post("/orders", list(fields.items()), body))
    if reached.calls == calls:  # the server refused the request itself
        assert 400 <= status < 500, answer
        assert count(db, "idempotency_keys") == count(db, "orders") == 0
    else:
        assert_sound(db, status, answer_headers.get("content-type"), answer, table="orders")
    assert_not_echoed(logs, value, body)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        pytest.param(
            lambda k, u: raw_post("/orders", k, json.dumps(ORDER).encode(), length=500),
            400,
            id="content-length-longer-than-body",
        ),
        pytest.param(
            lambda k, u: raw_post("/orders", k, json.dumps(ORDER).encode(), length=10),
            400,
            id="content-length-shorter-than-body",
        ),
        pytest.param(
            lambda k, u: raw_post("/orders", k, b"", length=SHOP_MAX_BODY + 1),
            413,
            id="content-length-over-limit-no-body",
        ),
        pytest.param(
            lambda k, u: raw_post("/orders", [*k, (b"Idempotency-Key", u)], json.dumps(ORDER).encode()),
            400,
            id="duplicate-key-header",
        ),
        pytest.param(
            lambda k, u: raw_post(
                "/orders",
                [*k[:1], (b"Idempotency-Key", b"\xe2\x80\x9c" + u + b"\xe2\x80\x9d"), *k[2:]],
                b"{}",
            ),
            400,
            id="smart-quoted-key",
        ),
    ],
)
def test_raw_requests(
    shop_port: tuple[int, Reached],
    api_key: str,
    db: psycopg.Connection[Any],
    request_bytes: Callable[[list[tuple[bytes, bytes]], bytes], bytes],
    status: int,
) -> None:
    """Framing tricks a client library would not send end in a problem answer and no key row."""
    port, _ = shop_port
    key = str(uuid.uuid4()).encode()
    fields = [
        (b"Authorization", b"Bearer " + api_key.encode()),
        (b"Idempotency-Key", key),
        (b"Content-Type", b"application/json"),
    ]
    got, answer_headers, answer = send_raw(port, request_bytes(fields, key))
    assert got == status, answer
    problem_document(got, answer_headers.get("content-type"), answer)
    assert count(db, "idempotency_keys") == count(db, "orders") == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"Idempotency-Key", b"{u}\r{u}"),
        (b"Idempotency-Key", b"{u}\n{u}"),
        (b"Idempotency-Key", b"{u}\x00"),
        (b"Idempotency-Key", b"{u}\r\n {u}"),
        (b"Idempotency-Key", b"\xff\xfe{u}"),
        (b"Idempotency-Key", b"{u}\r\nIdempotency-Key: {u}"),
        (b"Idempotency-Key", b"{u}\x1b[31m"),
        (b"Idempotency-Key", b"a" * 9000),
        (b"Authorization", b"Bearer {k}\r\nX-Org: 2"),
        (b"Authorization", b"Bearer {k}\x00"),
        (b"Content-Type", b"application/json\r\n\r\n{}"),
        (b"Content-Type", b"application/json\x7f"),
    ],
    ids=[
        "key-cr",
        "key-lf",
        "key-nul",
        "key-obs-fold",
        "key-non-utf8",
        "key-injected-twice",
        "key-ansi-escape",
        "key-9000-bytes",
        "auth-injected-header",
        "auth-nul",
        "content-type-injected-body",
        "content-type-del",
    ],
)
def test_gunicorn_decides(
    gunicorn_port: tuple[int, Path],
    api_key: str,
    db: psycopg.Connection[Any],
    name: bytes,
    value: bytes,
) -> None:
    """Under gunicorn, odd bytes in a header are refused by the server or the shop, never a 5xx or an echo."""
    port, log = gunicorn_port
    raw = value.replace(b"{u}", str(uuid.uuid4()).encode()).replace(b"{k}", api_key.encode())
    fields = {
        b"Authorization": b"Bearer " + api_key.encode(),
        b"Idempotency-Key": str(uuid.uuid4()).encode(),
        b"Content-Type": b"application/json",
        name: raw,
    }
    status, answer_headers, answer = send_raw(port, raw_post("/orders", list(fields.items()), b"{}"))
    assert status < 500, answer
    if answer_headers.get("content-type", "").startswith(PROBLEM_JSON):
        assert_sound(db, status, answer_headers["content-type"], answer, table="orders")
    else:  # gunicorn's own refusal, before the shop
        assert 400 <= status < 500 and status != 413
        assert count(db, "idempotency_keys") == count(db, "orders") == 0
    logged = log.read_bytes().decode("latin-1")
    assert not CONTROL.search(logged.replace("\r\n", "\n")), logged


def _chunked(fields: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A POST of ``body`` in 8 KiB chunks, without a Content-Length."""
    request = raw_post("/orders", [*fields, (b"Transfer-Encoding", b"chunked")], b"", length=-1)
    for at in range(0, len(body), 8192):
        request += b"%x\r\n%s\r\n" % (len(body[at : at + 8192]), body[at : at + 8192])
    return request + b"0\r\n\r\n"


@pytest.mark.parametrize("padding", [b" ", b"x"], ids=["json-then-spaces", "garbage"])
@pytest.mark.parametrize("server", ["shop_port", "gunicorn_port"], ids=["werkzeug", "gunicorn"])
def test_chunked_oversized_body_is_413(
    request: pytest.FixtureRequest, api_key: str, db: psycopg.Connection[Any], server: str, padding: bytes
) -> None:
    """A chunked body over the limit is a 413 before any key row, like one with a Content-Length."""
    port = request.getfixturevalue(server)[0]
    fields = [
        (b"Authorization", b"Bearer " + api_key.encode()),
        (b"Idempotency-Key", str(uuid.uuid4()).encode()),
        (b"Content-Type", b"application/json"),
    ]
    body = json.dumps(ORDER).encode() + padding * (SHOP_MAX_BODY + 1)
    status, answer_headers, answer = send_raw(port, _chunked(fields, body))
    assert status == 413, answer
    problem_document(status, answer_headers.get("content-type"), answer)
    assert count(db, "idempotency_keys") == count(db, "orders") == 0
