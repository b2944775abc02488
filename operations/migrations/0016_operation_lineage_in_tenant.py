"""An operation's lineage never crosses tenants, and its checkpoint is one of its run's.

`operation_prepare` refuses both, but a row written any other way (a data fix, a script, a
restore) would put another tenant's run ids on the operation's page and its approval card.
The intent trigger already keeps these columns from changing after the insert, so checking
the insert is enough."""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION operation_lineage_in_tenant() RETURNS trigger AS $$
BEGIN
    IF NEW.run_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM operations_run WHERE id = NEW.run_id AND tenant_id = NEW.tenant_id
    ) THEN
        RAISE EXCEPTION 'operation %: run % is not a run of its tenant', NEW.id, NEW.run_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.checkpoint_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM operations_checkpoint
         WHERE id = NEW.checkpoint_id AND run_id IS NOT DISTINCT FROM NEW.run_id
    ) THEN
        RAISE EXCEPTION 'operation %: checkpoint % is not a checkpoint of its run',
            NEW.id, NEW.checkpoint_id USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.supersedes_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM operations_operation
         WHERE id = NEW.supersedes_id AND tenant_id = NEW.tenant_id AND action = NEW.action
    ) THEN
        RAISE EXCEPTION 'operation %: it supersedes % of another tenant or action',
            NEW.id, NEW.supersedes_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER operation_lineage_in_tenant
    BEFORE INSERT ON operations_operation
    FOR EACH ROW EXECUTE FUNCTION operation_lineage_in_tenant();
"""

REVERSE_SQL = """
DROP TRIGGER operation_lineage_in_tenant ON operations_operation;
DROP FUNCTION operation_lineage_in_tenant();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0015_webhook_reviewed_at")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
