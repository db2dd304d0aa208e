"""Checks of one route: replay, mismatch, a duplicate in flight, two organisations, many at once.

Each returns the responses it got, for further asserts, or raises :class:`~._core.NotRetrySafe` saying what
went wrong in plain words.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from ._core import (
    WAIT,
    Call,
    Effect,
    at_once,
    client_of,
    describe,
    fail,
    hooked,
    replayed,
    send_and_kill,
    show,
    start,
)

__all__ = ["check_in_flight", "check_mismatch", "check_replay", "check_scope", "hammer"]

_OUTSIDE = (
    "does the view write outside idem.connection (a second connection, or idem.pool, that commits on"
    " its own)?"
)


def _first(call: Call, response: TestResponse, effect: Effect, before: int, what: str = "the first") -> None:
    """The first answer must be a real one, and the effect must have grown by one exactly when it is 2xx."""
    status = response.status_code
    if status >= 500 or status in (409, 422) or replayed(response):
        raise fail(
            f"{what} request to {call.name} with a new key answered {show(response)}; the check needs a"
            " request the route accepts."
        )
    grew = effect() - before
    expected = 1 if status < 300 else 0
    if grew != expected:
        raise fail(
            f"{what} request to {call.name} answered {status}, and {describe(effect)} changed by {grew}"
            f" (expected {expected}): the effect must count one per request that did its work, e.g. the"
            " rows the view inserts."
        )


def _killed_leaves_nothing(
    client: FlaskClient, call: Call, key: uuid.UUID, body: Any, effect: Effect
) -> None:
    """A request killed inside its transaction, right after the view returned, leaves ``effect`` as it was."""
    before = effect()
    killer = send_and_kill(client, call, key, body, "view")
    if not killer.killed:
        raise fail(
            f"{call.name} never reached flask-idem's transaction: is the view decorated with"
            " @idem.idempotent() (under the route decorator), and does the request carry what the route"
            " needs to get that far (authentication)?"
        )
    after_crash = effect()
    if after_crash != before:
        raise fail(
            f"{call.name} was killed before its COMMIT, yet {describe(effect)} changed from {before} to"
            f" {after_crash}: {_OUTSIDE} Such a write stays when the request fails, and the retry does it"
            " again."
        )


def _twice(
    client: FlaskClient,
    call: Call,
    key: uuid.UUID,
    bodies: tuple[Any, Any],
    effect: Effect,
    before: int,
    what: str,
    why: str,
) -> tuple[TestResponse, TestResponse]:
    """A first request with ``key`` (a real answer, see :func:`_first`), then ``what``, a second with the
    same key, which must leave ``effect`` as it was (else ``why``); both answers."""
    first = call.send(client, key, json=bodies[0])
    _first(call, first, effect, before)
    counted = effect()
    second = call.send(client, key, json=bodies[1])
    if effect() != counted:
        raise fail(f"{what} changed {describe(effect)} from {counted} to {effect()}: {why}")
    return first, second


def check_replay(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    effect: Effect,
    json: Any = None,
    data: bytes | str | None = None,
    headers: Mapping[str, str] | None = None,
    key: uuid.UUID | None = None,
) -> tuple[TestResponse, TestResponse]:
    """A retry gets the first answer again and the view's effect happens once, even after a crash: three
    attempts with one key, the first killed inside its transaction (:doc:`/testing-routes`).

    :param effect: counts what the view does, e.g. ``Rows(idem_db, "orders")``.
    :returns: the first answer and the replay.
    """
    client, call, new_key, body = start(target, method, path, json, headers, data)
    key = key or new_key
    before = effect()
    _killed_leaves_nothing(client, call, key, body, effect)
    what = f"the second request to {call.name} with the same key"
    first, again = _twice(client, call, key, (body, body), effect, before, what, _OUTSIDE)
    expected = 200 if first.status_code == 201 else first.status_code
    if not replayed(again) or again.status_code != expected:
        raise fail(
            f"the second request to {call.name} with the same key answered {show(again)}, not the stored"
            f" answer ({expected} with Idempotent-Replayed: true): is the view decorated with"
            " @idem.idempotent()?"
        )
    if again.get_data() != first.get_data():
        raise fail(
            f"the replay of {call.name} has another body than the first answer:"
            f" {first.get_data()[:200]!r} then {again.get_data()[:200]!r}."
        )
    return first, again


def check_mismatch(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    effect: Effect,
    json: Any,
    changed: Any,
    headers: Mapping[str, str] | None = None,
) -> TestResponse:
    """The same key with another body is refused with 422 (or, under ``on_mismatch="replay"``, answered
    with the stored response) and writes nothing.

    :param changed: the JSON body of the second request, different from ``json``.
    :returns: the answer to the changed request.
    """
    client = client_of(target)
    call = Call(method, path, json, None, headers or {})
    what = f"a request to {call.name} that reused a key with another body"
    why = "it must be refused and write nothing."
    first, second = _twice(client, call, uuid.uuid4(), (json, changed), effect, effect(), what, why)
    if second.status_code == 422 and second.mimetype == "application/problem+json":
        return second
    if replayed(second) and second.get_data() == first.get_data():
        return second
    raise fail(
        f"a request to {call.name} that reused a key with another body answered {show(second)}, neither"
        " 422 (problem+json) nor the stored answer: is the view decorated with @idem.idempotent()?"
    )


def check_in_flight(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    effect: Effect,
    json: Any = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[TestResponse, TestResponse]:
    """While the first request is inside its transaction, a duplicate is told 409 at once.

    The kit holds the first request right after its view returned, inside the transaction (a barrier,
    no sleep), sends the duplicate, then lets the first finish.

    :returns: the first answer and the duplicate's.
    """
    client, call, key, body = start(target, method, path, json, headers)
    before = effect()
    first, duplicate = _duplicate_while_held(client, call, key, body)
    if duplicate.status_code != 409 or "Retry-After" not in duplicate.headers:
        raise fail(
            f"a duplicate of {call.name} sent while the first was inside its transaction answered"
            f" {show(duplicate)}, not 409 with Retry-After."
        )
    _first(call, first, effect, before)
    return first, duplicate


def _duplicate_while_held(
    client: FlaskClient, call: Call, key: uuid.UUID, body: Any
) -> tuple[TestResponse, TestResponse]:
    """The first request's answer and a duplicate's, sent while the first is held in its transaction
    right after its view returned (a barrier, no sleep), then let go."""
    app = client.application
    entered, release = threading.Event(), threading.Event()
    answers: dict[str, TestResponse | BaseException] = {}
    held: list[str] = []

    def first_attempt() -> None:
        try:
            answers["first"] = call.send(app.test_client(), key, json=body)
        except BaseException as e:  # reported by the main thread
            answers["first"] = e
        finally:
            entered.set()  # also when the request ended without reaching the hook

    worker = threading.Thread(target=first_attempt, daemon=True)

    def hold(point: str, conn: psycopg.Connection[Any] | None) -> None:
        if threading.get_ident() == worker.ident and point == "view":
            held.append(point)
            entered.set()
            release.wait(WAIT)

    with hooked(app, hold):
        worker.start()
        try:
            if not entered.wait(WAIT) or not held:
                worker.join(WAIT)
                raise fail(
                    f"{call.name} never reached flask-idem's transaction (it answered"
                    f" {_shown(answers.get('first'))}): is the view decorated with @idem.idempotent()?"
                )
            duplicate = call.send(client, key, json=body)
        finally:
            release.set()
            worker.join(WAIT)
    first = answers.get("first")
    if not isinstance(first, TestResponse):
        raise fail(f"the first request to {call.name} failed while held: {first!r}")
    return first, duplicate


def _shown(answer: TestResponse | BaseException | None) -> str:
    return show(answer) if isinstance(answer, TestResponse) else repr(answer)


def check_scope(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    effect: Effect,
    headers: Mapping[str, str],
    other_headers: Mapping[str, str],
    json: Any = None,
) -> tuple[TestResponse, TestResponse]:
    """The same key from two organisations names two operations: each does its work and gets its own answer.

    :param headers: the credentials of one organisation.
    :param other_headers: the credentials of another.
    :returns: the two first answers.
    """
    client, ours, key, body = start(target, method, path, json, headers)
    theirs = Call(method, path, json, None, other_headers)
    before = effect()
    first = ours.send(client, key, json=body)
    _first(ours, first, effect, before)
    counted = effect()
    other = theirs.send(client, key, json=body)
    if replayed(other):
        raise fail(
            f"another organisation sending {ours.name} with the same key got the first organisation's"
            f" stored answer ({show(other)}): the scope must be the authenticated organisation, taken"
            " from the credentials, never from the request body or anything else the client chooses."
        )
    _first(theirs, other, effect, counted, what="the other organisation's")
    for call, response in ((ours, first), (theirs, other)):
        again = call.send(client, key, json=body)
        if not replayed(again) or again.get_data() != response.get_data():
            raise fail(
                f"a retry of {call.name} answered {show(again)}, not that organisation's own stored"
                f" answer {show(response)}."
            )
    return first, other


def hammer(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    effect: Effect,
    json: Any = None,
    headers: Mapping[str, str] | None = None,
    threads: int = 8,
) -> list[TestResponse]:
    """``threads`` threads send the same request with the same key at once: one does the work.

    Every answer is the first one (say 201), its replay (200, ``Idempotent-Replayed``) or 409 (still in
    flight), and ``effect`` grows by one.

    :returns: the answers.
    """
    client, call, key, body = start(target, method, path, json, headers)
    app = client.application
    before = effect()
    responses = at_once(
        app, threads, lambda client: call.send(client, key, json=body), f"requests to {call.name}"
    )
    originals = [r for r in responses if r.status_code != 409 and not replayed(r)]
    if len(originals) != 1:
        raise fail(
            f"{len(originals)} of {threads} concurrent requests to {call.name} with one key were answered"
            f" as first requests ({', '.join(show(r) for r in originals[:3])}): exactly one may run the view."
        )
    original = originals[0]
    _first(call, original, effect, before)
    allowed = {409, 200 if original.status_code == 201 else original.status_code}
    for response in responses:
        if response is original:
            continue
        if response.status_code not in allowed or (
            response.status_code != 409 and response.get_data() != original.get_data()
        ):
            raise fail(
                f"a concurrent duplicate of {call.name} answered {show(response)}; expected 409 or the"
                f" replay of {show(original)}."
            )
    return responses
