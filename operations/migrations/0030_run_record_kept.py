"""A run is never removed, as its checkpoints, its intents and the audit trail are not.

0026 keeps a run's lineage (its origin, mode, launcher and reason) from being rewritten,
but a DELETE took the whole row, and that record with it: launching a replay or a branch
writes no audit event, so the run's row is the auditor's only trace of that decision, and
the four-eyes rule reads who launched it from there. Every run, not only a derived one: an
original run is what its checkpoints and intents name, and what a later replay derives from.

A row-level BEFORE DELETE trigger, as the other tables' are: TRUNCATE, which fires no row
triggers, stays what empties the tables between tests (pytest-django's flush)."""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION run_record_kept() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'DELETE on operations_run is refused: run % and its lineage are kept',
        OLD.id USING ERRCODE = 'restrict_violation';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER run_record_kept
    BEFORE DELETE ON operations_run
    FOR EACH ROW EXECUTE FUNCTION run_record_kept();
"""

REVERSE_SQL = r"""
DROP TRIGGER IF EXISTS run_record_kept ON operations_run;
DROP FUNCTION IF EXISTS run_record_kept();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0029_operation_lookups_failing_since")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
