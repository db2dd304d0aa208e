-- ===== The outbox on Citus (IDEM_DISTRIBUTED), applied after outbox.sql, once the key table is ==========
-- distributed; safe to run twice. Sharded by organisation and co-located with the key table, so that a
-- view's message, its key and its writes sit on one node and commit in one node's transaction.
SELECT create_distributed_table({outbox_name}, 'org_id', colocate_with => {table_name})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {outbox_name}::regclass);
-- ===== end of the outbox on Citus ======================================================================
