"""What ``init_app`` keeps for one application, and the one way to reach it.

Everything of the extension that belongs to an application (its settings, its pool, its key store and
its flows) lives in ``app.extensions["idem"]`` as an :class:`IdemState`. Code reads it through
:func:`get_state`, never by indexing ``app.extensions`` itself, so that a missing ``init_app`` always gives
the same helpful error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flask import Flask, current_app

from .flow import Flow
from .pool import ConnectionSource, ProcessPool
from .settings import Settings
from .store import Store

__all__ = ["EXTENSION_NAME", "IdemState", "get_state"]

#: The key of the state in ``app.extensions``.
EXTENSION_NAME = "idem"


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
        )
        store = Store(
            pool, table=settings.table, tombstone_ttl=settings.tombstone_ttl, distributed=settings.distributed
        )
        return cls(settings=settings, pool=pool, store=store, flows=flows)


def get_state(app: Flask | None = None) -> IdemState:
    """The extension's state of ``app``, or of the current application when ``app`` is ``None``.

    :raises RuntimeError: when flask-idem was not initialised on the application.
    """
    target = current_app if app is None else app
    state: IdemState | None = target.extensions.get(EXTENSION_NAME)
    if state is None:
        raise RuntimeError("flask-idem is not initialised on this application; call idem.init_app(app).")
    return state
