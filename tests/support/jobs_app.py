"""A small application with idempotent Celery tasks, for the background job tests.

Two tasks: ``jobs.add`` (atomic: one row in ``job_effects`` per run, so a second run would show) and
``jobs.mail`` (a flow: the intent's row, a receipt delivered to a Maildir, the outside party, then the
finish step). Every run of a task's function appends a line to the trace file first, so a test counts how
often a function started, and can hold it (``hold`` seconds) to kill its worker meanwhile.

A worker process loads it from the environment: ``celery -A tests.support.jobs_app worker`` with
``JOBS_DATABASE_URL``, ``JOBS_BROKER_URL``, ``JOBS_QUEUE``, ``JOBS_TRACE`` and ``JOBS_MAILDIR`` set.
"""

from __future__ import annotations

import mailbox
import os
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from celery import Celery
from flask import Flask, current_app

from flask_idem import Flow, Idempotency, Run
from flask_idem.celery import CeleryJobs
from flask_idem.jobs import Job

from .notes_app import org_from_header

__all__ = ["add", "build_jobs_app", "idem", "jobs", "mail", "receipts"]

idem = Idempotency(scope=org_from_header)
jobs = CeleryJobs(idem)
mailing = Flow("jobs.mail", lease_timeout=3.0)

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS job_effects ("
    " org_id bigint NOT NULL, idem_key uuid NOT NULL, task text NOT NULL, value bigint NOT NULL)"
)


def _trace(task: str, job: Job | Run) -> None:
    with open(current_app.config["JOBS_TRACE"], "a") as f:
        f.write(f"{task} {job.org_id} {job.key} {os.getpid()}\n")


def _starts(key: object) -> int:
    """How often a function started for ``key`` before (from the trace)."""
    try:
        with open(current_app.config["JOBS_TRACE"]) as f:
            return sum(1 for line in f if f" {key} " in line)
    except FileNotFoundError:
        return 0


@jobs.task(name="jobs.add")
def add(job: Job, value: int, hold: float = 0.0, fail: int = 0, holds: int = 1000) -> dict[str, Any]:
    """Record ``value``; in its first ``holds`` starts, hold ``hold`` seconds inside the transaction;
    fail the first ``fail`` attempts."""
    earlier = _starts(job.key)
    _trace("add", job)
    job.connection.execute(
        "INSERT INTO job_effects (org_id, idem_key, task, value) VALUES (%s, %s, 'add', %s)",
        (job.org_id, job.key, value),
    )
    if earlier < holds:
        time.sleep(hold)
    if job.failures < fail:
        raise RuntimeError("failing on purpose")
    return {"value": value, "doubled": 2 * value}


@jobs.task(name="jobs.mail", flow=mailing)
def mail(job: Job, to: str, hold: float = 0.0) -> dict[str, Any]:
    """The intent: one row, and the address; the receipt is sent by the flow's call step."""
    _trace("mail", job)
    job.connection.execute(
        "INSERT INTO job_effects (org_id, idem_key, task, value) VALUES (%s, %s, 'mail', 0)",
        (job.org_id, job.key),
    )
    return {"to": to, "hold": hold}


def _maildir(path: str | Path) -> mailbox.Maildir:
    """The Maildir at ``path``, made if missing by any number of processes at once (``Maildir``'s own
    ``create=True`` is not: of two pool processes making it together, one gets ``FileExistsError``)."""
    for sub in ("tmp", "new", "cur"):
        Path(path, sub).mkdir(parents=True, exist_ok=True)
    return mailbox.Maildir(str(path), create=False)


def receipts(maildir: str | Path) -> list[str]:
    """The Message-IDs of every receipt in the Maildir, duplicates included."""
    return sorted(str(message["Message-ID"]) for message in _maildir(maildir))


def _find_receipt(run: Run) -> dict[str, Any] | None:
    wanted = f"<{run.derived_key('send')}@jobs.test>"
    return {"message_id": wanted} if wanted in receipts(current_app.config["JOBS_MAILDIR"]) else None


@mailing.call(resolve=_find_receipt)
def send(run: Run) -> dict[str, Any]:
    """Deliver the receipt (a Maildir stands for the mail server), then hold before it is recorded."""
    _trace("send", run)
    message = EmailMessage()
    message["To"] = run.intent["to"]
    message["Message-ID"] = f"<{run.derived_key('send')}@jobs.test>"
    message.set_content("Thank you.")
    _maildir(current_app.config["JOBS_MAILDIR"]).add(message)
    time.sleep(run.intent["hold"])
    return {"message_id": message["Message-ID"]}


@mailing.finish
def sent(run: Run) -> dict[str, Any]:
    run.connection.execute(
        "UPDATE job_effects SET value = value + 1 WHERE org_id = %s AND idem_key = %s", (run.org_id, run.key)
    )
    return {"sent": run.results["send"]["message_id"]}


def build_jobs_app(
    database_url: str, *, broker_url: str, queue: str, trace: str, maildir: str, **config: Any
) -> Flask:
    """The application and its Celery application (``app.extensions["celery"]``) on ``queue``."""
    app = Flask(__name__)
    app.config.from_prefixed_env()
    app.config.update(
        {
            "IDEM_DATABASE_URL": database_url,
            "IDEM_JOB_BACKOFF": 0.2,
            "IDEM_JOB_BACKOFF_CAP": 1.0,
            "IDEM_OUTBOX_LEASE": 2.0,
            "JOBS_TRACE": trace,
            "JOBS_MAILDIR": maildir,
            **config,
        }
    )
    idem.init_app(app)
    celery_app = Celery("tests.support.jobs_app", set_as_current=False)
    celery_app.conf.update(
        broker_url=broker_url,
        task_default_queue=queue,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    jobs.init_app(app, celery_app)
    return app


def _from_environment() -> Celery | None:
    if "JOBS_DATABASE_URL" not in os.environ:
        return None
    app = build_jobs_app(
        os.environ["JOBS_DATABASE_URL"],
        broker_url=os.environ["JOBS_BROKER_URL"],
        queue=os.environ["JOBS_QUEUE"],
        trace=os.environ["JOBS_TRACE"],
        maildir=os.environ["JOBS_MAILDIR"],
    )
    global _flask_app
    _flask_app = app
    celery: Celery = app.extensions["celery"]
    return celery


_flask_app: Flask


def relay_killed_after(count: int) -> None:
    """Relay the outbox from the environment's app, and SIGKILL this process right after the
    ``count``-th publish, before that message is marked sent (a relay process dying there)."""
    import signal

    from flask_idem.relay import relay

    assert celery is not None
    published = 0

    def after(message: object) -> None:
        nonlocal published
        published += 1
        if published == count:
            os.kill(os.getpid(), signal.SIGKILL)

    relay(_flask_app, after_publish=after)


#: The Celery application of a worker process (``celery -A tests.support.jobs_app worker``).
celery = _from_environment()
