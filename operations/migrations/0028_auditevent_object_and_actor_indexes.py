from django.db import migrations, models
from django.db.models.functions import Upper


class Migration(migrations.Migration):
    # Built without holding up the actions whose audit rows are written meanwhile.
    atomic = False

    dependencies = [
        ("operations", "0027_run_conversation_named"),
    ]

    # Once two AddIndexConcurrently: re-runnable after an interrupted build, as 0023 (which
    # says why, and why editing it changes no deployment). One index per operation: a run
    # interrupted at the second finds the first built, drops and builds it again.
    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[
                        'DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_object_id";',
                        'CREATE INDEX CONCURRENTLY "audit_tenant_object_id" ON'
                        ' "operations_auditevent" ("tenant_id", "object_id", "id" DESC);',
                    ],
                    reverse_sql='DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_object_id";',
                ),
            ],
            state_operations=[
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(
                        fields=["tenant", "object_id", "-id"], name="audit_tenant_object_id"
                    ),
                ),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[
                        'DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_actor_id";',
                        'CREATE INDEX CONCURRENTLY "audit_tenant_actor_id" ON'
                        ' "operations_auditevent" ("tenant_id", (UPPER("actor_username")),'
                        ' "id" DESC);',
                    ],
                    reverse_sql='DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_actor_id";',
                ),
            ],
            state_operations=[
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(
                        models.F("tenant"), Upper("actor_username"), models.F("id").desc(),
                        name="audit_tenant_actor_id",
                    ),
                ),
            ],
        ),
    ]
