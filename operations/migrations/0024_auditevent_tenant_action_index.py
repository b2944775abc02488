from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without holding up the actions whose audit rows are written meanwhile.
    atomic = False

    dependencies = [
        ("operations", "0023_operation_tenant_status_index"),
    ]

    # Once AddIndexConcurrently: re-runnable after an interrupted build, as 0023 (which says
    # why, and why editing it changes no deployment).
    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[
                        'DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_action";',
                        'CREATE INDEX CONCURRENTLY "audit_tenant_action" ON'
                        ' "operations_auditevent" ("tenant_id", "action");',
                    ],
                    reverse_sql='DROP INDEX CONCURRENTLY IF EXISTS "audit_tenant_action";',
                ),
            ],
            state_operations=[
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["tenant", "action"], name="audit_tenant_action"),
                ),
            ],
        ),
    ]
