-- The statements that keep the application's privileges on every table a revision creates or replaces,
-- run by flask idem migrate (flask_idem/_migrate.py) and by the Alembic branch (flask_idem/alembic.py),
-- online and in the SQL that 'flask db upgrade --sql' prints, in every transaction of a revision.
--
-- Loaded by flask_idem/_layout.py with flask_idem/_sqlfile.py (as _store.sql is). Braces are the names
-- of flask_idem._layout.names(): {table_literal} is the key table as a string; {grants} is the grants
-- of every revision up to the one applied, as one string in which {{role}} stands for a role. No percent
-- sign: an offline Alembic run with pyformat's escaping (Flask-Migrate's env.py) would double it.

-- name: remember
-- First, before the revision's DDL: the roles that may read and write the key table as it is, that is
-- the application's (those 'flask idem migrate --grant' was given for, or the group role they are granted
-- through), read from its privileges (pg_class.relacl) with its owner left out. Kept in a setting of the
-- transaction (set_config(..., true)), read back by "restore": a revision that replaces the key table
-- drops the very privileges this reads. A role that may only read (a reporting role) is not one of them.
-- A NULL in the list is PUBLIC. The catalog is the record: nothing to keep in step with it.
SELECT set_config('flask_idem.roles', ARRAY(
    SELECT r.rolname::text
    FROM pg_catalog.pg_class AS c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        LEFT JOIN pg_catalog.pg_roles AS r ON r.oid = a.grantee
    WHERE c.oid = to_regclass({table_literal}) AND a.grantee <> c.relowner
    GROUP BY a.grantee, r.rolname
    HAVING array_agg(a.privilege_type::text) @> ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']
    ORDER BY 1
)::text, true)

-- name: restore
-- Last, in the same transaction: each of those roles is given the grants of every revision up to this
-- one, on the tables as they are now (a table made or made anew by the revision included). The
-- transaction commits its DDL and these grants together: no request ever meets a new table without
-- them. A grant the role holds already changes nothing.
DO $grants$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY coalesce(nullif(current_setting('flask_idem.roles', true), ''), '{{}}')::text[]
    LOOP
        EXECUTE replace({grants}, '{{role}}', coalesce(quote_ident(v_role), 'PUBLIC'));
    END LOOP;
END
$grants$
