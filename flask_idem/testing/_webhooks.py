"""The check of a webhook route: an event delivered again and again, one after another and all at once,
is handled once."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from ._core import Effect, at_once, client_of, describe, fail, show

__all__ = ["check_webhook_redelivery"]

_ONCE = (
    "is the view decorated with @idem.webhook(source) (under the route decorator), and does the handler"
    " write on idem.connection (not on a connection of its own, which commits whatever happens)?"
)


def check_webhook_redelivery(
    target: Flask | FlaskClient,
    path: str,
    *,
    sign: Callable[[bytes], Mapping[str, str]],
    body: bytes | Callable[[], bytes],
    effect: Effect,
    times: int = 3,
    threads: int = 8,
) -> list[TestResponse]:
    """A provider's redeliveries of one event, one after another or all at once, run its handler once.

    One event is delivered ``times`` times in a row, then another from ``threads`` threads at once; each
    delivery is a ``POST`` of ``body`` with the headers ``sign(body)`` returns.

    :param sign: the headers that make a delivery of a body pass the route's source: its signature
        (and timestamp, event id header...) made with the test secret.
    :param body: a function returning the body of a new event (a new event id) on each call, so that the
        concurrent deliveries are of an event not seen before; or one body, then delivered in both parts.
    :param effect: counts what the handler does, e.g. ``Rows(idem_db, "payments")``: one per event
        handled.
    :returns: every answer, in the order sent (the concurrent ones last).
    """
    client = client_of(target)
    name = f"POST {path}"

    def new_body() -> bytes:
        return body() if callable(body) else body

    def deliver(sent: bytes, on: FlaskClient) -> TestResponse:
        return on.post(path, data=sent, headers=dict(sign(sent)))

    event = new_body()
    before = effect()
    answers = [deliver(event, client) for _ in range(times)]
    _in_a_row(name, answers, effect() - before, effect)
    expected = 1 if callable(body) else 0
    answers.extend(_all_at_once(client.application, name, new_body(), deliver, effect, threads, expected))
    return answers


def _in_a_row(name: str, answers: list[TestResponse], grew: int, effect: Effect) -> None:
    """Deliveries of one event one after another (``answers``): the first a 2xx, every redelivery one
    too, and ``effect`` grown by one (``grew``)."""
    first = answers[0]
    if not 200 <= first.status_code < 300:
        raise fail(
            f"the first delivery of an event to {name} answered {show(first)}; the check needs a delivery"
            " the route accepts: do sign(body)'s headers pass the route's source, with the secret the"
            " application uses in tests?"
        )
    if grew == 0:
        raise fail(
            f"the first delivery of an event to {name} answered {first.status_code} but did not change"
            f" {describe(effect)}: the effect must count one per event handled, e.g. the rows the handler"
            " inserts."
        )
    if grew > 1:
        raise fail(
            f"delivering one event {len(answers)} times to {name} changed {describe(effect)} by {grew}"
            f" (expected 1, however often it is delivered): {_ONCE}"
        )
    for again in answers[1:]:
        if not 200 <= again.status_code < 300:
            raise fail(
                f"a redelivery of an event already handled by {name} answered {show(again)}: a provider"
                " takes any answer but a 2xx for a failed delivery and keeps delivering it. " + _ONCE
            )


def _all_at_once(
    app: Flask,
    name: str,
    event: bytes,
    deliver: Callable[[bytes, FlaskClient], TestResponse],
    effect: Effect,
    threads: int,
    expected: int,
) -> list[TestResponse]:
    """``threads`` deliveries of ``event`` at the same moment: ``expected`` effects (one for a new event),
    each answer 2xx or 409."""
    before = effect()
    responses = at_once(app, threads, lambda client: deliver(event, client), f"deliveries to {name}")
    for response in responses:
        if response.status_code != 409 and not 200 <= response.status_code < 300:
            raise fail(
                f"one of {threads} concurrent deliveries of one event to {name} answered {show(response)};"
                " expected a 2xx, or 409 while another delivery of it is being handled."
            )
    grew = effect() - before
    if grew != expected:
        raise fail(
            f"{threads} concurrent deliveries of one event to {name} changed {describe(effect)} by {grew}"
            f" (expected {expected}): {_ONCE}"
        )
    return responses
