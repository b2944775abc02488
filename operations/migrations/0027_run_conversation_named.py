"""A run names its conversation: a blank id is refused.

The agent's runtime wrote it unchecked, and a blank one names no conversation a page could
lead to. A run's lineage never changes once written (0026), so a blank one from before this
migration is kept as it is, and its pages say that none was recorded.

So only a new run is refused, by a trigger on INSERT. A CHECK constraint, even NOT VALID,
is checked again on every UPDATE of an old row: a run written blank before this migration
could then never change its status, the one column 0026 lets change. The model keeps the
check (as run_conversation_named, the name the trigger's error carries) for what Django
validates."""

from django.db import migrations, models

SQL = r"""
CREATE OR REPLACE FUNCTION run_conversation_named() RETURNS trigger AS $$
BEGIN
    IF NEW.conversation_id !~ '\S' THEN
        RAISE EXCEPTION 'run %: violates run_conversation_named: a run names its conversation',
            NEW.id USING ERRCODE = 'check_violation', CONSTRAINT = 'run_conversation_named';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER run_conversation_named
    BEFORE INSERT ON operations_run
    FOR EACH ROW EXECUTE FUNCTION run_conversation_named();
"""

REVERSE_SQL = """
DROP TRIGGER run_conversation_named ON operations_run;
DROP FUNCTION run_conversation_named();
"""


class Migration(migrations.Migration):

    dependencies = [
        ("operations", "0026_run_lineage_immutable"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="run",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("conversation_id__regex", "\\S")),
                        name="run_conversation_named",
                    ),
                ),
            ],
            database_operations=[migrations.RunSQL(SQL, REVERSE_SQL)],
        ),
    ]
