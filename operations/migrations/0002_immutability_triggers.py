"""PostgreSQL enforces what must never change: the audit trail, checkpoints, and intents."""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION console_refuse_change() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION '% on % is refused: rows are append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER audit_event_append_only
    BEFORE UPDATE OR DELETE ON operations_auditevent
    FOR EACH ROW EXECUTE FUNCTION console_refuse_change();

CREATE TRIGGER checkpoint_immutable
    BEFORE UPDATE OR DELETE ON operations_checkpoint
    FOR EACH ROW EXECUTE FUNCTION console_refuse_change();

CREATE OR REPLACE FUNCTION operation_intent_immutable() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'DELETE on operations_operation is refused: the journal keeps every intent'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.action IS DISTINCT FROM OLD.action
       OR NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
       OR NEW.tool_name IS DISTINCT FROM OLD.tool_name
       OR NEW.payload IS DISTINCT FROM OLD.payload
       OR NEW.canonical_intent IS DISTINCT FROM OLD.canonical_intent
       OR NEW.payload_hash IS DISTINCT FROM OLD.payload_hash
       OR NEW.policy_version IS DISTINCT FROM OLD.policy_version
       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
       OR NEW.run_id IS DISTINCT FROM OLD.run_id
       OR NEW.checkpoint_id IS DISTINCT FROM OLD.checkpoint_id
       OR NEW.command_id IS DISTINCT FROM OLD.command_id
       OR NEW.supersedes_id IS DISTINCT FROM OLD.supersedes_id THEN
        RAISE EXCEPTION 'the intent of operation % is immutable; a changed intent is a new operation', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER operation_intent_immutable
    BEFORE UPDATE OR DELETE ON operations_operation
    FOR EACH ROW EXECUTE FUNCTION operation_intent_immutable();
"""

REVERSE_SQL = r"""
DROP TRIGGER IF EXISTS operation_intent_immutable ON operations_operation;
DROP FUNCTION IF EXISTS operation_intent_immutable();
DROP TRIGGER IF EXISTS checkpoint_immutable ON operations_checkpoint;
DROP TRIGGER IF EXISTS audit_event_append_only ON operations_auditevent;
DROP FUNCTION IF EXISTS console_refuse_change();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0001_initial")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
