"""A run names its conversation: a blank id is refused.

The agent's runtime wrote it unchecked, and a blank one names no conversation a page could
lead to. A run's lineage never changes once written (0026), so a blank one from before this
migration is kept as it is (the constraint is NOT VALID: it binds rows written from now on),
and its pages say that none was recorded."""

from django.db import migrations, models

ADD = r"""
ALTER TABLE operations_run ADD CONSTRAINT run_conversation_named
    CHECK (conversation_id::text ~ '\S') NOT VALID;
"""

DROP = "ALTER TABLE operations_run DROP CONSTRAINT run_conversation_named;"


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
            database_operations=[migrations.RunSQL(ADD, DROP)],
        ),
    ]
