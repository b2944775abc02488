from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without locking the journal against writes: on a deployed journal of millions of
    # operations a plain CREATE INDEX would stall every execute until it finished.
    atomic = False

    dependencies = [
        ("operations", "0022_evidence_kind_label"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="operation",
            index=models.Index(fields=["tenant", "status"], name="op_tenant_status"),
        ),
    ]
