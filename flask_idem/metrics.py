"""Prometheus metrics from flask-idem's signals, and the key table's state read at scrape time.

Optional (``pip install "flask-idem[metrics]"``): ``metrics = Metrics(); metrics.init_app(app)``, and
:meth:`Metrics.response` as the ``/metrics`` view. Counters and histograms are updated by receivers of
:mod:`flask_idem.signals`, never from the database per request; the key table's gauges come from
:class:`KeyTableCollector` at scrape time (one statement over two small partial indexes, and the
catalog). Under a pre-fork server, set ``PROMETHEUS_MULTIPROC_DIR``; see :doc:`/observing`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import psycopg
from blinker import NamedSignal
from flask import Flask, Response

from . import _jobs_state, _partitions, signals
from ._state import IdemState, get_state
from .errors import ConfigurationError

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("flask_idem.metrics needs prometheus-client: pip install 'flask-idem[metrics]'.") from e

__all__ = ["EXTENSION_NAME", "KeyTableCollector", "Metrics", "multiprocess_dir"]

#: The key of the :class:`Metrics` object in ``app.extensions``.
EXTENSION_NAME = "idem_metrics"

logger = logging.getLogger("flask_idem")

T = TypeVar("T")

#: Buckets of the key table's operations, in seconds: most take well under a millisecond's worth of
#: round trips, and anything over a second is an incident.
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: Buckets of the steps of flows, in seconds: a step with an outside call takes what the outside takes.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: The outcome signals counted by ``flask_idem_outcomes_total`` (the steps have a histogram instead).
COUNTED = tuple(s for s in signals.OUTCOMES if s is not signals.step_finished)

#: The webhook signals counted by ``flask_idem_webhook_deliveries_total`` too, by source.
WEBHOOK_SIGNALS = (
    signals.webhook_verified,
    signals.webhook_rejected,
    signals.webhook_duplicate,
    signals.webhook_handled,
)


def multiprocess_dir() -> str | None:
    """The directory of prometheus-client's multiprocess mode, or ``None`` when it is off."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class Metrics:
    """The Prometheus metrics of flask-idem, for one or more applications.

    :param app: initialise this application at once.
    :param registry: where the counters and histograms are registered; default: prometheus-client's
        global ``REGISTRY``. Unless the multiprocess mode is on, :attr:`collector` is registered there
        too, so an existing ``/metrics`` endpoint shows everything.

    Create it once per process (a second instance would register the same names again).
    """

    def __init__(self, app: Flask | None = None, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        #: ``flask_idem_outcomes_total{endpoint, outcome}``: the outcome signals, by route.
        self.outcomes = Counter(
            "flask_idem_outcomes",
            "Idempotency outcomes (flask_idem.signals), by route and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        #: ``flask_idem_task_outcomes_total{task, outcome}``: background tasks' outcomes, job_deferred too.
        self.task_outcomes = Counter(
            "flask_idem_task_outcomes",
            "Idempotency outcomes of background tasks (flask_idem.jobs), by task and outcome.",
            ["task", "outcome"],
            registry=self.registry,
        )
        #: ``flask_idem_webhook_deliveries_total{source, outcome, check}``: webhook deliveries; ``check`` is
        #: the failed check of a rejected one (``signature``, ``timestamp``...), empty otherwise.
        self.webhooks = Counter(
            "flask_idem_webhook_deliveries",
            "Webhook deliveries (flask_idem.webhooks), by source, outcome and a rejected one's failed check.",
            ["source", "outcome", "check"],
            registry=self.registry,
        )
        #: ``flask_idem_step_duration_seconds{flow, step, kind}``: finished steps of flows.
        self.steps = Histogram(
            "flask_idem_step_duration_seconds",
            "Time the finished steps of multi-step requests took (call steps: the outside call).",
            ["flow", "step", "kind"],
            registry=self.registry,
            buckets=STEP_BUCKETS,
        )
        #: ``flask_idem_store_duration_seconds{operation}``: the key table's operations.
        self.store = Histogram(
            "flask_idem_store_duration_seconds",
            "Time the key table's operations took, waiting for PostgreSQL included.",
            ["operation"],
            registry=self.registry,
            buckets=STORE_BUCKETS,
        )
        #: The collector of the key table's state gauges.
        self.collector = KeyTableCollector()
        if multiprocess_dir() is None:
            self.registry.register(self.collector)
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Count ``app``'s outcomes and read its key table at scrape time.

        Call it after :meth:`Idempotency.init_app <flask_idem.Idempotency.init_app>`.

        :raises ConfigurationError: when ``app`` already has metrics.
        """
        get_state(app)  # fails with the usual message when flask-idem is not initialised
        if EXTENSION_NAME in app.extensions:
            raise ConfigurationError("This application already has flask-idem metrics; call init_app once.")
        app.extensions[EXTENSION_NAME] = self
        for signal in COUNTED:
            signal.connect(self._counter(signal), sender=app, weak=False)
        for signal in WEBHOOK_SIGNALS:
            signal.connect(self._webhook_counter(signal), sender=app, weak=False)
        signals.step_finished.connect(self._on_step, sender=app, weak=False)
        signals.store_operation.connect(self._on_store, sender=app, weak=False)
        self.collector.add(app)

    def _counter(self, signal: NamedSignal) -> Callable[..., None]:
        outcome = signal.name.replace("-", "_")
        outcomes, tasks = self.outcomes, self.task_outcomes

        def count(
            sender: Flask, *, endpoint: str | None = None, task: str | None = None, **data: Any
        ) -> None:
            if task is not None:  # a background task's delivery, or a message the relay published
                tasks.labels(task, outcome).inc()
            else:
                outcomes.labels(endpoint or "", outcome).inc()

        return count

    def _webhook_counter(self, signal: NamedSignal) -> Callable[..., None]:
        outcome = signal.name.replace("-", "_")
        webhooks = self.webhooks

        def count(sender: Flask, *, source: str, check: str | None = None, **data: Any) -> None:
            webhooks.labels(source, outcome, check or "").inc()

        return count

    def _on_step(
        self, sender: Flask, *, flow: str, step: str, outside: bool, duration: float, **data: Any
    ) -> None:
        self.steps.labels(flow, step, "call" if outside else "database").observe(duration)

    def _on_store(self, sender: Flask, *, operation: str, duration: float, **data: Any) -> None:
        self.store.labels(operation).observe(duration)

    def registry_to_scrape(self) -> CollectorRegistry:
        """What a scrape should read: :attr:`registry`, or in multiprocess mode a fresh registry with
        every process's files and :attr:`collector`."""
        if multiprocess_dir() is None:
            return self.registry
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        registry.register(self.collector)
        return registry

    def response(self) -> Response:
        """A Flask response with the text exposition of :meth:`registry_to_scrape`: a ``/metrics`` view."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry_to_scrape()), content_type=CONTENT_TYPE_LATEST)


class KeyTableCollector(Collector):
    """Gauges of the key table's state, read with :meth:`Store.state <flask_idem._store.Store.state>`
    (one statement per key table) each time a registry collects it, labelled with the table's name: the
    processing, stranded and flagged requests, the oldest one's age, whether the table could be read
    (``flask_idem_key_table_up``), the outbox's unsent messages, and the partitions, from the catalog
    only. The table of :doc:`/observing` says what each gauge means.

    Applications sharing one database and table are read once, through the one added last. The
    collector does not keep an application alive.
    """

    def __init__(self) -> None:
        self._apps: list[weakref.ref[Flask]] = []

    def add(self, app: Flask) -> None:
        """Read ``app``'s key table too."""
        self._apps = [ref for ref in self._apps if ref() is not None] + [weakref.ref(app)]

    def describe(self) -> Iterable[Metric]:
        """The gauges' names, without reading anything (a registry calls this when it is registered)."""
        return list(_families().values())

    def collect(self) -> Iterable[Metric]:
        """Read each key table once and return the gauges."""
        families = _families()
        seen: set[tuple[str, str]] = set()
        for ref in reversed(self._apps):
            app = ref()
            if app is None:
                continue
            state = get_state(app)
            where = (state.settings.database_url, state.settings.table)
            if where not in seen:
                seen.add(where)
                _collect(families, app, state)
        return list(families.values())


def _collect(families: dict[str, GaugeMetricFamily], app: Flask, state: IdemState) -> None:
    """The gauges of ``app``'s key table, its partitions and its outbox."""
    label = [state.settings.table]
    found = _read("the key table", state.store.state)
    families["up"].add_metric(label, int(found is not None))
    if found is None:
        return
    families["processing"].add_metric(label, found.processing)
    families["stranded"].add_metric(label, found.stranded)
    families["flagged"].add_metric(label, found.flagged)
    families["oldest"].add_metric(label, found.oldest_processing_seconds)

    def overview() -> _partitions.Overview:
        with state.source.connection() as conn:
            return _partitions.overview(conn, state.settings.table)

    parts = _read("the key table's partitions", overview)
    if parts is not None:
        _add_partitions(families, label, parts, horizon=state.horizon(), ahead=state.settings.partition_ahead)
    jobs: _jobs_state.JobsState | None = app.extensions.get(_jobs_state.EXTENSION_NAME)
    outbox = None if jobs is None else _read("the outbox", jobs.outbox.state)
    if outbox is not None:
        families["unsent"].add_metric(label, outbox.unsent)
        families["unsent_age"].add_metric(label, outbox.oldest_unsent_seconds)


def _read(what: str, read: Callable[[], T]) -> T | None:
    """``read()``, or ``None`` and a warning when the database could not be read."""
    try:
        return read()
    except psycopg.Error as e:
        logger.warning(
            "Could not read %s for metrics: %s (SQLSTATE %s).", what, type(e).__name__, e.sqlstate or "none"
        )
        return None


_KIND = ["table", "kind"]

#: The collector's gauges: the key :meth:`KeyTableCollector.collect` knows each by, its name, help, labels.
_GAUGES = (
    (
        "partitions",
        "flask_idem_partitions",
        "Partitions of the key table (kind=keys) or of its tombstones.",
        _KIND,
    ),
    (
        "partition_bytes",
        "flask_idem_partitions_bytes",
        "Bytes on disk of those partitions, indexes included.",
        _KIND,
    ),
    (
        "partition_passed",
        "flask_idem_partitions_oldest_passed_seconds",
        "Seconds since the oldest partition's range ended (waiting for flask idem purge); 0 if it has not.",
        _KIND,
    ),
    (
        "partition_end",
        "flask_idem_partitions_newest_end_seconds",
        "Seconds until the newest partition of the key table ends: no key can expire later.",
        ["table"],
    ),
    (
        "partition_short",
        "flask_idem_partitions_running_out",
        "1 when the newest partition ends less than half of IDEM_PARTITION_AHEAD past the longest retention.",
        ["table"],
    ),
    ("processing", "flask_idem_keys_processing", "Multi-step requests not finished yet.", ["table"]),
    (
        "stranded",
        "flask_idem_keys_stranded",
        "Processing requests whose lease expired, waiting to be resumed.",
        ["table"],
    ),
    (
        "flagged",
        "flask_idem_keys_flagged",
        "Requests given up and flagged for a person (flask idem stuck).",
        ["table"],
    ),
    (
        "oldest",
        "flask_idem_oldest_processing_age_seconds",
        "Age of the oldest processing request; 0 if none.",
        ["table"],
    ),
    ("up", "flask_idem_key_table_up", "1 if the key table could be read for this scrape, else 0.", ["table"]),
    ("unsent", "flask_idem_outbox_unsent", "Outbox messages the relay has not published yet.", ["table"]),
    (
        "unsent_age",
        "flask_idem_outbox_oldest_unsent_age_seconds",
        "Age of the oldest unsent outbox message; 0 if none.",
        ["table"],
    ),
)


def _families() -> dict[str, GaugeMetricFamily]:
    return {key: GaugeMetricFamily(name, text, labels=labels) for key, name, text, labels in _GAUGES}


def _add_partitions(
    families: dict[str, GaugeMetricFamily],
    label: list[str],
    parts: _partitions.Overview,
    *,
    horizon: float,
    ahead: float,
) -> None:
    """The partition gauges of one key table."""
    for kind, listed in (("keys", parts.keys), ("tombstones", parts.tombstones)):
        passed = parts.passed(listed)
        oldest = (parts.now - passed[0].upper).total_seconds() if passed and passed[0].upper else 0.0
        families["partitions"].add_metric([*label, kind], len(listed))
        families["partition_bytes"].add_metric([*label, kind], sum(p.bytes for p in listed))
        families["partition_passed"].add_metric([*label, kind], oldest)
    end = parts.newest_end
    if end is not None:
        families["partition_end"].add_metric(label, (end - parts.now).total_seconds())
    families["partition_short"].add_metric(
        label, int(parts.warning(horizon=horizon, ahead=ahead) is not None)
    )
