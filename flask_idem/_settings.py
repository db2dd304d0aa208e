"""The ``IDEM_*`` settings of one application, read and checked once by ``init_app``.

:data:`SETTINGS` is the table of every key: its parser and check, its default and a line on what it is
for; every reader goes through it, and ``docs/config.rst`` mirrors it (a test holds them together). Also
the types and validators of the options a route can override.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, TypeAlias, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ._cipher import parse_response_keys
from .errors import ConfigurationError

__all__ = [
    "DEFAULT_REPLAY_HEADERS",
    "SETTINGS",
    "VIEW_OPTIONS_ATTR",
    "REQUIRED",
    "OnMismatch",
    "ScopeFunc",
    "Setting",
    "Settings",
    "check_database_url",
    "parse_connect_options",
    "parse_choice",
    "parse_on_mismatch",
    "parse_seconds",
    "table_parts",
]

T = TypeVar("T")

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

#: Attribute of a decorated view that holds its options (``flask_idem._view.ViewOptions``), whose ``ttl``
#: :meth:`IdemState.horizon <flask_idem._state.IdemState.horizon>` reads.
VIEW_OPTIONS_ATTR = "_flask_idem"

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


def parse_choice(name: str, value: Any, choices: tuple[T, ...]) -> T:
    """``value`` as one of ``choices``; ``name`` is the setting or option it came from."""
    for choice in choices:
        if value == choice:
            return choice
    listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
    raise ConfigurationError(f"{name} must be {listed}, not {value!r}.")


def parse_on_mismatch(name: str, value: Any) -> OnMismatch:
    """``value`` as an :data:`OnMismatch` policy; ``name`` is the setting it came from."""
    return parse_choice(name, value, _MISMATCH_CHOICES)


def table_parts(table: object) -> list[str]:
    """The parts of a key table's name, ``table`` or ``schema.table``.

    :raises ValueError: for anything else (not a string, an empty name or part, more than one dot).
    """
    parts = table.split(".") if isinstance(table, str) else []
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"IDEM_TABLE must be 'table' or 'schema.table', not {table!r}.")
    return parts


def _table(name: str, value: Any) -> str:
    try:
        table_parts(value)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    return str(value)


def _database_url(name: str, value: Any) -> str:
    if not value or not isinstance(value, str):
        raise ConfigurationError(
            "Set IDEM_DATABASE_URL to a PostgreSQL URL such as"
            " 'postgresql://user@localhost/app' before calling init_app()."
        )
    check_database_url(value)
    return str(value)  # a str already; said again for the type checkers of the lowest versions


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be true or false, not {value!r}.")
    return value


def _at_least_one(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, not {value!r}.")
    return int(value)  # an int already; said again for the type checkers of the lowest versions


def _seconds_or_zero(name: str, value: Any) -> float:
    return parse_seconds(name, value, zero=True)


def _optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``parse``, or ``None`` for ``None``."""
    return lambda name, value: None if value is None else parse(name, value)


def _retry_after(name: str, value: Any) -> int:
    return max(1, _positive_int(name, value))


def _replay_headers(name: str, value: Any) -> frozenset[str]:
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(h, str) for h in value):
        raise ConfigurationError(f"{name} must be a list of header names.")
    lowered = frozenset(h.lower() for h in value)
    if "set-cookie" in lowered:
        raise ConfigurationError(
            f"{name} must not include Set-Cookie: a replay would hand one client's"
            " cookies to whoever retries."
        )
    if {"authorization", "proxy-authorization"} & lowered:
        raise ConfigurationError(
            f"{name} must not include Authorization: a replay would hand one client's"
            " credentials to whoever retries."
        )
    return lowered


def _connect_options(name: str, value: Any) -> dict[str, str | int | None]:
    return parse_connect_options(value)


def _response_keys(name: str, value: Any) -> tuple[str, ...]:
    return parse_response_keys(value)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a key that has none and must be set (``IDEM_DATABASE_URL``, unless ``sqlalchemy=``).
REQUIRED: Any = _Required()


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``IDEM_*`` configuration key: how its value is parsed and checked, its default, and what it is
    for. ``docs/config.rst`` has an entry for each, with the same default (a test compares them)."""

    key: str
    #: ``parse(key, value)``: the value as the code uses it; raises :class:`ConfigurationError`, naming
    #: the key, for a value out of range.
    parse: Callable[[str, Any], Any]
    #: The value when the key is not set, as a user would write it in the configuration.
    default: Any
    #: One line on what it is for; ``docs/config.rst`` says the rest.
    doc: str
    #: The default as ``docs/config.rst`` shows it, where that is not a Python literal of ``default``.
    shown: str | None = None

    def read(self, config: Mapping[str, Any]) -> Any:
        """The parsed value of this key in ``config``, or of its default."""
        return self.parse(self.key, config.get(self.key, self.default))


#: Every ``IDEM_*`` key, read by ``init_app`` (into :class:`Settings`) or, for background jobs, by a
#: runner's ``init_app`` (``IDEM_JOB_*``, ``IDEM_OUTBOX_*``). The one place a default is written.
SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting("IDEM_DATABASE_URL", _database_url, REQUIRED, "The PostgreSQL server of the key table."),
        Setting("IDEM_TABLE", _table, "idempotency_keys", "The key table's name, table or schema.table."),
        Setting("IDEM_KEY_TTL", parse_seconds, 24 * 3600.0, "How long a key's stored response is kept."),
        Setting("IDEM_ON_MISMATCH", parse_on_mismatch, "reject", "A reused key with another request."),
        Setting("IDEM_REQUIRE_KEY", _bool, True, "Whether a write without a key is refused (400)."),
        Setting("IDEM_RETRY_AFTER", _retry_after, 1, "Retry-After of 409 and 503, whole seconds."),
        Setting(
            "IDEM_REPLAY_HEADERS",
            _replay_headers,
            DEFAULT_REPLAY_HEADERS,
            "Response headers stored and replayed.",
            shown=", ".join(f"``{h}``" for h in DEFAULT_REPLAY_HEADERS),
        ),
        Setting("IDEM_POOL_MIN_SIZE", _positive_int, 1, "Connections each process's pool keeps open."),
        Setting("IDEM_POOL_MAX_SIZE", _positive_int, 10, "Most connections each process's pool opens."),
        Setting("IDEM_POOL_TIMEOUT", parse_seconds, 5.0, "Wait for a pooled connection before a 503."),
        Setting(
            "IDEM_PREPARE_THRESHOLD", _optional(_positive_int), 5, "psycopg's prepare_threshold; None: off."
        ),
        Setting("IDEM_DISTRIBUTED", _bool, False, "The key table is a Citus distributed table."),
        Setting("IDEM_LEASE_TIMEOUT", parse_seconds, 30.0, "A multi-step request's lease between steps."),
        Setting("IDEM_RECOVERY_DEADLINE", parse_seconds, 3600.0, "Past it, recovery gives a request up."),
        Setting("IDEM_RECOVERY_BACKOFF", parse_seconds, 2.0, "The base of the recovery job's backoff."),
        Setting("IDEM_RECOVERY_BACKOFF_CAP", parse_seconds, 300.0, "The longest wait of that backoff."),
        Setting(
            "IDEM_TOMBSTONE_TTL", _seconds_or_zero, 30 * 24 * 3600.0, "How long an expired key is remembered."
        ),
        Setting(
            "IDEM_PARTITION_INTERVAL",
            parse_seconds,
            24 * 3600.0,
            "The time range of one key table partition.",
        ),
        Setting(
            "IDEM_PARTITION_AHEAD", parse_seconds, 7 * 24 * 3600.0, "How far ahead purge makes partitions."
        ),
        Setting("IDEM_CONNECT_OPTIONS", _connect_options, {}, "libpq parameters over the pool's defaults."),
        Setting(
            "IDEM_DATABASE_DEADLINE", _optional(parse_seconds), 10.0, "A request's database time; None: none."
        ),
        Setting("IDEM_MAX_RESPONSE_BYTES", _positive_int, 1024 * 1024, "The largest response body kept."),
        Setting(
            "IDEM_RESPONSE_KEYS",
            _response_keys,
            None,
            "Fernet keys of encrypted routes, the first encrypting.",
            shown="none",
        ),
        Setting(
            "IDEM_MIGRATION_LOCK_TIMEOUT", parse_seconds, 2.0, "A migration statement's wait for a lock."
        ),
        Setting("IDEM_JOB_ATTEMPTS", _at_least_one, 10, "Failed attempts of a task before it is given up."),
        Setting("IDEM_JOB_DEADLINE", parse_seconds, 3600.0, "Past it, a task is given up."),
        Setting("IDEM_JOB_BACKOFF", parse_seconds, 2.0, "The base of the backoff between a task's attempts."),
        Setting("IDEM_JOB_BACKOFF_CAP", parse_seconds, 300.0, "The longest wait of that backoff."),
        Setting("IDEM_OUTBOX_LEASE", parse_seconds, 30.0, "How long a relay holds the messages it claimed."),
        Setting("IDEM_OUTBOX_RETENTION", _seconds_or_zero, 24 * 3600.0, "How long sent messages are kept."),
    )
}


def _default(key: str) -> Any:
    """The parsed default of ``key``: a dataclass field's default, from :data:`SETTINGS`."""
    setting = SETTINGS[key]
    return setting.parse(key, setting.default)


@dataclass(frozen=True, slots=True)
class Settings:
    """The ``IDEM_*`` configuration of one application, read and checked once by ``init_app``; the current
    application's is :attr:`Idempotency.settings <flask_idem.Idempotency.settings>`.

    Each attribute is the key of the same name without its prefix, in lower case (``table`` is
    ``IDEM_TABLE``, ``retry_after`` is ``IDEM_RETRY_AFTER``), with its default applied; see the
    configuration page for each. Read-only: the configuration is not read again after ``init_app``.
    """

    database_url: str = field(repr=False)
    table: str = _default("IDEM_TABLE")
    key_ttl: float = _default("IDEM_KEY_TTL")
    on_mismatch: OnMismatch = _default("IDEM_ON_MISMATCH")
    require_key: bool = _default("IDEM_REQUIRE_KEY")
    retry_after: int = _default("IDEM_RETRY_AFTER")
    replay_headers: frozenset[str] = _default("IDEM_REPLAY_HEADERS")
    pool_min_size: int = _default("IDEM_POOL_MIN_SIZE")
    pool_max_size: int = _default("IDEM_POOL_MAX_SIZE")
    pool_timeout: float = _default("IDEM_POOL_TIMEOUT")
    prepare_threshold: int | None = _default("IDEM_PREPARE_THRESHOLD")
    distributed: bool = _default("IDEM_DISTRIBUTED")
    lease_timeout: float = _default("IDEM_LEASE_TIMEOUT")
    recovery_deadline: float = _default("IDEM_RECOVERY_DEADLINE")
    recovery_backoff: float = _default("IDEM_RECOVERY_BACKOFF")
    recovery_backoff_cap: float = _default("IDEM_RECOVERY_BACKOFF_CAP")
    tombstone_ttl: float = _default("IDEM_TOMBSTONE_TTL")
    partition_interval: float = _default("IDEM_PARTITION_INTERVAL")
    partition_ahead: float = _default("IDEM_PARTITION_AHEAD")
    connect_options: Mapping[str, str | int | None] = field(
        default_factory=lambda: _default("IDEM_CONNECT_OPTIONS"), repr=False
    )
    database_deadline: float | None = _default("IDEM_DATABASE_DEADLINE")
    max_response_bytes: int = _default("IDEM_MAX_RESPONSE_BYTES")
    response_keys: tuple[str, ...] = field(default=_default("IDEM_RESPONSE_KEYS"), repr=False)
    migration_lock_timeout: float = _default("IDEM_MIGRATION_LOCK_TIMEOUT")

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"Settings(database_url={_redacted(self.database_url)!r}, {shown})"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, database_url: str | None = None) -> Settings:
        """Build the settings from a Flask config, with an actionable error for each bad value.

        :param database_url: the database when it does not come from ``IDEM_DATABASE_URL`` (the
            SQLAlchemy engine's).
        """
        url = _database_url("IDEM_DATABASE_URL", database_url or config.get("IDEM_DATABASE_URL"))
        values = {
            f.name: SETTINGS[f"IDEM_{f.name.upper()}"].read(config)
            for f in fields(cls)
            if f.name != "database_url"
        }
        if values["pool_max_size"] < max(values["pool_min_size"], 1):
            raise ConfigurationError("IDEM_POOL_MAX_SIZE must be at least 1 and IDEM_POOL_MIN_SIZE.")
        return cls(database_url=url, **values)


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
