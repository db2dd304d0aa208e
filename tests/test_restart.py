"""A database restart is not an outage: once PostgreSQL is back, requests succeed.

The shop runs under gunicorn (4 workers x 4 threads) on a PostgreSQL of its own, so that restarting it
disturbs no other test. Its pools are warmed, the server is restarted with ``pg_ctl -m fast`` and with
``-m immediate`` (a crash), and once it answers again a burst of writes and reads goes out from 16
clients, one attempt each: no retries on the client's side to hide a failure.
"""

from __future__ import annotations

import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from .history.cluster import Cluster, running_cluster, wait_until_postgres_answers

pytestmark = pytest.mark.slow

WORKERS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Outside pytest's 0700 directories: the embedded server runs as a user of its own.
    with tempfile.TemporaryDirectory(prefix="flask-idem-restart-") as workdir:
        with running_cluster(Path(workdir), seed=1, orgs=1, workers=WORKERS, threads=4) as cluster:
            yield cluster


def burst(cluster: Cluster, writes: int, reads: int = 0) -> Counter[int]:
    """``writes`` new orders (a fresh key each) and ``reads`` order lists from 16 clients; status counts."""
    auth = {"Authorization": f"Bearer {cluster.api_keys[0]}"}

    def write(_: int) -> int:
        headers = {**auth, "Idempotency-Key": str(uuid.uuid4())}
        body = {"amount": 1250, "currency": "EUR"}
        return requests.post(cluster.shop_url + "/orders", json=body, headers=headers, timeout=30).status_code

    def read(_: int) -> int:
        return requests.get(cluster.shop_url + "/orders", headers=auth, timeout=30).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(write, range(writes))) + list(pool.map(read, range(reads)))
    return Counter(statuses)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_requests_succeed_once_the_database_is_back(cluster: Cluster, mode: str) -> None:
    """After a restart every stale pooled connection is replaced unseen: at most one 503 per process."""
    warm = burst(cluster, writes=64, reads=16)
    assert warm == {201: 64, 200: 16}, warm
    cluster.restart_postgres(mode)
    wait_until_postgres_answers(cluster.database_url)
    after = burst(cluster, writes=80, reads=32)
    print(f"after a {mode} restart: {dict(after)}")
    assert set(after) <= {200, 201, 503}, after
    assert after[503] <= WORKERS, f"{after[503]} requests were answered 503 after the {mode} restart"
    assert after[201] + after[503] == 80
