"""Fulfilment: after a payment succeeds, a background task reserves the order and mails the receipt.

The payment's finish step writes the task's message into the outbox, in its own transaction
(:func:`after_payment`): the message exists exactly when the payment is recorded as succeeded. The relay
(``flask idem relay --loop``, started by ``shop serve``) publishes it to RabbitMQ, and a Celery worker
(``celery -A example_app.worker worker``) runs :func:`fulfil`, an idempotent task with three steps:

1. the task itself, in one transaction with its key: a ``fulfilments`` row, ``reserved``;
2. ``send_receipt``: the receipt goes to the mail sink with no transaction open, its Message-ID derived
   from the task's key; resumed after a crash, the sink is searched for that Message-ID first;
3. ``mark_sent``: the row becomes ``sent``, with the receipt's Message-ID.

The mail sink is a Maildir (``MAIL_SINK``, by default ``instance/mail``): what a local mail server
delivers to, and what a mail reader or a test opens. ``MAIL_SINK_DELAY`` (seconds, default 0) makes it
slow to answer after taking a receipt, for fault injection.
"""

from __future__ import annotations

import mailbox
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from flask import current_app

from flask_idem.flow import Flow, Run
from flask_idem.jobs import Job

from .extensions import jobs

__all__ = ["after_payment", "fulfil", "fulfilment", "receipts"]

#: The fulfilment's steps after the task's own transaction.
fulfilment = Flow("shop.fulfilment")


@jobs.task(name="shop.fulfil", flow=fulfilment)
def fulfil(job: Job, order_id: int, payment_id: int) -> dict[str, Any]:
    """Reserve the order for shipping; the receipt is mailed by the next step."""
    row = job.connection.execute(
        "INSERT INTO fulfilments (org_id, order_id, payment_id) VALUES (%s, %s, %s) RETURNING id",
        (job.org_id, order_id, payment_id),
    ).fetchone()
    assert row is not None
    return {"fulfilment_id": row[0], "order_id": order_id, "to": f"billing@org-{job.org_id}.example"}


def _message_id(run: Run) -> str:
    return f"<{run.derived_key('receipt')}@shop.example>"


def _sink(path: str | Path) -> mailbox.Maildir:
    """The mail sink at ``path``, made if missing by any number of processes at once (``Maildir``'s own
    ``create=True`` is not: of two worker processes making it together, one gets ``FileExistsError``)."""
    for sub in ("tmp", "new", "cur"):
        Path(path, sub).mkdir(parents=True, exist_ok=True)
    return mailbox.Maildir(str(path), create=False)


def receipts(sink: str | Path) -> list[mailbox.MaildirMessage]:
    """Every message in the mail sink ``sink``, oldest first."""
    return sorted(_sink(sink), key=lambda message: message.get_date())


def find_receipt(run: Run) -> dict[str, Any] | None:
    """The receipt already in the sink for this task, if any (the resolver of :func:`send_receipt`)."""
    wanted = _message_id(run)
    for message in receipts(current_app.config["MAIL_SINK"]):
        if message["Message-ID"] == wanted:
            return {"message_id": wanted}
    return None


@fulfilment.call(resolve=find_receipt)
def send_receipt(run: Run) -> dict[str, Any]:
    """Mail the receipt to the organisation's billing address."""
    message = EmailMessage()
    message["From"] = "shop@shop.example"
    message["To"] = run.intent["to"]
    message["Subject"] = f"Receipt for order {run.intent['order_id']}"
    message["Message-ID"] = _message_id(run)
    message["X-Shop-Order"] = f"{run.org_id}:{run.intent['order_id']}"
    message.set_content(f"Thank you for your order {run.intent['order_id']}. It is on its way.")
    _sink(current_app.config["MAIL_SINK"]).add(message)
    # Fault injection, like the gateway's: a mail server slow to answer after it took the message.
    time.sleep(float(current_app.config.get("MAIL_SINK_DELAY", 0.0)))
    return {"message_id": message["Message-ID"]}


@fulfilment.finish
def mark_sent(run: Run) -> dict[str, Any]:
    """Record that the receipt went out."""
    run.connection.execute(
        "UPDATE fulfilments SET status = 'sent', receipt_id = %s, updated_at = now()"
        " WHERE org_id = %s AND id = %s",
        (run.results["send_receipt"]["message_id"], run.org_id, run.intent["fulfilment_id"]),
    )
    return {
        "fulfilment_id": run.intent["fulfilment_id"],
        "receipt": run.results["send_receipt"]["message_id"],
    }


def after_payment(run: Run, outcome: dict[str, Any]) -> None:
    """In a payment's finish step: when it succeeded, enqueue the fulfilment in the same transaction."""
    if outcome["status"] != "succeeded":
        return
    jobs.enqueue(
        fulfil,
        run.intent["order_id"],
        run.intent["payment_id"],
        conn=run.connection,
        org_id=run.org_id,
        key=run.derived_key("fulfil"),
    )
