"""Each attempt keeps which provider account it reached (a fingerprint of endpoint and key):
an empty lookup in another account (a key switched from test to live mode, say) must not
count as proof that a call made in the first one did nothing."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("operations", "0013_auditevent_object_id_length")]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="provider_account",
            field=models.CharField(blank=True, max_length=20),
        ),
    ]
