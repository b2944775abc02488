"""A derived run says why it was launched, and no run's lineage changes once written.

A replay or a branch is a person's decision: the design asks a reason of it, which the
lineage check (0006) never required. And the columns an auditor reads a run's origin from
(its parent and checkpoint, its mode, who launched it and why, its conversation and
workflow) could be rewritten by any UPDATE: an evidence replay relabelled live, a branch's
reason erased, its launcher swapped (which moves four eyes: approvals exclude whoever
launched the run), or the lineage turned into a loop. Only the status changes.

Derived runs written without a reason before this migration are marked as such, not
given an invented one."""

from django.db import migrations, models

BACKFILL = r"""
UPDATE operations_run
   SET launch_reason = 'not recorded: launched before a reason was required'
 WHERE mode <> 'original' AND launch_reason !~ '\S';
"""

SQL = r"""
CREATE OR REPLACE FUNCTION run_lineage_immutable() RETURNS trigger AS $$
BEGIN
    IF (NEW.conversation_id, NEW.workflow_name, NEW.workflow_version,
        NEW.state_schema_version, NEW.parent_run_id, NEW.parent_checkpoint_id, NEW.mode,
        NEW.launch_reason, NEW.launched_by_id, NEW.created_at)
       IS DISTINCT FROM
       (OLD.conversation_id, OLD.workflow_name, OLD.workflow_version,
        OLD.state_schema_version, OLD.parent_run_id, OLD.parent_checkpoint_id, OLD.mode,
        OLD.launch_reason, OLD.launched_by_id, OLD.created_at) THEN
        RAISE EXCEPTION 'run %: its lineage (origin, mode, launcher, reason) never changes',
            NEW.id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER run_lineage_immutable
    BEFORE UPDATE ON operations_run
    FOR EACH ROW EXECUTE FUNCTION run_lineage_immutable();
"""

REVERSE_SQL = """
DROP TRIGGER run_lineage_immutable ON operations_run;
DROP FUNCTION run_lineage_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0025_run_lineage_in_tenant")]

    operations = [
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.CheckConstraint(
                condition=models.Q(("mode", "original"), ("launch_reason__regex", "\\S"),
                                   _connector="OR"),
                name="run_derived_has_reason",
            ),
        ),
        migrations.RunSQL(SQL, REVERSE_SQL),
    ]
