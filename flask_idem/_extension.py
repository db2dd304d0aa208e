"""The :class:`Idempotency` extension: ``init_app``, the route decorators, and the view's connection.
The top floor: nothing below imports it."""

from __future__ import annotations

import functools
import logging
import math
import uuid
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from flask import Flask, Response
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from . import _deadline, _http, _layout, _migrate, _partitions, _view, _webhook
from ._async import synchronous
from ._policy import Fingerprint
from ._pool import ConnectionSource, ForkSafeConnectionPool, PooledConnection
from ._replay import StoreResponse, parse_store_response
from ._settings import OnMismatch, ScopeFunc, Settings, parse_on_mismatch, parse_seconds
from ._state import EXTENSION_NAME, IdemState, get_state
from .cli import idem_cli
from .errors import ConfigurationError
from .flow import Flow
from .webhooks import Event, Source

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy
    from sqlalchemy.orm import scoped_session

__all__ = ["Idempotency"]

F = TypeVar("F", bound=Callable[..., Any])
OptionsT = TypeVar("OptionsT")

_logger = logging.getLogger("flask_idem")


class Idempotency:
    """Make write routes of a Flask application safe to retry.

    Create it once, with or without an application (the app factory pattern)::

        idem = Idempotency(scope=current_org_id)

        def create_app():
            app = Flask(__name__)
            app.config["IDEM_DATABASE_URL"] = "postgresql://localhost/shop"
            idem.init_app(app)
            return app

    and opt routes in with :meth:`idempotent`. An application that writes through Flask-SQLAlchemy passes
    ``sqlalchemy=db`` instead of a database URL, and its views keep using ``db.session`` (:doc:`/sqlalchemy`).

    :param app: initialise this application at once.
    :param scope: a function called during a request that returns the authenticated organisation's id
        (an ``int`` that fits a ``bigint``; :func:`flask_idem.scope_id` maps others), or ``None`` when
        the request is not authenticated (401). Keys belong to that organisation; derive it from the
        credentials, never from the request body.
    :param sqlalchemy: the Flask-SQLAlchemy extension (or a ``scoped_session``) whose session idempotent
        views write through: the key store runs in the session's transaction; ``IDEM_DATABASE_URL``
        must not be set.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        scope: ScopeFunc | None = None,
        sqlalchemy: SQLAlchemy | scoped_session[Any] | None = None,
    ) -> None:
        self.scope = scope
        self.sqlalchemy = sqlalchemy
        self._flows: dict[str, Flow] = {}
        #: Every decorated view and its wrapper, to find a wrapper that never became a route.
        self._wrappers: dict[Callable[..., Any], Callable[..., Any]] = {}
        self._apps: weakref.WeakSet[Flask] = weakref.WeakSet()
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read the ``IDEM_*`` configuration of ``app``, set up its key store and add ``flask idem``.

        The database is not touched and the pool opens on first use in each process (safe in a
        pre-fork server's master); the key table's layout is checked at the first write request or
        ``flask idem`` command (:meth:`check_layout`). With ``sqlalchemy=``, call ``db.init_app(app)``
        first. The first request checks that every decorated view is its route's (a misplaced decorator
        fails every request, naming the view) and warns of decorated routes that answer no write
        method; a warning is logged at once when ``MAX_CONTENT_LENGTH`` is not set.

        :raises ConfigurationError: when the configuration is invalid, or when ``app`` was already
            initialised by an :class:`Idempotency` instance.
        """
        if EXTENSION_NAME in app.extensions:
            raise ConfigurationError(
                "This application already has flask-idem set up. Call init_app() once per"
                " application; create one Idempotency() and share it between modules."
            )
        settings, source = self._settings(app)
        app.extensions[EXTENSION_NAME] = IdemState.create(settings, self._flows, source)
        if "idem" not in app.cli.commands:
            app.cli.add_command(idem_cli)
        app.before_request(self._placement_check(app))
        if settings.database_deadline is not None:
            app.wsgi_app = _deadline.RequestDeadline(app.wsgi_app, settings.database_deadline)  # type: ignore[method-assign]
        self._apps.add(app)
        if app.config.get("MAX_CONTENT_LENGTH") is None:
            _logger.warning(
                "MAX_CONTENT_LENGTH is not set in application %r: flask-idem reads the whole body of every"
                " keyed request into memory to fingerprint it, however large. Set"
                " app.config['MAX_CONTENT_LENGTH'] (in bytes; the shop uses 64 KiB) so that a larger body"
                " is refused with 413 before any database work.",
                app.name,
            )

    def _settings(self, app: Flask) -> tuple[Settings, ConnectionSource | None]:
        """The settings of ``app``, and where its key store's connections come from: the pool of
        ``IDEM_DATABASE_URL`` (``None``), or with ``sqlalchemy=`` the session's."""
        if self.sqlalchemy is None:
            return Settings.from_config(app.config), None
        from .sqla import SessionSource  # SQLAlchemy is an optional dependency

        if app.config.get("IDEM_DATABASE_URL"):
            raise ConfigurationError(
                "IDEM_DATABASE_URL is set, but with sqlalchemy= the key store runs on the"
                " SQLAlchemy engine's connections, in the session's transaction. Remove it."
            )
        sessions = SessionSource.for_app(app, self.sqlalchemy)
        settings = Settings.from_config(app.config, database_url=sessions.conninfo)
        sessions.deadline = settings.database_deadline
        return settings, sessions

    def _placement_check(self, app: Flask) -> Callable[[], None]:
        """A ``before_request`` hook that refuses to serve while a decorated view is not its route's view
        (the decorator placed above ``@app.post``). It compares them at the first request, once every
        blueprint is registered; the routes' methods are known only then too."""
        misplaced: list[str] | None = None

        def check() -> None:
            nonlocal misplaced
            if misplaced is None:
                routed = set(app.view_functions.values())
                misplaced = sorted(
                    f"{view.__module__}.{view.__qualname__}"
                    for view, wrapper in self._wrappers.items()
                    if view in routed and wrapper not in routed
                )
                _warn_read_only(app)
            if misplaced:
                raise ConfigurationError(_misplaced_message(misplaced))

        return check

    def idempotent(
        self,
        *,
        scope: ScopeFunc | None = None,
        required: bool | None = None,
        on_mismatch: OnMismatch | None = None,
        ttl: float | timedelta | None = None,
        flow: Flow | None = None,
        key_from: Callable[[], Sequence[str]] | None = None,
        fingerprint: Fingerprint | None = None,
        store_response: StoreResponse = "full",
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
        Options left as ``None`` take the application's configuration. The view may be ``async def``
        (with ``flask[async]``), run to completion inside the key's transaction.

        :param scope: overrides the extension's scope function for this route.
        :param required: whether a request without ``Idempotency-Key`` is refused (400); if not, it runs
            the view once in a transaction, without a key. Default: ``IDEM_REQUIRE_KEY``.
        :param on_mismatch: ``"reject"`` (422) or ``"replay"`` (the original response) for a reused key
            whose request differs. Default: ``IDEM_ON_MISMATCH``.
        :param ttl: how long the key is kept, in seconds or as a ``timedelta``. Default: ``IDEM_KEY_TTL``.
        :param flow: makes the route multi-step (:doc:`/flows`): the view returns the intent as a
            ``dict`` and the flow's steps do the rest. A key is always required.
        :param key_from: a function returning the key's values in the request, for a request that cannot
            send the header (``lambda: request.form.getlist("idempotency_key")`` for an HTML form),
            validated like the header's.
        :param fingerprint: what counts as the same request (:doc:`/fingerprints`). Default: the method,
            path, query, media type and the whole body.
        :param store_response: what is kept of the route's answers (:doc:`/responses`): ``"full"``,
            ``"location"`` (a 2xx replayed as ``303 See Other`` to its ``Location``) or ``"encrypted"``
            (with ``IDEM_RESPONSE_KEYS``). Atomic routes only.

        :raises ConfigurationError: at decoration time, when there is no scope, an option is invalid, or the
            view is ``async def`` and asgiref (``flask-idem[async]``) is not installed.
        """
        options = self._route_options(
            scope, required, on_mismatch, ttl, flow, key_from, fingerprint, store_response
        )

        def decorator(view: F) -> F:
            # The options are set on the wrapper for flask_idem.openapi and flask_idem.testing to read.
            wrapper = self._wrap(view, _view.handle, options, _view.OPTIONS_ATTR)
            for app in self._apps:
                if view in app.view_functions.values():
                    raise ConfigurationError(_misplaced_message([f"{view.__module__}.{view.__qualname__}"]))
            return wrapper

        return decorator

    def _route_options(
        self,
        scope: ScopeFunc | None,
        required: bool | None,
        on_mismatch: OnMismatch | None,
        ttl: float | timedelta | None,
        flow: Flow | None,
        key_from: Callable[[], Sequence[str]] | None,
        fingerprint: Fingerprint | None,
        store_response: StoreResponse,
    ) -> _view.ViewOptions:
        """The options of an idempotent route (:meth:`idempotent`'s), checked once, when the decorator is
        applied: a request reads them as they are."""
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
            self.add_flow(flow)
        if fingerprint is not None and not isinstance(fingerprint, Fingerprint):
            raise ConfigurationError(f"fingerprint= takes a flask_idem.Fingerprint, not {fingerprint!r}.")
        store = parse_store_response("store_response", store_response)
        if flow is not None and store != "full":
            raise ConfigurationError(
                "store_response= is for atomic routes: a multi-step route's answer is stored by its finish"
                " step, which the recovery job also runs, away from the route. Keep secrets out of it."
            )
        return _view.ViewOptions(
            scope=scope,
            required=required,
            on_mismatch=None if on_mismatch is None else parse_on_mismatch("on_mismatch", on_mismatch),
            ttl=None if ttl is None else parse_seconds("ttl", ttl),
            flow=flow,
            key_from=key_from,
            # The default policy without earlier ones is no policy: nothing more to do per request.
            fingerprint=None
            if fingerprint is None or (fingerprint.default and not fingerprint.previous)
            else fingerprint,
            store_response=store,
        )

    def _wrap(
        self,
        view: F,
        handle: Callable[
            [IdemState, Callable[..., Any], tuple[Any, ...], dict[str, Any], OptionsT], Response
        ],
        options: OptionsT,
        attr: str,
    ) -> F:
        """``view`` wrapped to hand each request to a door's ``handle`` with ``options`` (set as ``attr``)."""
        run = synchronous(view, "view")

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Response:
            return handle(get_state(), run, args, kwargs, options)

        self._wrappers[view] = wrapper
        setattr(wrapper, attr, options)
        return wrapper  # type: ignore[return-value]

    def webhook(
        self, source: Source, *, scope: Callable[[], str | int | None] | None = None
    ) -> Callable[[F], F]:
        """Decorate a view that receives a provider's webhook deliveries, so that each event is handled
        once, however often it is delivered (:doc:`/webhooks`)::

            @app.post("/webhooks/stripe")
            @idem.webhook(webhooks.stripe(os.environ["STRIPE_WEBHOOK_SECRET"]))
            def stripe_event():
                event = idem.event.json()
                ...
                return "", 204

        A delivery is verified on its raw body before any database work (``400`` and nothing written
        when it fails). The event id is recorded in the view's transaction on :attr:`connection`, so the
        view's writes and "handled" commit together; a redelivery is answered with the first answer and
        the view does not run.

        :param source: how to verify a delivery and read its event id (:mod:`flask_idem.webhooks`).
        :param scope: for a source whose event ids are unique only per tenant: a function returning the
            tenant of the delivery being handled. Default: the source's event ids are unique.
        :raises ConfigurationError: at decoration time, when ``source`` is not a webhook source.
        """
        if not isinstance(source, Source):
            raise ConfigurationError(
                f"idem.webhook() takes a flask_idem.webhooks source (webhooks.stripe(secret), ...), not"
                f" {source!r}."
            )
        options = _webhook.WebhookOptions(source, scope)

        def decorator(view: F) -> F:
            return self._wrap(view, _webhook.handle, options, _webhook.OPTIONS_ATTR)  # read by .testing

        return decorator

    @property
    def event(self) -> Event:
        """The verified event of the running webhook view (:meth:`webhook`): its source, its id and its
        raw body (``idem.event.json()`` parses it).

        :raises RuntimeError: outside a webhook view handling a delivery.
        """
        return _webhook.current_event()

    def add_flow(self, flow: Flow) -> None:
        """Make ``flow`` known to the recovery job (``flask idem recover``) of this extension's applications.

        :meth:`idempotent` and :meth:`flask_idem.jobs.Jobs.task` do it for their flows.

        :raises ConfigurationError: when another flow has the same name.
        """
        known = self._flows.setdefault(flow.name, flow)
        if known is not flow:
            raise ConfigurationError(f"Two flows are named {flow.name!r}; flow names must be unique.")

    def create_table(self) -> None:
        """Create the current application's key table in the latest layout, or upgrade it
        (``flask idem init-db``), on a connection of its own; safe to run twice, and at once.

        :raises ConfigurationError: when this code cannot run on the table then (a newer layout).
        """
        state = get_state()
        settings = state.settings
        report = _migrate.upgrade(
            settings.database_url,
            table=settings.table,
            distributed=settings.distributed,
            lock_timeout=settings.migration_lock_timeout,
            connect_options=settings.connect_options,
            horizon=state.horizon(),
        )
        _layout.check(report.found, settings.table)

    def check_layout(self) -> None:
        """Check now that the current application's key table exists in a layout this flask-idem runs on.

        The extension checks it by itself at the first use of the database; call this where a deployment
        should fail early instead (a readiness probe, gunicorn's ``post_worker_init``). Once passed, it
        costs nothing.

        :raises ConfigurationError: when the table is missing, older than this code runs on, or newer
            than it knows; the message names the command to run.
        """
        get_state().check_layout()

    def partition_warning(self) -> str | None:
        """A sentence when the current application's key table runs out of partitions soon, else
        ``None``.

        The sentence comes when the newest ends less than half of :data:`IDEM_PARTITION_AHEAD` past the
        longest retention (``flask idem purge`` has not run for days); it names the command to run.
        Catalog queries only: cheap enough for a readiness probe, which should report it, not fail on it
        (:doc:`/retention`).
        """
        state = get_state()
        with state.source.connection() as conn:
            parts = _partitions.overview(conn, state.settings.table)
        return parts.warning(horizon=state.horizon(), ahead=state.settings.partition_ahead)

    def close(self) -> None:
        """Close the current application's connection pool in this process.

        A later use opens a new pool. With ``sqlalchemy=`` it does nothing: the engine is the application's.
        """
        get_state().source.close()

    @property
    def connection(self) -> psycopg.Connection[TupleRow]:
        """The psycopg connection of the running idempotent view, inside its transaction.

        Use it for every write the view makes, so that they commit with the key record. Do not commit or
        roll back yourself; savepoints are fine. With ``sqlalchemy=``, the connection under ``db.session``.

        :raises RuntimeError: outside an idempotent view handling a write request.
        """
        return _http.current().connection

    @property
    def key(self) -> uuid.UUID | None:
        """The ``Idempotency-Key`` of the running idempotent view's request.

        ``None`` when the route does not require a key and the request came without one.

        :raises RuntimeError: outside an idempotent view handling a write request.
        """
        return _http.current().key

    def deadline(self, seconds: float | None) -> AbstractContextManager[None]:
        """Give the database work of a ``with`` block ``seconds`` of database time in all, measured by the
        client, instead of ``IDEM_DATABASE_DEADLINE``::

            with idem.deadline(1.0), idem.pool.connection() as conn:
                conn.execute("SELECT 1")  # a readiness check: answered within a second, or 503

        Connections borrowed in the block are cut when the time is spent, and a borrow after that raises
        :class:`DeadlineExceeded` at once. Inside a request the block gets at most what is left of the
        request's deadline. ``None``: no deadline at all, for a long maintenance query (the server's
        ``statement_timeout`` still applies).
        """
        return _deadline.budget(seconds if seconds is not None else math.inf)

    @property
    def settings(self) -> Settings:
        """The current application's configuration, as ``init_app`` read and checked it (read-only).

        For code that needs what flask-idem was told, such as the key table's name (``idem.settings.table``).

        :raises RuntimeError: when flask-idem was not initialised on the current application.
        """
        return get_state().settings

    @property
    def pool(self) -> ConnectionPool[PooledConnection]:
        """The current application's connection pool, for database work outside idempotent views::

            with idem.pool.connection() as conn:
                rows = conn.execute("SELECT ...").fetchall()

        :raises ConfigurationError: with ``sqlalchemy=``, where the application's engine is the pool.
        """
        source = get_state().source
        if not isinstance(source, ForkSafeConnectionPool):
            raise ConfigurationError(
                "This application uses SQLAlchemy (Idempotency(sqlalchemy=...)): flask-idem has no pool"
                " of its own. Use db.session, or db.engine for connections."
            )
        return source.pool


def _warn_read_only(app: Flask) -> None:
    """Warn of each decorated endpoint of ``app`` whose routes answer only methods passed through."""
    methods: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        view = app.view_functions.get(rule.endpoint)
        if view is not None and hasattr(view, _view.OPTIONS_ATTR):
            # A rule without methods answers every method, writes included.
            methods.setdefault(rule.endpoint, set()).update(rule.methods or {"POST"})
    for endpoint, answered in sorted(methods.items()):
        if answered <= _view.SAFE_METHODS:
            _logger.warning(
                "@idem.idempotent() on endpoint %r does nothing: its routes answer only %s, which pass"
                " through untouched (no key, no transaction). Route a write method to it (@app.post,"
                " put, patch or delete), or remove the decorator.",
                endpoint,
                ", ".join(sorted(answered)),
            )


def _misplaced_message(views: list[str]) -> str:
    return (
        f"@idem.idempotent() is not the view its route calls for {', '.join(views)}: it is placed above"
        " the route decorator, so Flask registered the undecorated view and the route has no"
        " idempotency at all. Put @idem.idempotent() below @app.post(...) (or @bp.post(...)):"
        " the route decorator must be the outermost one."
    )
