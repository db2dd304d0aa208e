"""`flask --app example_app shop buy` end to end: the retry helper against the real shop and gateway."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psutil
import psycopg
import pytest

from ..support.helpers import ROOT, count, wait_for
from ..support.shop_actions import add_fault, charges, payment_statuses

pytestmark = pytest.mark.slow


def buy(base: str, api_key: str, database_url: str, *extra: str) -> subprocess.Popen[str]:
    """Start `shop buy` as its own process."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flask",
            "--app",
            "example_app",
            "shop",
            "buy",
            "--amount",
            "1999",
            "--currency",
            "EUR",
            "--api-key",
            api_key,
            "--url",
            base,
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "FLASK_DATABASE_URL": database_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def keys_used(output: str) -> list[set[str]]:
    """The keys each operation's attempts carried, operation by operation."""
    blocks = re.split(r"^POST .*$", output, flags=re.MULTILINE)[1:]
    return [set(re.findall(r"key=(\S+)", block)) for block in blocks]


def test_buy_converges_through_a_dropped_connection(
    live_shop: tuple[str, subprocess.Popen[bytes]],
    make_org: Callable[[str], tuple[int, str]],
    database_url: str,
    gateway_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """The gateway drops the connection after charging: the payment is retried to exactly one charge."""
    _, api_key = make_org("buyer")
    add_fault(gateway_url, "drop_after")
    proc = buy(live_shop[0], api_key, database_url)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 0, output
    assert "-> 503" in output  # the first payment attempt learned nothing and was told to retry
    assert [len(k) for k in keys_used(output)] == [1, 1]  # one key per operation, on every attempt
    assert re.search(r"^payment \d+: succeeded", output, re.MULTILINE)
    assert (count(db, "orders"), len(charges(gateway_url))) == (1, 1)
    assert payment_statuses(db) == ["succeeded"]


def test_buy_converges_through_a_killed_worker(
    live_shop: tuple[str, subprocess.Popen[bytes]],
    make_org: Callable[[str], tuple[int, str]],
    database_url: str,
    gateway_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """The shop worker dies after the charge: the helper keeps its key until the retry takes over."""
    base, master = live_shop
    _, api_key = make_org("buyer")
    add_fault(gateway_url, "delay", delay=8.0)
    proc = buy(base, api_key, database_url)

    def charged() -> bool:
        assert proc.poll() is None, "the helper ended before the gateway charged"
        return len(charges(gateway_url)) >= 1

    wait_for(charged, 30, message="the gateway was never called")
    for worker in psutil.Process(master.pid).children():
        os.kill(worker.pid, signal.SIGKILL)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 0, output
    assert "ConnectionError" in output
    assert re.search(r"^payment \d+: succeeded", output, re.MULTILINE)
    assert [len(k) for k in keys_used(output)] == [1, 1]
    assert (count(db, "orders"), len(charges(gateway_url))) == (1, 1)
    assert payment_statuses(db) == ["succeeded"]


def test_buy_fails_for_good_on_a_decline(
    live_shop: tuple[str, subprocess.Popen[bytes]],
    make_org: Callable[[str], tuple[int, str]],
    database_url: str,
    gateway_url: str,
) -> None:
    """A decline is final: one attempt, a non-zero exit, and the problem shown."""
    _, api_key = make_org("buyer")
    proc = buy(live_shop[0], api_key, database_url, "--source", "tok_chargedecline")
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert "-> 402" in output and "failed after 1 attempt(s)" in output
    assert len(charges(gateway_url)) == 1
