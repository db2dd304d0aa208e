"""Fault injection: ``/_faults`` queues failures for the next charge requests.

The blueprint is registered only when ``FAULTS_ENABLED`` is true; otherwise ``/_faults`` is 404 and
charge requests never look at the queue. Each entry affects the next ``count`` well-formed
``POST /charges`` requests, whichever process serves them, and entries apply in the order they were
posted. Each mode answers late by the entry's ``delay`` seconds:

``delay``
    charge, wait, then answer normally: a slow gateway whose charge is made before its caller may
    have given up.
``fail_before``
    wait, then answer 500 without charging.
``fail_after``
    charge (or find the key's charge), wait, then answer 500.
``drop_after``
    charge, wait, then close the connection without any answer.

The modes ``webhook_duplicate``, ``webhook_reorder`` and ``webhook_fail_first`` affect the next ``count``
webhook events instead (see :mod:`example_app.gateway.events`); charge requests pass them by.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from flask import Blueprint, Response, current_app, request
from werkzeug.exceptions import InternalServerError

from ..schemas import load
from .schemas import MODES, FaultIn
from .store import Fault, current_store

__all__ = ["MODES", "CannotDrop", "InjectedFault", "after_charge", "before_charge", "bp"]

bp = Blueprint("faults", __name__)


class InjectedFault(InternalServerError):
    """500 answered on purpose by a ``fail_before`` or ``fail_after`` fault."""

    def __init__(self, mode: str) -> None:
        super().__init__(f"Injected fault '{mode}'.")


class CannotDrop(RuntimeError):
    """``drop_after`` needs the client socket, and the WSGI server did not provide it."""


_fault_in = FaultIn()


@bp.post("/_faults")
def add_fault() -> tuple[dict[str, Any], int]:
    """Queue a fault for the next ``count`` charge requests."""
    data = load(_fault_in, request.get_json())
    return current_store().add_fault(**data).to_dict(), 201


@bp.get("/_faults")
def list_faults() -> dict[str, Any]:
    """The queued faults, next first, with the uses each has left."""
    return {"faults": [fault.to_dict() for fault in current_store().faults()]}


@bp.delete("/_faults")
def clear_faults() -> tuple[str, int]:
    """Remove every queued fault."""
    current_store().clear_faults()
    return "", 204


def before_charge() -> Fault | None:
    """Take the next fault (if enabled); for ``fail_before``, sleep its delay and fail without charging."""
    if not current_app.config["FAULTS_ENABLED"]:
        return None
    fault = current_store().take_fault()
    if fault is None:
        return None
    current_app.logger.warning("Injecting fault %r (delay %ss).", fault.mode, fault.delay)
    if fault.mode == "fail_before":
        time.sleep(fault.delay)
        raise InjectedFault(fault.mode)
    return fault


def after_charge(fault: Fault | None) -> Response | None:
    """Act on a fault once the charge is committed: sleep its delay, then fail or drop the connection.

    Returns the (unsendable) response to end the request with after a drop, else ``None``.
    """
    if fault is None:
        return None
    time.sleep(fault.delay)
    if fault.mode == "delay":
        return None
    if fault.mode == "fail_after":
        raise InjectedFault(fault.mode)
    drop_connection()
    return Response(status=500)


def drop_connection() -> None:
    """Cut the client's TCP connection at once, so that the client receives no answer at all.

    Gunicorn puts the client socket in the WSGI environ as ``gunicorn.socket``, Werkzeug's
    development server as ``werkzeug.socket``. The socket is shut down, not closed: the client sees
    the connection end at once, while the descriptor stays the server's to close. The response the
    server then tries to write fails with EPIPE, which both servers treat as a vanished client.

    :raises CannotDrop: the server (the Flask test client, for one) exposes no socket.
    """
    sock: socket.socket | None = request.environ.get("gunicorn.socket") or request.environ.get(
        "werkzeug.socket"
    )
    if sock is None:
        raise CannotDrop("drop_after needs gunicorn or the Werkzeug server: no socket in environ.")
    sock.shutdown(socket.SHUT_RDWR)
