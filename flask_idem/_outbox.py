"""The outbox table of background jobs: every SQL statement about it (``_outbox.sql``).

A message is written in the caller's transaction (:meth:`Outbox.write`), so it exists exactly when the
request's writes and key commit. The relay claims unsent messages under a short lease (``FOR UPDATE SKIP
LOCKED``, a token, COMMIT: no lock is held while it publishes), publishes each, and marks it sent under
its token; a message whose relay died is claimed again when its lease lapses.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ._pool import ConnectionSource
from ._settings import Settings
from ._sqlfile import SqlFile
from ._task import Envelope, Message

__all__ = ["Outbox", "OutboxState", "outbox_table"]


def outbox_table(key_table: str) -> str:
    """The outbox's name for the key table ``key_table``: ``_outbox`` appended, in the same schema."""
    return key_table + "_outbox"


@dataclass(frozen=True, slots=True)
class OutboxState:
    """Unsent messages at a glance (for ``flask idem relay`` and the metrics)."""

    unsent: int
    #: Age in seconds of the oldest unsent message; 0 when there is none.
    oldest_unsent_seconds: float


class Outbox:
    """The outbox of one key table.

    :param source: where :meth:`claim`, :meth:`mark_sent`, :meth:`release` and :meth:`purge` borrow
        connections (:meth:`write` runs on the caller's). The table is made with the key table
        (``flask_idem/migrations/v1_first_release.sql``).
    :param table: the key table's name (``IDEM_TABLE``); the outbox is named after it.
    :param distributed: the key table is distributed on Citus; the outbox is co-located with it.
    """

    def __init__(self, source: ConnectionSource, *, table: str, distributed: bool = False) -> None:
        self.source = source
        self.distributed = distributed
        self._sql = _Statements(table, distributed=distributed)

    @classmethod
    def of(cls, source: ConnectionSource, settings: Settings) -> Outbox:
        """The outbox of the key table that ``settings`` name, on ``source``."""
        return cls(source, table=settings.table, distributed=settings.distributed)

    def write(
        self,
        conn: psycopg.Connection[Any],
        *,
        org_id: int,
        task: str,
        key: uuid.UUID,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> uuid.UUID:
        """Write one message in the transaction open on ``conn``; return its id."""
        message_id = uuid.uuid4()
        params = {
            "org_id": org_id,
            "id": message_id,
            "task": task,
            "key": key,
            "args": Jsonb(list(args)),
            "kwargs": Jsonb(kwargs),
        }
        conn.execute(self._sql.write, params)
        return message_id

    def claim(self, *, token: uuid.UUID, lease: float, limit: int) -> list[Message]:
        """Claim up to ``limit`` unsent messages that no live claim holds, oldest first, under ``token``.

        Committed before it returns: the relay publishes with no transaction open.
        """
        params: dict[str, Any] = {"token": token, "lease": lease, "limit": limit}
        with self.source.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            if not self.distributed:
                rows = cur.execute(self._sql.claim, params).fetchall()
            else:
                # On Citus FOR UPDATE cannot span shards: read candidates without locks, then claim them
                # organisation by organisation (one shard each), checking again that each is due.
                by_org: dict[int, list[uuid.UUID]] = {}
                for row in cur.execute(self._sql.claim_candidates, params).fetchall():
                    by_org.setdefault(row["org_id"], []).append(row["id"])
                rows = [
                    claimed
                    for org_id, ids in by_org.items()
                    for claimed in cur.execute(self._sql.claim, {**params, "org": org_id, "ids": ids})
                ]
        rows.sort(key=lambda row: row["created_at"])
        return [_message(row) for row in rows]

    def mark_sent(self, message: Message, *, token: uuid.UUID) -> bool:
        """Mark ``message`` sent, if ``token`` still holds it; false when another relay took it over."""
        params = {"org_id": message.envelope.org_id, "id": message.id, "token": token}
        with self.source.connection() as conn:
            return conn.execute(self._sql.mark_sent, params).rowcount == 1

    def release(self, message: Message, *, token: uuid.UUID, error: str, retry_in: float) -> None:
        """Give a message up after a failed publish: it may be claimed again in ``retry_in`` seconds."""
        params = {
            "org_id": message.envelope.org_id,
            "id": message.id,
            "token": token,
            "error": error,
            "retry_in": retry_in,
        }
        with self.source.connection() as conn:
            conn.execute(self._sql.release, params)

    def purge(self, *, older_than: float) -> int:
        """Delete messages sent more than ``older_than`` seconds ago; return how many."""
        with self.source.connection() as conn:
            return conn.execute(self._sql.purge, {"older_than": older_than}).rowcount

    def state(self) -> OutboxState:
        """How many messages are unsent, and the oldest one's age (one statement over a partial index)."""
        with self.source.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(self._sql.state).fetchone()
        assert row is not None  # aggregates always answer one row
        return OutboxState(unsent=row["unsent"], oldest_unsent_seconds=row["oldest"])


def _message(row: dict[str, Any]) -> Message:
    created: datetime = row["created_at"]
    envelope = Envelope(row["org_id"], row["key"], created.timestamp())
    return Message(id=row["id"], task=row["task"], args=row["args"], kwargs=row["kwargs"], envelope=envelope)


class _Statements:
    """The outbox's statements (``_outbox.sql``), composed once for one key table name."""

    def __init__(self, table: str, *, distributed: bool) -> None:
        parts = table.split(".")
        outbox = [*parts[:-1], outbox_table(parts[-1])]
        q = SqlFile("_outbox.sql", {"outbox": sql.Identifier(*outbox)}, distributed=distributed)
        self.write = q("write")
        self.claim_candidates = q("claim_candidates")
        self.claim = q("claim")
        self.mark_sent = q("mark_sent")
        self.release = q("release")
        self.purge = q("purge")
        self.state = q("state")
