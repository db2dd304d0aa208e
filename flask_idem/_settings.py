"""The ``IDEM_*`` settings of one application, read and checked once by ``init_app``.

Also the types of the options a route can override (:data:`ScopeFunc`, :data:`OnMismatch`) and their
validators, shared by the configuration and by :meth:`.Idempotency.idempotent`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, TypeAlias

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ._cipher import parse_response_keys
from .errors import ConfigurationError

__all__ = [
    "DEFAULT_REPLAY_HEADERS",
    "OnMismatch",
    "ScopeFunc",
    "Settings",
    "check_database_url",
    "parse_connect_options",
    "parse_on_mismatch",
    "parse_seconds",
]

#: The scope callable: returns the authenticated organisation's id, or ``None`` when the request is not
#: authenticated (answered 401).
ScopeFunc: TypeAlias = Callable[[], "int | None"]

#: What to do with a reused key whose request differs: refuse it (422) or replay the first answer.
OnMismatch: TypeAlias = Literal["reject", "replay"]

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

#: The URL schemes libpq accepts.
_SCHEMES = ("postgresql", "postgres")

_MISMATCH_CHOICES: tuple[OnMismatch, ...] = ("reject", "replay")


def parse_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` (a number or a ``timedelta``) as positive seconds; ``name`` is the setting it came from.

    :param zero: whether 0 is allowed too.
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (value == 0 and not zero)
    ):
        kind = "a non-negative" if zero else "a positive"
        raise ConfigurationError(f"{name} must be {kind} number of seconds, not {value!r}.")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigurationError(f"{name} must be a non-negative integer, not {value!r}.")


def parse_on_mismatch(name: str, value: Any) -> OnMismatch:
    """``value`` as an :data:`OnMismatch` policy; ``name`` is the setting it came from."""
    for choice in _MISMATCH_CHOICES:
        if value == choice:
            return choice
    raise ConfigurationError(f"{name} must be 'reject' or 'replay', not {value!r}.")


@dataclass(frozen=True, slots=True)
class Settings:
    """The ``IDEM_*`` configuration of one application, read and checked once by ``init_app``; the current
    application's is :attr:`Idempotency.settings <flask_idem.Idempotency.settings>`.

    Each attribute is the key of the same name without its prefix, in lower case (``table`` is
    ``IDEM_TABLE``, ``retry_after`` is ``IDEM_RETRY_AFTER``), with its default applied; see the
    configuration page for each. Read-only: the configuration is not read again after ``init_app``.
    """

    database_url: str = field(repr=False)
    table: str = "idempotency_keys"
    key_ttl: float = 24 * 3600.0
    on_mismatch: OnMismatch = "reject"
    require_key: bool = True
    retry_after: int = 1
    replay_headers: frozenset[str] = frozenset(h.lower() for h in DEFAULT_REPLAY_HEADERS)
    pool_min_size: int = 1
    pool_max_size: int = 10
    pool_timeout: float = 5.0
    prepare_threshold: int | None = 5
    distributed: bool = False
    lease_timeout: float = 30.0
    recovery_deadline: float = 3600.0
    recovery_backoff: float = 2.0
    recovery_backoff_cap: float = 300.0
    #: How long a key is remembered after its stored response expired (``IDEM_TOMBSTONE_TTL``).
    tombstone_ttl: float = 30 * 24 * 3600.0
    #: libpq parameters over the pool's defaults (``IDEM_CONNECT_OPTIONS``); ``None`` removes a default.
    connect_options: Mapping[str, str | int | None] = field(default_factory=dict, repr=False)
    #: A request's database time in all, kept by the client (``IDEM_DATABASE_DEADLINE``); ``None``: none.
    database_deadline: float | None = 10.0
    #: The largest response body kept for retries (``IDEM_MAX_RESPONSE_BYTES``).
    max_response_bytes: int = 1024 * 1024
    #: Keys of ``store_response="encrypted"`` routes (``IDEM_RESPONSE_KEYS``), the first encrypting.
    response_keys: tuple[str, ...] = field(default=(), repr=False)
    #: How long a migration's statement waits for a lock before its transaction is tried again.
    migration_lock_timeout: float = 2.0

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"Settings(database_url={_redacted(self.database_url)!r}, {shown})"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, database_url: str | None = None) -> Settings:
        """Build the settings from a Flask config, with an actionable error for each bad value.

        :param database_url: the database when it does not come from ``IDEM_DATABASE_URL`` (the
            SQLAlchemy engine's).
        """
        url = database_url or config.get("IDEM_DATABASE_URL")
        if not url or not isinstance(url, str):
            raise ConfigurationError(
                "Set IDEM_DATABASE_URL to a PostgreSQL URL such as"
                " 'postgresql://user@localhost/app' before calling init_app()."
            )
        check_database_url(url)
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
        if {"authorization", "proxy-authorization"} & {h.lower() for h in headers}:
            raise ConfigurationError(
                "IDEM_REPLAY_HEADERS must not include Authorization: a replay would hand one client's"
                " credentials to whoever retries."
            )
        table = config.get("IDEM_TABLE", defaults.table)
        parts = table.split(".") if isinstance(table, str) else []
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ConfigurationError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}.")
        require_key = config.get("IDEM_REQUIRE_KEY", defaults.require_key)
        if not isinstance(require_key, bool):
            raise ConfigurationError(f"IDEM_REQUIRE_KEY must be true or false, not {require_key!r}.")
        distributed = config.get("IDEM_DISTRIBUTED", defaults.distributed)
        if not isinstance(distributed, bool):
            raise ConfigurationError(f"IDEM_DISTRIBUTED must be true or false, not {distributed!r}.")
        threshold = config.get("IDEM_PREPARE_THRESHOLD", defaults.prepare_threshold)
        if threshold is not None:
            threshold = _positive_int("IDEM_PREPARE_THRESHOLD", threshold)
        deadline = config.get("IDEM_DATABASE_DEADLINE", defaults.database_deadline)
        if deadline is not None:
            deadline = parse_seconds("IDEM_DATABASE_DEADLINE", deadline)
        return cls(
            database_url=url,
            table=table,
            key_ttl=parse_seconds("IDEM_KEY_TTL", config.get("IDEM_KEY_TTL", defaults.key_ttl)),
            on_mismatch=parse_on_mismatch(
                "IDEM_ON_MISMATCH", config.get("IDEM_ON_MISMATCH", defaults.on_mismatch)
            ),
            require_key=require_key,
            distributed=distributed,
            prepare_threshold=threshold,
            retry_after=max(1, _positive_int("IDEM_RETRY_AFTER", config.get("IDEM_RETRY_AFTER", 1))),
            replay_headers=frozenset(h.lower() for h in headers),
            pool_min_size=min_size,
            pool_max_size=max_size,
            pool_timeout=parse_seconds("IDEM_POOL_TIMEOUT", config.get("IDEM_POOL_TIMEOUT", 5.0)),
            tombstone_ttl=parse_seconds(
                "IDEM_TOMBSTONE_TTL", config.get("IDEM_TOMBSTONE_TTL", defaults.tombstone_ttl), zero=True
            ),
            connect_options=parse_connect_options(config.get("IDEM_CONNECT_OPTIONS", {})),
            database_deadline=deadline,
            max_response_bytes=_positive_int(
                "IDEM_MAX_RESPONSE_BYTES", config.get("IDEM_MAX_RESPONSE_BYTES", defaults.max_response_bytes)
            ),
            response_keys=parse_response_keys(config.get("IDEM_RESPONSE_KEYS")),
            **{
                name: parse_seconds(
                    f"IDEM_{name.upper()}", config.get(f"IDEM_{name.upper()}", getattr(defaults, name))
                )
                for name in (
                    "lease_timeout",
                    "recovery_deadline",
                    "recovery_backoff",
                    "recovery_backoff_cap",
                    "migration_lock_timeout",
                )
            },
        )


def parse_connect_options(value: Any) -> dict[str, str | int | None]:
    """``IDEM_CONNECT_OPTIONS``: libpq connection parameters, each a string, an int or ``None``."""
    if not isinstance(value, Mapping) or not all(
        isinstance(name, str)
        and (option is None or (isinstance(option, (str, int)) and not isinstance(option, bool)))
        for name, option in value.items()
    ):
        raise ConfigurationError(
            "IDEM_CONNECT_OPTIONS must be a dict of libpq connection parameters, such as"
            " {'connect_timeout': 10, 'tcp_user_timeout': 10000}; None removes one of flask-idem's defaults."
        )
    try:
        make_conninfo("", **{name: option for name, option in value.items() if option is not None})
    except psycopg.ProgrammingError as e:
        raise ConfigurationError(f"IDEM_CONNECT_OPTIONS: {e}.") from None
    return dict(value)


def check_database_url(url: str) -> None:
    """Refuse (:class:`ConfigurationError`) anything but a PostgreSQL URL or a libpq key=value string.

    A malformed URL would otherwise be found only by the pool, which retries it until every request
    times out with a 503 "retry later": a permanent mistake dressed as a passing fault. The message
    never repeats the value, which may hold a password.
    """
    scheme, sep, _ = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) and scheme.lower() not in _SCHEMES:
        hint = (
            " That is a SQLAlchemy URL: pass Idempotency(sqlalchemy=db) instead, or drop the '+driver'."
            if scheme.lower().startswith(("postgresql+", "postgres+"))
            else ""
        )
        raise ConfigurationError(
            f"IDEM_DATABASE_URL must be a PostgreSQL URL (postgresql://...), not a {scheme!r} URL.{hint}"
        )
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            "IDEM_DATABASE_URL is not a PostgreSQL connection string. Use a URL such as"
            " 'postgresql://user:password@host:5432/dbname' or libpq's 'host=... dbname=...' form."
        ) from None


def _redacted(url: str) -> str:
    """``url`` without its password, for display."""
    try:
        params = conninfo_to_dict(url)
    except Exception:  # not a conninfo psycopg understands: show nothing of it
        return "<unparsable>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo("", **params)
