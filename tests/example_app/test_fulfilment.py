"""The shop's fulfilment through the outbox, the relay and real Celery workers on RabbitMQ.

Paid orders are fulfilled exactly once: a relay SIGKILLed between publish and mark publishes again, a
worker SIGKILLed after mailing a receipt leaves the task to the next worker, and in the end every paid
order has one fulfilment and one receipt, a declined one none, and nothing is left running or unsent.
Skipped, saying why, where no broker answers (tests/support/celery_workers.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask

from example_app.fulfilment import receipts
from flask_idem.relay import relay

from ..support.celery_workers import (
    BROKER_URL,
    broker_marks,
    delete_queue,
    kill,
    new_queue,
    ready_messages,
    running,
    worker,
)
from ..support.servers import ROOT
from ..support.shop_actions import pay, place_order, wait_for

pytestmark = broker_marks()


def deliveries_ended(log: Path) -> int:
    """How many deliveries of shop.fulfil a worker's log shows ended with a result (run or replayed)."""
    return sum(" shop.fulfil[" in line and " succeeded in " in line for line in log.read_text().splitlines())


def test_every_paid_order_is_fulfilled_exactly_once_through_kills(
    make_shop: Callable[..., Flask], database_url: str, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """Three paid orders and a declined one; the relay and a worker die at the worst moments."""
    queue, sink = new_queue("flask-idem-shop"), tmp_path / "mail"
    celery = {
        "broker_url": BROKER_URL,
        "task_default_queue": queue,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
    }
    shop = make_shop(CELERY=celery, MAIL_SINK=str(sink), IDEM_LEASE_TIMEOUT=2.0, IDEM_OUTBOX_LEASE=1.0)
    client = shop.test_client()
    with shop.app_context():
        from example_app.cli import create_org

        api_key = create_org("buyer")[1]
    paid = [place_order(client, api_key, 100 + n) for n in range(3)]
    for order_id in paid:
        assert pay(client, api_key, order_id, uuid.uuid4()).status_code == 201
    declined = place_order(client, api_key, 999)
    assert pay(client, api_key, declined, uuid.uuid4(), source="tok_chargedecline").status_code == 402
    assert db.execute("SELECT count(*) FROM idempotency_keys_outbox").fetchone() == (3,)

    env = {
        "FLASK_DATABASE_URL": database_url,
        "FLASK_CELERY__broker_url": BROKER_URL,
        "FLASK_CELERY__task_default_queue": queue,
        "FLASK_MAIL_SINK": str(sink),
        "FLASK_IDEM_LEASE_TIMEOUT": "2",
        "FLASK_IDEM_OUTBOX_LEASE": "1",
        "FLASK_IDEM_JOB_BACKOFF": "0.2",
        "FLASK_IDEM_JOB_BACKOFF_CAP": "1",
    }
    try:
        # A relay process killed after publishing every message, before marking the last one sent.
        script = (
            "import os, signal; from example_app import create_app; from flask_idem.relay import relay;"
            " seen = [];"
            " relay(create_app(), after_publish=lambda m: seen.append(m) or"
            " (len(seen) == 3 and os.kill(os.getpid(), signal.SIGKILL)))"
        )
        killed = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env={**os.environ, **env}, timeout=120
        )
        assert killed.returncode == -9
        db.execute("UPDATE idempotency_keys_outbox SET claimed_until = now(), sent_at = NULL")  # all again
        assert relay(shop).published == 3  # every message twice on the queue now

        # A worker whose mail sink is slow: SIGKILLed, with its pool, once a receipt went out.
        slow = {**env, "FLASK_MAIL_SINK_DELAY": "60"}
        with worker("example_app.worker", slow, tmp_path / "worker1.log", concurrency=1) as proc:
            wait_for(lambda: len(receipts(sink)) == 1, timeout=90)
            family = [
                proc.pid,
                *(p.pid for p in __import__("psutil").Process(proc.pid).children(recursive=True)),
            ]
            for pid in family:
                kill(pid)
            proc.wait(10)
        assert running(family) == []

        # Six copies on the queue (the first worker's given back): wait until each was delivered and
        # ended, having run the task or returned its stored result, before the queue is deleted.
        log = tmp_path / "worker2.log"
        with worker("example_app.worker", env, log, concurrency=2) as proc:
            wait_for(
                lambda: (
                    deliveries_ended(log) >= 6
                    and ready_messages(queue) == 0
                    and db.execute("SELECT count(*) FROM fulfilments WHERE status = 'sent'").fetchone()
                    == (3,)
                ),
                timeout=120,
                interval=0.2,
            )
            family = [
                proc.pid,
                *(p.pid for p in __import__("psutil").Process(proc.pid).children(recursive=True)),
            ]
        assert running(family) == []
    finally:
        delete_queue(queue)

    assert deliveries_ended(log) == 6
    fulfilled = Counter(r[0] for r in db.execute("SELECT order_id FROM fulfilments").fetchall())
    assert fulfilled == Counter(paid)
    mailed = Counter(str(m["X-Shop-Order"]).split(":")[1] for m in receipts(sink))
    assert mailed == Counter(str(order_id) for order_id in paid)
    assert db.execute("SELECT count(*) FROM idempotency_keys WHERE status = 'processing'").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL").fetchone() == (0,)
