"""Statements sent together: several in one round trip, their parameters apart from their text.

psycopg gives every statement a turn of the conversation of its own: ``BEGIN``, each statement, and
``COMMIT`` each wait for the server's answer before the next is sent. A fresh key adds two statements to
the view's transaction (the reservation before it, the completion after it), so on its own it would cost
two waits more than the route without the extension. A *batch* sends a few statements in libpq's pipeline
mode, each as Parse (unless prepared), Bind and Execute, followed by a single Sync: the server answers them
all in one turn. :class:`~flask_idem.pool.Batched` uses it to send ``BEGIN`` with the reservation and the
completion with ``COMMIT``.

What a batch keeps, and why it is safe:

- **Parameters stay out of the statement text.** Values travel in Bind messages, never spliced into the
  SQL. A failing statement is logged by PostgreSQL (``log_min_error_statement``) with its ``$1``
  placeholders; the values are only logged where the server is set to log them
  (``log_parameter_max_length_on_error``, 0 by default). A stored response can carry personal data.
- **One Sync per batch.** To a pooler such as PgBouncer in transaction mode, a batch is one ordinary
  exchange that ends with one ReadyForQuery, inside a transaction or outside one.
- **Prepared statements only when asked, and never assumed.** With ``prepared`` a statement is prepared
  under a name derived from its text and its parameter types (a Close first, so preparing again is never
  an error), and the caller's set of names is kept in step with what the server was told. Anything that
  may deallocate them (a rollback through psycopg, ``DISCARD ALL``, another server behind a pooler) is
  answered by clearing the set, or by SQLSTATE 26000 when it went unseen.
- **psycopg finds the connection as it left it.** A batch holds the connection's lock, reads every result
  up to the Sync, and leaves pipeline mode before it returns, so psycopg sees an idle connection (in a
  transaction or not) with nothing pending. Errors are psycopg's own exception classes.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, MutableSet, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg.abc import Transformer
from psycopg.adapt import PyFormat
from psycopg.generators import fetch_many, send

__all__ = ["BEGIN", "COMMIT", "ROLLBACK", "Result", "Statement", "can_prepare", "run"]

BEGIN = b"BEGIN"
COMMIT = b"COMMIT"
ROLLBACK = b"ROLLBACK"

_PLACEHOLDER = re.compile(rb"%\((\w+)\)s|%%")
_OK = frozenset({pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK})


def can_prepare() -> bool:
    """Whether libpq can close a prepared statement at the protocol level (libpq 17 and later)."""
    return pq.version() >= 170000


@dataclass(frozen=True, slots=True)
class Statement:
    """A statement with named parameters, rewritten once into the ``$n`` form the protocol takes."""

    #: The text, with ``$1``, ``$2``... in place of ``%(name)s``.
    text: bytes
    #: The parameter names, in ``$n`` order.
    params: tuple[str, ...]
    #: Stem of the names it is prepared under: a digest of the text.
    stem: bytes

    @classmethod
    def from_query(cls, query: bytes) -> Statement:
        """Rewrite a psycopg query with ``%(name)s`` placeholders; a repeated name is one parameter."""
        names: list[str] = []

        def number(match: re.Match[bytes]) -> bytes:
            if match.group(0) == b"%%":
                return b"%"
            name = match.group(1).decode("ascii")
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        text = _PLACEHOLDER.sub(number, query)
        stem = b"flask_idem_" + hashlib.blake2b(text, digest_size=8).hexdigest().encode("ascii")
        return cls(text, tuple(names), stem)


@dataclass(frozen=True, slots=True)
class Result:
    """What one statement of a batch answered."""

    rows: list[dict[str, Any]]
    #: Rows the statement affected or returned (psycopg's ``cursor.rowcount``).
    rowcount: int


#: A batch's item: a command without parameters (``BEGIN``), or a statement and its parameter values.
Item = bytes | tuple[Statement, Mapping[str, Any]]


def run(
    conn: psycopg.Connection[Any],
    items: Sequence[Item],
    *,
    transformer: Transformer,
    prepared: MutableSet[bytes] | None = None,
) -> list[Result]:
    """Send ``items`` in one round trip and return their results, in order.

    :param transformer: adapts the parameters and the rows (the connection's own adapters).
    :param prepared: names of the statements prepared on this connection; a statement not in it is
        prepared, and its name added once that succeeded. ``None``: nothing is prepared (unnamed
        statements only, as behind a pooler without prepared-statement support).
    :raises psycopg.Error: the first statement that failed, once every result up to the Sync was read.
        The statements after it did not run. On SQLSTATE 26000 (a prepared statement was gone) the set
        ``prepared`` is emptied.
    """
    pgconn = conn.pgconn
    with conn.lock:
        if pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the connection is closed")
        if pgconn.pipeline_status != pq.PipelineStatus.OFF:
            raise psycopg.ProgrammingError("A batch cannot be sent inside a psycopg pipeline.")
        # Parameters are adapted before anything is sent: a value that cannot be leaves nothing half sent.
        messages = [_adapt(item, transformer, prepared) for item in items]
        pgconn.enter_pipeline_mode()
        try:
            for message in messages:
                message.send(pgconn)
            pgconn.pipeline_sync()
            answers = conn.wait(_receive(pgconn, sum(message.answers for message in messages)))
        except BaseException:
            # Interrupted with results still unread (or the connection lost): the connection cannot
            # leave pipeline mode in a known state, so it is closed, and the pool replaces it.
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.OperationalError:
                conn.close()
            raise
        pgconn.exit_pipeline_mode()
    return _results(conn, answers, messages, transformer, prepared)


@dataclass(frozen=True, slots=True)
class _Message:
    """One item of a batch, adapted: what to send, and how many results it answers with."""

    text: bytes
    params: Sequence[Any] | None = None
    types: Sequence[int] | None = None
    formats: Sequence[pq.Format] | None = None
    #: The name it is prepared under; ``prepare``: whether to prepare it first (a Close, then a Parse,
    #: each answering with a result of its own).
    name: bytes | None = None
    prepare: bool = False

    @property
    def answers(self) -> int:
        return 3 if self.prepare else 1

    def send(self, pgconn: pq.abc.PGconn) -> None:
        binary = pq.Format.BINARY
        if self.name is None:
            pgconn.send_query_params(
                self.text,
                self.params,
                param_types=self.types,
                param_formats=self.formats,
                result_format=binary,
            )
            return
        if self.prepare:
            pgconn.send_close_prepared(self.name)
            pgconn.send_prepare(self.name, self.text, param_types=self.types)
        pgconn.send_query_prepared(self.name, self.params, param_formats=self.formats, result_format=binary)


def _adapt(item: Item, transformer: Transformer, prepared: MutableSet[bytes] | None) -> _Message:
    if isinstance(item, bytes):
        return _Message(item)
    statement, values = item
    formats = [PyFormat.AUTO] * len(statement.params)
    params = transformer.dump_sequence([values[name] for name in statement.params], formats)
    types, param_formats = transformer.types or (), transformer.formats
    if prepared is None:
        return _Message(statement.text, params, types, param_formats)
    name = _prepared_name(statement, tuple(types))
    return _Message(statement.text, params, types, param_formats, name=name, prepare=name not in prepared)


@functools.cache
def _prepared_name(statement: Statement, types: tuple[int, ...]) -> bytes:
    """The name ``statement`` is prepared under with these parameter types.

    A prepared statement keeps the types it was prepared with, and psycopg picks int2, int4 or int8 for
    an integer by its value: each set of types gets a statement of its own, as in psycopg's own cache.
    """
    digest = hashlib.blake2b(repr(types).encode("ascii"), digest_size=4).hexdigest()
    return statement.stem + b"_" + digest.encode("ascii")


def _receive(pgconn: pq.abc.PGconn, count: int) -> Any:
    """Flush the batch, then read ``count`` results and the Sync's."""
    yield from send(pgconn)
    answers: list[pq.abc.PGresult] = []
    for _ in range(count):
        results = yield from fetch_many(pgconn)
        answers.append(results[-1] if results else _missing())
    sync = yield from fetch_many(pgconn)
    if not sync or sync[0].status != pq.ExecStatus.PIPELINE_SYNC:
        raise psycopg.InternalError("A batch's Sync went unanswered.")
    return answers


def _missing() -> Any:
    raise psycopg.InternalError("A statement of a batch went unanswered.")


def _results(
    conn: psycopg.Connection[Any],
    answers: list[pq.abc.PGresult],
    messages: list[_Message],
    transformer: Transformer,
    prepared: MutableSet[bytes] | None,
) -> list[Result]:
    results: list[Result] = []
    position = 0
    for message in messages:
        parts = answers[position : position + message.answers]
        position += message.answers
        for part in parts:
            if part.status == pq.ExecStatus.FATAL_ERROR:
                error = errors.error_from_result(part, encoding=conn.info.encoding)
                if error.sqlstate == "26000" and prepared is not None:
                    prepared.clear()  # deallocated behind our back: prepare everything anew
                raise error
            if part.status not in _OK:
                # PIPELINE_ABORTED: an earlier statement failed, and its error was raised above.
                raise psycopg.InternalError(f"unexpected result {pq.ExecStatus(part.status).name} in a batch")
        if message.prepare and prepared is not None and message.name is not None:
            prepared.add(message.name)
        results.append(_result(parts[-1], transformer))
    return results


def _result(answer: pq.abc.PGresult, transformer: Transformer) -> Result:
    if answer.status != pq.ExecStatus.TUPLES_OK:
        status = answer.command_status or b""
        tail = status.rsplit(b" ", 1)[-1]
        return Result([], int(tail) if tail.isdigit() else -1)
    transformer.set_pgresult(answer)
    names = [(answer.fname(i) or b"").decode("utf-8") for i in range(answer.nfields)]
    values = transformer.load_rows(0, answer.ntuples, tuple)
    return Result([dict(zip(names, row, strict=True)) for row in values], answer.ntuples)
