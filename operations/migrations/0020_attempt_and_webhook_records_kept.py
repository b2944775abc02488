"""A call's or a lookup's record, and a provider's event, are facts the engine decides on:
kept for good, and rewritten only where they are still being written.

* An attempt is never removed: the record of a call with no answer is what keeps a lookup
  from calling again while that call may still land. What was sent (its operation, number,
  kind, worker, start, key, account and reach) never changes; its answer is written once,
  while it reads `started`. Only a person's review marks change after that.
* A provider event is never removed: its (provider, event id) row is what makes the
  provider's redelivery a duplicate. What the provider said never changes; the event is
  linked to an operation once, and only how it was decided moves."""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION attempt_record_kept() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'DELETE on operations_attempt is refused: every call and lookup is kept'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.operation_id, NEW.number, NEW.kind, NEW.worker, NEW.started_at,
        NEW.idempotency_key, NEW.provider_account, NEW.reach_until)
       IS DISTINCT FROM
       (OLD.operation_id, OLD.number, OLD.kind, OLD.worker, OLD.started_at,
        OLD.idempotency_key, OLD.provider_account, OLD.reach_until) THEN
        RAISE EXCEPTION 'attempt %: what was sent is immutable', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.outcome <> 'started' AND
       (NEW.outcome, NEW.finished_at, NEW.http_status, NEW.provider_request_id,
        NEW.external_id, NEW.request_hash, NEW.error_class, NEW.error_message)
       IS DISTINCT FROM
       (OLD.outcome, OLD.finished_at, OLD.http_status, OLD.provider_request_id,
        OLD.external_id, OLD.request_hash, OLD.error_class, OLD.error_message) THEN
        RAISE EXCEPTION 'attempt %: its answer is recorded once', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER attempt_record_kept
    BEFORE UPDATE OR DELETE ON operations_attempt
    FOR EACH ROW EXECUTE FUNCTION attempt_record_kept();

CREATE OR REPLACE FUNCTION webhook_event_kept() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'DELETE on operations_webhookevent is refused: redelivered, it would apply'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.provider, NEW.event_id, NEW.event_type, NEW.external_id, NEW.data,
        NEW.provider_created_at, NEW.received_at, NEW.reported_status)
       IS DISTINCT FROM
       (OLD.provider, OLD.event_id, OLD.event_type, OLD.external_id, OLD.data,
        OLD.provider_created_at, OLD.received_at, OLD.reported_status)
       OR (OLD.operation_id IS NOT NULL AND NEW.operation_id IS DISTINCT FROM OLD.operation_id)
    THEN
        RAISE EXCEPTION 'webhook event %: what the provider said is immutable', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER webhook_event_kept
    BEFORE UPDATE OR DELETE ON operations_webhookevent
    FOR EACH ROW EXECUTE FUNCTION webhook_event_kept();
"""

REVERSE_SQL = r"""
DROP TRIGGER IF EXISTS webhook_event_kept ON operations_webhookevent;
DROP FUNCTION IF EXISTS webhook_event_kept();
DROP TRIGGER IF EXISTS attempt_record_kept ON operations_attempt;
DROP FUNCTION IF EXISTS attempt_record_kept();
"""


class Migration(migrations.Migration):
    dependencies = [("operations", "0019_attempt_reach_until")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
