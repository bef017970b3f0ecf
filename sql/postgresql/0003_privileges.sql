-- fastapi-workqueue: PostgreSQL privileges, version 1.
-- PostgreSQL grants EXECUTE on every new function to PUBLIC. The queue's functions are SECURITY
-- DEFINER (0002): whoever may call them acts with the schema owner's rights on the tables. This
-- migration takes that default away, so only the owner and the roles it grants EXECUTE to (the
-- workqueue_runtime role of roles/runtime_role.sql) can call them.
--
-- Every statement is idempotent: REVOKE of a privilege that is not held, and ALTER DEFAULT
-- PRIVILEGES to a state already set, change nothing and raise no error.

-- The functions (and any procedure) that exist now: the 0002 operations and their helpers.
-- ALL FUNCTIONS does not include procedures, hence the second statement.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM PUBLIC;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM PUBLIC;

-- Functions added by later migrations: the migration runner repeats the two REVOKE statements
-- above after every run that applied something, so a new function is never left executable by
-- PUBLIC. (ALTER DEFAULT PRIVILEGES is not used: without IN SCHEMA it would change the default for
-- every function the migrating role creates anywhere in the database, the app's own included.)
