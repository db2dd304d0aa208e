"""Statements sent together: several in one round trip, their parameters apart from their text.

A *batch* sends a few statements in libpq's pipeline mode, each as Parse (unless prepared), Bind and
Execute, followed by a single Sync: the server answers them all in one turn (``docs/transactions.rst``,
"Round trips", says what that buys and what it keeps). :class:`~flask_idem._pool.Batched` uses it to send
``BEGIN`` with the reservation and the completion with ``COMMIT``.

- **One Sync per batch**: to PgBouncer in transaction mode a batch is one ordinary exchange that ends
  with one ReadyForQuery, inside a transaction or outside one.
- **Prepared statements only when asked, and never assumed**: a statement is prepared under a name
  derived from its text and its parameter types (a Close first, so preparing again is never an error);
  anything that may deallocate them (a rollback through psycopg, ``DISCARD ALL``, another server behind
  a pooler) is answered by clearing the caller's set of names, or by SQLSTATE 26000 when it went unseen.
- **psycopg finds the connection as it left it**: a batch holds the connection's lock, reads every result
  up to the Sync, and leaves pipeline mode before it returns. Errors are psycopg's own exception classes.

**psycopg's internals, behind a fence.** Sending and reading goes through the documented :mod:`psycopg.pq`;
doing it as psycopg does needs pieces with no compatibility promise, used only here:

- ``psycopg.generators.send`` and ``fetch_many``, and ``Connection.wait``: to flush the batch and read
  its results the way psycopg waits for its own (interruptible, the connection's own wait policy);
- ``Connection.lock``: so that nothing else uses the connection while a batch is on the wire;
- ``psycopg.adapt.Transformer``'s ``dump_sequence``, ``types``, ``formats``, ``set_pgresult`` and
  ``load_rows``: the connection's own adapters for the parameters and the rows;
- ``psycopg.errors.error_from_result``: errors of psycopg's own classes, with their diagnostics;
- and, in :mod:`._connection`, the ``Connection._deallocate`` hook, to learn when psycopg deallocates
  every prepared statement (without it, batches do not prepare their statements).

They are imported on first use and checked once per process (:func:`usable`): each is there, and a
trial batch answers as expected. Otherwise the extension logs once what it fell back from and sends every
statement on a round trip of its own through psycopg's public API, which keeps the same contract.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Mapping, MutableSet, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg.abc import Transformer
from psycopg.adapt import PyFormat

__all__ = ["BEGIN", "COMMIT", "ROLLBACK", "Result", "Statement", "adapters", "can_prepare", "run", "usable"]

logger = logging.getLogger("flask_idem")

BEGIN = b"BEGIN"
COMMIT = b"COMMIT"
ROLLBACK = b"ROLLBACK"

_PLACEHOLDER = re.compile(rb"%\((\w+)\)s|%%")


@dataclass(frozen=True)
class _Internals:
    """The psycopg internals a batch uses (see the module's docstring)."""

    send: Callable[..., Any]
    fetch_many: Callable[..., Any]
    error_from_result: Callable[..., psycopg.Error]
    adapters: Callable[[psycopg.Connection[Any]], Transformer]
    #: Whether psycopg tells a connection when it deallocates its prepared statements (the
    #: ``Connection._deallocate`` hook); without it batches run, and prepare none of their statements.
    deallocate: bool


@functools.cache
def _internals() -> _Internals | str:
    """The internals, imported on first use; what is missing when one is."""
    try:
        from psycopg import generators
        from psycopg.adapt import Transformer as Adapters

        for name in ("dump_sequence", "set_pgresult", "load_rows", "types", "formats"):
            getattr(Adapters, name)
        if not callable(psycopg.Connection.wait):
            raise AttributeError("psycopg.Connection.wait is not callable")
        deallocate = callable(getattr(psycopg.Connection, "_deallocate", None))
        return _Internals(
            generators.send, generators.fetch_many, errors.error_from_result, Adapters, deallocate
        )
    except (ImportError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"


_verdict: bool | None = None
_verdict_lock = threading.Lock()


def usable(conn: psycopg.Connection[Any]) -> bool:
    """Whether batches can run in this process, found out once on ``conn`` (a new, idle connection).

    The internals must be there, and a trial batch must answer as psycopg would: a row of the right
    value, and a failing statement as psycopg's own error class. Otherwise this logs, once, what the
    extension falls back from, and answers false from then on. Without the ``_deallocate`` hook it logs,
    once, that batches prepare nothing (:func:`can_prepare`).
    """
    global _verdict
    if _verdict is not None:
        return _verdict
    with _verdict_lock:
        if _verdict is None:
            found = _internals()
            why = found if isinstance(found, str) else _trial(conn, found)
            if why is not None:
                logger.warning(
                    "flask-idem cannot send BEGIN and COMMIT together with its statements with this"
                    " psycopg (%s, %s): every statement takes a round trip of its own.",
                    psycopg.__version__,
                    why,
                )
            elif isinstance(found, _Internals) and not found.deallocate:
                logger.warning(
                    "flask-idem's batches prepare none of their statements with this psycopg (%s,"
                    " psycopg.Connection._deallocate is missing): each is parsed on every run.",
                    psycopg.__version__,
                )
            _verdict = why is None
        return _verdict


_TRIAL = b"SELECT %(value)s::int4 AS value"
_TRIAL_ERROR = b"SELECT 1 / %(zero)s::int4"


def _trial(conn: psycopg.Connection[Any], internals: _Internals) -> str | None:
    """Run two small batches on ``conn``; ``None`` when they answered as expected, else what went wrong."""
    try:
        transformer = internals.adapters(conn)
        rows = run(conn, [(Statement.from_query(_TRIAL), {"value": 42})], transformer=transformer)[0].rows
        if rows != [{"value": 42}]:
            return f"a trial batch answered {rows!r}"
        try:
            run(conn, [(Statement.from_query(_TRIAL_ERROR), {"zero": 0})], transformer=transformer)
        except errors.DivisionByZero:
            pass
        else:
            return "a trial batch's failing statement raised nothing"
    except psycopg.OperationalError:
        raise  # the connection, not psycopg: the pool discards it and finds out on the next one
    except Exception as e:  # anything else is psycopg behaving unexpectedly
        return f"a trial batch raised {type(e).__name__}: {e}"
    return None


def adapters(conn: psycopg.Connection[Any]) -> Transformer:
    """The adapters a batch on ``conn`` uses (call only once :func:`usable` answered true)."""
    return _checked().adapters(conn)


def _checked() -> _Internals:
    found = _internals()
    if isinstance(found, str):
        raise RuntimeError(f"Batches cannot run with this psycopg: {found}.")
    return found


def can_prepare() -> bool:
    """Whether batches may prepare their statements: libpq can close a prepared statement at the protocol
    level (libpq 17 and later), and psycopg tells when it deallocates them all (:class:`_Internals`)."""
    found = _internals()
    return pq.version() >= 170000 and isinstance(found, _Internals) and found.deallocate


@dataclass(frozen=True, slots=True)
class Statement:
    """A statement with named parameters, rewritten once into the ``$n`` form the protocol takes."""

    #: The text, with ``$1``, ``$2``... in place of ``%(name)s``.
    text: bytes
    #: The parameter names, in ``$n`` order.
    params: tuple[str, ...]
    #: Stem of the names it is prepared under: a digest of the text.
    stem: bytes
    #: How each parameter is adapted (psycopg's choice, by value), for ``dump_sequence``.
    formats: tuple[PyFormat, ...] = ()
    #: The names it is prepared under, by parameter types (see :func:`_prepared_name`).
    names: dict[tuple[int, ...], bytes] = field(default_factory=dict, compare=False, hash=False, repr=False)

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
        return cls(text, tuple(names), stem, (PyFormat.AUTO,) * len(names))


@dataclass(frozen=True, slots=True)
class Result:
    """What one statement of a batch answered."""

    rows: list[dict[str, Any]]
    #: Rows the statement affected or returned (psycopg's ``cursor.rowcount``).
    rowcount: int


#: A batch's item: a command without parameters (``BEGIN``), or a statement and its parameter values.
Item = bytes | tuple[Statement, Mapping[str, Any]]

#: What a command without parameters answers.
_COMMAND = Result([], -1)


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
    internals = _checked()
    pgconn = conn.pgconn
    with conn.lock:
        if pgconn.status != _CONN_OK:
            raise psycopg.OperationalError("the connection is closed")
        if pgconn.pipeline_status != _PIPELINE_OFF:
            raise psycopg.ProgrammingError("A batch cannot be sent inside a psycopg pipeline.")
        # Parameters are adapted before anything is sent: a value that cannot be leaves nothing half sent.
        messages = [_adapt(item, transformer, prepared) for item in items]
        answers = sum(message.answers for message in messages)
        pgconn.enter_pipeline_mode()
        try:
            for message in messages:
                message.send(pgconn)
            pgconn.pipeline_sync()
            results = conn.wait(_receive(internals, pgconn, answers))
        except BaseException:
            # Interrupted with results still unread (or the connection lost): the connection cannot
            # leave pipeline mode in a known state, so it is closed, and the pool replaces it.
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.OperationalError:
                conn.close()
            raise
        pgconn.exit_pipeline_mode()
    return _results(conn, results, messages, transformer, prepared, internals)


@dataclass(frozen=True, slots=True)
class _Message:
    """One item of a batch, adapted: what to send, and how to read what it answers."""

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
        """How many results it answers with: the Close and the Parse of a statement it prepares answer too."""
        return 3 if self.prepare else 1

    def send(self, pgconn: pq.abc.PGconn) -> None:
        if self.name is None:
            pgconn.send_query_params(
                self.text,
                self.params,
                param_types=self.types,
                param_formats=self.formats,
                result_format=_BINARY,
            )
            return
        if self.prepare:
            pgconn.send_close_prepared(self.name)
            pgconn.send_prepare(self.name, self.text, param_types=self.types)
        pgconn.send_query_prepared(self.name, self.params, param_formats=self.formats, result_format=_BINARY)


def _adapt(item: Item, transformer: Transformer, prepared: MutableSet[bytes] | None) -> _Message:
    if isinstance(item, bytes):
        return _Message(item)
    statement, values = item
    params = transformer.dump_sequence([values[name] for name in statement.params], statement.formats)
    types, param_formats = transformer.types or (), transformer.formats
    if prepared is None:
        return _Message(statement.text, params, types, param_formats)
    key = tuple(types)  # the same tuple, with psycopg's adapters
    name = statement.names.get(key)
    if name is None:
        name = statement.names[key] = _prepared_name(statement, key)
    return _Message(statement.text, params, types, param_formats, name=name, prepare=name not in prepared)


def _prepared_name(statement: Statement, types: tuple[int, ...]) -> bytes:
    """The name ``statement`` is prepared under with these parameter types.

    A prepared statement keeps the types it was prepared with, and psycopg picks int2, int4 or int8 for
    an integer by its value: each set of types gets a statement of its own, as in psycopg's own cache.
    """
    digest = hashlib.blake2b(repr(types).encode("ascii"), digest_size=4).hexdigest()
    return statement.stem + b"_" + digest.encode("ascii")


def _receive(internals: _Internals, pgconn: pq.abc.PGconn, count: int) -> Any:
    """Flush the batch, then read ``count`` results and the Sync's."""
    yield from internals.send(pgconn)
    fetch_many = internals.fetch_many
    answers: list[pq.abc.PGresult] = []
    for _ in range(count):
        results = yield from fetch_many(pgconn)
        if not results:
            raise psycopg.InternalError("A statement of a batch went unanswered.")
        answers.append(results[-1])
    sync = yield from fetch_many(pgconn)
    if not sync or sync[0].status != _PIPELINE_SYNC:
        raise psycopg.InternalError("A batch's Sync went unanswered.")
    return answers


def _results(
    conn: psycopg.Connection[Any],
    answers: list[pq.abc.PGresult],
    messages: list[_Message],
    transformer: Transformer,
    prepared: MutableSet[bytes] | None,
    internals: _Internals,
) -> list[Result]:
    results: list[Result] = []
    position = 0
    for message in messages:
        parts = answers[position : position + message.answers]
        position += message.answers
        for part in parts:
            status = part.status
            if status == _TUPLES_OK or status == _COMMAND_OK:
                continue
            if status == _FATAL_ERROR:
                error = internals.error_from_result(part, encoding=conn.info.encoding)
                if error.sqlstate == "26000" and prepared is not None:
                    prepared.clear()  # deallocated behind our back: prepare everything anew
                raise error
            # PIPELINE_ABORTED: an earlier statement failed, and its error was raised above.
            raise psycopg.InternalError(f"unexpected result {pq.ExecStatus(status).name} in a batch")
        if message.prepare and prepared is not None and message.name is not None:
            prepared.add(message.name)
        if message.params is None:
            results.append(_COMMAND)
        else:
            results.append(_result(parts[-1], transformer, message.name or message.text))
    return results


#: The column names of the rows a statement answers, by the name (or text) it was sent under.
_columns: dict[bytes, list[str]] = {}


def _result(answer: pq.abc.PGresult, transformer: Transformer, sent_as: bytes) -> Result:
    if answer.status != _TUPLES_OK:
        status = answer.command_status or b""
        tail = status.rsplit(b" ", 1)[-1]
        return Result([], int(tail) if tail.isdigit() else -1)
    count = answer.nfields
    names = _columns.get(sent_as)
    if names is None or len(names) != count:
        names = [(answer.fname(i) or b"").decode("utf-8") for i in range(count)]
        if len(_columns) < 1000:  # the store's few statements; a bound all the same
            _columns[sent_as] = names
    transformer.set_pgresult(answer)
    rows = transformer.load_rows(0, answer.ntuples, tuple)
    return Result([dict(zip(names, row, strict=True)) for row in rows], answer.ntuples)


_CONN_OK = pq.ConnStatus.OK
_PIPELINE_OFF = pq.PipelineStatus.OFF
_BINARY = pq.Format.BINARY
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
