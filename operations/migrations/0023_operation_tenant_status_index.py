from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without locking the journal against writes: on a deployed journal of millions of
    # operations a plain CREATE INDEX would stall every execute until it finished.
    atomic = False

    dependencies = [
        ("operations", "0022_evidence_kind_label"),
    ]

    # Once AddIndexConcurrently. A concurrent build that is interrupted (a statement_timeout,
    # a Ctrl-C on a migrate waiting for a long transaction) leaves the index behind INVALID
    # and this migration unrecorded, and the next migrate stopped on "relation already
    # exists": the leftover is dropped before the build. The SQL is what `sqlmigrate` gave
    # for AddIndexConcurrently, and the state the same AddIndex, so a database that applied
    # the old version holds exactly what this one builds: editing it changes no deployment.
    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[
                        'DROP INDEX CONCURRENTLY IF EXISTS "op_tenant_status";',
                        'CREATE INDEX CONCURRENTLY "op_tenant_status" ON "operations_operation"'
                        ' ("tenant_id", "status");',
                    ],
                    reverse_sql='DROP INDEX CONCURRENTLY IF EXISTS "op_tenant_status";',
                ),
            ],
            state_operations=[
                migrations.AddIndex(
                    model_name="operation",
                    index=models.Index(fields=["tenant", "status"], name="op_tenant_status"),
                ),
            ],
        ),
    ]
