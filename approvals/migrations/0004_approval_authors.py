"""Four eyes over a chain of replaced intents: each approval keeps who wrote its intent or
any it replaces, or launched the run of any of them. Pending approvals get theirs now; a
decided one is a record, left as it was. Then PostgreSQL keeps it as it keeps the intent an
approval binds."""

import django.contrib.postgres.fields
from django.db import migrations, models

SQL = r"""
CREATE OR REPLACE FUNCTION approval_decision_kept() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'DELETE on approvals_approval is refused: every decision is kept'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.operation_id, NEW.payload_hash, NEW.policy_version, NEW.requested_at, NEW.authors)
       IS DISTINCT FROM
       (OLD.operation_id, OLD.payload_hash, OLD.policy_version, OLD.requested_at, OLD.authors)
    THEN
        RAISE EXCEPTION 'approval %: the intent it binds is immutable', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.status <> 'pending' AND NEW IS DISTINCT FROM OLD THEN
        RAISE EXCEPTION 'approval %: decided (%), it is not rewritten', OLD.id, OLD.status
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""

# Back to 0003's function (the column goes with the field's removal after this).
REVERSE_SQL = r"""
CREATE OR REPLACE FUNCTION approval_decision_kept() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'DELETE on approvals_approval is refused: every decision is kept'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.operation_id, NEW.payload_hash, NEW.policy_version, NEW.requested_at)
       IS DISTINCT FROM
       (OLD.operation_id, OLD.payload_hash, OLD.policy_version, OLD.requested_at) THEN
        RAISE EXCEPTION 'approval %: the intent it binds is immutable', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.status <> 'pending' AND NEW IS DISTINCT FROM OLD THEN
        RAISE EXCEPTION 'approval %: decided (%), it is not rewritten', OLD.id, OLD.status
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""

MAX_SUPERSEDES_WALK = 1000


def pending_authors_fill(apps, schema_editor):
    Approval = apps.get_model("approvals", "Approval")
    for approval in Approval.objects.filter(status="pending").select_related("operation"):
        authors: set[int] = set()
        op = approval.operation
        for _ in range(MAX_SUPERSEDES_WALK):
            if op is None:
                break
            run = op.run
            authors.update(pk for pk in (op.created_by_id, run and run.launched_by_id) if pk)
            op = op.supersedes
        Approval.objects.filter(id=approval.id, status="pending").update(authors=sorted(authors))


class Migration(migrations.Migration):
    # The operation's author, replaced intent and run (whose launcher counts) are as old as
    # the operations app's first migration: no later one is needed, so going back over the
    # operations app's migrations leaves this one alone.
    dependencies = [("approvals", "0003_approval_decision_kept")]

    operations = [
        migrations.AddField(
            model_name="approval",
            name="authors",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.BigIntegerField(), blank=True, default=list, size=None
            ),
        ),
        migrations.RunPython(pending_authors_fill, migrations.RunPython.noop),
        migrations.RunSQL(SQL, REVERSE_SQL),
    ]
