"""Crashing a multi-step request after each of its steps in turn, and checking it still ends once."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from psycopg import sql
from werkzeug.test import TestResponse

from .._state import get_state
from ..recovery import recover
from ._core import Call, Effect, Killer, describe, fail, hooked, replayed, send_and_kill, show, start

__all__ = ["crash_between_steps"]


def crash_between_steps(
    target: Flask | FlaskClient,
    method: str,
    path: str,
    *,
    outside: Effect,
    json: Any = None,
    headers: Mapping[str, str] | None = None,
    effect: Effect | None = None,
) -> list[str]:
    """Kill a multi-step request after each of its steps in turn; each must still end with one outside call.

    A first request runs without a crash, to note the points it passes (the view, each step by name,
    ``"finish"``) and the outside calls it makes. Then a request with a new key is killed at each point
    (:class:`~._core.WorkerKilled`, raised in its thread before that step's result is recorded) and
    finished by the client's retry (killed in the view, it was rolled back whole) or by
    :func:`flask_idem.recovery.recover`; each must end with as many outside calls as the run without a
    crash, the stored answer, and the effect done once.

    :param outside: counts the calls the outside party saw, e.g. charges at the payment provider.
    :param json: the JSON body, or a function returning a body for each new key (an order to pay).
    :param effect: counts what the request does in the database, one per finished request.
    :returns: the points where a request was killed.
    """
    client, call, key, body = start(target, method, path, json, headers)
    app = client.application
    calls, done = outside(), effect() if effect else 0
    watcher = Killer(None)
    with hooked(app, watcher):
        clean = call.send(client, key, json=body)
    points = watcher.seen
    per_request = outside() - calls
    _check_clean(call, clean, points, per_request, outside, effect() - done if effect else None, effect)
    call_steps = set(watcher.outside)
    for point in points:
        _crash_at(client, call, point, point in call_steps, per_request, outside, effect, clean)
    return points


def _check_clean(
    call: Call,
    clean: TestResponse,
    points: list[str],
    per_request: int,
    outside: Effect,
    grew: int | None,
    effect: Effect | None,
) -> None:
    """The run without a crash must be a multi-step request that works: it passed ``points``, made
    ``per_request`` outside calls, and grew ``effect`` by one (``grew``)."""
    if "view" not in points:
        raise fail(
            f"{call.name} never reached flask-idem's transaction (it answered {show(clean)}): is the view"
            " decorated with @idem.idempotent(flow=...)?"
        )
    if points == ["view"]:
        raise fail(f"{call.name} is not a multi-step route (no step after the view); use check_replay.")
    if clean.status_code >= 500 or replayed(clean):
        raise fail(
            f"{call.name} with a new key answered {show(clean)}; the check needs a request that works."
        )
    if per_request < 1:
        raise fail(
            f"{call.name} answered {clean.status_code} but the outside party saw no call ({describe(outside)}"
            " did not change): `outside` must count the calls the outside party received."
        )
    if effect is not None and grew != 1:
        raise fail(
            f"{call.name} answered {clean.status_code} and {describe(effect)} changed by {grew}:"
            " the effect must count one per finished request."
        )


def _crash_at(
    client: FlaskClient,
    call: Call,
    point: str,
    is_call: bool,
    per_request: int,
    outside: Effect,
    effect: Effect | None,
    clean: TestResponse,
) -> None:
    """A request with a new key killed at ``point`` must end as the run without a crash did (``clean``),
    with ``per_request`` outside calls and the effect done once."""
    key, body = uuid.uuid4(), call.body()
    calls, done = outside(), effect() if effect else 0
    _kill(client, call, key, body, point, outside, calls)
    final = call.send(client, key, json=body)
    seen = outside() - calls
    if seen != per_request:
        hint = (
            f" The call step {point!r} must give the outside party a key from run.derived_key(), the same"
            " on every attempt, so that it deduplicates the repeated call (and a resolve= that finds it)."
            if is_call
            else ""
        )
        raise fail(
            f"{call.name} killed after {point!r} and then finished made {seen} call(s) to the outside party,"
            f" where a request without a crash makes {per_request}.{hint}"
        )
    if effect is not None and effect() - done != 1:
        raise fail(
            f"{call.name} killed after {point!r} and then finished changed {describe(effect)} by"
            f" {effect() - done}, not once."
        )
    expected = clean.status_code
    if point != "view":
        expected = 200 if expected == 201 else expected
    if final.status_code != expected or (point != "view" and not replayed(final)):
        raise fail(
            f"the retry of {call.name} killed after {point!r} answered {show(final)}; expected"
            f" {expected}{' (replayed)' if point != 'view' else ''} like the request without a crash."
        )


def _kill(
    client: FlaskClient, call: Call, key: uuid.UUID, body: Any, point: str, outside: Effect, calls: int
) -> None:
    """Kill a request with ``key`` at ``point``: killed in its view, it was rolled back whole and made no
    outside call (``calls`` before it); killed after, the recovery job finishes it once its lease is
    over."""
    app = client.application
    killer = send_and_kill(client, call, key, body, point)
    if not killer.killed:
        raise fail(
            f"{call.name} did not reach {point!r} on a second run (it went {' -> '.join(killer.seen)}):"
            " the check needs a request that takes the same steps every time."
        )
    if point == "view":
        seen = outside() - calls
        if seen:
            raise fail(
                f"the outside party saw {seen} call(s) from {call.name} although the request was killed"
                " in its view, before the COMMIT, and rolled back: the view is the flow's first,"
                " transactional step and must not call outside. Call outside only in a @flow.call step,"
                " whose result is recorded and never made again blindly."
            )
        return
    _make_due(app, key)
    report = recover(app)
    if not any(entry[1] == key for entry in report.completed):
        raise fail(
            f"after {call.name} was killed after {point!r}, the recovery job did not finish it: {report!r}"
        )


def _make_due(app: Flask, key: uuid.UUID) -> None:
    """Let time pass for a killed request: its lease is over and the recovery job may take it now."""
    state = get_state(app)
    table = sql.Identifier(*state.settings.table.split("."))
    with state.source.transaction() as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {} SET lease_expires_at = now(), next_attempt_at = NULL"
                " WHERE idem_key = %s AND status = 'processing'"
            ).format(table),
            (key,),
        )
