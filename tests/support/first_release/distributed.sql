-- The key table on Citus (IDEM_DISTRIBUTED, or `flask idem init-db --distributed`), applied after
-- schema.sql in the same transaction; every statement is safe to run twice. Names come from IDEM_TABLE.

-- Shards by organisation: every statement of a request names its org_id, so Citus routes it to the one
-- node holding that organisation's keys. The application's own tables distributed by org_id with
-- colocate_with => this table keep a request's writes and its key on the same node.
SELECT create_distributed_table({table_name}, 'org_id')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {table_name}::regclass);

-- The reservation as one function that Citus runs on the node holding the key's shard (a delegated,
-- co-located function): its advisory lock, its INSERT and its lookup all happen on that node, in one
-- round trip from the node the application talks to. A statement cannot do this on Citus: an INSERT in
-- a CTE, or an INSERT ... SELECT, is planned in several steps through the coordinator.
--
-- Same answer as the reserve statement of the store: whether this call inserted the row, whether it
-- holds the key's lock, and the committed row of the key when it did not insert it. The lock is taken
-- before the INSERT, so a request never waits on another's uncommitted row: without the lock it does
-- not insert at all. The lock lives on the shard's node, whichever node the request entered through.
CREATE OR REPLACE FUNCTION {reserve}(
    p_org_id bigint, p_key uuid, p_sha bytea, p_method text, p_path text, p_ttl float8, p_lock bigint,
    p_flow text, p_token uuid, p_lease float8, p_tomb float8
) RETURNS TABLE (
    fresh boolean, taken boolean, request_sha bytea, status text, response jsonb, expired boolean,
    stale boolean, lease_live boolean, flow text, step text, state jsonb
) LANGUAGE plpgsql AS $$
DECLARE
    v_taken boolean := pg_try_advisory_xact_lock(p_lock);
BEGIN
    IF v_taken THEN
        INSERT INTO {table} AS k (org_id, idem_key, request_sha, method, path, status, expires_at,
                                  flow, lease_token, lease_expires_at)
        VALUES (p_org_id, p_key, p_sha, p_method, p_path, 'processing',
                now() + make_interval(secs => p_ttl), p_flow, p_token,
                now() + make_interval(secs => p_lease))
        ON CONFLICT (org_id, idem_key) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT true, true, NULL::bytea, NULL::text, NULL::jsonb, NULL::boolean,
                                NULL::boolean, NULL::boolean, NULL::text, NULL::text, NULL::jsonb;
            RETURN;
        END IF;
    END IF;
    -- The columns of the reserve statement (flask_idem.store), as a later request reads them.
    RETURN QUERY
        SELECT false, v_taken, k.request_sha, k.status, k.response, k.status <> 'processing' AND NOT k.needs_attention AND (k.response ? 'tombstone' IS TRUE AND k.expires_at <= now() OR k.response ? 'tombstone' IS NOT TRUE    AND k.expires_at <= now() - make_interval(secs => p_tomb)) AS expired, k.status <> 'processing' AND NOT k.needs_attention AND (k.response ? 'tombstone' OR k.expires_at <= now()) AS stale, coalesce(k.lease_expires_at > now(), false) AS lease_live, k.flow, k.step, k.state
        FROM (SELECT) AS one LEFT JOIN {table} AS k ON k.org_id = p_org_id AND k.idem_key = p_key;
END
$$;

-- force_delegation: delegated inside the request's transaction too, which then continues on that node.
SELECT create_distributed_function(
    {reserve_signature}, 'p_org_id', colocate_with => {table_name}, force_delegation => true
);
