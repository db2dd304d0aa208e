"""Per-route policies against a real PostgreSQL: what counts as the same request (and what a 422 then
says), and what a stored response may hold (size, secrets, streams and files)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet
from flask import Flask
from werkzeug.test import TestResponse

from flask_idem import Fingerprint
from flask_idem._settings import Settings

from .support.helpers import app_factory, count
from .support.policy_app import ORG, build_policy_app


@pytest.fixture
def make(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Callable[..., Flask]]:
    """Build the policy application with extra configuration; its pool is closed afterwards."""
    with app_factory(lambda **config: build_policy_app(database_url, **config)) as make:
        yield make


@pytest.fixture
def policy_app(make: Callable[..., Flask]) -> Flask:
    return make()


def post(
    policy_app: Flask, path: str, key: uuid.UUID | None, json: Any = None, *, query: str = "", **headers: str
) -> TestResponse:
    sent = {**ORG, **headers}
    if key is not None:
        sent["Idempotency-Key"] = str(key)
    return policy_app.test_client().post(path + query, json=json, headers=sent)


def stored(db: psycopg.Connection[Any], key: uuid.UUID) -> dict[str, Any]:
    row = db.execute("SELECT response FROM idempotency_keys WHERE idem_key = %s", (key,)).fetchone()
    assert row is not None
    document: dict[str, Any] = row[0]
    return document


# -- what counts as the same request -------------------------------------------------------------------------


def test_a_volatile_field_does_not_make_a_retry_a_mismatch(
    policy_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """/client_ts and /trace/id change on every attempt: the retry is replayed, not refused."""
    key = uuid.uuid4()
    first = post(
        policy_app,
        "/volatile",
        key,
        {"amount": 5, "client_ts": 1, "trace": {"id": "a"}},
        **{"X-Currency": "EUR"},
    )
    again = post(
        policy_app,
        "/volatile",
        key,
        {"trace": {"id": "b"}, "client_ts": 2, "amount": 5.0},
        **{"X-Currency": "EUR"},
    )
    assert first.status_code == 201
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert count(db, "notes") == 1


@pytest.mark.parametrize(
    ("body", "headers", "differs"),
    [
        ({"amount": 6, "client_ts": 1}, {"X-Currency": "EUR"}, ["body except /client_ts, /trace/id"]),
        ({"amount": 5, "client_ts": 1}, {"X-Currency": "USD"}, ["header X-Currency"]),
        ({"amount": 5, "client_ts": 1}, {}, ["header X-Currency"]),
        ({"amount": 6}, {"X-Currency": "USD"}, ["body except /client_ts, /trace/id", "header X-Currency"]),
    ],
    ids=["body", "header", "header-absent", "both"],
)
def test_a_real_change_is_a_422_that_names_the_part(
    policy_app: Flask,
    db: psycopg.Connection[Any],
    body: dict[str, Any],
    headers: dict[str, str],
    differs: list[str],
) -> None:
    """The 422 says which counted part differs (by name, never by value) and writes nothing."""
    key = uuid.uuid4()
    assert (
        post(policy_app, "/volatile", key, {"amount": 5, "client_ts": 1}, **{"X-Currency": "EUR"}).status_code
        == 201
    )
    answer = post(policy_app, "/volatile", key, body, **headers)
    assert answer.status_code == 422
    assert answer.json is not None
    assert answer.json["differs"] == differs
    assert "differs in: " + ", ".join(differs) in answer.json["detail"]
    assert "USD" not in answer.get_data(as_text=True) and '"6"' not in answer.get_data(as_text=True)
    assert count(db, "notes") == 1


def test_only_included_members_count(policy_app: Flask) -> None:
    """include=["/amount", "/currency"]: a changed note is the same request, a changed amount is not."""
    key = uuid.uuid4()
    assert post(policy_app, "/picked", key, {"amount": 5, "currency": "EUR", "note": "a"}).status_code == 201
    assert post(policy_app, "/picked", key, {"amount": 5, "currency": "EUR", "note": "b"}).status_code == 200
    refused = post(policy_app, "/picked", key, {"amount": 7, "currency": "EUR"})
    assert refused.status_code == 422 and refused.json is not None
    assert refused.json["differs"] == ["body /amount"]


def test_a_custom_function_decides(policy_app: Flask) -> None:
    """custom= counts what it returns (here the 'ref' query argument), and the body not at all."""
    key = uuid.uuid4()
    assert post(policy_app, "/custom", key, {"any": 1}, query="?ref=a").status_code == 201
    assert post(policy_app, "/custom", key, {"any": 2}, query="?ref=a").status_code == 200
    assert (
        post(policy_app, "/custom", key, {"any": 1}, query="?ref=b").status_code == 422
    )  # the query counts too


def test_the_stored_response_keeps_part_digests_not_values(
    policy_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """What is stored of the request: the policy's id and an 8-byte digest per part; no header value."""
    key = uuid.uuid4()
    post(policy_app, "/volatile", key, {"amount": 5, "client_ts": 1}, **{"X-Currency": "EUR"})
    request = stored(db, key)["request"]
    assert set(request) == {"policy", "parts"}
    assert set(request["parts"]) == {
        "method",
        "path",
        "query",
        "media type",
        "body except /client_ts, /trace/id",
        "header x-currency",
    }
    assert all(len(v) == 16 for v in request["parts"].values())
    assert "EUR" not in json.dumps(request)


def test_the_default_policy_stores_nothing_more(policy_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A route without a policy keeps the stored document it always had (no 'request' member)."""
    key = uuid.uuid4()
    post(policy_app, "/deploy", key, {"a": 1})
    assert "request" not in stored(db, key)


@pytest.mark.parametrize("previous", [False, True], ids=["forgotten", "kept-in-previous"])
def test_a_policy_changed_between_two_attempts(
    make: Callable[..., Flask], db: psycopg.Connection[Any], previous: bool
) -> None:
    """A deploy changes the route's policy between two attempts of one key. With the old policy in
    previous=, the retry is compared under it (replayed, or a 422 naming the part that differs under it);
    without, it cannot be compared: 422, saying the policy changed. Either way nothing runs twice."""
    old = Fingerprint(exclude=["/ts"])
    new = Fingerprint(exclude=["/ts", "/nonce"], previous=[old] if previous else [])
    key = uuid.uuid4()
    before = make(deploy=old)
    assert post(before, "/deploy", key, {"a": 1, "ts": 1, "nonce": "x"}).status_code == 201
    after = make(deploy=new)
    retry = post(after, "/deploy", key, {"a": 1, "ts": 2, "nonce": "x"})
    if previous:
        assert retry.status_code == 200 and retry.headers["Idempotent-Replayed"] == "true"
        changed = post(after, "/deploy", key, {"a": 2, "ts": 2, "nonce": "x"})
        assert changed.status_code == 422 and changed.json is not None  # compared under the old policy
        assert changed.json["differs"] == ["body except /ts"]
        assert "earlier fingerprint policy" in changed.json["detail"]
    else:
        assert retry.status_code == 422 and retry.json is not None
        assert retry.json["differs"] == ["fingerprint policy"]
        assert "policy has changed" in retry.json["detail"]
    assert count(db, "notes") == 1


@pytest.mark.parametrize("previous", [False, True], ids=["forgotten", "kept-in-previous"])
def test_a_route_given_its_first_policy(
    make: Callable[..., Flask], db: psycopg.Connection[Any], previous: bool
) -> None:
    """Keys stored before the route had a policy (the default) match after it gets one only when the
    default is named in previous=; the 422 otherwise lists what the route now compares."""
    key = uuid.uuid4()
    body = {"a": 1, "ts": 1}
    assert post(make(deploy=None), "/deploy", key, body).status_code == 201
    policy = Fingerprint(exclude=["/ts"], previous=[Fingerprint()] if previous else [])
    retry = post(make(deploy=policy), "/deploy", key, body)
    if previous:
        assert retry.status_code == 200
    else:
        assert retry.status_code == 422 and retry.json is not None
        assert (
            "This route compares: method; path; query; media type; body except /ts." in retry.json["detail"]
        )
    assert count(db, "notes") == 1


def test_a_policy_with_a_bad_body_is_a_400(policy_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A malformed JSON body under a policy is refused as under the default: 400, no key row."""
    answer = policy_app.test_client().post(
        "/volatile",
        data=b'{"a": 1, "a": 2}',
        content_type="application/json",
        headers={**ORG, "Idempotency-Key": str(uuid.uuid4())},
    )
    assert answer.status_code == 400
    assert count(db, "idempotency_keys") == 0


def test_the_decorator_refuses_what_is_not_a_policy() -> None:
    """fingerprint= takes a Fingerprint; store_response= one of its three words."""
    from flask_idem import Idempotency
    from flask_idem.errors import ConfigurationError

    idem = Idempotency(scope=lambda: 1)
    with pytest.raises(ConfigurationError, match="takes a flask_idem.Fingerprint"):
        idem.idempotent(fingerprint=["/a"])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="'full', 'location' or 'encrypted'"):
        idem.idempotent(store_response="none")  # type: ignore[arg-type]


# -- what a stored response may hold: secrets ------------------------------------------------------------


def test_a_secret_is_replayed_as_a_303_to_its_location(
    policy_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """store_response="location": the first caller gets the secret, the stored row and a retry do not."""
    key = uuid.uuid4()
    first = post(policy_app, "/tokens", key, {})
    assert first.status_code == 201 and first.json is not None and first.json["token"].startswith("secret-")
    again = post(policy_app, "/tokens", key, {})
    assert again.status_code == 303
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert b"secret" not in again.data
    assert "secret" not in json.dumps(stored(db, key))
    assert count(db, "notes") == 1


def test_a_secret_without_a_location_is_refused_and_rolled_back(
    policy_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """A 2xx with no Location cannot be kept as a 303: 500 problem, nothing committed, nothing stored."""
    key = uuid.uuid4()
    answer = post(policy_app, "/tokens/nowhere", key, {})
    assert answer.status_code == 500
    assert answer.json is not None and answer.json["type"] == "urn:flask-idem:problem:response-not-stored"
    assert count(db, "notes") == 0 and count(db, "idempotency_keys") == 0


def test_an_error_of_a_secret_route_is_kept_in_full(policy_app: Flask) -> None:
    """Only 2xx answers are cut to their Location: a 403 is replayed as it was."""
    key = uuid.uuid4()
    first = post(policy_app, "/tokens/refused", key, {})
    again = post(policy_app, "/tokens/refused", key, {})
    assert (first.status_code, again.status_code) == (403, 403)
    assert again.data == first.data


@pytest.fixture
def keys() -> list[str]:
    return [Fernet.generate_key().decode(), Fernet.generate_key().decode()]


def test_an_encrypted_body_is_replayed_and_unreadable_at_rest(
    make: Callable[..., Flask], db: psycopg.Connection[Any], keys: list[str]
) -> None:
    """store_response="encrypted": the row holds a Fernet token, the retry gets the body byte for byte."""
    policy_app = make(IDEM_RESPONSE_KEYS=keys[:1])
    key = uuid.uuid4()
    first = post(policy_app, "/secrets", key, {})
    assert first.status_code == 201 and first.json is not None
    document = stored(db, key)
    assert "body" not in document and "body_b64" not in document
    assert first.json["secret"] not in json.dumps(document)
    assert Fernet(keys[0]).decrypt(document["body_enc"].encode()) == first.data
    again = post(policy_app, "/secrets", key, {})
    assert again.status_code == 200 and again.data == first.data


def test_keys_rotate(make: Callable[..., Flask], db: psycopg.Connection[Any], keys: list[str]) -> None:
    """A new key put first still reads what the old one encrypted; a key dropped too early cannot be read,
    which is a 500 that says so, and the operation is not run again."""
    old, new = keys
    key = uuid.uuid4()
    first = post(make(IDEM_RESPONSE_KEYS=[old]), "/secrets", key, {})
    rotated = make(IDEM_RESPONSE_KEYS=f"{new}, {old}")  # one string, as from an environment variable
    assert post(rotated, "/secrets", key, {}).data == first.data
    other = uuid.uuid4()
    post(rotated, "/secrets", other, {})
    assert Fernet(new).decrypt(stored(db, other)["body_enc"].encode())
    dropped = post(make(IDEM_RESPONSE_KEYS=[new]), "/secrets", key, {})
    assert dropped.status_code == 500 and dropped.json is not None
    assert dropped.json["type"] == "urn:flask-idem:problem:stored-response-unreadable"
    assert count(db, "notes") == 2


def test_an_encrypted_route_without_keys_fails_before_running(
    policy_app: Flask, db: psycopg.Connection[Any]
) -> None:
    """Without IDEM_RESPONSE_KEYS the route fails at once, naming the setting; nothing is written."""
    policy_app.config["PROPAGATE_EXCEPTIONS"] = False
    answer = post(policy_app, "/secrets", uuid.uuid4(), {})
    assert answer.status_code == 500
    assert count(db, "notes") == 0 and count(db, "idempotency_keys") == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [(["not-a-key"], "Key 1 of IDEM_RESPONSE_KEYS is not a Fernet key"), (5, "must be a list of keys")],
    ids=["malformed", "type"],
)
def test_bad_response_keys_are_refused_at_init(database_url: str, value: Any, message: str) -> None:
    """A malformed key is refused by init_app, without repeating it."""
    from flask_idem.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message) as caught:
        build_policy_app(database_url, IDEM_RESPONSE_KEYS=value)
    assert "not-a-key" not in str(caught.value)


@pytest.mark.parametrize("header", ["Authorization", "Set-Cookie", "proxy-authorization"])
def test_credentials_are_never_replay_headers(header: str) -> None:
    """IDEM_REPLAY_HEADERS refuses Set-Cookie and Authorization: a replay would hand them to a retrier."""
    from flask_idem.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="must not include"):
        Settings.from_config(
            {"IDEM_DATABASE_URL": "postgresql://x/y", "IDEM_REPLAY_HEADERS": ["Location", header]}
        )


# -- what a stored response may hold: size, streams and files ---------------------------------------------


@pytest.mark.parametrize("path", ["/sized", "/streamed", "/files"])
def test_within_the_limit_a_body_is_stored_whole(
    make: Callable[..., Flask], db: psycopg.Connection[Any], path: str
) -> None:
    """A plain, streamed or file body up to IDEM_MAX_RESPONSE_BYTES is stored whole and replayed byte for
    byte (never empty)."""
    policy_app = make(IDEM_MAX_RESPONSE_BYTES=5000)
    key = uuid.uuid4()
    first = post(policy_app, path, key, {"size": 5000})
    again = post(policy_app, path, key, {"size": 5000})
    assert first.status_code == 201 if path != "/files" else first.status_code == 200
    assert len(first.data) == 5000
    assert again.data == first.data and again.headers["Idempotent-Replayed"] == "true"
    if path == "/files":
        assert policy_app.config["OPENED"].closed


@pytest.mark.parametrize("path", ["/sized", "/streamed", "/files"])
def test_over_the_limit_a_request_is_refused_and_rolled_back(
    make: Callable[..., Flask], db: psycopg.Connection[Any], path: str
) -> None:
    """One byte over: 500 response-not-stored, the view's write rolled back, no key row, the file closed;
    the retry meets the same limit (never a truncated or an empty replay)."""
    policy_app = make(IDEM_MAX_RESPONSE_BYTES=5000)
    key = uuid.uuid4()
    for _ in range(2):
        answer = post(policy_app, path, key, {"size": 5001})
        assert answer.status_code == 500
        assert answer.json is not None and answer.json["type"] == "urn:flask-idem:problem:response-not-stored"
        assert count(db, "notes") == 0 and count(db, "idempotency_keys") == 0
    if path == "/files":
        assert policy_app.config["OPENED"].closed


def test_a_stream_read_from_the_views_connection(policy_app: Flask, db: psycopg.Connection[Any]) -> None:
    """A generator that reads idem.connection lazily still has it: it is read before COMMIT."""
    key = uuid.uuid4()
    first = post(policy_app, "/streamed/rows", key, {})
    assert first.status_code == 201
    assert first.data == f"rows {key}\n".encode()
    assert post(policy_app, "/streamed/rows", key, {}).data == first.data


def test_the_limit_setting() -> None:
    """IDEM_MAX_RESPONSE_BYTES defaults to 1 MiB and must be a non-negative integer."""
    from flask_idem.errors import ConfigurationError

    assert Settings.from_config({"IDEM_DATABASE_URL": "postgresql://x/y"}).max_response_bytes == 1024 * 1024
    with pytest.raises(ConfigurationError, match="IDEM_MAX_RESPONSE_BYTES"):
        Settings.from_config({"IDEM_DATABASE_URL": "postgresql://x/y", "IDEM_MAX_RESPONSE_BYTES": "1MB"})


def test_new_response_key_makes_a_working_key(
    make: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """flask idem new-response-key prints a key that IDEM_RESPONSE_KEYS accepts and encrypts with."""
    printed = make().test_cli_runner().invoke(args=["idem", "new-response-key"])
    assert printed.exit_code == 0, printed.output
    key = printed.output.strip()
    policy_app = make(IDEM_RESPONSE_KEYS=key)
    first = post(policy_app, "/secrets", uuid.uuid4(), {})
    assert first.status_code == 201
    (document,) = db.execute("SELECT response FROM idempotency_keys").fetchone() or (None,)
    assert Fernet(key).decrypt(document["body_enc"].encode()) == first.data


def test_an_earlier_policy_reads_what_it_names(
    make: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A previous policy that counted a header the new one does not is compared with that header read
    again: the same request matches, another currency does not."""
    old = Fingerprint(headers=["X-Currency"])
    new = Fingerprint(exclude=["/ts"], previous=[old])
    key = uuid.uuid4()
    assert post(make(deploy=old), "/deploy", key, {"a": 1}, **{"X-Currency": "EUR"}).status_code == 201
    after = make(deploy=new)
    assert post(after, "/deploy", key, {"a": 1}, **{"X-Currency": "EUR"}).status_code == 200
    refused = post(after, "/deploy", key, {"a": 1}, **{"X-Currency": "USD"})
    assert refused.status_code == 422 and refused.json is not None
    assert refused.json["differs"] == ["header X-Currency"]
    assert count(db, "notes") == 1


def test_a_header_renamed_in_another_letter_case(
    make: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A deploy that only writes X-Currency as x-currency keeps stored keys matching: the retry is
    replayed, and a real change is named in the new spelling."""
    key = uuid.uuid4()
    before = make(deploy=Fingerprint(headers=["X-Currency"]))
    assert post(before, "/deploy", key, {"a": 1}, **{"X-Currency": "EUR"}).status_code == 201
    after = make(deploy=Fingerprint(headers=["x-currency"]))
    retry = post(after, "/deploy", key, {"a": 1}, **{"X-Currency": "EUR"})
    assert retry.status_code == 200 and retry.headers["Idempotent-Replayed"] == "true"
    refused = post(after, "/deploy", key, {"a": 1}, **{"X-Currency": "USD"})
    assert refused.status_code == 422 and refused.json is not None
    assert refused.json["differs"] == ["header x-currency"]
    assert count(db, "notes") == 1


@pytest.mark.parametrize("taken_over", [False, True], ids=["at-once", "taken-over"])
def test_a_finished_flow_names_the_part_that_differs(
    policy_app: Flask, db: psycopg.Connection[Any], taken_over: bool
) -> None:
    """A multi-step request finished by its first attempt, or by a retry that took it over, keeps its
    part digests: a changed header is a 422 naming it, a changed /ts is replayed."""
    key = uuid.uuid4()
    body, eur = {"size": 10, "ts": 1}, {"X-Currency": "EUR"}
    if taken_over:
        policy_app.config["SEND_UNKNOWN"] = True
        assert post(policy_app, "/transfers", key, body, **eur).status_code == 503
    assert post(policy_app, "/transfers", key, body, **eur).status_code == 201
    assert "header x-currency" in stored(db, key)["request"]["parts"]
    assert post(policy_app, "/transfers", key, {"size": 10, "ts": 2}, **eur).status_code == 200
    refused = post(policy_app, "/transfers", key, body, **{"X-Currency": "USD"})
    assert refused.status_code == 422 and refused.json is not None
    assert refused.json["differs"] == ["header X-Currency"]


def test_a_flow_answer_over_the_limit(make: Callable[..., Flask], db: psycopg.Connection[Any]) -> None:
    """Over IDEM_MAX_RESPONSE_BYTES a flow's finish is rolled back but its call stands: the 500 says so
    (not "nothing was changed"), the request stays in progress, and a retry does not call again."""
    policy_app = make(IDEM_MAX_RESPONSE_BYTES=100)
    key = uuid.uuid4()
    for _ in range(2):
        answer = post(policy_app, "/transfers", key, {"size": 101}, **{"X-Currency": "EUR"})
        assert answer.status_code == 500 and answer.json is not None
        assert answer.json["type"] == "urn:flask-idem:problem:response-not-stored"
        assert "earlier steps were carried out" in answer.json["detail"]
        assert "Do not send it again under a new Idempotency-Key" in answer.json["detail"]
        assert "nothing was changed" not in answer.json["detail"]
    assert len(policy_app.config["SENT"]) == 1
    assert db.execute("SELECT status, step FROM idempotency_keys").fetchone() == ("processing", "send")
    assert count(db, "notes") == 1  # the intent's; the finish step's write was rolled back


def test_a_flow_keeps_its_answers_in_full() -> None:
    """store_response= is refused on a multi-step route: its finish step (also run by the recovery job,
    away from the route) stores the answer."""
    from flask_idem import Flow, Idempotency
    from flask_idem.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="store_response= is for atomic routes"):
        Idempotency(scope=lambda: 1).idempotent(flow=Flow("policies.flow"), store_response="location")
