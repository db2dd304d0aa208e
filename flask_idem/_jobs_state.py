"""The background jobs' state of an application: its policy, outbox and relay's publisher, and the
registry entry of each task (:class:`TaskSpec`). What the job door (:mod:`._delivery`), the relay and the
CLI read; :mod:`flask_idem.jobs` fills it in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from flask import Flask

from . import _layout
from ._outbox import Outbox
from ._settings import SETTINGS
from ._state import get_state
from ._task import JobPolicy, Publisher
from .errors import ConfigurationError
from .flow import Flow

__all__ = ["EXTENSION_NAME", "JobsState", "TaskSpec", "get_jobs"]

#: The key of the background jobs' state in ``app.extensions``.
EXTENSION_NAME = "idem_jobs"


@dataclass(frozen=True, slots=True)
class JobsState:
    """What :meth:`Jobs.init_app <flask_idem.jobs.Jobs.init_app>` keeps for one application
    (``app.extensions["idem_jobs"]``): the policy, the outbox, the relay's publisher."""

    policy: JobPolicy
    outbox: Outbox
    publisher: Publisher
    #: Seconds a relay holds the messages it claimed (``IDEM_OUTBOX_LEASE``).
    relay_lease: float
    #: Seconds sent messages are kept before the relay deletes them (``IDEM_OUTBOX_RETENTION``).
    retention: float
    #: Set once the outbox was found there (:meth:`check_outbox`).
    outbox_found: threading.Event = field(default_factory=threading.Event)

    def check_outbox(self, conn: psycopg.Connection[Any], table: str) -> None:
        """Make sure, once, that the key table and its outbox exist in a layout this code runs on.

        :raises ConfigurationError: naming the command that creates or upgrades them.
        """
        if not self.outbox_found.is_set():
            _layout.check(_layout.read(conn, table), table)
            self.outbox_found.set()

    @classmethod
    def create(cls, app: Flask, publisher: Publisher, policy: JobPolicy | None = None) -> JobsState:
        """The state of ``app`` (whose flask-idem is initialised), from its ``IDEM_JOB_*`` configuration."""
        state = get_state(app)
        config = app.config
        return cls(
            policy=policy or JobPolicy.from_config(config),
            outbox=Outbox.of(state.source, state.settings),
            publisher=publisher,
            relay_lease=SETTINGS["IDEM_OUTBOX_LEASE"].read(config),
            retention=SETTINGS["IDEM_OUTBOX_RETENTION"].read(config),
        )


def get_jobs(app: Flask) -> JobsState:
    """The background jobs' state of ``app``.

    :raises ConfigurationError: when no runner was set up on the application.
    """
    found: JobsState | None = app.extensions.get(EXTENSION_NAME)
    if found is None:
        raise ConfigurationError(
            "Background jobs are not set up on this application: call jobs.init_app(app, celery_app)"
            " (flask_idem.celery.CeleryJobs, or another runner's init_app) after idem.init_app(app)."
        )
    return found


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One idempotent task as :meth:`Jobs.task <flask_idem.jobs.Jobs.task>` registered it: its name, its
    function, and its options (``None``: the application's)."""

    name: str
    func: Callable[..., Any]
    flow: Flow | None = None
    ttl: float | None = None
    policy: JobPolicy | None = None
