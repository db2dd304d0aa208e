-- The shop's tables on Citus (IDEM_DISTRIBUTED), applied by init-db after schema.sql and after the key
-- table was distributed; safe to run twice (it does nothing once orders is distributed).
--
-- Orders and payments: distributed by org_id and co-located with the key table, so that a request's
-- key, its order and its payment sit on one node and its transaction touches that node only.
-- Organisations: few rows, read by every request (API keys) and referenced by every table: a reference
-- table, copied to every node.
--
-- The order matters. A local table that references a reference table becomes a "Citus local table" on
-- the coordinator, and one with an identity column cannot be distributed after that; a distributed table
-- cannot reference a local one. So the foreign keys to orgs go, the tables are distributed, orgs becomes
-- a reference table, and the foreign keys come back.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'orders'::regclass) THEN
        RETURN;
    END IF;
    ALTER TABLE fulfilments DROP CONSTRAINT IF EXISTS fulfilments_org_id_fkey;
    ALTER TABLE payments DROP CONSTRAINT IF EXISTS payments_org_id_fkey;
    ALTER TABLE orders DROP CONSTRAINT IF EXISTS orders_org_id_fkey;
    PERFORM create_distributed_table('orders', 'org_id', colocate_with => {key_table});
    PERFORM create_distributed_table('payments', 'org_id', colocate_with => {key_table});
    PERFORM create_distributed_table('fulfilments', 'org_id', colocate_with => {key_table});
    PERFORM create_reference_table('orgs');
    ALTER TABLE orders ADD CONSTRAINT orders_org_id_fkey FOREIGN KEY (org_id) REFERENCES orgs (id);
    ALTER TABLE payments ADD CONSTRAINT payments_org_id_fkey FOREIGN KEY (org_id) REFERENCES orgs (id);
    ALTER TABLE fulfilments ADD CONSTRAINT fulfilments_org_id_fkey FOREIGN KEY (org_id) REFERENCES orgs (id);
END
$$;

-- Receipt links: with their orders, by org_id (they reference orders only, so no foreign key to drop).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'receipt_links'::regclass) THEN
        PERFORM create_distributed_table('receipt_links', 'org_id', colocate_with => {key_table});
    END IF;
END
$$;

-- The gateway's events as applied (example_app/gateway_events.py): with their payments, by org_id.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'payment_events'::regclass) THEN
        PERFORM create_distributed_table('payment_events', 'org_id', colocate_with => {key_table});
    END IF;
END
$$;
