"""What ``init_app`` keeps for one application, and the one way to reach it.

Everything of the extension that belongs to an application (its settings, its pool, its key store and
its flows) lives in ``app.extensions["idem"]`` as an :class:`IdemState`. Code reads it through
:func:`get_state`, never by indexing ``app.extensions`` itself, so that a missing ``init_app`` always gives
the same helpful error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import psycopg
from flask import Flask, current_app
from psycopg.rows import TupleRow

from ._codec import ResponseCodec
from .flow import Flow
from .pool import ConnectionSource, ProcessPool
from .settings import Settings
from .store import Store

__all__ = ["EXTENSION_NAME", "Hook", "IdemState", "get_state"]

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
    pool: ConnectionSource
    store: Store
    #: The flows of multi-step routes by name, for the recovery job (shared with the extension object).
    flows: Mapping[str, Flow]
    #: Test hooks, called at each point of :meth:`fire`; empty outside :mod:`flask_idem.testing`.
    hooks: list[Hook] = field(default_factory=list)
    #: Encrypts the stored bodies of ``store_response="encrypted"`` routes; ``None`` without
    #: ``IDEM_RESPONSE_KEYS``.
    codec: ResponseCodec | None = None

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
        """The state of an application configured with ``settings``.

        Its connections come from ``source`` when given, and otherwise from a pool of its own, opened on
        first use.
        """
        pool = source or ProcessPool(
            settings.database_url,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            timeout=settings.pool_timeout,
            prepare_threshold=settings.prepare_threshold,
            connect_options=settings.connect_options,
            deadline=settings.database_deadline,
        )
        store = Store(
            pool, table=settings.table, tombstone_ttl=settings.tombstone_ttl, distributed=settings.distributed
        )
        codec = ResponseCodec(settings.response_keys) if settings.response_keys else None
        return cls(settings=settings, pool=pool, store=store, flows=flows, codec=codec)


def get_state(app: Flask | None = None) -> IdemState:
    """The extension's state of ``app``, or of the current application when ``app`` is ``None``.

    :raises RuntimeError: when flask-idem was not initialised on the application.
    """
    target = current_app if app is None else app
    state: IdemState | None = target.extensions.get(EXTENSION_NAME)
    if state is None:
        raise RuntimeError("flask-idem is not initialised on this application; call idem.init_app(app).")
    return state
