"""The :class:`Idempotency` extension: configuration, per-application state and the route decorator."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from flask import Flask, Response, current_app

from . import _view
from .errors import ConfigurationError
from .flow import Flow
from .store import Store

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from .store import Connection

__all__ = ["DEFAULT_REPLAY_HEADERS", "Idempotency", "Settings"]

F = TypeVar("F", bound=Callable[..., Any])

#: Response headers stored with a response and sent again on replay (``IDEM_REPLAY_HEADERS``). Cookies
#: are deliberately absent: a replay must not hand out the first caller's session.
DEFAULT_REPLAY_HEADERS = (
    "Content-Type",
    "Content-Language",
    "Content-Location",
    "Location",
    "ETag",
    "Last-Modified",
    "Link",
)

_MISMATCH_CHOICES = ("reject", "replay")


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}.")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name} must be a non-negative integer, not {value!r}.")
    return value


def _mismatch(name: str, value: Any) -> str:
    if value not in _MISMATCH_CHOICES:
        raise ConfigurationError(f"{name} must be 'reject' or 'replay', not {value!r}.")
    return str(value)


@dataclass(frozen=True, slots=True)
class Settings:
    """The ``IDEM_*`` configuration of one application, read and checked once by ``init_app``.

    See the configuration page of the documentation for each key, its default and its meaning.
    """

    database_url: str
    table: str = "idempotency_keys"
    key_ttl: float = 24 * 3600.0
    on_mismatch: str = "reject"
    require_key: bool = True
    retry_after: int = 1
    replay_headers: frozenset[str] = frozenset(h.lower() for h in DEFAULT_REPLAY_HEADERS)
    pool_min_size: int = 1
    pool_max_size: int = 10
    pool_timeout: float = 5.0
    prepare_threshold: int | None = 5
    lease_timeout: float = 30.0
    recovery_deadline: float = 3600.0
    recovery_backoff: float = 2.0
    recovery_backoff_cap: float = 300.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """Build the settings from a Flask config, with an actionable error for each bad value."""
        url = config.get("IDEM_DATABASE_URL")
        if not url or not isinstance(url, str):
            raise ConfigurationError(
                "Set IDEM_DATABASE_URL to a PostgreSQL URL such as"
                " 'postgresql://user@localhost/app' before calling init_app()."
            )
        defaults = cls(database_url=url)
        min_size = _positive_int("IDEM_POOL_MIN_SIZE", config.get("IDEM_POOL_MIN_SIZE", 1))
        max_size = _positive_int("IDEM_POOL_MAX_SIZE", config.get("IDEM_POOL_MAX_SIZE", 10))
        if max_size < max(min_size, 1):
            raise ConfigurationError("IDEM_POOL_MAX_SIZE must be at least 1 and IDEM_POOL_MIN_SIZE.")
        headers = config.get("IDEM_REPLAY_HEADERS", DEFAULT_REPLAY_HEADERS)
        if not isinstance(headers, (list, tuple, set, frozenset)) or not all(
            isinstance(h, str) for h in headers
        ):
            raise ConfigurationError("IDEM_REPLAY_HEADERS must be a list of header names.")
        if "set-cookie" in (h.lower() for h in headers):
            raise ConfigurationError(
                "IDEM_REPLAY_HEADERS must not include Set-Cookie: a replay would hand one client's"
                " cookies to whoever retries."
            )
        table = config.get("IDEM_TABLE", defaults.table)
        parts = table.split(".") if isinstance(table, str) else []
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ConfigurationError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}.")
        require_key = config.get("IDEM_REQUIRE_KEY", defaults.require_key)
        if not isinstance(require_key, bool):
            raise ConfigurationError(f"IDEM_REQUIRE_KEY must be true or false, not {require_key!r}.")
        threshold = config.get("IDEM_PREPARE_THRESHOLD", defaults.prepare_threshold)
        if threshold is not None:
            threshold = _positive_int("IDEM_PREPARE_THRESHOLD", threshold)
        return cls(
            database_url=url,
            table=table,
            key_ttl=_seconds("IDEM_KEY_TTL", config.get("IDEM_KEY_TTL", defaults.key_ttl)),
            on_mismatch=_mismatch("IDEM_ON_MISMATCH", config.get("IDEM_ON_MISMATCH", defaults.on_mismatch)),
            require_key=require_key,
            prepare_threshold=threshold,
            retry_after=max(1, _positive_int("IDEM_RETRY_AFTER", config.get("IDEM_RETRY_AFTER", 1))),
            replay_headers=frozenset(h.lower() for h in headers),
            pool_min_size=min_size,
            pool_max_size=max_size,
            pool_timeout=_seconds("IDEM_POOL_TIMEOUT", config.get("IDEM_POOL_TIMEOUT", 5.0)),
            **{
                name: _seconds(
                    f"IDEM_{name.upper()}", config.get(f"IDEM_{name.upper()}", getattr(defaults, name))
                )
                for name in ("lease_timeout", "recovery_deadline", "recovery_backoff", "recovery_backoff_cap")
            },
        )


@dataclass(frozen=True, slots=True)
class _State:
    """What ``init_app`` keeps for one application in ``app.extensions["idem"]``."""

    settings: Settings
    store: Store
    #: The flows of multi-step routes by name, for the recovery job (shared with the extension object).
    flows: Mapping[str, Flow]


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

    def __init__(self, app: Flask | None = None, *, scope: _view.ScopeFunc | None = None) -> None:
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
        if "idem" in app.extensions:
            raise ConfigurationError(
                "This application already has flask-idem set up. Call init_app() once per"
                " application; create one Idempotency() and share it between modules."
            )
        settings = Settings.from_config(app.config)
        store = Store(
            settings.database_url,
            table=settings.table,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            timeout=settings.pool_timeout,
            prepare_threshold=settings.prepare_threshold,
        )
        app.extensions["idem"] = _State(settings=settings, store=store, flows=self._flows)

        from .cli import idem_cli

        if "idem" not in app.cli.commands:
            app.cli.add_command(idem_cli)

    def idempotent(
        self,
        *,
        scope: _view.ScopeFunc | None = None,
        required: bool | None = None,
        on_mismatch: str | None = None,
        ttl: float | timedelta | None = None,
        flow: Flow | None = None,
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
            on_mismatch=None if on_mismatch is None else _mismatch("on_mismatch", on_mismatch),
            ttl=None if ttl is None else _seconds("ttl", ttl),
            flow=flow,
        )

        def decorator(view: F) -> F:
            if inspect.iscoroutinefunction(view):
                raise ConfigurationError(
                    f"{view.__qualname__} is async; flask-idem supports synchronous views only."
                )

            @functools.wraps(view)
            def wrapper(*args: Any, **kwargs: Any) -> Response:
                return _view.handle(_state(), view, args, kwargs, options)

            return wrapper  # type: ignore[return-value]

        return decorator

    def create_table(self) -> None:
        """Create the current application's key table and index if missing (``flask idem init-db``)."""
        _state().store.init_schema()

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
        return _state().store.pool


def _state() -> _State:
    try:
        state: _State = current_app.extensions["idem"]
    except KeyError:
        raise RuntimeError(
            "flask-idem is not initialised on this application; call idem.init_app(app)."
        ) from None
    return state
