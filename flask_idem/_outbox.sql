-- Every statement flask-idem runs on the outbox of background jobs, for a reviewer to read as SQL.
--
-- Loaded as _store.sql is (flask_idem/_sqlfile.py): each block starts with "-- name: <name>", comments
-- are dropped, {outbox} is the outbox table (the key table's name with "_outbox" appended, in its schema),
-- fragments are filled in by name, and a block whose name ends with "citus" replaces its namesake on a
-- Citus distributed table (IDEM_DISTRIBUTED), where FOR UPDATE cannot span shards.

-- name: fragment due
-- A message not sent yet, that no live claim holds.
o.sent_at IS NULL AND (o.claimed_until IS NULL OR o.claimed_until <= now())

-- name: fragment due_rows
-- The claim's candidates: the oldest due messages.
SELECT o.org_id, o.id FROM {outbox} AS o WHERE {due} ORDER BY o.created_at LIMIT %(limit)s

-- name: fragment due_rows citus
-- One organisation's candidates at a time (claim_candidates found them): a router statement on its shard.
SELECT o.org_id, o.id FROM {outbox} AS o
WHERE o.org_id = %(org)s AND o.id = ANY(%(ids)s::uuid[]) AND {due}

-- name: fragment one_org
true

-- name: fragment one_org citus
t.org_id = %(org)s

-- name: fragment mine
-- The guard of a relay's writes to the messages it claimed: its token.
org_id = %(org_id)s AND id = %(id)s AND claim_token = %(token)s

-- name: write
-- One message, in the caller's transaction: it exists exactly when the request's writes and key commit.
INSERT INTO {outbox} (org_id, id, task, idem_key, args, kwargs)
VALUES (%(org_id)s, %(id)s, %(task)s, %(key)s, %(args)s, %(kwargs)s)

-- name: claim_candidates
-- On Citus, the due messages read without locks first, then claimed organisation by organisation.
SELECT o.org_id, o.id FROM {outbox} AS o WHERE {due} ORDER BY o.created_at LIMIT %(limit)s

-- name: claim
-- Due rows locked with SKIP LOCKED in a subquery, each given the claimer's token and a lease from the
-- database's clock.
UPDATE {outbox} AS t SET claim_token = %(token)s,
    claimed_until = now() + make_interval(secs => %(lease)s), attempts = t.attempts + 1
FROM ({due_rows} FOR UPDATE SKIP LOCKED) AS due
WHERE {one_org} AND t.org_id = due.org_id AND t.id = due.id
RETURNING t.org_id, t.id, t.task, t.idem_key AS key, t.args, t.kwargs, t.created_at

-- name: mark_sent
UPDATE {outbox} SET sent_at = now(), claim_token = NULL, claimed_until = NULL,
    last_error = NULL WHERE {mine}

-- name: release
-- A failed publish: the message may be claimed again in %(retry_in)s seconds.
UPDATE {outbox} SET claim_token = NULL, last_error = %(error)s,
    claimed_until = now() + make_interval(secs => %(retry_in)s) WHERE {mine}

-- name: purge
DELETE FROM {outbox} WHERE sent_at IS NOT NULL
  AND sent_at <= now() - make_interval(secs => %(older_than)s)

-- name: state
-- Unsent messages at a glance: one statement over the partial index of unsent messages.
SELECT count(*) AS unsent,
    coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest
FROM {outbox} WHERE sent_at IS NULL
