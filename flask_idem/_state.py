"""What ``init_app`` keeps for one application, and the one way to reach it.

Everything of the extension that belongs to an application lives in ``app.extensions["idem"]`` as an
:class:`IdemState`, read through :func:`get_state`, so that a missing ``init_app`` always gives the same
helpful error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from flask import Flask, current_app, has_app_context
from psycopg.rows import TupleRow

from . import _layout
from ._cipher import ResponseCipher
from ._pool import ConnectionSource, ForkSafeConnectionPool
from ._settings import VIEW_OPTIONS_ATTR, Settings
from ._store import Store
from .flow import Flow

__all__ = ["EXTENSION_NAME", "Hook", "IdemState", "get_state"]

logger = logging.getLogger("flask_idem")

#: The key of the state in ``app.extensions``.
EXTENSION_NAME = "idem"

#: A test hook (:mod:`flask_idem.testing`): called with the name of the point a request reached and the
#: connection of the transaction still open there (``None`` after a call step, which has none).
Hook = Callable[[str, psycopg.Connection[TupleRow] | None], None]


@dataclass(frozen=True, slots=True)
class IdemState:
    """The extension's state for one application."""

    settings: Settings
    #: Where this application's connections and transactions come from: its per-process pool (the key
    #: store's and :attr:`.Idempotency.pool`), or its SQLAlchemy session (:mod:`.sqla`).
    source: ConnectionSource
    store: Store
    #: The flows of multi-step routes by name, for the recovery job (shared with the extension object).
    flows: Mapping[str, Flow]
    #: Test hooks, called at each point of :meth:`fire`; empty outside :mod:`flask_idem.testing`.
    hooks: list[Hook] = field(default_factory=list)
    #: Encrypts the stored bodies of ``store_response="encrypted"`` routes; ``None`` without
    #: ``IDEM_RESPONSE_KEYS``.
    codec: ResponseCipher | None = None
    #: Set once the key table was found in a layout this code runs on (:meth:`check_layout`).
    layout_checked: threading.Event = field(default_factory=threading.Event)

    def check_layout(self) -> None:
        """Make sure the key table exists in a layout this code runs on: once, at the first use of the
        database, then never again (one flag to read).

        One catalog query, which needs no privilege; a missing index is logged once, as a warning, with
        the statement that restores it. Not done by ``init_app``, which must not touch the database
        (``flask idem init-db`` and ``flask db upgrade`` load the application before the table exists).

        :raises ConfigurationError: when the table is missing, has a layout this code cannot run on, or
            lacks a column or the unique key the code uses, naming the command that fixes it; checked
            again at the next use.
        """
        if self.layout_checked.is_set():
            return
        with self.source.connection() as conn:
            found = _layout.read(conn, self.settings.table)
        _layout.check(found, self.settings.table)
        for warning in _layout.warnings(found, self.settings.table):
            logger.warning("%s", warning)
        self.layout_checked.set()

    def horizon(self) -> float:
        """Seconds ahead of now that this application's keys may expire, and that partitions of the key
        table are made ahead of: its longest retention (``IDEM_KEY_TTL``, or a route's longer ``ttl=``
        among the current application's views) and ``IDEM_PARTITION_AHEAD``."""
        longest = self.settings.key_ttl
        if has_app_context():
            for view in current_app.view_functions.values():
                views: list[Any] = [view]
                view_class = getattr(view, "view_class", None)
                if view_class is not None:  # a MethodView's decorated methods
                    views += [getattr(view_class, name, None) for name in ("post", "put", "patch", "delete")]
                for one in views:
                    ttl = getattr(getattr(one, VIEW_OPTIONS_ATTR, None), "ttl", None)
                    if isinstance(ttl, (int, float)):
                        longest = max(longest, float(ttl))
        return longest + self.settings.partition_ahead

    def fire(self, point: str, conn: psycopg.Connection[TupleRow] | None) -> None:
        """Call the test hooks at ``point``: ``"view"`` after the view ran, inside its transaction;
        a step's name after it ran, before its result is recorded; ``"finish"`` inside the finish
        step's transaction. A hook that raises ends the request there, as a crash would.
        """
        for hook in self.hooks:
            hook(point, conn)

    @classmethod
    def create(
        cls, settings: Settings, flows: Mapping[str, Flow], source: ConnectionSource | None = None
    ) -> IdemState:
        """The state of an application configured with ``settings``, on ``source`` or a pool of its own."""
        source = source or ForkSafeConnectionPool(
            settings.database_url,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            timeout=settings.pool_timeout,
            prepare_threshold=settings.prepare_threshold,
            connect_options=settings.connect_options,
            deadline=settings.database_deadline,
        )
        store = Store(
            source,
            table=settings.table,
            tombstone_ttl=settings.tombstone_ttl,
            distributed=settings.distributed,
        )
        codec = ResponseCipher(settings.response_keys) if settings.response_keys else None
        return cls(settings=settings, source=source, store=store, flows=flows, codec=codec)


def get_state(app: Flask | None = None) -> IdemState:
    """The extension's state of ``app``, or of the current application when ``app`` is ``None``.

    :raises RuntimeError: when flask-idem was not initialised on the application.
    """
    target = current_app if app is None else app
    state: IdemState | None = target.extensions.get(EXTENSION_NAME)
    if state is None:
        raise RuntimeError("flask-idem is not initialised on this application; call idem.init_app(app).")
    return state
