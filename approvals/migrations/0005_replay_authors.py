"""Four eyes over derived runs: a replay or a branch asks its nodes' commands again, so whoever
wrote the same command in a run it derives from, or launched that run, is an author of the
copy too. Pending approvals get those authors now (decided ones are records, left as they
were). `authors` is immutable once written, so the trigger that keeps it is set aside for
this one rewrite, inside the migration's transaction."""

from django.db import migrations

MAX_ANCESTORS = 50


def pending_replay_authors_add(apps, schema_editor):
    Approval = apps.get_model("approvals", "Approval")
    Operation = apps.get_model("operations", "Operation")
    Run = apps.get_model("operations", "Run")
    pending = Approval.objects.filter(
        status="pending", operation__run__parent_run__isnull=False
    ).exclude(operation__command_id="").select_related("operation", "operation__run")
    changes: dict[str, list[int]] = {}
    for approval in pending:
        op = approval.operation
        ancestors: list[str] = []
        parent_id = op.run.parent_run_id
        while parent_id and parent_id not in ancestors and len(ancestors) < MAX_ANCESTORS:
            ancestors.append(parent_id)
            parent_id = (
                Run.objects.filter(id=parent_id).values_list("parent_run_id", flat=True).first()
            )
        earlier = Operation.objects.filter(
            tenant_id=op.tenant_id, run_id__in=ancestors, command_id=op.command_id
        ).values_list("created_by_id", "run__launched_by_id")
        authors = set(approval.authors) | {pk for pair in earlier for pk in pair if pk}
        if authors != set(approval.authors):
            changes[approval.id] = sorted(authors)
    if not changes:
        return
    # ALTER TABLE refuses a table with pending trigger events (deferred foreign keys).
    schema_editor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    schema_editor.execute("ALTER TABLE approvals_approval DISABLE TRIGGER approval_decision_kept")
    for approval_id, authors in changes.items():
        Approval.objects.filter(id=approval_id, status="pending").update(authors=authors)
    schema_editor.execute("ALTER TABLE approvals_approval ENABLE TRIGGER approval_decision_kept")


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0004_approval_authors"),
        ("operations", "0026_run_lineage_immutable"),
    ]

    operations = [migrations.RunPython(pending_replay_authors_add, migrations.RunPython.noop)]
