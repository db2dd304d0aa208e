"""OpenTelemetry: the idempotency outcome on the request's span, and a child span per outside call.

Optional (``pip install "flask-idem[otel]"``), and off until an application calls ``Tracing(app)`` (or
``init_app``): then every outcome signal sets ``flask_idem.*`` attributes and an event on the current span,
each :meth:`~flask_idem.Flow.call` step runs in a child span ``flask_idem call <flow>.<step>``, and each
request the recovery job works on in a span ``flask_idem recover <flow>`` (:doc:`/observing`). OpenTelemetry
is imported by :meth:`Tracing.init_app` only.
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


def call_span(run: Any, step: str) -> AbstractContextManager[Any]:
    """A child span around a call step of ``run`` (a :class:`~flask_idem.Run`), when tracing is on."""
    name = f"flask_idem call {run.flow}.{step}"
    return _span(name, flow=run.flow, step=step, org_id=run.org_id, key=run.key)


def recovery_span(flow: str, org_id: int, key: uuid.UUID, attempts: int) -> AbstractContextManager[Any]:
    """A span around the recovery job's work on one request, when tracing is on."""
    return _span(f"flask_idem recover {flow}", flow=flow, org_id=org_id, key=key, attempts=attempts)


def _span(name: str, **data: Any) -> AbstractContextManager[Any]:
    tracer: Tracer | None = current_app.extensions.get(EXTENSION_NAME)
    return nullcontext() if tracer is None else _traced(tracer, name, _attributes(data))


@contextmanager
def _traced(tracer: Tracer, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
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
