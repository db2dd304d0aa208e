"""The shop's fixtures: the shop paying through the test gateway (``shop``), and ``make_shop`` for a shop
with other settings. What tests do to the shop is in :mod:`tests.support.shop_actions`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from example_app import create_app
from example_app.cli import create_org

from ..support.helpers import app_factory


@pytest.fixture
def make_shop(shop_config: dict[str, Any]) -> Iterator[Callable[..., Flask]]:
    """Build the shop against the test gateway, with configuration overrides; pools closed afterwards."""
    with app_factory(lambda **overrides: create_app({**shop_config, **overrides})) as make:
        yield make


@pytest.fixture
def shop(make_shop: Callable[..., Flask]) -> Flask:
    """The shop, paying through the test gateway."""
    return make_shop()


@pytest.fixture
def org(shop: Flask) -> tuple[int, str]:
    """An organisation of the shop: its id and API key."""
    with shop.app_context():
        return create_org("payer")
