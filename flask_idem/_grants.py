"""A privilege the application's role lacks: which grant is missing, and the command that gives it.

PostgreSQL refuses a statement on an object the role may not use with ``InsufficientPrivilege``
(SQLSTATE 42501) and a message that names the object's kind and name and nothing else ("permission denied
for table idempotency_keys_tombstones"), so the message may be logged. Such an error is the deployment's
problem, not the client's, and it is over once the grant is given: every door answers it as a store that
is unavailable for now (a request or a webhook delivery: 503, ``Retry-After``, ``retryable: true``; a job
or a recovery pass: tried again later), and :func:`report` says in the log what to grant and how, once
per cause and route (or task) every :data:`REPEAT` seconds rather than once per request.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import psycopg
from flask import current_app, has_app_context
from psycopg.conninfo import conninfo_to_dict

__all__ = ["REPEAT", "denied", "missing_grant", "report"]

logger = logging.getLogger("flask_idem")

#: Seconds before the same missing grant is logged again at ``ERROR`` (in between: at ``DEBUG``).
REPEAT = 600.0

#: PostgreSQL's message for an object the role may not use: its kind and its name, quoted or not.
_DENIED = re.compile(r'permission denied for (?P<kind>[a-z ]+?) "?(?P<name>[^"]+?)"?$')

#: What the application's role needs on an object of each kind: on flask-idem's tables what the
#: revisions' grants give (``flask idem migrate --grant``), USAGE on their schema; EXECUTE on functions
#: PostgreSQL gives to PUBLIC unless an administrator revoked it; USAGE on an application's sequence.
_NEEDED = {
    "table": "SELECT, INSERT, UPDATE, DELETE",
    "schema": "USAGE",
    "function": "EXECUTE",
    "sequence": "USAGE",
}

_told: dict[tuple[str, str, str], float] = {}
_lock = threading.Lock()


def missing_grant(
    error: psycopg.Error, role: str | None = None, *, key_table: str | None = None
) -> str | None:
    """What ``error`` says is missing and how to grant it, in one sentence; ``None`` when ``error`` is not
    a missing privilege.

    :param role: the application's role; default: the user of ``IDEM_DATABASE_URL`` in the current
        application, else the placeholder ``ROLE``.
    :param key_table: the key table, whose name begins the names of flask-idem's tables (its partitions,
        tombstones and outbox): ``flask idem migrate --grant`` covers those and their schema, and the
        ``GRANT`` statement is given for any other object. ``None``: every table is taken for flask-idem's.
    """
    error = _denial(error)
    if not isinstance(error, psycopg.errors.InsufficientPrivilege):
        return None
    who = role or _role() or "ROLE"
    message = error.diag.message_primary or "permission denied"
    denied = _DENIED.match(message)
    if denied is None:  # "must be owner of ...": DDL, which the tables' owner runs, never the application
        return f"the role {who} may not do this ({message}): run it as the role that owns the tables"
    kind, name = denied["kind"], denied["name"]
    privilege = _NEEDED.get(kind)
    if privilege is None:  # a view, a type, ...: nothing flask-idem uses; the application knows
        return f"the role {who} lacks a privilege on {kind} {name} ({message}): grant it, as its owner"
    if _covered(kind, name, key_table):
        fix = f"run 'flask idem migrate --grant {who}' as the tables' owner"
    else:
        fix = f"run 'GRANT {privilege} ON {kind.upper()} {name} TO {who}' as its owner"
    return f"the role {who} lacks {privilege} on {kind} {name} ({message}): {fix}"


def _covered(kind: str, name: str, key_table: str | None) -> bool:
    """Whether ``flask idem migrate --grant`` grants the role what it needs on ``kind`` ``name``: the key
    table's own tables (named after it), and the schema the key table names, if it names one."""
    if key_table is None:
        return kind == "table"
    schema, _, base = key_table.rpartition(".")
    if kind == "schema":
        return name == schema
    return kind == "table" and (name == base or name.startswith(base + "_"))


def report(
    error: psycopg.Error,
    where: str,
    then: str,
    *,
    role: str | None = None,
    key_table: str | None = None,
) -> bool:
    """Log the grant ``error`` says is missing, naming ``where`` it happened and what was done ``then``;
    at ``ERROR`` the first time in :data:`REPEAT` seconds for this place (a route, a task), role and
    message, else at ``DEBUG``.

    :returns: whether ``error`` is a missing privilege (nothing is logged otherwise).
    """
    grant = missing_grant(error, role, key_table=key_table)
    if grant is None:
        return False
    cause = (where, grant, _denial(error).diag.message_primary or "")
    now = time.monotonic()
    with _lock:
        last = _told.get(cause)
        first = last is None or now - last >= REPEAT
        if first:
            _told[cause] = now
    logger.log(
        logging.ERROR if first else logging.DEBUG,
        "Missing privilege in %s: InsufficientPrivilege (SQLSTATE 42501), %s; %s.",
        where,
        grant,
        then,
    )
    return True


def denied(error: psycopg.Error) -> bool:
    """Whether ``error`` is, or was raised from, a privilege the role lacks."""
    return isinstance(_denial(error), psycopg.errors.InsufficientPrivilege)


def _denial(error: psycopg.Error) -> psycopg.Error:
    """``error``, or the missing privilege it was raised from: a statement sent with COMMIT (a batched
    transaction) fails at COMMIT, and is raised as a COMMIT whose outcome is unknown, from it."""
    seen: BaseException | None = error
    chain: set[int] = set()
    while seen is not None and id(seen) not in chain:  # a cause may be raised from itself
        if isinstance(seen, psycopg.errors.InsufficientPrivilege):
            return seen
        chain.add(id(seen))
        seen = seen.__cause__
    return error


def _role() -> str | None:
    """The user named by the current application's ``IDEM_DATABASE_URL``, if any."""
    if not has_app_context():
        return None
    url = current_app.config.get("IDEM_DATABASE_URL")
    if not isinstance(url, str) or not url:
        return None
    try:
        user = conninfo_to_dict(url).get("user")
    except psycopg.ProgrammingError:  # not a libpq URL (an SQLAlchemy one, say)
        return None
    return str(user) if user else None
