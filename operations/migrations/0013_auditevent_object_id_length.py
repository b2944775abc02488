"""An audit event's object id holds a username (role grants and revokes), which Django allows
up to 150 characters: at 64, granting a role to a longer name failed with a database error."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("operations", "0012_evidence_append_only")]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="object_id",
            field=models.CharField(blank=True, max_length=150),
        ),
    ]
