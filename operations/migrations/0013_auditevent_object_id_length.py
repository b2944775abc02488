"""An audit event's object id holds a username (role grants and revokes), which Django allows
up to 150 characters: at 64, granting a role to a longer name failed with a database error."""

from django.db import migrations, models
from django.db.models.functions import Length


def refuse_going_back_over_long_object_ids(apps, schema_editor):
    """The audit trail is append-only: an event naming a username longer than 64 characters
    can be neither cut nor removed to fit the old column."""
    AuditEvent = apps.get_model("operations", "AuditEvent")
    long_ids = AuditEvent.objects.annotate(length=Length("object_id")).filter(length__gt=64)
    if count := long_ids.count():
        raise RuntimeError(
            f"cannot unapply operations 0013: {count} audit event(s) name an object id longer "
            "than 64 characters (a role granted to or revoked from a longer username), which "
            "0012's column cannot hold, and the audit trail is never rewritten"
        )


class Migration(migrations.Migration):
    dependencies = [("operations", "0012_evidence_append_only")]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="object_id",
            field=models.CharField(blank=True, max_length=150),
        ),
        # Last, so that going back checks first and says why instead of a bare DataError.
        migrations.RunPython(migrations.RunPython.noop, refuse_going_back_over_long_object_ids),
    ]
