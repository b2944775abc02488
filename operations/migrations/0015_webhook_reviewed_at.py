"""A held event leaves the operators' queue when a person disputes or resolves its operation,
not whenever the status changes: an event about a second payment that arrived while the call
was in flight vanished from the queue once the call's own answer landed.

Events already out of the queue (received before their operation's last status change) are
marked reviewed at that change, so the queue shows the same events after the upgrade."""

from django.db import migrations, models

MARK_REVIEWED = """
UPDATE operations_webhookevent AS event
   SET reviewed_at = op.status_changed_at
  FROM operations_operation AS op
 WHERE event.operation_id = op.id
   AND event.needs_review
   AND event.received_at <= op.status_changed_at;
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0014_attempt_provider_account")]

    operations = [
        migrations.AddField(
            model_name="webhookevent",
            name="reviewed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(MARK_REVIEWED, reverse_sql=migrations.RunSQL.noop),
        migrations.RemoveIndex(model_name="webhookevent", name="webhook_needs_review_idx"),
        migrations.AddIndex(
            model_name="webhookevent",
            index=models.Index(
                condition=models.Q(needs_review=True, reviewed_at__isnull=True),
                fields=["operation", "received_at"],
                name="webhook_held_idx",
            ),
        ),
    ]
