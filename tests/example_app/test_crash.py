"""Crashes with real processes: a gunicorn worker SIGKILLed between the gateway's charge and its record."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import psycopg
import pytest
import requests
from flask import Flask

from ..support.helpers import headers, wait_for_http
from ..support.shop_actions import add_fault, charges, lease_expired, payment_statuses, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("finisher", ["recover", "retry"])
def test_worker_killed_between_charge_and_record(
    live_shop: tuple[str, subprocess.Popen[bytes]],
    make_org: Callable[[str], tuple[int, str]],
    make_shop: Callable[..., Flask],
    gateway_url: str,
    db: psycopg.Connection[Any],
    finisher: str,
) -> None:
    """SIGKILL after the gateway charged: recovery or a retry ends with one charge and one payment."""
    base, master = live_shop
    _, api_key = make_org("crash")
    order = requests.post(
        base + "/orders",
        json={"amount": 999, "currency": "EUR"},
        headers=headers(api_key, uuid.uuid4()),
        timeout=10,
    ).json()
    add_fault(gateway_url, "delay", delay=8.0)  # charge at once, answer 8 s later
    key = uuid.uuid4()
    payment = {"json": {"order_id": order["id"], "source": "tok_visa"}, "headers": headers(api_key, key)}
    outcome: dict[str, Any] = {}

    def first_attempt() -> None:
        try:
            outcome["response"] = requests.post(base + "/payments", timeout=30, **payment)
        except requests.RequestException as e:
            outcome["error"] = e

    thread = threading.Thread(target=first_attempt)
    thread.start()
    wait_for(lambda: len(charges(gateway_url)) == 1)
    for worker in psutil.Process(master.pid).children():
        os.kill(worker.pid, signal.SIGKILL)
    thread.join(30)
    assert "error" in outcome, outcome  # the client never heard back
    assert payment_statuses(db) == ["pending"]
    wait_for(lambda: lease_expired(db))
    wait_for_http(base + "/orders", master)  # gunicorn has replaced its workers
    if finisher == "recover":
        result = make_shop().test_cli_runner().invoke(args=["idem", "recover"])
        assert "Claimed 1: 1 completed" in result.output, result.output
        retry = requests.post(base + "/payments", timeout=30, **payment)
        assert retry.status_code == 200
        assert retry.headers["Idempotent-Replayed"] == "true"
    else:
        retry = requests.post(base + "/payments", timeout=30, **payment)
        assert retry.status_code == 201, retry.text
    made = charges(gateway_url)
    assert len(made) == 1
    assert retry.json()["gateway_charge_id"] == made[0]["id"]
    assert retry.json()["status"] == "succeeded"
    assert payment_statuses(db) == ["succeeded"]
