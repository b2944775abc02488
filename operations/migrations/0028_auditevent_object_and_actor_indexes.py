from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models.functions import Upper


class Migration(migrations.Migration):
    # Built without holding up the actions whose audit rows are written meanwhile.
    atomic = False

    dependencies = [
        ("operations", "0027_run_conversation_named"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                fields=["tenant", "object_id", "-id"], name="audit_tenant_object_id"
            ),
        ),
        AddIndexConcurrently(
            model_name="auditevent",
            index=models.Index(
                models.F("tenant"), Upper("actor_username"), models.F("id").desc(),
                name="audit_tenant_actor_id",
            ),
        ),
    ]
