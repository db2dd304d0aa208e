"""Crashes and concurrent recovery with real processes: a SIGKILLed gunicorn worker, two recovery jobs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import psycopg
import pytest
import requests
from flask import Flask

from ..helpers import ROOT, close_pool, headers, wait_for_http
from ..shop_actions import add_fault, charges, pay, payment_statuses, place_order, wait_for

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
    wait_for(
        lambda: (
            db.execute(
                "SELECT lease_expires_at < now() FROM idempotency_keys WHERE path = '/payments'"
            ).fetchone()
            == (True,)
        )
    )
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


def test_two_recovery_processes_share_the_work(
    shop: Flask,
    make_org: Callable[[str], tuple[int, str]],
    database_url: str,
    gateway_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """Two `flask idem recover` processes at once never handle one row twice; all rows complete once."""
    client = shop.test_client()
    _, api_key = make_org("stranded")
    add_fault(gateway_url, "fail_after", count=6)
    keys = []
    for _ in range(6):
        key = uuid.uuid4()
        answer = pay(client, api_key, place_order(client, api_key, 10), key)
        assert answer.status_code == 503
        keys.append(str(key))
    close_pool(shop)
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now() WHERE status = 'processing'")
    env = {**os.environ, "FLASK_DATABASE_URL": database_url, "FLASK_GATEWAY_URL": gateway_url}
    command = [sys.executable, "-m", "flask", "--app", "example_app", "idem", "recover", "--limit", "3"]
    procs = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    completed = [re.findall(r"^completed .*key=(\S+)", out, re.MULTILINE) for out in outputs]
    assert [len(c) for c in completed] == [3, 3], outputs
    assert not set(completed[0]) & set(completed[1])
    assert sorted(completed[0] + completed[1]) == sorted(keys)
    assert len(charges(gateway_url)) == 6
    assert payment_statuses(db) == ["succeeded"] * 6
    assert db.execute("SELECT count(*) FROM idempotency_keys WHERE status = 'processing'").fetchone() == (0,)
