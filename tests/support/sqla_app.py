"""The shop's orders route on Flask-SQLAlchemy: ``Idempotency(sqlalchemy=db)`` and ``db.session`` in views.

It uses the shop's tables (``orgs``, ``orders``) and API keys, mapped as models, so the same tests and the
same hammers run against it as against the raw-psycopg shop. A few more routes show what the extension
does with ``db.session.commit()`` and ``db.session.rollback()`` inside an idempotent view, and a
multi-step flow whose steps write through ``db.session`` too.

``gunicorn 'tests.support.sqla_app:create_app()'`` serves it with ``FLASK_DATABASE_URL`` set.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import threading
import uuid
from datetime import datetime
from typing import Any

from flask import Blueprint, Flask, current_app, g, request, url_for
from flask_sqlalchemy import SQLAlchemy
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import URL, BigInteger, DateTime, Identity, LargeBinary, String, Uuid, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from werkzeug.exceptions import NotFound, Unauthorized

from example_app import problems
from example_app.schemas import OrderIn, load
from flask_idem import DEFAULT_CONNECT_OPTIONS, Flow, Idempotency, OutcomeUnknown, Run

from . import pgbouncer


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


def current_org_id() -> int | None:
    org_id: int | None = g.get("org_id")
    return org_id


idem = Idempotency(scope=current_org_id, sqlalchemy=db)


class Org(db.Model):  # type: ignore[name-defined, misc]
    __tablename__ = "orgs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    name: Mapped[str] = mapped_column(String)
    api_key_sha: Mapped[bytes] = mapped_column(LargeBinary, unique=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Order(db.Model):  # type: ignore[name-defined, misc]
    __tablename__ = "orders"
    # INSERT ... RETURNING id, created_at: the view's flush fills in both.
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    org_id: Mapped[int] = mapped_column(BigInteger)
    idempotency_key: Mapped[uuid.UUID] = mapped_column(Uuid)
    amount: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "amount": self.amount,
            "currency": self.currency,
            "created_at": self.created_at.isoformat(),
        }


bp = Blueprint("orders", __name__)


@bp.before_request
def authenticate() -> None:
    """``Authorization: Bearer <API key>``, looked up through ``db.session`` (which begins a transaction)."""
    api_key = request.headers.get("Authorization", "").removeprefix("Bearer ")
    org_id = db.session.scalar(
        select(Org.id).where(
            Org.api_key_sha == hashlib.sha256(api_key.encode()).digest(), Org.revoked_at.is_(None)
        )
    )
    if org_id is None:
        raise Unauthorized("The API key is unknown or revoked.")
    g.org_id = org_id


_order_in = OrderIn()


def _new_order() -> Order:
    data = load(_order_in, request.get_json())
    order = Order(org_id=g.org_id, idempotency_key=idem.key, amount=data["amount"], currency=data["currency"])
    db.session.add(order)
    db.session.flush()
    return order


@bp.post("/orders")
@idem.idempotent()
def create_order() -> Any:
    """Create an order through ``db.session``; ``X-Test-Crash: kill`` kills the worker after the write."""
    order = _new_order()
    if request.headers.get("X-Test-Crash") == "kill":  # written and flushed, not committed
        os.kill(os.getpid(), signal.SIGKILL)
    return order.to_dict(), 201, {"Location": url_for(".get_order", order_id=order.id)}


@bp.post("/orders/async")
@idem.idempotent()
async def create_order_async() -> Any:
    """``async def``: ``db.session`` on the coroutine's thread is the request's session (scoped by the
    application context, which the coroutine shares)."""
    await asyncio.sleep(0)
    order = _new_order()
    await asyncio.sleep(0)
    return order.to_dict(), 201


@bp.get("/orders/<int:order_id>")
def get_order(order_id: int) -> Any:
    order = db.session.get(Order, order_id)
    if order is None or order.org_id != g.org_id:
        raise NotFound("There is no such order.")
    return order.to_dict()


@bp.get("/orders")
def list_orders() -> Any:
    orders = db.session.scalars(select(Order).where(Order.org_id == g.org_id).order_by(Order.id))
    return {"orders": [o.to_dict() for o in orders]}


@bp.post("/orders/commit")
@idem.idempotent()
def commits() -> Any:
    """The mistake of a Flask-SQLAlchemy habit: committing inside the view."""
    order = _new_order()
    db.session.commit()
    return order.to_dict(), 201


@bp.post("/orders/rollback")
@idem.idempotent()
def rolls_back() -> Any:
    _new_order()
    db.session.rollback()
    return {}, 201


@bp.post("/orders/rollback-swallowed")
@idem.idempotent()
def rolls_back_and_goes_on() -> Any:
    _new_order()
    try:
        db.session.rollback()
    except RuntimeError:
        pass
    return {}, 201


@bp.post("/orders/savepoint")
@idem.idempotent()
def savepoint() -> Any:
    """A failed insert inside ``begin_nested()`` is undone alone; the order and the key stay."""
    order = _new_order()
    try:
        with db.session.begin_nested():
            db.session.add(
                Order(org_id=g.org_id, idempotency_key=idem.key, amount=1, currency=order.currency)
            )
    except IntegrityError:  # (org_id, idempotency_key) is unique
        pass
    return order.to_dict(), 201


@bp.post("/orders/raw")
@idem.idempotent()
def raw_and_orm() -> Any:
    """``idem.connection`` is the connection under ``db.session``: both writes are in one transaction."""
    order = _new_order()
    row = idem.connection.execute("SELECT count(*) FROM orders WHERE id = %s", (order.id,)).fetchone()
    return {"seen_by_raw": row[0] if row else None}, 201


@bp.post("/orders/duplicate")
@idem.idempotent()
def duplicate() -> Any:
    """A unique violation at flush, not caught: SQLAlchemy's IntegrityError leaves the view."""
    order = _new_order()
    db.session.add(Order(org_id=g.org_id, idempotency_key=idem.key, amount=1, currency=order.currency))
    db.session.flush()
    return {}, 201


@bp.post("/orders/block")
@idem.idempotent()
def block() -> Any:
    order = _new_order()
    entered: threading.Event = current_app.config["ENTERED"]
    release: threading.Event = current_app.config["RELEASE"]
    entered.set()
    release.wait(10)
    return order.to_dict(), 201


@bp.post("/orders/fail")
@idem.idempotent()
def fail() -> Any:
    _new_order()
    raise RuntimeError("the view broke after its write")


# -- a multi-step route whose steps write through db.session ----------------------------------------------

receipt = Flow("sqla.receipt", lease_timeout=2.0)


@receipt.call
def send(run: Run) -> Any:
    """The outside call: no transaction is open, so the session holds no connection."""
    calls: list[bool] = current_app.config.setdefault("SENT", [])
    calls.append(db.session().in_transaction())
    faults: list[str] = current_app.config.get("SEND_FAULTS", [])
    if faults:
        raise OutcomeUnknown(faults.pop(0))
    return {"sent": len(calls)}


@receipt.finish
def record(run: Run) -> Any:
    order = db.session.get(Order, run.intent["order_id"])
    assert order is not None
    order.amount += 1  # what the step writes, in the step's own session transaction
    db.session.flush()
    return {**order.to_dict(), "sent": run.results["send"]["sent"]}, 201


@bp.post("/receipts")
@idem.idempotent(flow=receipt)
def create_receipt() -> Any:
    return {"order_id": _new_order().id}


def sqlalchemy_url(conninfo: str) -> URL:
    """A ``postgresql+psycopg`` URL for a libpq connection string or URL."""
    return URL.create("postgresql+psycopg", query=conninfo_to_dict(conninfo))


def create_app(test_config: dict[str, Any] | None = None) -> Flask:
    """The Flask-SQLAlchemy shop; ``DATABASE_URL`` names the database (``FLASK_DATABASE_URL``)."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update(test_config or {})
    app.config["SQLALCHEMY_DATABASE_URI"] = sqlalchemy_url(app.config["DATABASE_URL"])
    # The engine's connections are the application's: give them the timeouts flask-idem gives its own,
    # where the URL has none (docs/sqlalchemy.rst, "Timeouts").
    given = conninfo_to_dict(app.config["DATABASE_URL"])
    connect_args: dict[str, Any] = {k: v for k, v in DEFAULT_CONNECT_OPTIONS.items() if k not in given}
    if pgbouncer.ENABLED:  # transaction pooling: no server-side prepared statements
        connect_args["prepare_threshold"] = None
    app.config.setdefault("SQLALCHEMY_ENGINE_OPTIONS", {"connect_args": connect_args})
    db.init_app(app)
    idem.init_app(app)
    problems.register(app)
    app.register_blueprint(bp)
    return app
