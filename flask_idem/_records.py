"""The records of the key table: what the store takes (a key, a request, a lease) and what it answers,
bound to the statements' rows by column name."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

__all__ = [
    "RECORD_FIELDS",
    "RangeRows",
    "Final",
    "KeyRecord",
    "KeyRef",
    "KeyedRequest",
    "Lease",
    "Reservation",
    "Stranded",
    "StuckRow",
    "TableState",
    "TableStats",
    "lock_id",
]

#: Advisory locks share one namespace with the application's own. Mixing this constant into the lock id
#: keeps ours apart from ids an application derives from small integers.
_LOCK_SALT = b"flask-idem/v1"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KeyRef:
    """One key of one organisation: the primary key of a row of the key table."""

    org_id: int
    key: uuid.UUID


@dataclass(frozen=True, slots=True)
class KeyedRequest(KeyRef):
    """A write request that carries a key: what a reservation records about it."""

    #: The request's fingerprint (:func:`flask_idem._fingerprint.fingerprint`).
    request_sha: bytes
    #: A request's method and path; ``None`` for a background job's row, which has ``task``.
    method: str | None
    path: str | None
    #: A background job's task; ``None`` for a request.
    task: str | None = None


@dataclass(frozen=True, slots=True)
class Lease(KeyRef):
    """A worker's hold on a multi-step request: every write it makes is guarded by ``token``."""

    token: uuid.UUID
    #: How long the lease lasts from each write that renews it.
    seconds: float


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A committed row of the key table, as a later request with the same key sees it."""

    request_sha: bytes
    status: str
    response: dict[str, Any] | None
    #: Past its retention period and its tombstone's, finished, and not flagged for a person: the key
    #: may be used anew.
    expired: bool
    #: Past its retention period but not its tombstone's: the stored response is gone (or about to be),
    #: and a retry is told where the result is, or that it expired.
    stale: bool
    #: Multi-step rows: whether a worker holds the request now, the flow, and what it recorded.
    lease_live: bool = False
    flow: str | None = None
    step: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


#: The columns of a key's row that a later request reads, as the store's statements name them.
RECORD_FIELDS = tuple(f.name for f in fields(KeyRecord))


@dataclass(frozen=True, slots=True)
class Stranded:
    """A multi-step request the recovery job claimed: its lease had expired."""

    org_id: int
    key: uuid.UUID
    flow: str
    step: str | None
    state: dict[str, Any]
    #: A request's method and path, or a background job's task.
    method: str | None
    path: str | None
    attempts: int
    overdue: bool
    task: str | None = None


@dataclass(frozen=True, slots=True)
class StuckRow:
    """A row ``flask idem stuck`` reports."""

    org_id: int
    key: uuid.UUID
    status: str
    flow: str | None
    step: str | None
    attempts: int
    age_seconds: float
    needs_attention: bool
    last_error: str | None
    #: What the row is for: a request's method and path, or a background job's task
    #: (:mod:`flask_idem.jobs`).
    method: str | None = ""
    path: str | None = ""
    task: str | None = None


@dataclass(frozen=True, slots=True)
class TableState:
    """The key table's state at a glance, read with one query over small partial indexes (for metrics).

    Only committed rows count: an atomic request's row is never seen ``processing`` by others, so
    ``processing`` rows are multi-step requests.
    """

    #: Multi-step requests not finished yet.
    processing: int
    #: Of those, the ones whose lease has expired: stranded, waiting for a retry or the recovery job.
    stranded: int
    #: Rows flagged for a person (``flask idem stuck``).
    flagged: int
    #: Age in seconds of the oldest processing request; 0 when there is none.
    oldest_processing_seconds: float


@dataclass(frozen=True, slots=True)
class RangeRows:
    """The rows of one range of ``expires_at``: of one partition, for ``flask idem stats``."""

    rows: int
    #: Multi-step requests still in progress: purge keeps their partition until they finish.
    processing: int = 0
    #: Rows flagged for a person: purge moves them to a live partition.
    flagged: int = 0


@dataclass(frozen=True, slots=True)
class TableStats:
    """What ``flask idem stats`` prints. Reads the whole table: meant for a person, not for a scraper."""

    #: Rows by status, sorted by status.
    by_status: list[tuple[str, int]]
    #: Multi-step rows by flow, status and last finished step (``None`` before any step after the intent).
    by_flow: list[tuple[str, str, str | None, int]]
    flagged: int
    #: Rows kept as tombstones (:data:`IDEM_TOMBSTONE_TTL`): their stored response has expired.
    tombstones: int
    #: Rows past their tombstone's period too (or past retention, when tombstones are off): ``flask idem
    #: purge`` drops them with their partition.
    to_delete: int
    #: The oldest processing request, or ``None``.
    oldest_processing: StuckRow | None
    #: ``pg_total_relation_size`` of the table (with its indexes and TOAST), and the indexes alone.
    total_bytes: int
    index_bytes: int
    #: When asked for: the rows of each partition's range of ``expires_at`` (and one past the last bound),
    #: counted, not estimated; likewise the compact tombstones.
    keys_by_range: list[RangeRows] = field(default_factory=list)
    tombstones_by_range: list[RangeRows] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Reservation:
    """What :meth:`Store.reserve` found: ``reserved`` when this transaction owns the key; else ``record``
    is the committed row, or ``None`` while another transaction holds the key uncommitted (in flight)."""

    reserved: bool
    record: KeyRecord | None = None


def lock_id(org_id: int, key: uuid.UUID) -> int:
    """The signed 64-bit advisory lock id of one (org, key) pair."""
    digest = hashlib.blake2b(
        org_id.to_bytes(8, "big", signed=True) + key.bytes, digest_size=8, key=_LOCK_SALT
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Final(Generic[T]):
    """How one door's work ended: its own answer, and what the key table keeps of it.

    ``value`` is the door's (a request's :class:`~flask.Response`, a task's result). ``document`` is
    stored as the key's final answer and replayed to later attempts; ``None`` when the work failed
    (``failed``: its writes are rolled back and the key is left to a retry) or keeps nothing.
    """

    value: T
    document: dict[str, Any] | None
    #: The status a later attempt is told (a response's status code; a task's result is 200).
    status: int
    failed: bool = False
