"""OpenTelemetry: the idempotency outcome on the request's span, and a child span per outside call.

Optional (``pip install "flask-idem[otel]"``), and off until an application turns it on::

    from flask_idem.tracing import Tracing

    Tracing(app)  # or tracing = Tracing(); tracing.init_app(app) in a factory

Then, for that application:

- every outcome signal (:mod:`flask_idem.signals`) sets ``flask_idem.outcome``, ``flask_idem.org_id``,
  ``flask_idem.key`` (and the flow, step and status when it has them) on the current span, normally the
  request's span of ``opentelemetry-instrumentation-flask``, and adds a span event named after the
  outcome with the same attributes: a trace shows a replay, a 409 or a taken-over request for what it is;
- each :meth:`~flask_idem.Flow.call` step runs in a child span ``flask_idem call <flow>.<step>``, whose
  status is an error when the outcome is unknown;
- each request the recovery job works on runs in a span ``flask_idem recover <flow>``, the parent of its
  call spans.

OpenTelemetry is imported by :meth:`Tracing.init_app` only; without it installed, nothing of it is
imported and nothing here costs anything.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from blinker import NamedSignal
from flask import Flask, current_app

from . import signals

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = ["EXTENSION_NAME", "Tracing", "call_span", "recovery_span"]

#: The key of an application's tracer in ``app.extensions``.
EXTENSION_NAME = "idem_tracing"

_PREFIX = "flask_idem."


class Tracing:
    """Turn OpenTelemetry tracing of flask-idem on for an application.

    :param app: initialise this application at once.
    :param tracer_provider: where spans go; default: OpenTelemetry's global tracer provider.
    """

    def __init__(self, app: Flask | None = None, *, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer_provider = tracer_provider
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Connect the span annotations to ``app``'s signals and keep its tracer.

        :raises ModuleNotFoundError: when ``opentelemetry-api`` is not installed.
        """
        from opentelemetry import trace

        app.extensions[EXTENSION_NAME] = trace.get_tracer("flask_idem", tracer_provider=self.tracer_provider)
        for signal in signals.OUTCOMES:
            signal.connect(_annotator(signal, trace.get_current_span), sender=app, weak=False)


def _attributes(data: dict[str, Any]) -> dict[str, Any]:
    """Span attributes from a signal's arguments: strings, numbers and booleans only."""
    found: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, uuid.UUID):
            value = str(value)
        if isinstance(value, (str, bool, int, float)):
            found[_PREFIX + name] = value
    return found


def _annotator(signal: NamedSignal, current_span: Callable[[], Span]) -> Callable[..., None]:
    """A receiver of ``signal`` that annotates the current span."""
    outcome = signal.name.replace("-", "_")

    def annotate(sender: Flask, **data: Any) -> None:
        span = current_span()
        if not span.is_recording():
            return
        attributes = _attributes(data)
        span.add_event(_PREFIX + outcome, attributes)
        attributes.pop(_PREFIX + "endpoint", None)  # the request span names its route itself
        attributes[_PREFIX + "outcome"] = outcome
        span.set_attributes(attributes)

    return annotate


def _tracer() -> Tracer | None:
    tracer: Tracer | None = current_app.extensions.get(EXTENSION_NAME)
    return tracer


def call_span(run: Any, step: str) -> AbstractContextManager[Any]:
    """A child span around a call step of ``run`` (a :class:`~flask_idem.Run`), when tracing is on."""
    tracer = _tracer()
    if tracer is None:
        return nullcontext()
    name = f"flask_idem call {run.flow}.{step}"
    return _span(
        tracer, name, _attributes({"flow": run.flow, "step": step, "org_id": run.org_id, "key": run.key})
    )


def recovery_span(flow: str, org_id: int, key: uuid.UUID, attempts: int) -> AbstractContextManager[Any]:
    """A span around the recovery job's work on one request, when tracing is on."""
    tracer = _tracer()
    if tracer is None:
        return nullcontext()
    attributes = _attributes({"flow": flow, "org_id": org_id, "key": key, "attempts": attempts})
    return _span(tracer, f"flask_idem recover {flow}", attributes)


@contextmanager
def _span(tracer: Tracer, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    from opentelemetry.trace import Status, StatusCode

    with tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as e:
            cause = e.__cause__ or e  # the engine wraps a call's exception in a private one
            span.record_exception(cause)
            span.set_status(Status(StatusCode.ERROR, type(cause).__name__))
            raise
