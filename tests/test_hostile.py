"""Hostile input: odd headers and bodies never cause a 5xx, a partial row, or an unescaped echo in the logs.

The properties run against the shop (its routes, its authentication, its problem handler) and against the
notes app (the extension alone), through the Werkzeug test client where it can carry the input, and over
raw sockets to real servers where only a server can decide: CR and LF inside header values, NUL bytes,
non-UTF-8 bytes, lying Content-Length, chunked bodies.

Every example starts from empty key, order, payment and note tables, so what is left afterwards is what
that one request wrote. The rule for what a request may leave behind:

- a ``201``: one completed key row and the one row it created;
- an error raised by the extension before the view ran (``400`` for the key or the body, ``401``, ``409``,
  ``413``, ``422`` key mismatch; their problem type is ``urn:flask-idem:problem:...``, or they are ``401``
  and ``413``): nothing at all;
- an error the view answered (the shop's ``422`` validation errors, ``415``, ``404``): one completed key
  row holding exactly that answer, and nothing else. Flask's own ``about:blank`` ``400`` comes from either
  side (a body cut short fails as it is read for the fingerprint; an empty JSON body fails in the view),
  so it leaves nothing or exactly its stored answer.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_idem.errors import PROBLEM_JSON

from .helpers import count, gunicorn, headers
from .notes_app import ORG
from .servers import in_thread

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: The shop refuses bodies larger than this (its MAX_CONTENT_LENGTH).
SHOP_MAX_BODY = 64 * 1024

ORDER = {"amount": 1250, "currency": "EUR"}
PAYMENT = {"order_id": 1, "source": "tok_visa"}
ROUTES = {"/orders": ORDER, "/payments": PAYMENT}

#: Control characters, C0 and C1, but not LF (a traceback in a log message has line breaks of its own).
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_EXTENSION_PROBLEM = "urn:flask-idem:problem:"
#: Errors only a view answers. Flask's ``about:blank`` 400 is not among them: reading a body the client cut
#: short raises it before the view, and ``get_json()`` of an empty body raises it inside.
_VIEW_ANSWERS = (402, 404, 415, 422)


# -- Strategies ------------------------------------------------------------------------------------------

_UUIDS = st.uuids().map(str)


def _latin1(text: str) -> str:
    """``text`` as a WSGI server hands a header over: its UTF-8 bytes, each byte one latin-1 character."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


def _spliced(parts: tuple[str, str, int]) -> str:
    value, odd, at = parts
    return value[:at] + odd + value[at:]


#: One header value as the test client can carry it: anything but CR and LF.
_HEADER_TEXT = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=80)
_ODD_CHARS = st.text(st.sampled_from('\x00\x01\t\x0b\x1b\x7f\x85\xa0\xff,;"\\ {}é'), min_size=1, max_size=3)

KEY_VALUES = st.one_of(
    _UUIDS,
    _UUIDS.map(str.upper),
    _UUIDS.map(lambda u: f'"{u}"'),
    _UUIDS.map(lambda u: f"  {u} "),
    _UUIDS.map(lambda u: f"{{{u}}}"),
    _UUIDS.map(lambda u: f"urn:uuid:{u}"),
    _UUIDS.map(lambda u: u.replace("-", "")),
    _UUIDS.map(lambda u: f"'{u}'"),
    st.tuples(_UUIDS, _UUIDS).map(", ".join),
    st.tuples(_UUIDS, _ODD_CHARS, st.integers(0, 36)).map(_spliced),
    _HEADER_TEXT,
    st.text(st.characters(exclude_characters="\r\n"), max_size=20).map(_latin1),
    st.integers(65, 20_000).map(lambda n: "a" * n),
    st.sampled_from(["", '""', '"', ",", "null", "0", "-1"]),
)

_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_NAMES = st.sampled_from(["amount", "currency", "order_id", "source", "org_id", ""]) | st.text(max_size=6)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_NAMES, inner, max_size=4),
    max_leaves=12,
)


def _dump(value: Any, ascii_only: bool) -> bytes:
    # "surrogatepass": a lone surrogate in a string becomes bytes that are not UTF-8, which is hostile too.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


#: Bodies no JSON encoder writes.
SPECIAL_BODIES = [
    b'{"amount": 1e400, "currency": "EUR"}',
    b'{"amount": NaN, "currency": "EUR"}',
    b'{"amount": Infinity, "currency": "EUR"}',
    b'{"amount": -Infinity, "currency": "EUR"}',
    b"NaN",
    b'{"amount": 1, "amount": 2, "currency": "EUR"}',
    b'{"order_id": 1, "source": "tok_visa", "order_id": 2}',
    b'\xef\xbb\xbf{"amount": 1250, "currency": "EUR"}',
    json.dumps(ORDER).encode("utf-16"),
    json.dumps(ORDER).encode("utf-32-le"),
    b'{"amount": 1250, "currency": "EUR"}\x00',
    b"\x00",
    b'{"amount": 1' + b"0" * 5000 + b', "currency": "EUR"}',
    b'{"amount": 9223372036854775808, "currency": "EUR"}',
    b'{"amount": 1250, "currency": "E\\u0000R"}',
    b'{"amount": 1250, "currency": "\\ud800"}',
    b'{"amount": 1250, "currency": "EUR\\n"}',
    b'{"amount": 1.0, "currency": "EUR"}',
    b'{"amount": 125e1, "currency": "EUR"}',
    b'{"amount": true, "currency": "EUR"}',
    b'{"amount": "1250", "currency": "EUR"}',
    b'{"amount": 1250, "currency": "EUR", "org_id": 2}',
    b'{"order_id": 1, "source": "tok_visa", "org_id": 2}',
    b'{"order_id": 1, "source": "tok_4242424242424242"}',
    b"[" * 65 + b"]" * 65,
    b"[" * 64 + b"]" * 64,
    b"[" * 60_000,
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b'"\\\\\\"',
    b'{"amount": 1250, "currency": "EUR"',
    b"",
    b" ",
    b"null",
    b"[]",
    b"{}",
    b'"x"',
    b"amount=1250&currency=EUR&amount=1",
    b'--b\r\nContent-Disposition: form-data; name="amount"\r\n\r\n1\r\n--b--\r\n',
]

#: Orders and payments that are valid, or nearly: a bound, a duplicate-looking member, an extra member.
_NEAR_VALID = st.fixed_dictionaries(
    {
        "amount": st.integers(1, 2**63 - 1) | st.sampled_from([0, -1, 2**63, 2**64]),
        "currency": st.from_regex(r"[A-Z]{3}", fullmatch=True) | st.sampled_from(["eur", "EURO", "EU"]),
    },
    optional={"order_id": st.integers(0, 2**63), "source": st.from_regex(r"tok_\w{1,62}", fullmatch=True)},
)

BODIES = st.one_of(
    st.builds(_dump, _NEAR_VALID, st.booleans()),
    st.builds(_dump, JSON_VALUES, st.booleans()),
    st.builds(
        _dump,
        st.fixed_dictionaries(
            {"amount": _JSON_SCALARS, "currency": _JSON_SCALARS},
            optional={"order_id": _JSON_SCALARS, "source": _JSON_SCALARS, "org_id": st.integers()},
        ),
        st.booleans(),
    ),
    st.binary(max_size=64),
    st.sampled_from(SPECIAL_BODIES),
    st.tuples(st.builds(_dump, JSON_VALUES, st.booleans()), st.integers(0, 40)).map(lambda t: t[0][: t[1]]),
)

_JSON_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
        "APPLICATION/JSON",
        "application/problem+json",
        "application/vnd.api+json",
    ]
)
_OTHER_TYPES = st.sampled_from(
    [
        "text/json",
        "text/x+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=b",
        "multipart/form-data",
        "application/octet-stream",
        "",
        "*/*",
        "application/json;;;",
        "application/json; charset",
    ]
)
#: Half JSON, so that most bodies get as far as the parser; the rest anything.
CONTENT_TYPES = st.sampled_from(
    [_JSON_TYPES, _JSON_TYPES, _OTHER_TYPES, _HEADER_TEXT.map(lambda s: s[:40])]
).flatmap(lambda types: types)


# -- Checks ----------------------------------------------------------------------------------------------


def _clean(db: psycopg.Connection[Any]) -> None:
    db.execute("DELETE FROM payments; DELETE FROM orders; DELETE FROM notes; DELETE FROM idempotency_keys")


def _problem(status: int, content_type: str | None, body: bytes) -> dict[str, Any]:
    """The problem document of an error answer, checked to be one."""
    assert content_type is not None and content_type.split(";")[0].strip() == PROBLEM_JSON, (status, body)
    document: dict[str, Any] = json.loads(body)
    assert document["status"] == status
    assert isinstance(document["type"], str) and isinstance(document["title"], str)
    return document


def _assert_sound(
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
    problem = _problem(status, content_type, body)
    assert written == 0
    if problem["type"].startswith(_EXTENSION_PROBLEM) or status in (401, 413):
        assert keys == [], problem
    elif status in _VIEW_ANSWERS or keys:  # the view answered: that answer is stored, and nothing else
        assert len(keys) == 1, problem
        assert keys[0][1]["status"] == status
        assert keys[0][1]["body"].encode() == body


def _assert_not_echoed(caplog: pytest.LogCaptureFixture, *inputs: str | bytes) -> None:
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
        assert not _CONTROL.search(message), message
        for fragment in fragments:
            assert fragment not in message, message


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """Every log record at DEBUG and above, with Werkzeug's ANSI colours (control characters) turned off."""
    monkeypatch.setattr("werkzeug.serving._log_add_style", False)
    caplog.set_level(logging.DEBUG)
    return caplog


# -- The shop through the test client --------------------------------------------------------------------


@pytest.mark.parametrize("path", list(ROUTES), ids=["orders", "payments"])
@SETTINGS
@given(values=st.lists(KEY_VALUES, min_size=1, max_size=3))
def test_odd_idempotency_keys(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    path: str,
    values: list[str],
) -> None:
    """Any Idempotency-Key header is a 400 invalid-key, or a request stored under the one UUID it names."""
    _clean(db)
    logs.clear()
    sent = [("Authorization", f"Bearer {api_key}"), *(("Idempotency-Key", v) for v in values)]
    response = client.post(path, json=ROUTES[path], headers=sent)
    _assert_sound(db, response.status_code, response.content_type, response.get_data(), table=path[1:])
    if response.status_code == 400:
        assert response.json is not None
        assert response.json["type"] in {
            _EXTENSION_PROBLEM + "invalid-key",
            _EXTENSION_PROBLEM + "missing-key",
        }
        assert all(v not in response.get_data(as_text=True) for v in values if len(v) >= 16)
    else:
        assert len(values) == 1
        (stored,) = db.execute("SELECT idem_key FROM idempotency_keys").fetchone() or (None,)
        assert str(stored) in values[0].lower()
    _assert_not_echoed(logs, *values)


@pytest.mark.parametrize("path", list(ROUTES), ids=["orders", "payments"])
@SETTINGS
@given(body=BODIES, content_type=CONTENT_TYPES, query=st.text(st.characters(max_codepoint=0xFF), max_size=24))
def test_hostile_bodies(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    path: str,
    body: bytes,
    content_type: str,
    query: str,
) -> None:
    """Whatever the body, content type and query string, the answer is sound and nothing partial is left."""
    _clean(db)
    logs.clear()
    response = client.post(
        path,
        data=body,
        content_type=content_type,
        query_string=query,
        headers=headers(api_key, uuid.uuid4()),
    )
    _assert_sound(db, response.status_code, response.content_type, response.get_data(), table=path[1:])
    _assert_not_echoed(logs, body, content_type, query)


@SETTINGS
@given(body=BODIES, content_type=CONTENT_TYPES)
def test_hostile_retry_of_a_finished_key(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], body: bytes, content_type: str
) -> None:
    """A hostile retry of a finished key is a replay, a 422 mismatch or a 400/413, and changes no row."""
    _clean(db)
    key = uuid.uuid4()
    first = client.post("/orders", json=ORDER, headers=headers(api_key, key))
    assert first.status_code == 201
    before = db.execute("SELECT * FROM idempotency_keys").fetchall()
    again = client.post("/orders", data=body, content_type=content_type, headers=headers(api_key, key))
    assert again.status_code < 500
    if again.status_code == 200:
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_data() == first.get_data()
    else:
        problem = _problem(again.status_code, again.content_type, again.get_data())
        assert problem["type"].startswith(_EXTENSION_PROBLEM) or again.status_code == 413, problem
    assert db.execute("SELECT * FROM idempotency_keys").fetchall() == before
    assert count(db, "orders") == 1


@SETTINGS
@given(
    values=st.lists(
        st.one_of(
            _HEADER_TEXT,
            _HEADER_TEXT.map(lambda s: "Bearer " + s),
            st.sampled_from(["Bearer", "Bearer ", "bearer", "Basic dXNlcjpwYXNz", "Token", "Bearer null"]),
            st.sampled_from(
                ["{k} ", " {k}", "bearer {k}", "Bearer  {k}", "Bearer {k},", "{k}", "Bearer {k}x"]
            ),
            st.sampled_from(
                ["Bearer {k}\x00", "Bearer {k}\t", "Bearer {k}\x85", 'Bearer "{k}"', "Bearer {k}é"]
            ),
            st.integers(129, 20_000).map(lambda n: "Bearer " + "a" * n),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_odd_authorization_headers(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    values: list[str],
) -> None:
    """Any Authorization header but the exact bearer key is a 401 problem and a challenge; nothing written."""
    _clean(db)
    logs.clear()
    sent = [v.replace("{k}", api_key) for v in values]
    response = client.post(
        "/orders",
        json=ORDER,
        headers=[*(("Authorization", v) for v in sent), ("Idempotency-Key", str(uuid.uuid4()))],
    )
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].lower().startswith("bearer")
    _assert_sound(db, response.status_code, response.content_type, response.get_data(), table="orders")
    assert api_key not in response.get_data(as_text=True)
    _assert_not_echoed(logs, *sent)


@pytest.mark.parametrize(
    "body",
    [b'{"amount": 1e400, "currency": "EUR"}', b"-1e999", b"[1E+309]"],
    ids=["amount", "negative", "in-array"],
)
def test_overflowing_number_is_a_400(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], body: bytes
) -> None:
    """A JSON number too large for a float is a 400 invalid-body before any key row, not a 500."""
    response = client.post(
        "/orders", data=body, content_type="application/json", headers=headers(api_key, uuid.uuid4())
    )
    assert response.status_code == 400
    assert response.json is not None and response.json["type"] == _EXTENSION_PROBLEM + "invalid-body"
    assert count(db, "idempotency_keys") == 0


@pytest.mark.parametrize(
    ("query", "content_type", "body", "status"),
    [
        ("\xc3\xa9=1", "application/json", json.dumps(ORDER).encode(), 201),
        ("", "application/x-www-form-urlencoded", "caf\u00e9=1".encode(), 415),
    ],
    ids=["query", "form-body"],
)
def test_non_ascii_query_or_form_is_not_a_5xx(
    client: FlaskClient,
    api_key: str,
    db: psycopg.Connection[Any],
    query: str,
    content_type: str,
    body: bytes,
    status: int,
) -> None:
    """Raw UTF-8 in the query string or a form body is fingerprinted like any bytes, not a 500."""
    response = client.post(
        "/orders",
        data=body,
        content_type=content_type,
        query_string=query,
        headers=headers(api_key, uuid.uuid4()),
    )
    assert response.status_code == status
    _assert_sound(db, response.status_code, response.content_type, response.get_data(), table="orders")


@pytest.mark.parametrize(
    ("size", "reused"),
    [(SHOP_MAX_BODY + 1, False), (4 * SHOP_MAX_BODY, False), (SHOP_MAX_BODY + 1, True)],
    ids=["just-over", "four-times", "over-on-a-finished-key"],
)
def test_oversized_body_is_413_before_any_key_row(
    client: FlaskClient, api_key: str, db: psycopg.Connection[Any], size: int, reused: bool
) -> None:
    """A body over the limit is a 413 problem, and no key row is read or written for it."""
    key = uuid.uuid4()
    if reused:
        assert client.post("/orders", json=ORDER, headers=headers(api_key, key)).status_code == 201
    before = db.execute("SELECT * FROM idempotency_keys").fetchall()
    padding = "x" * (size - len('{"amount": 1250, "currency": "EUR", "pad": ""}'))
    body = json.dumps({**ORDER, "pad": padding}).encode()
    assert len(body) == size
    response = client.post(
        "/orders", data=body, content_type="application/json", headers=headers(api_key, key)
    )
    assert response.status_code == 413
    _problem(413, response.content_type, response.get_data())
    assert db.execute("SELECT * FROM idempotency_keys").fetchall() == before
    assert count(db, "idempotency_keys") == (1 if reused else 0)


# -- The extension alone: the notes app ------------------------------------------------------------------


@pytest.fixture
def notes(make_app: Callable[..., Flask]) -> Flask:
    """The notes app, refusing bodies over 1 KiB."""
    return make_app(MAX_CONTENT_LENGTH=1024)


@SETTINGS
@given(values=st.lists(KEY_VALUES, max_size=2), body=BODIES, content_type=CONTENT_TYPES)
def test_extension_alone(
    notes: Flask,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    values: list[str],
    body: bytes,
    content_type: str,
) -> None:
    """Without the shop's handlers, the extension's own errors are problems, and its rows never partial."""
    _clean(db)
    logs.clear()
    sent = [*ORG.items(), *(("Idempotency-Key", v) for v in values)]
    response = notes.test_client().post("/notes/optional", data=body, content_type=content_type, headers=sent)
    assert response.status_code < 500
    if response.status_code == 413:  # Flask's own answer, before the extension: this app has no handler
        assert len(body) > 1024
        assert count(db, "idempotency_keys") == count(db, "notes") == 0
    elif not values:  # no key: the route runs once, without a key row
        assert response.status_code == 201
        assert (count(db, "idempotency_keys"), count(db, "notes")) == (0, 1)
    else:
        _assert_sound(db, response.status_code, response.content_type, response.get_data(), table="notes")
    _assert_not_echoed(logs, *values, body, content_type)


def test_notes_oversized_body_is_413_before_any_key_row(notes: Flask, db: psycopg.Connection[Any]) -> None:
    """The extension reads the body only under the application's limit: 413, and no key row."""
    response = notes.test_client().post(
        "/notes/optional",
        data=b"[" + b"1," * 1000 + b"1]",
        content_type="application/json",
        headers={**ORG, "Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 413
    assert count(db, "idempotency_keys") == count(db, "notes") == 0


# -- Real servers over raw sockets -----------------------------------------------------------------------


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


@pytest.fixture
def shop_port(app: Flask) -> Iterator[tuple[int, Reached]]:
    """The shop served by Werkzeug on loopback: its port, and how many requests reached it."""
    with serve(app) as served:
        yield served


#: Raw header values: the test client refuses CR and LF, NUL and non-latin-1 text; a server may not.
RAW_VALUES = st.one_of(
    st.binary(max_size=48),
    st.tuples(
        _UUIDS.map(str.encode), st.sampled_from([b"\r", b"\n", b"\r\n", b"\x00", b"\r\n ", b"\n\t"])
    ).map(lambda t: t[0] + t[1] + t[0]),
    _UUIDS.map(lambda u: u.encode() + b"\r\nIdempotency-Key: " + u.encode()),
    _UUIDS.map(lambda u: u.encode() + b"\r\nContent-Length: 0"),
    _UUIDS.map(lambda u: u.encode() + b"\nTransfer-Encoding: chunked"),
    _UUIDS.map(lambda u: u.encode() + b"\r\n\r\n" + json.dumps(ORDER).encode()),
    _UUIDS.map(lambda u: b"\xef\xbb\xbf" + u.encode()),
    _UUIDS.map(lambda u: u.encode("utf-16-le")),
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
    _clean(db)
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
        _assert_sound(db, status, answer_headers.get("content-type"), answer, table="orders")
    _assert_not_echoed(logs, value, body)


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
    _problem(got, answer_headers.get("content-type"), answer)
    assert count(db, "idempotency_keys") == count(db, "orders") == 0


@pytest.fixture(scope="module")
def gunicorn_port(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """The shop under gunicorn (one worker), shared by this module's tests: its port and its log file."""
    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    env = {"FLASK_DATABASE_URL": database_url, "FLASK_IDEM_POOL_MAX_SIZE": "2"}
    with gunicorn(log, env=env, workers=1, threads=2) as (base, _):
        yield int(base.rsplit(":", 1)[1]), log


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
        _assert_sound(db, status, answer_headers["content-type"], answer, table="orders")
    else:  # gunicorn's own refusal, before the shop
        assert 400 <= status < 500 and status != 413
        assert count(db, "idempotency_keys") == count(db, "orders") == 0
    logged = log.read_bytes().decode("latin-1")
    assert not _CONTROL.search(logged.replace("\r\n", "\n")), logged


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
    _problem(status, answer_headers.get("content-type"), answer)
    assert count(db, "idempotency_keys") == count(db, "orders") == 0
