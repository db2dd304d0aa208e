"""Setting the extension up: configuration, app factories, and the mistakes it refuses at setup time."""

from __future__ import annotations

import asyncio
import importlib.util
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem._settings import Settings
from flask_idem._state import get_state
from flask_idem.errors import ConfigurationError

URL = "postgresql://localhost/unused"


def make(**config: Any) -> Flask:
    app = Flask(__name__)
    app.config.update({"IDEM_DATABASE_URL": URL, **config})
    return app


def test_defaults() -> None:
    """Without IDEM_* keys the documented defaults apply."""
    settings = Settings.from_config({"IDEM_DATABASE_URL": URL})
    assert (settings.key_ttl, settings.on_mismatch, settings.retry_after) == (86400.0, "reject", 1)
    assert (settings.table, settings.require_key, settings.lease_timeout) == ("idempotency_keys", True, 30.0)
    assert "location" in settings.replay_headers and "set-cookie" not in settings.replay_headers


def test_values_are_read() -> None:
    """Each key is read, including timedeltas and header lists."""
    settings = Settings.from_config(
        {
            "IDEM_DATABASE_URL": URL,
            "IDEM_KEY_TTL": timedelta(hours=1),
            "IDEM_ON_MISMATCH": "replay",
            "IDEM_REPLAY_HEADERS": ["Location", "X-Order"],
            "IDEM_POOL_MAX_SIZE": 3,
            "IDEM_LEASE_TIMEOUT": 5,
        }
    )
    assert settings.key_ttl == 3600.0
    assert settings.on_mismatch == "replay"
    assert settings.replay_headers == frozenset({"location", "x-order"})
    assert (settings.pool_max_size, settings.lease_timeout) == (3, 5.0)


BAD = {
    "no-url": {"IDEM_DATABASE_URL": None},
    "ttl-zero": {"IDEM_KEY_TTL": 0},
    "ttl-string": {"IDEM_KEY_TTL": "1 day"},
    "ttl-bool": {"IDEM_KEY_TTL": True},
    "mismatch": {"IDEM_ON_MISMATCH": "ignore"},
    "pool-min-over-max": {"IDEM_POOL_MIN_SIZE": 5, "IDEM_POOL_MAX_SIZE": 2},
    "headers-string": {"IDEM_REPLAY_HEADERS": "Location"},
    "set-cookie": {"IDEM_REPLAY_HEADERS": ["Location", "Set-Cookie"]},
    "lease-negative": {"IDEM_LEASE_TIMEOUT": -1},
    "table-type": {"IDEM_TABLE": 3},
    "table-shape": {"IDEM_TABLE": "a.b.c"},
    "headers-number": {"IDEM_REPLAY_HEADERS": 5},
    "require-key-string": {"IDEM_REQUIRE_KEY": "no"},
    "prepare-threshold": {"IDEM_PREPARE_THRESHOLD": -1},
}


@pytest.mark.parametrize("config", BAD.values(), ids=BAD.keys())
def test_bad_configuration_is_refused(config: dict[str, Any]) -> None:
    """An invalid value stops init_app with a message naming the key."""
    with pytest.raises(ConfigurationError) as info:
        Idempotency(make(**config), scope=lambda: 1)
    assert "IDEM_" in str(info.value)


def test_environment_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASK_IDEM_* variables reach the settings through from_prefixed_env."""
    monkeypatch.setenv("FLASK_IDEM_DATABASE_URL", URL)
    monkeypatch.setenv("FLASK_IDEM_KEY_TTL", "3600")
    app = Flask(__name__)
    app.config.from_prefixed_env()
    Idempotency(app, scope=lambda: 1)
    assert get_state(app).settings.key_ttl == 3600.0


def test_app_factory_and_second_init() -> None:
    """One extension serves several apps; initialising one app twice is refused."""
    idem = Idempotency(scope=lambda: 1)
    first, second = make(), make(IDEM_KEY_TTL=60)
    idem.init_app(first)
    idem.init_app(second)
    assert get_state(first) is not get_state(second)
    assert "idem" in first.cli.commands
    with pytest.raises(ConfigurationError, match="once"):
        idem.init_app(first)


def test_route_without_scope_is_refused() -> None:
    """Decorating a route with no scope anywhere fails at import time, never falls back to a global scope."""
    idem = Idempotency()
    with pytest.raises(ConfigurationError, match="scope"):
        idem.idempotent()
    idem.idempotent(scope=lambda: 1)


@pytest.mark.parametrize(
    "options",
    [{"on_mismatch": "nope"}, {"ttl": -5}, {"ttl": "x"}],
    ids=["mismatch", "ttl-negative", "ttl-type"],
)
def test_bad_decorator_options(options: dict[str, Any]) -> None:
    """Invalid decorator options fail when the decorator is applied."""
    with pytest.raises(ConfigurationError):
        Idempotency(scope=lambda: 1).idempotent(**options)


def test_async_views_need_asgiref(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without asgiref (flask[async]), an async view is refused when decorated, naming what to install."""

    async def view() -> None:
        await asyncio.sleep(0)

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "asgiref" else real(name))
    with pytest.raises(ConfigurationError, match=r"view\b.*install flask-idem\[async\]"):
        Idempotency(scope=lambda: 1).idempotent()(view)


def test_outside_a_view() -> None:
    """idem.connection outside an idempotent view, or an app without the extension, explain themselves."""
    idem = Idempotency(scope=lambda: 1)
    app = make()
    with app.app_context(), pytest.raises(RuntimeError, match="init_app"):
        _ = idem.pool
    idem.init_app(app)
    with app.test_request_context(), pytest.raises(RuntimeError, match="idempotent"):
        _ = idem.connection


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://shop:s3cret-pw@db.internal:5432/shop",
        "host=db.internal dbname=shop user=shop password=s3cret-pw",
    ],
    ids=["url", "key-value"],
)
def test_settings_repr_hides_the_password(url: str) -> None:
    """The settings' repr names the database but never shows its password."""
    shown = repr(Settings.from_config({"IDEM_DATABASE_URL": url}))
    assert "s3cret-pw" not in shown
    assert "db.internal" in shown and "***" in shown


def test_close_closes_the_current_applications_pool(database_url: str) -> None:
    """idem.close() closes the pool of the application in context; the next use opens a new one."""
    idem = Idempotency(scope=lambda: 1)
    app = make(IDEM_DATABASE_URL=database_url)
    idem.init_app(app)
    with app.app_context():
        first = idem.pool
        with first.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        idem.close()
        assert first.closed
        second = idem.pool
        assert second is not first and not second.closed
        idem.close()


def test_flow_lease_timeout_takes_a_timedelta() -> None:
    """Flow(lease_timeout=...) accepts a timedelta like ttl= does, and refuses a non-positive one."""
    from flask_idem import Flow

    assert Flow("a", lease_timeout=timedelta(seconds=90)).lease_timeout == 90.0
    with pytest.raises(ConfigurationError, match="lease_timeout"):
        Flow("b", lease_timeout=timedelta(0))


def test_a_name_the_package_lacks_is_an_attribute_error() -> None:
    """The package's ``__getattr__`` (which reads ``__version__``) answers any other name with
    :exc:`AttributeError`: the pool's name before the first release included."""
    import flask_idem

    with pytest.raises(AttributeError, match="no attribute 'ProcessPool'"):
        flask_idem.ProcessPool  # noqa: B018
