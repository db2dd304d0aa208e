"""A late retry is not a new order: past retention a key leaves a tombstone, and a retry finding one
is never run again (303 to the first answer's Location, or 410).

Purge drops whole partitions of the key table after writing compact tombstones into
``<table>_tombstones`` (:func:`flask_idem._partitions.maintain`, what ``flask idem purge`` runs).

No test waits for time to pass. ``maintain`` runs with a fake clock ahead of the database's, on a key
table of its own: the partitions it retires are that table's, never those of the worker's shared
``idempotency_keys``. Before purge, a row's ``expires_at`` moved back in the first partition stands for
the database's clock going forward (the only one that counts, ``docs/retention.rst``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import psycopg.rows
import pytest
from flask import Flask
from psycopg import sql

from flask_idem import _migrate, _partitions
from flask_idem._state import get_state
from flask_idem.errors import PROBLEM_JSON

from .support import citus
from .support.helpers import age, count
from .support.layouts import drop
from .support.notes_app import post
from .support.partitions import holding

DAY = 24 * 3600

#: A key table made afresh for each test that retires its partitions.
OWN = "retired_keys"

#: The settings here: partitions of ten minutes, kept ten minutes, remembered an hour more.
#: A retry of the same key written later (``LONG_TTL``) expires past every fake clock below, in a
#: partition none of them retires: the application writes on the database's clock.
INTERVAL = 600.0
KEY_TTL = 600.0
TOMBSTONE_TTL = 3600.0
AHEAD = 1800.0
LONG_TTL = 3 * 3600.0


def identifier(table: str) -> sql.Identifier:
    return sql.Identifier(*table.split("."))


def query(db: psycopg.Connection[Any], template: str, table: str, *params: Any) -> list[tuple[Any, ...]]:
    """The rows of ``template`` with ``{}`` standing for ``table``."""
    return db.execute(sql.SQL(template).format(identifier(table)), params).fetchall()


def test_a_row_past_retention_answers_as_its_tombstone_until_its_partition_is_dropped(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """Before purge drops its partition, a row past retention answers as its tombstone would (303 to the
    first answer's Location, nothing run again); past the tombstone's period too, the key is new. Its
    expires_at moved back in the first partition (which takes every moment before its bound) stands for
    the database's clock going forward."""
    app = make_app(IDEM_KEY_TTL=3600, IDEM_TOMBSTONE_TTL=30 * DAY)
    key = uuid.uuid4()
    first = post(app, "/notes", key, {"body": "a"})
    assert first.status_code == 201
    age(db, "1 hour 1 second")
    late = post(app, "/notes", key, {"body": "a"})
    assert (late.status_code, late.headers["Location"]) == (303, first.headers["Location"])
    assert post(app, "/notes", key, {"body": "changed"}).status_code == 422
    assert count(db, "notes") == 1
    age(db, "30 days")
    # The key is new again: any request with it runs (notes' bodies are unique, hence "b").
    assert post(app, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_conflict_publishes_the_retention_policy(make_app: Callable[..., Flask]) -> None:
    """A 409's problem details state how long answers and tombstones are kept, in seconds."""
    app = make_app(IDEM_KEY_TTL=7200, IDEM_TOMBSTONE_TTL=DAY)
    key = uuid.uuid4()
    entered, release = threading.Event(), threading.Event()
    app.config.update(ENTERED=entered, RELEASE=release)
    thread = threading.Thread(target=post, args=(app, "/notes/block", key))
    thread.start()
    try:
        assert entered.wait(10)
        conflict = post(app, "/notes/block", key)
    finally:
        release.set()
        thread.join(15)
    assert conflict.status_code == 409
    assert conflict.json["retention"] == {"response_seconds": 7200.0, "tombstone_seconds": float(DAY)}


# Partitions dropped whole, compact tombstones.


@pytest.fixture
def own_keys(database_url: str, direct_database_url: str) -> Iterator[str]:
    """A key table of its own, with partitions of ``INTERVAL`` made ahead for every key the tests write;
    dropped afterwards. Its first partition ends as it is made: ``horizon`` 0."""
    drop(direct_database_url, OWN)
    _migrate.upgrade(direct_database_url, table=OWN, distributed=citus.ENABLED, horizon=0)
    _partitions.maintain(
        direct_database_url,
        table=OWN,
        interval=INTERVAL,
        horizon=LONG_TTL + AHEAD,
        tombstone_ttl=TOMBSTONE_TTL,
    )
    yield OWN
    drop(direct_database_url, OWN)


@pytest.fixture
def make_own_app(make_app: Callable[..., Flask], own_keys: str) -> Callable[..., Flask]:
    """The notes app on the key table of its own, with the partition settings of this module."""

    def make(**config: Any) -> Flask:
        settings = {
            "IDEM_TABLE": own_keys,
            "IDEM_KEY_TTL": KEY_TTL,
            "IDEM_TOMBSTONE_TTL": TOMBSTONE_TTL,
            "IDEM_PARTITION_INTERVAL": INTERVAL,
            "IDEM_PARTITION_AHEAD": AHEAD,
        }
        return make_app(**{**settings, **config})

    return make


def maintain(app: Flask, at: datetime) -> _partitions.RetentionReport:
    """What ``flask idem purge`` runs for ``app`` (as :func:`flask_idem.cli.purge` calls it,
    on the application's URL), with the clock at ``at``."""
    state = get_state(app)
    settings = state.settings
    with app.app_context():
        state.check_layout()
    return _partitions.maintain(
        settings.database_url,
        table=settings.table,
        interval=settings.partition_interval,
        horizon=state.horizon(),
        tombstone_ttl=settings.tombstone_ttl,
        lock_timeout=settings.migration_lock_timeout,
        connect_options=settings.connect_options,
        now=lambda: at,
    )


def holder(db: psycopg.Connection[Any], key: uuid.UUID) -> _partitions.Partition:
    """The partition of the key table holding ``key``'s row."""
    [(expires_at,)] = query(db, "SELECT expires_at FROM {} WHERE idem_key = %s", OWN, key)
    return holding(db, OWN, expires_at)


def retired(*parts: _partitions.Partition) -> datetime:
    """The first moment at which ``maintain`` retires every one of ``parts``: its grace after they end."""
    uppers = [part.upper for part in parts]
    assert None not in uppers
    return max(u for u in uppers if u is not None) + timedelta(seconds=min(INTERVAL, _partitions.MAX_GRACE))


def names(db: psycopg.Connection[Any], parent: str) -> set[str]:
    return {part.name for part in _partitions.partitions(db, parent)}


def test_dropped_partition_answers_from_its_compact_tombstones(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """Once the partition holding the keys is dropped, a retry is 303 to the first answer's Location,
    or 410 when it had none, from the compact tombstones, and nothing runs again."""
    app = make_own_app()
    located, bare = uuid.uuid4(), uuid.uuid4()
    first = post(app, "/notes", located, {"body": "a"})
    assert first.status_code == 201
    assert post(app, "/notes/replayable", bare, {"body": "b"}).status_code == 201
    parts = {holder(db, located), holder(db, bare)}

    report = maintain(app, retired(*parts))
    assert {part.name for part in parts} <= set(report.dropped)
    assert not {part.name for part in parts} & names(db, OWN)
    assert report.tombstoned == 2
    assert query(db, "SELECT count(*) FROM {}", OWN) == [(0,)]

    late = post(app, "/notes", located, {"body": "a"})
    assert (late.status_code, late.headers["Location"]) == (303, first.headers["Location"])
    gone = post(app, "/notes/replayable", bare, {"body": "b"})
    assert gone.status_code == 410
    assert gone.content_type == PROBLEM_JSON
    assert gone.json["type"] == "urn:flask-idem:problem:key-expired"
    assert count(db, "notes") == 2


def test_changed_request_on_a_compact_tombstone_is_refused(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A different request with a key whose partition was dropped is 422, and writes nothing."""
    app = make_own_app()
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    assert maintain(app, retired(holder(db, key))).tombstoned == 1
    changed = post(app, "/notes", key, {"body": "b"})
    assert changed.status_code == 422
    assert changed.content_type == PROBLEM_JSON
    assert changed.json["retention"] == {"response_seconds": KEY_TTL, "tombstone_seconds": TOMBSTONE_TTL}
    assert count(db, "notes") == 1


def entry_bytes(db: psycopg.Connection[Any], relation: str) -> int:
    """The bytes the index entries of ``relation``'s one live row take: each entry's length and its line
    pointer, in every index of ``relation`` that has one (read from the index's only leaf page)."""
    db.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
    indexes = db.execute(
        "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass"
        " AND pg_relation_size(indexrelid) > current_setting('block_size')::int",
        (relation,),
    ).fetchall()
    total = 0
    for (index,) in indexes:
        # Every entry of one key has the same length: a row updated in place leaves one per version.
        [(length,)] = db.execute("SELECT DISTINCT itemlen FROM bt_page_items(%s, 1)", (index,)).fetchall()
        total += length + 4
    return total


def test_compact_tombstone_keeps_status_and_location_only(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """The compact tombstone holds the fingerprint, status and Location, no body and no other header,
    and takes under a third of the room of the row it replaces (under half, index entries included)."""
    app = make_own_app()
    key = uuid.uuid4()
    first = post(app, "/notes", key, {"body": "a"})
    assert first.status_code == 201
    part = holder(db, key)
    [(row, response, sha, expires_at)] = query(
        db, "SELECT pg_column_size(k.*), response, request_sha, expires_at FROM {} AS k", OWN
    )
    assert response["body"] is not None  # what the tombstone leaves behind
    full = row + entry_bytes(db, part.name)

    assert maintain(app, retired(part)).tombstoned == 1
    tombstones = f"{OWN}_tombstones"
    with db.cursor(row_factory=psycopg.rows.dict_row) as cursor:
        [stone] = cursor.execute(
            sql.SQL("SELECT t.*, pg_column_size(t.*) AS size FROM {} AS t").format(identifier(tombstones))
        ).fetchall()
    size, partition = stone.pop("size"), holding(db, tombstones, stone["expires_at"]).name
    assert stone == {
        "expires_at": expires_at + timedelta(seconds=TOMBSTONE_TTL),
        "org_id": 1,
        "idem_key": key,
        "status": 201,
        "request_sha": sha,
        "location": first.headers["Location"],
    }
    compact = size + entry_bytes(db, partition)
    print(
        f"bytes per key: the full row {row} + index entries {full - row} = {full};"
        f" its compact tombstone {size} + index entry {compact - size} = {compact}"
        f" ({compact / full:.2f} x; the rows alone {size / row:.2f} x)"
    )
    # Measured on this route's small answer (a two-member body, three headers): the tombstone's row is
    # under a third of the full row; with each one's index entries it is under 0.4 of it. The shop's
    # answer (docs/retention.rst, bench/README.md) brings the whole under a third.
    assert size * 3 <= row
    assert compact * 10 <= full * 4


def test_zero_tombstone_period_writes_none(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """IDEM_TOMBSTONE_TTL = 0: the dropped partition leaves no tombstone, and the key is new again."""
    app = make_own_app(IDEM_TOMBSTONE_TTL=0)
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    part = holder(db, key)
    report = maintain(app, retired(part))
    assert part.name in report.dropped
    assert report.tombstoned == 0
    assert query(db, "SELECT count(*) FROM {}", f"{OWN}_tombstones") == [(0,)]
    later = make_own_app(IDEM_TOMBSTONE_TTL=0, IDEM_KEY_TTL=LONG_TTL)
    assert post(later, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_tombstone_partitions_past_their_range_are_dropped(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """Retention, then the compact tombstone, then neither: 201, 303 once the key's partition is
    dropped, and a new key once the tombstone's partition is dropped too."""
    app = make_own_app()
    key = uuid.uuid4()
    first = post(app, "/notes", key, {"body": "a"})
    assert first.status_code == 201
    assert maintain(app, retired(holder(db, key))).tombstoned == 1
    assert post(app, "/notes", key, {"body": "a"}).headers["Location"] == first.headers["Location"]

    tombstones = f"{OWN}_tombstones"
    [(until,)] = query(db, "SELECT expires_at FROM {}", tombstones)
    stone_part = holding(db, tombstones, until)
    partition = stone_part.name
    assert stone_part.upper is not None
    inside = maintain(app, until - timedelta(seconds=1))  # still inside the tombstone's period
    assert partition not in inside.dropped
    assert post(app, "/notes", key, {"body": "a"}).status_code == 303

    report = maintain(app, stone_part.upper)
    assert partition in report.dropped
    assert partition not in names(db, tombstones)
    # The key is new again (notes' bodies are unique, hence "b"); written now, it expires after the
    # fake clock's partitions, in one that is live.
    later = make_own_app(IDEM_KEY_TTL=LONG_TTL)
    assert post(later, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_partition_retired_past_the_tombstone_period_leaves_none(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A partition retired only once its keys' tombstone period too has passed, by the clock that
    retires it, writes no tombstone: the key is new again."""
    app = make_own_app()
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    part = holder(db, key)
    [(expires_at,)] = query(db, "SELECT expires_at FROM {}", OWN)
    at = expires_at + timedelta(seconds=TOMBSTONE_TTL)
    assert at >= retired(part)
    report = maintain(app, at)
    assert part.name in report.dropped
    assert report.tombstoned == 0
    assert query(db, "SELECT count(*) FROM {}", f"{OWN}_tombstones") == [(0,)]
    later = make_own_app(IDEM_KEY_TTL=LONG_TTL)
    assert post(later, "/notes", key, {"body": "b"}).status_code == 201
    assert count(db, "notes") == 2


def test_flagged_row_moves_ahead_of_the_clock(
    make_own_app: Callable[..., Flask], db: psycopg.Connection[Any]
) -> None:
    """A row flagged for a person leaves its retired partition for one live by the clock that retired
    it, in one move, and keeps its response."""
    app = make_own_app()
    key = uuid.uuid4()
    assert post(app, "/notes", key, {"body": "a"}).status_code == 201
    query(db, "UPDATE {} SET needs_attention = true RETURNING 1", OWN)
    part = holder(db, key)
    at = retired(part)
    report = maintain(app, at)
    assert part.name in report.dropped
    assert (report.moved, report.tombstoned) == (1, 0)
    [(expires_at, flagged, response)] = query(db, "SELECT expires_at, needs_attention, response FROM {}", OWN)
    assert flagged and response["status"] == 201
    assert expires_at >= at + timedelta(seconds=2 * INTERVAL)
    assert holder(db, key).name in names(db, OWN)
