"""The shop's stranded payments: `flask idem recover` finishes them through the real gateway, two recovery
processes share the work, and a request stranded past the deadline is given up and flagged."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask

from ..support.helpers import ROOT, close_pool
from ..support.shop_actions import (
    add_fault,
    charges,
    fulfilments_enqueued,
    paid,
    pay,
    payment_statuses,
    place_order,
    stranded_payment,
)

pytestmark = pytest.mark.slow


def test_recover_finishes_a_stranded_payment(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """After a fail_after, `flask idem recover` looks the charge up and records it, enqueueing the order's
    fulfilment once; a retry replays it, and a second recovery pass finds nothing."""
    client = shop.test_client()
    order_id, key = stranded_payment(client, org[1], gateway_url, "fail_after")
    runner = shop.test_cli_runner()
    assert "Claimed 0" in runner.invoke(args=["idem", "recover"]).output  # not due yet: backoff
    db.execute("UPDATE idempotency_keys SET next_attempt_at = now()")
    result = runner.invoke(args=["idem", "recover"])
    assert result.exit_code == 0, result.output
    assert "Claimed 1: 1 completed" in result.output
    assert payment_statuses(db) == ["succeeded"]
    retry = pay(client, org[1], order_id, key)
    assert retry.status_code == 200
    assert retry.json["status"] == "succeeded"
    assert len(charges(gateway_url)) == 1
    assert "Claimed 0" in runner.invoke(args=["idem", "recover"]).output
    assert fulfilments_enqueued(db) == [(org[0], "shop.fulfil", *paid(db))]


def test_recovery_gives_up_after_the_deadline(
    shop: Flask, org: tuple[int, str], gateway_url: str, db: psycopg.Connection[Any]
) -> None:
    """Stranded past IDEM_RECOVERY_DEADLINE: failed, flagged, listed by `stuck`, replayed as 500."""
    client = shop.test_client()
    order_id, key = stranded_payment(client, org[1], gateway_url, "fail_before")
    db.execute(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 hours', next_attempt_at = now()"
        " WHERE path = '/payments'"
    )
    runner = shop.test_cli_runner()
    assert "1 failed" in runner.invoke(args=["idem", "recover"]).output
    stuck = runner.invoke(args=["idem", "stuck"]).output
    assert "NEEDS ATTENTION" in stuck and str(key) in stuck
    replay = pay(client, org[1], order_id, key)
    assert replay.status_code == 500
    assert replay.json["type"] == "urn:flask-idem:problem:operation-failed"
    assert charges(gateway_url) == []
    db.execute("UPDATE idempotency_keys SET expires_at = now() - interval '31 days'")  # past the tombstone
    purged = runner.invoke(args=["idem", "purge"]).output
    # Purge drops partitions whose range has passed, not rows: the first partition's range runs days
    # ahead, so nothing is dropped yet (tests/test_partitions.py retires one, flagged rows moved).
    assert "Dropped 0 partition(s)" in purged
    assert sorted(db.execute("SELECT path FROM idempotency_keys").fetchall()) == [
        ("/orders",),
        ("/payments",),
    ]


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
