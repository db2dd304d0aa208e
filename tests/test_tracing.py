"""OpenTelemetry: outcomes on the request's span and child spans for calls, seen by the SDK's in-memory
exporter."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from flask_idem import OutcomeUnknown
from flask_idem.recovery import recover
from flask_idem.tracing import Tracing

from .support.flow_app import Ledger, build_flow_app
from .support.helpers import close_pool
from .support.notes_app import post


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def notes(make_app: Callable[..., Flask], provider: TracerProvider) -> Flask:
    app = make_app()
    Tracing(app, tracer_provider=provider)
    return app


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def flow_app(
    database_url: str, db: psycopg.Connection[Any], ledger: Ledger, provider: TracerProvider
) -> Iterator[Flask]:
    app = build_flow_app(database_url, ledger)
    Tracing(app, tracer_provider=provider)
    yield app
    close_pool(app)


def traced(provider: TracerProvider, app: Flask, path: str, key: uuid.UUID, body: Any) -> Any:
    """POST inside a span standing for the request span of opentelemetry-instrumentation-flask."""
    with provider.get_tracer("tests").start_as_current_span("POST " + path):
        return post(app, path, key, body)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_request_span_carries_the_outcome(
    notes: Flask, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The request's span gets the outcome, key and org as attributes and one event per outcome."""
    key = uuid.uuid4()
    traced(provider, notes, "/notes", key, {"body": "a"})
    traced(provider, notes, "/notes", key, {"body": "a"})
    first, retry = exporter.get_finished_spans()
    assert first.attributes is not None and retry.attributes is not None
    assert dict(first.attributes) == {
        "flask_idem.outcome": "response_stored",
        "flask_idem.org_id": 1,
        "flask_idem.key": str(key),
        "flask_idem.status": 201,
    }
    assert [e.name for e in first.events] == ["flask_idem.key_reserved", "flask_idem.response_stored"]
    assert first.events[0].attributes is not None
    assert first.events[0].attributes["flask_idem.endpoint"] == "create"
    assert retry.attributes["flask_idem.outcome"] == "response_replayed"
    assert [e.name for e in retry.events] == ["flask_idem.response_replayed"]


def test_call_steps_run_in_child_spans(
    flow_app: Flask, ledger: Ledger, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Each call step is a child span of the request; an unknown outcome marks it as an error."""
    ledger.fail_next = OutcomeUnknown
    key = uuid.uuid4()
    assert traced(provider, flow_app, "/transfers", key, {"amount": 7}).status_code == 503
    spans = by_name(exporter)
    call, request = spans["flask_idem call notes.transfer.post"], spans["POST /transfers"]
    assert call.parent is not None and call.parent.span_id == request.context.span_id
    assert call.status.status_code == StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in call.events if e.attributes] == [
        "flask_idem.flow.OutcomeUnknown"
    ]
    assert call.attributes is not None and call.attributes["flask_idem.step"] == "post"
    assert request.attributes is not None and request.attributes["flask_idem.outcome"] == "outcome_unknown"

    exporter.clear()
    assert traced(provider, flow_app, "/transfers", key, {"amount": 7}).status_code == 201
    spans = by_name(exporter)
    assert spans["flask_idem call notes.transfer.post"].status.status_code == StatusCode.UNSET
    events = [e.name for e in spans["POST /transfers"].events]
    assert events == ["flask_idem.lease_taken_over", "flask_idem.step_finished", "flask_idem.response_stored"]


def test_recovery_runs_in_a_span(
    flow_app: Flask, ledger: Ledger, db: psycopg.Connection[Any], exporter: InMemorySpanExporter
) -> None:
    """The recovery job's work on a request is a span of its own, parent of the call it makes."""
    ledger.lose_answer = True
    post(flow_app, "/transfers", uuid.uuid4(), {"amount": 7})
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    exporter.clear()
    assert len(recover(flow_app).completed) == 1
    spans = by_name(exporter)
    recovery, call = spans["flask_idem recover notes.transfer"], spans["flask_idem call notes.transfer.post"]
    assert call.parent is not None and call.parent.span_id == recovery.context.span_id
    assert recovery.attributes is not None
    assert recovery.attributes["flask_idem.outcome"] == "recovered"
    assert recovery.attributes["flask_idem.attempts"] == 1


def test_without_tracing_no_span_is_made(
    make_app: Callable[..., Flask], provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """An application without Tracing adds nothing to the spans around it."""
    app = make_app()
    traced(provider, app, "/notes", uuid.uuid4(), {"body": "a"})
    (span,) = exporter.get_finished_spans()
    assert span.attributes == {} and span.events == ()
