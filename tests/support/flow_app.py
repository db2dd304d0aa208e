"""A small application with one multi-step route, and the outside party its flow calls (a ledger).

Shared by the flow tests and the recovery tests; fixtures ``ledger`` and ``flow_app`` are in conftest.py.
"""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Flask, abort, current_app, has_request_context, request

from flask_idem import Idempotency
from flask_idem.flow import Flow, OutcomeUnknown, Run

from .notes_app import org_from_header

__all__ = ["Ledger", "build_flow_app", "row"]


class Ledger:
    """The outside party: records one entry per key, and fails on demand."""

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}
        self.calls: list[str] = []
        self.fail_next: type[Exception] | None = None
        self.lose_answer = False

    def record(self, key: str, amount: int) -> dict[str, Any]:
        self.calls.append("record")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error("the ledger is down")
        self.entries.setdefault(key, amount)
        if self.lose_answer:  # recorded, but the answer never reaches the caller
            self.lose_answer = False
            raise OutcomeUnknown("connection reset")
        return {"entry": key, "amount": self.entries[key]}

    def find(self, key: str) -> dict[str, Any] | None:
        self.calls.append("find")
        return {"entry": key, "amount": self.entries[key]} if key in self.entries else None


def build_flow_app(database_url: str, ledger: Ledger, **config: Any) -> Flask:
    """An application whose ``POST /transfers`` is a flow: prepare, post to ``ledger``, done."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update({"IDEM_DATABASE_URL": database_url, "IDEM_LEASE_TIMEOUT": 30, **config})
    idem = Idempotency(app, scope=org_from_header)
    flow = Flow("notes.transfer")
    steps_run: list[str] = []
    app.config["STEPS_RUN"] = steps_run

    @flow.step
    def prepare(run: Run) -> dict[str, Any]:
        steps_run.append("prepare")
        if current_app.config.get("PREPARE_ABORT"):
            abort(409 if current_app.config["PREPARE_ABORT"] == 409 else 410)
        if current_app.config.get("PREPARE_RAISE"):
            current_app.config["PREPARE_RAISE"] = False
            raise RuntimeError("prepare broke")
        run.connection.execute("INSERT INTO notes (org_id, body) VALUES (%s, 'prepared')", (run.org_id,))
        return {"prepared": True}

    @flow.call(resolve=lambda run: ledger.find(run.derived_key("post")))
    def post(run: Run) -> dict[str, Any]:
        steps_run.append("post")
        return ledger.record(run.derived_key("post"), run.intent["amount"])

    @flow.finish
    def done(run: Run) -> Any:
        steps_run.append("done")
        # Whether the finish step ran in a request (the recovery door opens none), and a 4xx on demand.
        current_app.config.setdefault("FINISH_IN_REQUEST", []).append(has_request_context())
        if current_app.config.get("FINISH_ABORT"):
            abort(current_app.config.pop("FINISH_ABORT"))
        if current_app.config.get("FINISH_500"):
            current_app.config["FINISH_500"] = False
            return {"error": "later"}, 500
        return {"entry": run.results["post"]["entry"], "amount": run.results["post"]["amount"]}, 201

    @app.post("/transfers")
    @idem.idempotent(flow=flow)
    def transfer() -> Any:
        amount = request.get_json()["amount"]
        if amount < 0:
            return {"error": "negative"}, 400
        if amount == 0:
            abort(404)
        idem.connection.execute(
            "INSERT INTO notes (org_id, body) VALUES (%s, 'intent')", (org_from_header(),)
        )
        return {"amount": amount}

    return app


def row(db: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """The one key row: status, step, attempts, last error."""
    found = db.execute("SELECT status, step, attempts, last_error FROM idempotency_keys").fetchone()
    assert found is not None
    return tuple(found)
