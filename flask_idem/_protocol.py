"""The key protocol, written once for every door: a request (:mod:`._view`), a webhook delivery
(:mod:`._webhook`), a background job (:mod:`._delivery`) and the recovery job (:mod:`.recovery`).

It reserves a key (atomically, in the transaction of the work's writes, or under a lease for a
multi-step run), sorts what is already there into an outcome (:class:`InFlight`, :class:`Mismatch`,
:class:`Tombstone`, :class:`Replay`), completes the key, takes a stranded run over and gives one up. It
knows nothing of HTTP: a door hands it a :class:`Claim` and a callable doing its own work, which answers
a :class:`._records.Final`, and maps the outcomes to its world. Every outcome is announced here, once,
with its signal; the rules every door shares live here too (:func:`lease_seconds`, :func:`unavailable`).
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.rows import TupleRow

from . import signals
from ._records import Final, KeyedRequest, KeyRecord, Lease
from ._settings import Settings
from ._state import IdemState
from ._transactions import in_transaction
from .errors import store_unreachable
from .flow import INTENT, Flow, Run, run_from_record

__all__ = [
    "Claim",
    "Existing",
    "InFlight",
    "LeaseLost",
    "Mismatch",
    "Pending",
    "Replay",
    "Tombstone",
    "atomic",
    "begin",
    "classify",
    "give_up",
    "give_up_leased",
    "lease_seconds",
    "release",
    "stored",
    "unavailable",
]

T = TypeVar("T")

logger = logging.getLogger("flask_idem")


class LeaseLost(Exception):
    """Another attempt or the recovery job took the run over; this worker stops (the other finishes)."""


class Pending(Exception):
    """A call step ended without a known outcome; the lease was given up for a later attempt."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A door's claim on one key: the work it carries, how long its answer is kept, and how to tell
    whether a stored fingerprint is the same work."""

    request: KeyedRequest
    #: Seconds the key's final answer is kept (the door's ttl, or ``IDEM_KEY_TTL``).
    ttl: float
    #: Answer a different request with the stored answer instead of :class:`Mismatch`
    #: (``IDEM_ON_MISMATCH = "replay"``).
    replay_mismatch: bool = False
    #: Whether a stored fingerprint is this work's under an earlier fingerprint policy (:mod:`._policy`);
    #: ``None``: only the same fingerprint is the same work.
    earlier: Callable[[bytes], bool] | None = None
    #: The status the signals report for a :class:`Replay` or a :class:`Tombstone`, in the door's words
    #: (a request's ``303`` or ``410`` for a tombstone); ``None``: the stored answer's own ``status``.
    reported: Callable[[Replay | Tombstone], int | None] | None = None

    def same(self, request_sha: bytes) -> bool:
        """Whether the key's first work, stored with ``request_sha``, is this one."""
        if hmac.compare_digest(request_sha, self.request.request_sha):
            return True
        return self.earlier is not None and self.earlier(request_sha)


# -- what a key already holds -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another attempt holds the key and has not finished: try again later, never run it twice."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key was used before for other work: refused."""

    record: KeyRecord


@dataclass(frozen=True, slots=True)
class Tombstone:
    """The key's work finished long ago and its stored answer has expired: never run again.

    What is left is where the result is: the first answer's ``Location``, if it had one.
    """

    location: str | None

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> Tombstone:
        """The tombstone of a stored answer (its headers are kept as name-value pairs)."""
        for name, value in document.get("headers", ()):
            if name.lower() == "location":
                return cls(value)
        return cls(None)


@dataclass(frozen=True, slots=True)
class Replay:
    """The key's work finished: its stored answer (``failed``: given up, flagged for a person)."""

    document: Mapping[str, Any]
    #: The stored answer is another request's, replayed under ``replay_mismatch``.
    mismatched: bool = False
    failed: bool = False


Existing = InFlight | Mismatch | Tombstone | Replay

_IN_FLIGHT = InFlight()


def classify(record: KeyRecord | None, claim: Claim) -> Existing:
    """What a key already taken holds, for ``claim``: ``record`` is its committed row, ``None`` when
    another transaction holds the key uncommitted."""
    if record is None:
        return _IN_FLIGHT
    mismatched = not claim.same(record.request_sha)
    if mismatched and not claim.replay_mismatch:
        return Mismatch(record)
    if record.response is None:
        return _IN_FLIGHT
    if record.stale:
        return Tombstone.of(record.response)
    return Replay(record.response, mismatched, record.status == "failed")


def announce(outcome: Existing, claim: Claim) -> None:
    """Send the signal of ``outcome`` for ``claim``."""
    keyed = claim.request
    if isinstance(outcome, InFlight):
        signals.send_for(signals.key_in_flight, keyed)
    elif isinstance(outcome, Mismatch):
        signals.send_for(signals.mismatch_rejected, keyed)
    elif isinstance(outcome, Tombstone):
        signals.send_for(signals.tombstone_hit, keyed, status=_reported(outcome, claim))
    else:
        replayed = signals.mismatch_replayed if outcome.mismatched else signals.response_replayed
        signals.send_for(replayed, keyed, status=_reported(outcome, claim))


def _reported(outcome: Replay | Tombstone, claim: Claim) -> int | None:
    """The status a signal reports for ``outcome``: the door's (:attr:`Claim.reported`), or the stored
    answer's own."""
    if claim.reported is not None:
        return claim.reported(outcome)
    if isinstance(outcome, Replay):
        status: int | None = outcome.document.get("status")
        return status
    return None


def stored(keyed: KeyedRequest, flow: str | None, final: Final[Any]) -> None:
    """Announce a final answer committed just now (:data:`.signals.response_stored`)."""
    if final.document is not None and not final.failed:
        signals.send_for(signals.response_stored, keyed, flow=flow, status=final.status)


# -- atomic: the key and the work's writes commit together --------------------------------------------


def atomic(
    state: IdemState, claim: Claim, work: Callable[[psycopg.Connection[TupleRow]], Final[T]]
) -> Final[T] | Existing:
    """Reserve ``claim``'s key and run ``work`` in one transaction, storing its final answer with it.

    ``work`` runs only when this transaction reserved the key; what it answers is stored with ``COMMIT``
    (a failed answer, or an exception, rolls everything back, the reservation too). When the key is
    taken, nothing is written and what it holds is returned.
    """
    keyed = claim.request

    def body(conn: psycopg.Connection[TupleRow]) -> Final[T] | Existing:
        found = state.store.reserve(conn, keyed, ttl=claim.ttl)
        if not found.reserved:
            # Returned, not raised: the transaction ends with a COMMIT (a ROLLBACK would make psycopg
            # forget the connection's prepared statements), and nothing was written.
            return classify(found.record, claim)
        signals.send_for(signals.key_reserved, keyed, flow=None)
        final = work(conn)
        if final.document is not None and not final.failed:
            state.store.complete(conn, keyed, final.document)
        state.fire("view", conn)
        return final

    try:
        outcome = in_transaction(state.source, body, batched=True)
    except psycopg.Error as e:
        if not state.store.lost_race(e):
            raise
        # The key's row, written with COMMIT, met one committed meanwhile (under REPEATABLE READ, whose
        # snapshot predates the key's lock): nothing of this attempt was kept, and the next finds it.
        outcome = _IN_FLIGHT
    if isinstance(outcome, Final):
        stored(keyed, None, outcome)
    else:
        announce(outcome, claim)
    return outcome


# -- multi-step: the intent under a lease, then the steps (._steps) -----------------------------------


def lease_seconds(settings: Settings, flow: Flow | None = None) -> float:
    """How long a lease on a run of ``flow`` lasts from each write that renews it: the flow's
    ``lease_timeout``, or ``IDEM_LEASE_TIMEOUT``. The one rule of every door (a request's, a task's, the
    recovery job's, and an atomic run given up under a lease, which has no flow)."""
    if flow is not None and flow.lease_timeout is not None:
        return flow.lease_timeout
    return settings.lease_timeout


def begin(
    state: IdemState,
    claim: Claim,
    flow: Flow,
    lease: Lease,
    start: Callable[[psycopg.Connection[TupleRow]], Mapping[str, Any] | Final[T]],
) -> Run | Final[T] | Existing:
    """Reserve ``claim``'s key under ``lease`` and record the intent ``start`` makes, in one short
    transaction; or take a stranded run of the key over (one winner among concurrent attempts).

    ``start`` runs when the key was reserved; it answers the intent (a JSON object) or, when the work
    ended at once, its :class:`Final` answer. The :class:`.flow.Run` returned is advanced by
    :func:`._steps.advance`.

    :raises LeaseLost: the row reserved could not be written to again in the same transaction (as when
        its partition's detach began meanwhile): nothing was committed, and the key may be tried again.
    """
    flow.check()
    keyed = claim.request

    def body(conn: psycopg.Connection[TupleRow]) -> Run | Final[T] | Existing:
        found = state.store.reserve(conn, keyed, ttl=claim.ttl, flow=flow.name, lease=lease)
        if found.reserved:
            signals.send_for(signals.key_reserved, keyed, flow=flow.name)
            intent = start(conn)
            if isinstance(intent, Final):
                if intent.document is not None and not intent.failed:
                    state.store.complete(conn, lease, intent.document)
                return intent
            if not state.store.record_step(conn, lease, INTENT, intent):
                # The row this transaction wrote is not found again: never committed without its intent.
                raise LeaseLost()
            state.fire("view", conn)
            return Run(
                flow=flow.name,
                org_id=keyed.org_id,
                key=keyed.key,
                results={INTENT: intent},
                last_step=INTENT,
            )
        record = found.record
        if take_over(state, conn, record, claim, flow.name, lease):
            assert record is not None
            return run_from_record(
                flow, org_id=keyed.org_id, key=keyed.key, step=record.step, state=record.state
            )
        return classify(record, claim)

    started = in_transaction(state.source, body, batched=True)
    if isinstance(started, Run):
        if started.resumed:
            signals.send_for(signals.lease_taken_over, keyed, flow=flow.name, step=started.last_step)
    elif isinstance(started, Final):
        stored(keyed, flow.name, started)
    else:
        announce(started, claim)
    return started


def take_over(
    state: IdemState,
    conn: psycopg.Connection[TupleRow],
    record: KeyRecord | None,
    claim: Claim,
    flow: str,
    lease: Lease,
) -> bool:
    """Take the run ``record`` is over, under ``lease``, if it is stranded: processing in ``flow``, its
    lease lapsed, and the same work as ``claim``'s. Of concurrent callers one wins."""
    return (
        record is not None
        and record.status == "processing"
        and record.flow == flow
        and not record.lease_live
        and claim.same(record.request_sha)
        and state.store.take_over(conn, lease)
    )


# -- giving up: failed, and flagged for a person ------------------------------------------------------


def give_up(
    state: IdemState, claim: Claim, flow: str, lease: Lease, document: dict[str, Any], reason: str
) -> bool | Existing:
    """Mark ``claim``'s key failed with ``document`` as its answer, flagged for a person.

    The row is reserved anew under ``lease`` or taken over (a run whose lease lapsed). When another
    attempt holds or finished the key meanwhile, nothing is written and what it holds is returned.
    """

    def mark(conn: psycopg.Connection[TupleRow]) -> bool | Existing:
        # An atomic run's row is a leased one named ``flow``: reserved and failed at once.
        found = state.store.reserve(conn, claim.request, ttl=claim.ttl, flow=flow, lease=lease)
        if not found.reserved and not take_over(state, conn, found.record, claim, flow, lease):
            return classify(found.record, claim)
        return state.store.complete(conn, lease, document, failed=reason)

    marked = in_transaction(state.source, mark, batched=True)
    if not isinstance(marked, bool):
        announce(marked, claim)
    return marked


def give_up_leased(state: IdemState, lease: Lease, document: dict[str, Any], reason: str) -> bool:
    """Mark the run held under ``lease`` failed with ``document`` as its answer, flagged for a person;
    false when the lease was lost."""
    return in_transaction(
        state.source, lambda conn: state.store.complete(conn, lease, document, failed=reason)
    )


def release(state: IdemState, lease: Lease, error: str, retry_in: float) -> None:
    """Give ``lease`` up after a failure so that a retry can take over at once; best effort (the lease
    expires anyway). The recovery job waits ``retry_in`` seconds before it tries the run itself."""
    try:
        in_transaction(
            state.source, lambda conn: state.store.release(conn, lease, error=error, retry_in=retry_in)
        )
    except psycopg.Error as e:
        logger.warning("Could not release a lease: %s (SQLSTATE %s).", type(e).__name__, e.sqlstate)


# -- the key table out of reach ------------------------------------------------------------------------


def unavailable(state: IdemState, error: psycopg.Error, org_id: int | None, key: uuid.UUID | None) -> bool:
    """Whether ``error`` means that the key table is out of reach for now, so that the same work may
    succeed later (:func:`.errors.store_unreachable`); if so, :data:`.signals.store_unavailable` is
    sent, the same from every door. ``org_id`` and ``key`` are ``None`` when not known yet."""
    if not store_unreachable(error, state.settings.table):
        return False
    signals.send(
        signals.store_unavailable,
        org_id=org_id,
        key=key,
        error=type(error).__name__,
        sqlstate=error.sqlstate,
    )
    return True
