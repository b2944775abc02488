from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without holding up the actions whose audit rows are written meanwhile.
    atomic = False

    dependencies = [
        ("operations", "0023_operation_tenant_status_index"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(fields=["tenant", "action"], name="audit_tenant_action"),
        ),
    ]
