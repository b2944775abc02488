"""The intent trigger fires only for UPDATEs that name an intent column.

Every status change is an UPDATE of operations_operation, and each paid for a row trigger
comparing twelve columns (the JSON payload among them) that the statement never touched.
PostgreSQL fires an `UPDATE OF col, …` trigger whenever one of the columns is a target of
the SET list, changed or not, so any statement that could alter the intent (a full-row
save() included) is still checked by the same function.
"""

from django.db import migrations

INTENT_COLUMNS = (
    "action, tenant_id, tool_name, payload, canonical_intent, payload_hash, policy_version, "
    "idempotency_key, run_id, checkpoint_id, command_id, supersedes_id"
)

SQL = f"""
DROP TRIGGER operation_intent_immutable ON operations_operation;
CREATE TRIGGER operation_intent_immutable
    BEFORE UPDATE OF {INTENT_COLUMNS} ON operations_operation
    FOR EACH ROW EXECUTE FUNCTION operation_intent_immutable();
CREATE TRIGGER operation_never_deleted
    BEFORE DELETE ON operations_operation
    FOR EACH ROW EXECUTE FUNCTION operation_intent_immutable();
"""

REVERSE_SQL = """
DROP TRIGGER operation_never_deleted ON operations_operation;
DROP TRIGGER operation_intent_immutable ON operations_operation;
CREATE TRIGGER operation_intent_immutable
    BEFORE UPDATE OR DELETE ON operations_operation
    FOR EACH ROW EXECUTE FUNCTION operation_intent_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0003_drop_attempt_count")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
