"""The key protocol on its own (:mod:`flask_idem._protocol`, :mod:`flask_idem._steps`), door-free.

No view and no job runner: the tests call the protocol with claims and callables of their own, on a real
PostgreSQL, and look at what it answers and at what the key table and the ``notes`` table (the work's
own writes) hold afterwards. The races the doors share are tested here, once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idem import _protocol, signals
from flask_idem._protocol import (
    Claim,
    InFlight,
    LeaseLost,
    Mismatch,
    Pending,
    Replay,
    Tombstone,
    atomic,
    begin,
    classify,
    give_up,
    give_up_leased,
    release,
)
from flask_idem._records import Final, KeyedRequest, KeyRecord, Lease
from flask_idem._state import IdemState, get_state
from flask_idem._steps import advance
from flask_idem.errors import ConfigurationError
from flask_idem.flow import Flow, OutcomeUnknown, Run

from .support import pgbouncer
from .support.helpers import age, count

ORG = 7
SHA = b"\x01" * 32
OTHER = b"\x02" * 32
OLD = b"\x03" * 32
DAY = 24 * 3600
#: The answer of a run given up on, as a door would store it.
GAVE_UP = {"status": 503, "headers": [], "body": '{"error": "gave up"}'}


def claim(key: uuid.UUID, sha: bytes = SHA, **extra: Any) -> Claim:
    """A claim on ``key`` for the work fingerprinted ``sha``."""
    return Claim(KeyedRequest(ORG, key, sha, "POST", "/things"), ttl=3600.0, **extra)


def lease(key: uuid.UUID) -> Lease:
    """A fresh lease on ``key`` (a new token: another worker's)."""
    return Lease(ORG, key, uuid.uuid4(), 30.0)


def document(status: int = 201, body: Any = None, location: str | None = None) -> dict[str, Any]:
    """A stored answer in the key table's form."""
    headers = [["Content-Type", "application/json"]]
    if location is not None:
        headers.append(["Location", location])
    return {"status": status, "headers": headers, "body": json.dumps(body)}


def note(conn: psycopg.Connection[Any], body: str) -> None:
    """One row of the work's own, in the transaction open on ``conn``."""
    conn.execute("INSERT INTO notes (org_id, body) VALUES (%s, %s)", (ORG, body))


def notes_of(db: psycopg.Connection[Any], key: uuid.UUID) -> int:
    """Committed rows the work of ``key`` wrote."""
    row = db.execute("SELECT count(*) FROM notes WHERE body LIKE %s", (f"{key}%",)).fetchone()
    assert row is not None
    return int(row[0])


def never(*args: Any) -> Any:
    """Work that must not run (the key is taken, or the run ended before it)."""
    raise AssertionError("the work ran although the key was taken")


def key_row(db: psycopg.Connection[Any], key: uuid.UUID) -> dict[str, Any]:
    """The key's row, with whether its lease is live."""
    cur = db.cursor(row_factory=psycopg.rows.dict_row)
    row = cur.execute(
        "SELECT status, step, response, lease_token, coalesce(lease_expires_at > now(), false) AS live,"
        " next_attempt_at > now() AS backing_off, attempts, last_error, needs_attention"
        " FROM idempotency_keys WHERE org_id = %s AND idem_key = %s",
        (ORG, key),
    ).fetchone()
    assert row is not None
    return row


def strand(db: psycopg.Connection[Any], key: uuid.UUID) -> None:
    """Let the lease on ``key`` lapse, as if its worker had died."""
    db.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
        " WHERE org_id = %s AND idem_key = %s",
        (ORG, key),
    )


def hammer(app: Flask, n: int, call: Callable[[], Any]) -> list[Any]:
    """``call`` from ``n`` threads released at once; what each answered, none of them an exception."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def attempt(i: int) -> None:
        with app.app_context():
            barrier.wait(10)
            try:
                results[i] = call()
            except BaseException as e:  # reported below, with the others
                results[i] = e

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results


@pytest.fixture
def notes_app(make_app: Callable[..., Flask]) -> Iterator[Flask]:
    """A test application whose state the protocol runs on, with its context pushed (for signals)."""
    app = make_app(IDEM_POOL_MAX_SIZE=20, IDEM_TOMBSTONE_TTL=30 * DAY)
    with app.app_context():
        yield app


@pytest.fixture
def state(notes_app: Flask) -> IdemState:
    """The application's protocol state."""
    return get_state(notes_app)


# -- classify -----------------------------------------------------------------------------------------


DOC = document(201, {"id": 1})
#: A claim for the classify table (a key of its own: a claim is a value, and no row is read).
CLAIM = claim(uuid.UUID(int=1))


def record(
    sha: bytes = SHA, status: str = "completed", response: dict[str, Any] | None = DOC, stale: bool = False
) -> KeyRecord:
    """A committed key row."""
    return KeyRecord(sha, status, response, expired=False, stale=stale)


def earlier(sha: bytes) -> bool:
    """An earlier fingerprint policy's: ``OLD`` was this work's fingerprint."""
    return sha == OLD


@pytest.mark.parametrize(
    ("found", "claimed", "expected"),
    [
        (None, CLAIM, InFlight()),
        (record(OTHER), CLAIM, Mismatch(record(OTHER))),
        (record(OTHER), claim(CLAIM.request.key, replay_mismatch=True), Replay(DOC, mismatched=True)),
        (record(OTHER, "processing", None), claim(CLAIM.request.key, replay_mismatch=True), InFlight()),
        (record(status="processing", response=None), CLAIM, InFlight()),
        (
            record(response={**DOC, "headers": [["Location", "/things/1"]]}, stale=True),
            CLAIM,
            Tombstone("/things/1"),
        ),
        (record(response={**DOC, "headers": [["location", "/x"]]}, stale=True), CLAIM, Tombstone("/x")),
        (
            record(response={"tombstone": True, "status": 200, "headers": []}, stale=True),
            CLAIM,
            Tombstone(None),
        ),
        (record(status="failed"), CLAIM, Replay(DOC, failed=True)),
        (record(), CLAIM, Replay(DOC)),
        (record(OLD), claim(CLAIM.request.key, earlier=earlier), Replay(DOC)),
        (record(OTHER), claim(CLAIM.request.key, earlier=earlier), Mismatch(record(OTHER))),
    ],
    ids=[
        "uncommitted",
        "other-work",
        "other-work-replayed",
        "other-work-replayed-in-flight",
        "processing",
        "tombstone-location",
        "tombstone-location-any-case",
        "tombstone-gone",
        "failed",
        "completed",
        "earlier-fingerprint",
        "earlier-rejects",
    ],
)
def test_classify(found: KeyRecord | None, claimed: Claim, expected: _protocol.Existing) -> None:
    """What a key already taken holds sorts into one outcome."""
    assert classify(found, claimed) == expected


@pytest.mark.parametrize("location", ["/things/1", None], ids=["location", "none"])
def test_an_expired_answer_leaves_a_tombstone(
    notes_app: Flask, state: IdemState, db: psycopg.Connection[Any], location: str | None
) -> None:
    """Past its retention a key's stored answer is a tombstone, which keeps where the result is: the work
    never runs again, and its signal reports the status the door names (the protocol has none)."""
    key = uuid.uuid4()
    assert isinstance(
        atomic(state, claim(key), lambda conn: Final(None, document(201, {}, location), 201)), Final
    )
    age(db, "1 hour 1 second")
    heard: list[dict[str, Any]] = []

    def hear(sender: Flask, **data: Any) -> None:
        heard.append(data)

    told = {"/things/1": 1, None: 2}
    with signals.tombstone_hit.connected_to(hear, notes_app):
        found = atomic(state, claim(key, reported=lambda o: told[getattr(o, "location", "")]), never)
        assert atomic(state, claim(key), never) == found
    assert found == Tombstone(location)
    assert [d["status"] for d in heard] == [told[location], None]


# -- atomic -------------------------------------------------------------------------------------------


REPEATABLE_READ = {"options": "-c default_transaction_isolation=repeatable\\ read"}


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_atomic_race_runs_the_work_once(
    make_app: Callable[..., Flask], db: psycopg.Connection[Any], isolation: str
) -> None:
    """Sixteen attempts at one key at once: one Final, the others in flight or replayed, one row written.
    On the partitioned key table REPEATABLE READ is refused instead, before the work runs."""
    if isolation == "repeatable read" and pgbouncer.ENABLED:
        pytest.skip("PgBouncer ignores the startup option that sets the isolation level")
    options = REPEATABLE_READ if isolation == "repeatable read" else {}
    app = make_app(IDEM_POOL_MAX_SIZE=20, IDEM_CONNECT_OPTIONS=options)
    state = get_state(app)
    if isolation == "repeatable read":
        # On the partitioned key table the unique index of one partition cannot refuse a key
        # committed meanwhile in another: a transaction that keeps one snapshot is refused, naming why.
        with app.app_context(), pytest.raises(ConfigurationError, match="READ COMMITTED"):
            atomic(state, claim(uuid.uuid4()), never)
        assert count(db, "idempotency_keys") == 0
        return
    for _ in range(4):
        key = uuid.uuid4()
        ran: list[str] = []

        def work(conn: psycopg.Connection[Any], key: uuid.UUID = key, ran: list[str] = ran) -> Final[str]:
            level = conn.execute("SHOW transaction_isolation").fetchone()
            assert level == (isolation,)
            body = f"{key}:{uuid.uuid4()}"
            ran.append(body)
            note(conn, body)
            time.sleep(0.05)  # the others arrive while the key is held
            return Final(body, document(201, body), 201)

        outcomes = hammer(app, 16, partial(atomic, state, claim(key), work))
        finals = [o for o in outcomes if isinstance(o, Final)]
        assert len(finals) == 1, outcomes
        stored = finals[0].document
        assert stored is not None
        others = [o for o in outcomes if not isinstance(o, Final)]
        assert all(o == InFlight() or o == Replay(stored) for o in others), outcomes
        if isolation == "read committed":
            assert ran == [finals[0].value]
        assert notes_of(db, key) == 1
        with app.app_context():
            assert atomic(state, claim(key), never) == Replay(stored)
    assert count(db, "idempotency_keys") == 4


@pytest.mark.parametrize("ending", ["failed", "raises"])
def test_atomic_work_that_fails_leaves_nothing(
    state: IdemState, db: psycopg.Connection[Any], ending: str
) -> None:
    """Work that answers a failed Final or raises commits nothing, and the key can be used again."""
    key = uuid.uuid4()

    def work(conn: psycopg.Connection[Any]) -> Final[str]:
        note(conn, f"{key}:first")
        if ending == "raises":
            raise RuntimeError("the work broke")
        return Final("broke", None, 500, failed=True)

    if ending == "raises":
        with pytest.raises(RuntimeError, match="the work broke"):
            atomic(state, claim(key), work)
    else:
        assert atomic(state, claim(key), work) == Final("broke", None, 500, failed=True)
    assert (count(db, "idempotency_keys"), notes_of(db, key)) == (0, 0)

    def again(conn: psycopg.Connection[Any]) -> Final[str]:
        note(conn, f"{key}:again")
        return Final("done", document(201, "done"), 201)

    assert atomic(state, claim(key), again) == Final("done", document(201, "done"), 201)
    assert notes_of(db, key) == 1
    assert key_row(db, key)["response"] == document(201, "done")


def test_a_unique_violation_of_the_work_propagates(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A unique violation on the work's own table is the work's error, not the key's: it propagates."""
    key = uuid.uuid4()

    def work(conn: psycopg.Connection[Any]) -> Final[str]:
        note(conn, f"{key}:twice")
        note(conn, f"{key}:twice")
        return Final("never", document(), 201)

    with pytest.raises(psycopg.errors.UniqueViolation):
        atomic(state, claim(key), work)
    assert (count(db, "idempotency_keys"), notes_of(db, key)) == (0, 0)


# -- multi-step: begin, take over, give up, release ---------------------------------------------------


class Refused(Exception):
    """A database step's refusal, which the test door answers with (a request's 4xx)."""


class NoteDoor:
    """A door of the test's own: the finisher's value is stored as a JSON body, a :class:`Refused` as 409."""

    def finish(self, call: Callable[[], Any]) -> Final[Any]:
        value = call()
        if value == "fail":
            return Final(value, None, 500, failed=True)
        return Final(value, document(200, value), 200)

    def refused(self, error: Exception) -> Final[Any] | None:
        if isinstance(error, Refused):
            return Final(str(error), document(409, str(error)), 409)
        return None

    def failure(self, final: Final[Any]) -> str:
        return f"note {final.value}ed"


DOOR = NoteDoor()


def tiny_flow(
    post: Callable[[Run], Any] = lambda run: {"posted": run.intent["amount"]},
    prepare: Callable[[Run], Any] | None = None,
    finish: Callable[[Run], Any] | None = None,
    confirm: Callable[[Run], Any] | None = None,
) -> Flow:
    """prepare (a database step writing a note), post (a call step), with ``confirm`` a second call step,
    and done (the finisher)."""
    flow = Flow("protocol.tiny")

    @flow.step
    def prepare_step(run: Run) -> Any:
        note(run.connection, f"{run.key}:prepare:{uuid.uuid4()}")
        return prepare(run) if prepare is not None else {"prepared": True}

    @flow.call
    def post_step(run: Run) -> Any:
        return post(run)

    if confirm is not None:

        @flow.call
        def confirm_step(run: Run) -> Any:
            return confirm(run)

    @flow.finish
    def done(run: Run) -> Any:
        if finish is not None:
            return finish(run)
        return {"done": run.results["post_step"]}

    return flow


def intent(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The intent every run of the tests begins with."""
    return {"amount": 5}


def started(state: IdemState, flow: Flow, key: uuid.UUID) -> tuple[Run, Lease]:
    """A run of ``flow`` on ``key`` begun under a fresh lease, its intent recorded."""
    held = lease(key)
    run: Any = begin(state, claim(key), flow, held, intent)
    assert isinstance(run, Run) and not run.resumed
    return run, held


def test_begin_race_on_a_stranded_run_has_one_winner(
    notes_app: Flask, state: IdemState, db: psycopg.Connection[Any]
) -> None:
    """Sixteen attempts at a stranded run: one takes it over and resumes it, the others are in flight."""
    flow = tiny_flow()
    for _ in range(3):
        key = uuid.uuid4()
        started(state, flow, key)
        strand(db, key)

        def attempt(key: uuid.UUID = key) -> tuple[Lease, Any]:
            mine = lease(key)
            return mine, begin(state, claim(key), flow, mine, never)

        outcomes = hammer(notes_app, 16, attempt)
        runs = [(held, o) for held, o in outcomes if isinstance(o, Run)]
        assert len(runs) == 1, outcomes
        winner, run = runs[0]
        assert (run.resumed, run.last_step, run.results) == (True, "intent", {"intent": {"amount": 5}})
        assert all(o == InFlight() for _, o in outcomes if not isinstance(o, Run)), outcomes
        row = key_row(db, key)
        assert (row["lease_token"], row["live"], row["attempts"]) == (winner.token, True, 1)


@pytest.mark.parametrize(
    ("claimed", "flow_name", "taken"),
    [
        (lambda key: claim(key, OTHER), "protocol.tiny", "mismatch"),
        (lambda key: claim(key), "protocol.other", "in-flight"),
        (lambda key: claim(key, OTHER, earlier=lambda sha: sha == SHA), "protocol.tiny", "taken"),
    ],
    ids=["other-fingerprint", "other-flow", "earlier-fingerprint"],
)
def test_only_the_same_work_takes_a_stranded_run_over(
    state: IdemState,
    db: psycopg.Connection[Any],
    claimed: Callable[[uuid.UUID], Claim],
    flow_name: str,
    taken: str,
) -> None:
    """A stranded run is taken over only by the same work of the same flow."""
    key = uuid.uuid4()
    _, first = started(state, tiny_flow(), key)
    strand(db, key)
    flow = tiny_flow()
    flow.name = flow_name
    outcome = begin(state, claimed(key), flow, lease(key), never)
    row = key_row(db, key)
    if taken == "taken":
        assert isinstance(outcome, Run) and outcome.resumed
        assert row["live"] and row["lease_token"] != first.token
        return
    assert isinstance(outcome, Mismatch if taken == "mismatch" else InFlight), outcome
    assert (row["lease_token"], row["live"], row["attempts"]) == (first.token, False, 0)


def test_begin_on_a_live_run_is_in_flight(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A run whose lease is live is not taken over: a second begin is in flight and writes nothing."""
    key = uuid.uuid4()
    _, first = started(state, tiny_flow(), key)
    assert begin(state, claim(key), tiny_flow(), lease(key), never) == InFlight()
    assert key_row(db, key)["lease_token"] == first.token


def test_begin_that_ends_at_once_stores_its_final(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A start that answers a Final instead of an intent completes the key with it; a failed one leaves
    nothing."""
    key = uuid.uuid4()
    failed = Final("no", None, 400, failed=True)
    assert begin(state, claim(key), tiny_flow(), lease(key), lambda conn: failed) == failed
    assert count(db, "idempotency_keys") == 0
    refused = document(422, "refused")
    answer = Final("refused", refused, 422)
    assert begin(state, claim(key), tiny_flow(), lease(key), lambda conn: answer) == answer
    assert begin(state, claim(key), tiny_flow(), lease(key), never) == Replay(refused)


def test_give_up_while_the_run_is_held_writes_nothing(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """Giving up on a run another worker holds live answers in flight and leaves its row alone."""
    key = uuid.uuid4()
    _, first = started(state, tiny_flow(), key)
    assert give_up(state, claim(key), "protocol.tiny", lease(key), GAVE_UP, "too late") == InFlight()
    row = key_row(db, key)
    assert (row["status"], row["needs_attention"], row["lease_token"]) == ("processing", False, first.token)


def test_give_up_while_an_atomic_attempt_runs_writes_nothing(
    state: IdemState, db: psycopg.Connection[Any]
) -> None:
    """Giving up on a key an atomic attempt holds uncommitted answers in flight; the attempt commits."""
    key = uuid.uuid4()
    seen: list[Any] = []

    def work(conn: psycopg.Connection[Any]) -> Final[str]:
        seen.append(give_up(state, claim(key), "protocol.tiny", lease(key), GAVE_UP, "too late"))
        return Final("done", document(201, "done"), 201)

    assert isinstance(atomic(state, claim(key), work), Final)
    assert seen == [InFlight()]
    row = key_row(db, key)
    assert (row["status"], row["needs_attention"], row["response"]) == (
        "completed",
        False,
        document(201, "done"),
    )


def test_give_up_on_a_stranded_run_fails_and_flags_it(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A stranded run given up on is failed and flagged for a person; later attempts replay the failure."""
    key = uuid.uuid4()
    started(state, tiny_flow(), key)
    strand(db, key)
    assert give_up(state, claim(key), "protocol.tiny", lease(key), GAVE_UP, "too late") is True
    row = key_row(db, key)
    assert (row["status"], row["needs_attention"], row["last_error"], row["response"]) == (
        "failed",
        True,
        "too late",
        GAVE_UP,
    )
    assert atomic(state, claim(key), never) == Replay(GAVE_UP, failed=True)
    assert begin(state, claim(key), tiny_flow(), lease(key), never) == Replay(GAVE_UP, failed=True)


def test_give_up_on_a_key_without_a_row_fails_and_flags_it(
    state: IdemState, db: psycopg.Connection[Any]
) -> None:
    """An atomic run's attempts leave no row: giving up reserves the key and fails it at once."""
    key = uuid.uuid4()
    assert give_up(state, claim(key), "protocol.tiny", lease(key), GAVE_UP, "too many attempts") is True
    row = key_row(db, key)
    assert (row["status"], row["needs_attention"], row["live"]) == ("failed", True, False)
    assert atomic(state, claim(key), never) == Replay(GAVE_UP, failed=True)


def test_give_up_on_a_finished_key_replays_it(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """Giving up on a key whose work finished meanwhile writes nothing and answers its replay."""
    key = uuid.uuid4()
    atomic(state, claim(key), lambda conn: Final("done", DOC, 201))
    assert give_up(state, claim(key), "protocol.tiny", lease(key), GAVE_UP, "late") == Replay(DOC)
    assert (key_row(db, key)["status"], key_row(db, key)["needs_attention"]) == ("completed", False)


def test_give_up_leased_only_with_the_lease(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """The holder of a run's lease can fail it; a worker whose lease was lost cannot."""
    key = uuid.uuid4()
    _, first = started(state, tiny_flow(), key)
    strand(db, key)
    second = lease(key)
    assert isinstance(begin(state, claim(key), tiny_flow(), second, never), Run)
    assert give_up_leased(state, first, GAVE_UP, "lost") is False
    assert key_row(db, key)["status"] == "processing"
    assert give_up_leased(state, second, GAVE_UP, "held") is True
    row = key_row(db, key)
    assert (row["status"], row["needs_attention"], row["last_error"]) == ("failed", True, "held")


def test_release_lets_a_retry_take_over_at_once(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A released lease lapses at once (a retry takes the run over) and holds off the recovery job."""
    key = uuid.uuid4()
    _, first = started(state, tiny_flow(), key)
    release(state, lease(key), "not mine", retry_in=60)  # another token: nothing happens
    assert key_row(db, key)["live"]
    release(state, first, "broke", retry_in=60)
    row = key_row(db, key)
    assert (row["live"], row["backing_off"], row["last_error"]) == (False, True, "broke")
    run = begin(state, claim(key), tiny_flow(), lease(key), never)
    assert isinstance(run, Run) and run.resumed


# -- advancing a run (_steps) -------------------------------------------------------------------------


def test_a_run_finishing_stores_the_doors_answer(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """Advancing a run runs every step once and completes the key with what the door made of the finish."""
    key = uuid.uuid4()
    flow = tiny_flow()
    run, held = started(state, flow, key)
    final = advance(state, flow, run, held, DOOR, retry_in=1.0)
    stored = document(200, {"done": {"posted": 5}})
    assert final == Final({"done": {"posted": 5}}, stored, 200)
    row = key_row(db, key)
    assert (row["status"], row["step"], row["response"], row["lease_token"]) == (
        "completed",
        "post_step",
        final.document,
        None,
    )
    assert notes_of(db, key) == 1
    assert begin(state, claim(key), flow, lease(key), never) == Replay(stored)


def test_a_lost_lease_stops_the_run(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A worker whose run was taken over during its call step records nothing more and calls nothing
    more: LeaseLost; the worker that took it over finishes it."""
    key = uuid.uuid4()
    taken: list[Run] = []
    second = lease(key)
    confirmed: list[uuid.UUID] = []

    def post(run: Run) -> Any:
        if not taken:  # while this worker is outside, another takes its run over
            strand(db, key)
            resumed = begin(state, claim(key), flow, second, never)
            assert isinstance(resumed, Run)
            taken.append(resumed)
        return {"posted": run.intent["amount"]}

    def confirm(run: Run) -> Any:
        confirmed.append(run.key)
        return {"confirmed": True}

    flow = tiny_flow(post, confirm=confirm)
    run, first = started(state, flow, key)
    with pytest.raises(LeaseLost):
        advance(state, flow, run, first, DOOR, retry_in=1.0)
    assert confirmed == []
    row = key_row(db, key)
    assert (row["status"], row["step"], row["lease_token"]) == ("processing", "prepare_step", second.token)
    assert advance(state, flow, taken[0], second, DOOR, retry_in=1.0).document == document(
        200, {"done": {"posted": 5}}
    )
    assert confirmed == [key]
    assert key_row(db, key)["status"] == "completed"


def test_a_lost_lease_rolls_a_database_step_back(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A database step under a lease lost before it began writes nothing: LeaseLost."""
    key = uuid.uuid4()
    flow = tiny_flow()
    run, first = started(state, flow, key)
    strand(db, key)
    assert isinstance(begin(state, claim(key), flow, lease(key), never), Run)
    with pytest.raises(LeaseLost):
        advance(state, flow, run, first, DOOR, retry_in=1.0)
    assert notes_of(db, key) == 0


def test_an_unknown_outcome_is_pending_and_releases_the_lease(
    state: IdemState, db: psycopg.Connection[Any]
) -> None:
    """A call step raising OutcomeUnknown raises Pending, gives the lease up, and keeps earlier steps."""
    key = uuid.uuid4()

    def post(run: Run) -> Any:
        raise OutcomeUnknown("connection reset")

    flow = tiny_flow(post)
    run, held = started(state, flow, key)
    with pytest.raises(Pending):
        advance(state, flow, run, held, DOOR, retry_in=60.0)
    row = key_row(db, key)
    assert (row["status"], row["step"], row["live"], row["backing_off"], row["last_error"]) == (
        "processing",
        "prepare_step",
        False,
        True,
        "OutcomeUnknown",
    )
    assert notes_of(db, key) == 1
    resumed = begin(state, claim(key), flow, lease(key), never)  # at once: no need to wait for the lease
    assert isinstance(resumed, Run)
    assert (resumed.resumed, resumed.last_step) == (True, "prepare_step")


def test_a_refusal_of_a_database_step_ends_the_run(state: IdemState, db: psycopg.Connection[Any]) -> None:
    """A database step's error the door takes for an answer completes the key with it; no later step runs."""
    key = uuid.uuid4()

    def refuse(run: Run) -> Any:
        raise Refused("no stock")

    flow = tiny_flow(post=never, prepare=refuse)
    run, held = started(state, flow, key)
    final = advance(state, flow, run, held, DOOR, retry_in=1.0)
    assert final == Final("no stock", document(409, "no stock"), 409)
    assert key_row(db, key)["response"] == final.document


@pytest.mark.parametrize("ending", ["step-raises", "finish-fails"])
def test_a_failure_rolls_the_step_back_and_releases_the_lease(
    state: IdemState, db: psycopg.Connection[Any], ending: str
) -> None:
    """A database step raising an error the door does not answer, or a failed finish, rolls that step
    back and releases the lease for a retry."""
    key = uuid.uuid4()

    def broken(run: Run) -> Any:
        raise RuntimeError("broke")

    if ending == "step-raises":
        flow = tiny_flow(prepare=broken)
        run, held = started(state, flow, key)
        with pytest.raises(RuntimeError):
            advance(state, flow, run, held, DOOR, retry_in=60.0)
        expected = ("intent", "RuntimeError", 0)
    else:
        flow = tiny_flow(finish=lambda run: "fail")
        run, held = started(state, flow, key)
        assert advance(state, flow, run, held, DOOR, retry_in=60.0).failed
        expected = ("post_step", "note failed", 1)  # the door's word for it
    row = key_row(db, key)
    assert (row["status"], row["live"]) == ("processing", False)
    assert (row["step"], row["last_error"], notes_of(db, key)) == expected
