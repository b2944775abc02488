"""An approval binds one intent (its operation, payload hash and policy version) and, once
decided, is the record of a person's decision: PostgreSQL keeps both. The services already
change only a pending approval, and only its status, decision and successor; this holds for
every other writer (a script, a data fix) too. Never deleted: the trail of who approved what
would go with it."""

from django.db import migrations

SQL = r"""
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

CREATE TRIGGER approval_decision_kept
    BEFORE UPDATE OR DELETE ON approvals_approval
    FOR EACH ROW EXECUTE FUNCTION approval_decision_kept();
"""

REVERSE_SQL = r"""
DROP TRIGGER IF EXISTS approval_decision_kept ON approvals_approval;
DROP FUNCTION IF EXISTS approval_decision_kept();
"""


class Migration(migrations.Migration):
    dependencies = [("approvals", "0002_superseded_without_successor")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
