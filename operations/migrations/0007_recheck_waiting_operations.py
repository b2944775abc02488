"""Operations left waiting before the sweep queued them again: approved (or proven absent
after a call) and still authorized, but never claimed. Give them a recheck time now, so the
sweep queues their execute; the execute's claim makes that safe."""

from django.db import migrations
from django.db.models import Q
from django.db.models.functions import Now


def recheck_waiting(apps, schema_editor):
    Operation = apps.get_model("operations", "Operation")
    Operation.objects.filter(
        Q(requires_approval=True) | Q(provider_calls__gt=0),
        status="not_started",
        next_reconcile_at__isnull=True,
        authorization_expires_at__gt=Now(),
    ).exclude(authorized_hash="").update(next_reconcile_at=Now())


class Migration(migrations.Migration):
    dependencies = [("operations", "0006_tenant_role")]

    operations = [migrations.RunPython(recheck_waiting, migrations.RunPython.noop)]
