"""A run's lineage never crosses tenants either, and its parent checkpoint is one of its
parent run's (as operations 0016 holds for operations); nor does a run change tenants.

Nothing in the console writes a run's lineage yet but the demo data; a replay or a branch
will, and a row written any other way (a data fix, a script, a restore) would put another
tenant's run and checkpoint ids on the run's page. Checked on insert and on any change of
the columns it reads."""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION run_lineage_in_tenant() RETURNS trigger AS $$
BEGIN
    -- A run's operations and checkpoints are its tenant's: it never moves to another.
    IF TG_OP = 'UPDATE' AND NEW.tenant_id <> OLD.tenant_id THEN
        RAISE EXCEPTION 'run %: its tenant never changes', NEW.id
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.parent_run_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM operations_run WHERE id = NEW.parent_run_id AND tenant_id = NEW.tenant_id
    ) THEN
        RAISE EXCEPTION 'run %: parent run % is not a run of its tenant',
            NEW.id, NEW.parent_run_id USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.parent_checkpoint_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM operations_checkpoint
         WHERE id = NEW.parent_checkpoint_id AND run_id IS NOT DISTINCT FROM NEW.parent_run_id
    ) THEN
        RAISE EXCEPTION 'run %: checkpoint % is not a checkpoint of its parent run',
            NEW.id, NEW.parent_checkpoint_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER run_lineage_in_tenant
    BEFORE INSERT OR UPDATE OF tenant_id, parent_run_id, parent_checkpoint_id
    ON operations_run
    FOR EACH ROW EXECUTE FUNCTION run_lineage_in_tenant();
"""

REVERSE_SQL = """
DROP TRIGGER run_lineage_in_tenant ON operations_run;
DROP FUNCTION run_lineage_in_tenant();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0024_auditevent_tenant_action_index")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
