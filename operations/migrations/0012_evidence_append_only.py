"""Evidence is what proved each step (a lookup's answer, a webhook, a person's resolution):
written once, never rewritten or removed, like the audit trail."""

from django.db import migrations

SQL = r"""
CREATE TRIGGER evidence_append_only
    BEFORE UPDATE OR DELETE ON operations_evidence
    FOR EACH ROW EXECUTE FUNCTION console_refuse_change();
"""

REVERSE_SQL = "DROP TRIGGER IF EXISTS evidence_append_only ON operations_evidence;"


class Migration(migrations.Migration):
    dependencies = [("operations", "0011_attempt_started_at_default")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
