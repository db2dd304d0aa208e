"""The :class:`Idempotency` extension: ``init_app``, the route decorator, and the view's connection.

This is the top floor: it puts together the settings (:mod:`.settings`), the per-application state
(:mod:`.state`), what runs around a view (:mod:`._view`) and the CLI (:mod:`.cli`). Nothing below imports it.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from flask import Flask, Response
from psycopg_pool import ConnectionPool

from . import _view
from .cli import idem_cli
from .errors import ConfigurationError
from .flow import Flow
from .pool import Connection
from .settings import OnMismatch, ScopeFunc, Settings, parse_on_mismatch, parse_seconds
from .state import EXTENSION_NAME, IdemState, get_state

__all__ = ["Idempotency"]

F = TypeVar("F", bound=Callable[..., Any])


class Idempotency:
    """Make write routes of a Flask application safe to retry.

    Create it once, with or without an application (the app factory pattern)::

        idem = Idempotency(scope=current_org_id)

        def create_app():
            app = Flask(__name__)
            app.config["IDEM_DATABASE_URL"] = "postgresql://localhost/shop"
            idem.init_app(app)
            return app

    and opt routes in with :meth:`idempotent`.

    :param app: initialise this application at once.
    :param scope: a function called during a request that returns the authenticated organisation's id
        (an ``int`` that fits a ``bigint``), or ``None`` when the request is not authenticated (answered
        401). Keys belong to that organisation: the same key from two organisations names two operations.
        It must derive the organisation from the credentials, never from the request body.
    """

    def __init__(self, app: Flask | None = None, *, scope: ScopeFunc | None = None) -> None:
        self.scope = scope
        self._flows: dict[str, Flow] = {}
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read the ``IDEM_*`` configuration of ``app``, set up its key store and add ``flask idem``.

        The pool is not opened here but on first use in each process, so this is safe to call in the
        master of a pre-fork server.

        :raises ConfigurationError: when the configuration is invalid, or when ``app`` was already
            initialised by an :class:`Idempotency` instance.
        """
        if EXTENSION_NAME in app.extensions:
            raise ConfigurationError(
                "This application already has flask-idem set up. Call init_app() once per"
                " application; create one Idempotency() and share it between modules."
            )
        settings = Settings.from_config(app.config)
        app.extensions[EXTENSION_NAME] = IdemState.create(settings, self._flows)
        if "idem" not in app.cli.commands:
            app.cli.add_command(idem_cli)

    def idempotent(
        self,
        *,
        scope: ScopeFunc | None = None,
        required: bool | None = None,
        on_mismatch: OnMismatch | None = None,
        ttl: float | timedelta | None = None,
        flow: Flow | None = None,
        key_from: Callable[[], Sequence[str]] | None = None,
    ) -> Callable[[F], F]:
        """Decorate a view so that retried write requests are answered once.

        Place it under the route decorator::

            @app.post("/orders")
            @idem.idempotent()
            def create_order():
                conn = idem.connection
                ...

        The view runs in one transaction on :attr:`connection`; its writes, the key record and the stored
        response are committed together. GET, HEAD, OPTIONS and TRACE requests pass through untouched.
        Options left as ``None`` take the application's configuration.

        :param scope: overrides the extension's scope function for this route.
        :param required: whether a request without ``Idempotency-Key`` is refused (400). When not
            required, such a request runs the view once in a transaction, without a key. Default:
            ``IDEM_REQUIRE_KEY``.
        :param on_mismatch: ``"reject"`` (422) or ``"replay"`` (the original response) for a reused key
            whose request differs. Default: ``IDEM_ON_MISMATCH``.
        :param ttl: how long the key is kept, in seconds or as a ``timedelta``. Default:
            ``IDEM_KEY_TTL``.
        :param flow: makes the route multi-step (:mod:`flask_idem.flow`): the view records the intent in
            a short transaction and returns it as a ``dict``, and the flow's steps do the rest, each in
            its own short transaction or, for calls outside, with no transaction at all. A key is
            always required.
        :param key_from: where the key comes from, for a request that cannot send the header: a function
            returning the key's values in the request, validated like the header's (one UUID; none means
            no key), e.g. ``lambda: request.form.getlist("idempotency_key")`` for a plain HTML form.
            The body is read for the fingerprint before it is called. Default: the
            ``Idempotency-Key`` header.
        :raises ConfigurationError: at decoration time, when there is no scope or an option is invalid.
        """
        scope = scope or self.scope
        if scope is None:
            raise ConfigurationError(
                "An idempotent route needs a scope: pass Idempotency(scope=...) or"
                " idempotent(scope=...), a function returning the authenticated organisation's id."
                " Keys are never shared globally."
            )
        if flow is not None:
            if required is False:
                raise ConfigurationError("A multi-step route always requires an Idempotency-Key.")
            known = self._flows.setdefault(flow.name, flow)
            if known is not flow:
                raise ConfigurationError(f"Two flows are named {flow.name!r}; flow names must be unique.")
        options = _view.ViewOptions(
            scope=scope,
            required=required,
            on_mismatch=None if on_mismatch is None else parse_on_mismatch("on_mismatch", on_mismatch),
            ttl=None if ttl is None else parse_seconds("ttl", ttl),
            flow=flow,
            key_from=key_from,
        )

        def decorator(view: F) -> F:
            if inspect.iscoroutinefunction(view):
                raise ConfigurationError(
                    f"{view.__qualname__} is async; flask-idem supports synchronous views only."
                )

            @functools.wraps(view)
            def wrapper(*args: Any, **kwargs: Any) -> Response:
                return _view.handle(get_state(), view, args, kwargs, options)

            return wrapper  # type: ignore[return-value]

        return decorator

    def create_table(self) -> None:
        """Create the current application's key table and index if missing (``flask idem init-db``)."""
        get_state().store.init_schema()

    def close(self) -> None:
        """Close the current application's connection pool in this process.

        Call it when an application is done with (at the end of a test, or before a process exits
        without ``atexit``); a later use opens a new pool.
        """
        get_state().pool.close()

    @property
    def connection(self) -> Connection:
        """The psycopg connection of the running idempotent view, inside its transaction.

        Use it for every write the view makes, so that those writes commit together with the key
        record. Do not commit or roll back yourself; nested ``with conn.transaction():`` blocks
        (savepoints) are fine.

        :raises RuntimeError: outside an idempotent view handling a write request.
        """
        return _view.current().connection

    @property
    def key(self) -> uuid.UUID | None:
        """The ``Idempotency-Key`` of the running idempotent view's request.

        ``None`` when the route does not require a key and the request came without one. Use it to
        derive keys for calls the view makes elsewhere, or as a unique column of the rows it creates.

        :raises RuntimeError: outside an idempotent view handling a write request.
        """
        return _view.current().key

    @property
    def pool(self) -> ConnectionPool[Connection]:
        """The current application's connection pool, for database work outside idempotent views::

            with idem.pool.connection() as conn:
                rows = conn.execute("SELECT ...").fetchall()

        It is opened on first use in each process, so it is safe in a pre-fork server's master.
        """
        return get_state().pool.pool
