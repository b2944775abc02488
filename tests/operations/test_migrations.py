from __future__ import annotations

import pytest

from operations.models import Operation
from tests.helpers import migrated_back_to
from tests.operations.engine_helpers import authorized_payment, prepared_payment


@pytest.mark.django_db(transaction=True)
def test_it_gives_operations_left_waiting_before_0007_a_recheck(acme, approver):
    # Made by today's code, which writes columns later migrations add: taken back with them.
    waiting = authorized_payment(acme, approver)  # approved, never claimed
    fresh = prepared_payment(acme, invoice_id="inv_fresh")  # not approved: not waiting
    with migrated_back_to([("operations", "0006_tenant_role")]) as forward:
        Operation.objects.filter(id__in=[waiting.id, fresh.id]).update(next_reconcile_at=None)

        then = forward([("operations", "0007_recheck_waiting_operations")])
        rechecks = then.get_model("operations", "Operation").objects

        assert rechecks.get(id=waiting.id).next_reconcile_at is not None
        assert rechecks.get(id=fresh.id).next_reconcile_at is None


@pytest.mark.django_db(transaction=True)
def test_it_keeps_the_held_events_queue_as_it_was_across_0015(acme):
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from operations.models import WebhookEvent
    from operations.selectors import webhooks_held_for_review

    changed = timezone.now() - timedelta(minutes=10)
    op = prepared_payment(acme)  # made by today's code, then taken back (see above)
    with migrated_back_to([("operations", "0014_attempt_provider_account")]) as forward:
        Operation.objects.filter(id=op.id).update(status_changed_at=changed)
        with connection.cursor() as cursor:
            for event_id, received in (("evt_answered", changed - timedelta(minutes=1)),
                                       ("evt_held", changed + timedelta(minutes=1))):
                cursor.execute(
                    "INSERT INTO operations_webhookevent (provider, event_id, event_type, "
                    "operation_id, external_id, data, received_at, deliveries, applied, "
                    "outcome, needs_review) VALUES ('payments', %s, 'payment_intent.succeeded',"
                    " %s, 'pi_1', '{}', %s, 1, false, 'held for review', true)",
                    [event_id, op.id, received],
                )

        forward([("operations", "0015_webhook_reviewed_at")])

    # Before 0015 the queue showed only events newer than the operation's last change.
    assert WebhookEvent.objects.get(event_id="evt_answered").reviewed_at == changed
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_held"]


@pytest.mark.django_db(transaction=True)
def test_it_marks_derived_runs_without_a_reason_as_such_across_0026(acme):
    from operations.models import Run, RunMode
    from tests.factories import CheckpointFactory, RunFactory

    with migrated_back_to([("operations", "0025_run_lineage_in_tenant")]) as forward:
        checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
        blank = RunFactory(derived_from=checkpoint, launch_reason="  ")
        given = RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launch_reason="debug")

        forward([("operations", "0026_run_lineage_immutable")])

    assert Run.objects.get(id=blank.id).launch_reason == (
        "not recorded: launched before a reason was required")
    assert Run.objects.get(id=given.id).launch_reason == "debug"
    assert Run.objects.get(id=checkpoint.run_id).launch_reason == ""


@pytest.mark.django_db(transaction=True)
def test_it_keeps_a_run_without_a_conversation_from_before_0027_and_shows_it(acme, approver):
    from operations.engine import operation_prepare
    from operations.models import Run
    from tests.factories import RunFactory
    from tests.helpers import signed_in
    from tests.operations.engine_helpers import PAYMENT

    with migrated_back_to([("operations", "0026_run_lineage_immutable")]) as forward:
        run = RunFactory(tenant=acme, conversation_id="")

        forward([("operations", "0027_run_conversation_named")])

    # Its intent by today's code, which writes an operation's columns later migrations add.
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                           run=run, command_id="cmd_pay")

    # Its lineage never changes (0026): it stays as written, and its pages say so.
    assert Run.objects.get(id=run.id).conversation_id == ""
    client = signed_in(approver)
    for url in (f"/runs/{run.id}/", "/approvals/"):
        html = client.get(url).content.decode()
        assert op.id in html or run.id in html, url
        assert "none recorded" in html, url


@pytest.mark.django_db(transaction=True)
def test_it_lets_a_run_without_a_conversation_from_before_0027_change_its_status(acme):
    # 0026 lets only a run's status change, and 0027 refuses a blank conversation on new
    # runs only: a CHECK, even NOT VALID, is checked on every UPDATE of an old row too, and
    # such a run could never leave running.
    from django.db import IntegrityError, transaction

    from operations.models import Run, RunStatus
    from tests.factories import RunFactory

    with migrated_back_to([("operations", "0026_run_lineage_immutable")]) as forward:
        run = RunFactory(tenant=acme, conversation_id="", status=RunStatus.RUNNING)
        forward([("operations", "0027_run_conversation_named")])

    assert Run.objects.filter(id=run.id).update(status=RunStatus.PAUSED) == 1
    run.refresh_from_db()
    run.status = RunStatus.SUCCEEDED
    run.save()
    assert Run.objects.filter(id=run.id, conversation_id="",
                              status=RunStatus.SUCCEEDED).count() == 1
    # A new run is still refused one, and the error names the rule.
    with pytest.raises(IntegrityError, match="run_conversation_named"), transaction.atomic():
        RunFactory(tenant=acme, conversation_id=" ")
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_proves_no_call_of_the_previous_release_absent_in_another_provider_account(
    acme, approver, sandbox, settings
):
    """0014 leaves the calls made before it with no provider account: after the API key
    switches (test mode to live mode), an empty search in the new account says nothing of
    them (README: "Changing a key or a base while operations are unknown leaves those to a
    person"), or the next execute pays again under a key live mode never saw."""
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from operations import engine
    from operations.engine.core import adapter
    from operations.models import OperationStatus as S

    op = authorized_payment(acme, approver)
    test_mode = adapter(op.action).account()
    sent = timezone.now() - timedelta(minutes=10)
    with migrated_back_to([("operations", "0013_auditevent_object_id_length")]) as forward:
        # The previous release called in test mode; its worker died before the answer.
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO operations_attempt (operation_id, number, kind, worker, "
                "started_at, outcome, provider_request_id, external_id, idempotency_key, "
                "request_hash, error_class, error_message) VALUES (%s, 1, 'call', 'w1:7', "
                "%s, 'started', '', '', %s, '', '', '')",
                [op.id, sent, op.idempotency_key],
            )
        Operation.objects.filter(id=op.id).update(
            status="unknown", unknown_since=sent + timedelta(seconds=31),
            status_changed_at=sent + timedelta(seconds=31), provider_calls=1)
        forward([("operations", "0014_attempt_provider_account")])

    # After the upgrade the deployment moves to live mode: another account, which has never
    # seen this operation's key (the sandbox stands in for both, and holds no payment).
    settings.PAYMENTS_API_KEY = "sk_live_another_account"
    assert adapter(op.action).account() != test_mode

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, report.may_call_again) != ("absent", True), report.detail
    assert op.status == S.UNKNOWN, (
        f"{op.status}: an empty search in live mode taken as proof that test mode has no "
        "payment; the next execute pays again under a key live mode never saw")


@pytest.mark.django_db(transaction=True)
def test_it_lets_migrate_run_again_after_a_concurrent_index_build_was_interrupted(acme):
    """0023, 0024 and 0028 build their indexes CONCURRENTLY, outside a transaction, so that
    they run beside a live console. Such a build waits for the transactions writing the
    table; interrupted meanwhile (a deploy tool's statement_timeout, a Ctrl-C on a migrate
    that seems to hang), PostgreSQL leaves the index behind, INVALID, and the migration is
    not recorded. The deploying engineer's next `migrate` must finish the job, not stop on
    "relation already exists"."""
    from django.db import DatabaseError, connection

    index = "audit_tenant_object_id"
    with migrated_back_to([("operations", "0027_run_conversation_named")]) as forward:
        # A worker's transaction that has written an audit row and not yet committed.
        worker = connection.get_new_connection(connection.get_connection_params())
        try:
            worker.execute("BEGIN")
            worker.execute("LOCK TABLE operations_auditevent IN ROW EXCLUSIVE MODE")
            with connection.cursor() as cursor:
                cursor.execute("SET statement_timeout = '1s'")
            with pytest.raises(DatabaseError, match="statement timeout"):
                forward([("operations", "0028_auditevent_object_and_actor_indexes")])
        finally:
            worker.execute("ROLLBACK")
            worker.close()
            with connection.cursor() as cursor:
                cursor.execute("SET statement_timeout = 0")

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = %s", [index])
            assert cursor.fetchall() == [(False,)]  # left behind by the interrupted build

        problem = None
        try:
            forward([("operations", "0028_auditevent_object_and_actor_indexes")])
        except DatabaseError as exc:
            problem = exc
        finally:
            if problem is not None:  # leave the database migratable for the tests after
                with connection.cursor() as cursor:
                    cursor.execute(f"DROP INDEX IF EXISTS {index}")
        assert problem is None, f"migrate again after the interruption: {problem}"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = %s", [index])
            assert cursor.fetchall() == [(True,)]


@pytest.mark.django_db(transaction=True)
def test_it_says_why_it_cannot_go_back_over_0013_with_a_long_username_on_the_trail(acme):
    """Going back over 0013 with a grant to a username longer than 64 characters on the
    (append-only) trail cannot shrink the column: it says why, not a bare DataError."""
    from console.roles import role_grant, roles_setup
    from operations.models import AuditEvent
    from tests.factories import UserFactory

    roles_setup()
    user = UserFactory(username="dana.okonkwo-villanueva." + "x" * 50 + "@example.com")
    role_grant(user=user, role="Approver", tenant=acme)
    assert AuditEvent.objects.filter(object_id=user.username).exists()

    with pytest.raises(RuntimeError, match="0013"), migrated_back_to(
        [("operations", "0012_evidence_append_only")]
    ):
        pass
