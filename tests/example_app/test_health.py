"""The shop's health checks (example_app/health.py); the readiness check under a database fault is in
tests/test_faults.py."""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask


def test_readiness_reports_partitions_running_out(make_shop: Callable[..., Flask]) -> None:
    """GET /health/ready answers 200 either way, and lists in ``warnings`` the key table's partitions
    running out: here, as far ahead of the longest retention as IDEM_PARTITION_AHEAD asks (30 days) is
    past the partitions that purge made for the default (7 days)."""
    ready = make_shop().test_client().get("/health/ready")
    assert ready.status_code == 200
    assert ready.get_json() == {"status": "ok"}

    short = make_shop(IDEM_PARTITION_AHEAD=30 * 86400).test_client().get("/health/ready")
    assert short.status_code == 200
    assert short.get_json()["status"] == "ok"
    [warning] = short.get_json()["warnings"]
    assert warning.startswith("The newest partition of the key table idempotency_keys ends at ")
    assert "less than the longest retention (24.0 h) and half of IDEM_PARTITION_AHEAD (15.0 days)" in warning
    assert "Run 'flask idem purge' as the tables' owner" in warning
