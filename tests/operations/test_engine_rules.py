from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
from django.db import IntegrityError, InternalError, connection, transaction
from django.utils import timezone

from operations.engine import (
    AuthorizationRefused,
    operation_authorize,
    operation_execute,
    operation_prepare,
    operations_claim_waiting_for_execute,
    webhook_apply,
)
from operations.engine.core import worker_name
from operations.intents import IntentError
from operations.models import (
    Attempt,
    AuditEvent,
    Evidence,
    Operation,
    OperationStatus,
    Run,
    WebhookEvent,
)
from operations.providers.base import CallOutcome, WebhookFacts
from tests.factories import CheckpointFactory, RunFactory
from tests.operations.engine_helpers import PAYMENT, authorized_payment, prepared_payment

S = OperationStatus


@pytest.fixture
def run(acme):
    return Run.objects.create(conversation_id="conv_1", tenant=acme, workflow_name="pay_invoices",
                              workflow_version=7, state_schema_version=4)


@pytest.mark.django_db
def test_it_records_the_intent_with_hash_key_and_policy_before_any_call(acme):
    op = prepared_payment(acme)
    assert op.id.startswith("op_") and op.status == S.NOT_STARTED
    assert op.payload_hash.startswith("sha256:") and op.policy_version == "payments-v3"
    assert op.idempotency_key.startswith("ik_")
    assert op.requires_approval and not op.authorized_hash
    assert op.attempts.count() == 0 and op.provider_calls == 0
    assert AuditEvent.objects.filter(action="operation.prepare", object_id=op.id).count() == 1


@pytest.mark.django_db
def test_it_returns_the_same_operation_when_a_resumed_node_prepares_again(acme, run):
    first = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                              command_id="cmd_pay_03")
    again = operation_prepare(tenant=acme, action="payments.create", payload=dict(PAYMENT),
                              run=run, command_id="cmd_pay_03")
    assert again.id == first.id
    assert again.idempotency_key == first.idempotency_key
    with pytest.raises(IntentError, match="must supersede"):
        operation_prepare(tenant=acme, action="payments.create",
                          payload={**PAYMENT, "amount_minor": 1350000}, run=run,
                          command_id="cmd_pay_03")


@pytest.mark.django_db
def test_it_refuses_a_command_without_its_run(acme, run):
    # The run's row is the lock its commands are found again under: without it, preparing
    # the same command again would record a second intent.
    for _ in range(2):
        with pytest.raises(IntentError, match="command cmd_pay_04 is given without its run"):
            operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              command_id="cmd_pay_04")
    assert not Operation.objects.exists()
    first = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                              command_id="cmd_pay_04")
    with pytest.raises(IntentError, match="without its run"):
        operation_prepare(tenant=acme, action="payments.create", supersedes=first,
                          command_id="cmd_pay_04", payload={**PAYMENT, "amount_minor": 1})
    assert Operation.objects.get() == first


@pytest.mark.django_db
def test_it_makes_a_new_operation_with_its_own_key_when_a_branch_prepares_the_same_command(
    acme, run
):
    cp = CheckpointFactory(run=run)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                           checkpoint=cp, command_id="cmd_pay_01")
    branch = RunFactory(derived_from=cp)

    again = operation_prepare(tenant=acme, action="payments.create", payload=dict(PAYMENT),
                              run=branch, command_id="cmd_pay_01")

    assert again.id != op.id and again.idempotency_key != op.idempotency_key
    # The intent is the same one: the hash binds what is asked, not the run asking it.
    assert again.payload_hash == op.payload_hash


@pytest.mark.django_db(transaction=True)
def test_it_records_one_intent_when_two_workers_resume_the_same_node_at_once(acme, run):
    from tests.helpers import Background

    barrier = threading.Barrier(2)

    def resume():
        barrier.wait(timeout=10)
        return operation_prepare(tenant=acme, action="mail.send", run=run, command_id="cmd_1",
                                 payload={"to": "cfo@acme.test", "template": "receipt",
                                          "params": {}})

    first, second = Background(resume), Background(resume)

    assert first.join().id == second.join().id
    assert Operation.objects.filter(run=run, command_id="cmd_1").count() == 1


@pytest.mark.django_db
def test_it_returns_a_rejected_intent_as_it_is_when_a_resumed_node_prepares_it_again(
    acme, run, operator
):
    from operations.engine import operation_cancel

    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                           command_id="cmd_pay_07")
    assert operation_cancel(operation_id=op.id, actor=operator, reason="rejected: wrong vendor")

    again = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                              command_id="cmd_pay_07")

    assert again.id == op.id and again.status == S.CANCELLED
    assert Operation.objects.filter(run=run, command_id="cmd_pay_07").count() == 1


@pytest.mark.django_db
def test_it_supersedes_only_the_commands_current_intent(acme, run):
    first = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                              command_id="cmd_pay_08")
    second = operation_prepare(tenant=acme, action="payments.create", run=run,
                               command_id="cmd_pay_08", supersedes=first,
                               payload={**PAYMENT, "amount_minor": 1_300_000})
    other = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                              command_id="cmd_pay_09")

    with pytest.raises(IntentError, match=f"is at intent {second.id}"):
        operation_prepare(tenant=acme, action="payments.create", run=run,
                          command_id="cmd_pay_08", supersedes=other,
                          payload={**PAYMENT, "amount_minor": 1_400_000})
    with pytest.raises(IntentError, match="keeps the run and the command"):
        operation_prepare(tenant=acme, action="payments.create", run=run,
                          command_id="cmd_pay_10", supersedes=other,
                          payload={**PAYMENT, "amount_minor": 1_400_000})
    assert Operation.objects.filter(run=run).count() == 3


@pytest.mark.django_db
def test_it_never_lets_a_branchs_intent_supersede_the_original_runs(acme, run):
    """A branch makes new operations: superseding one of the original run's would cancel
    the original's intent from another run."""
    cp = CheckpointFactory(run=run)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                           checkpoint=cp, command_id="cmd_pay_01")
    branch = RunFactory(derived_from=cp)

    with pytest.raises(IntentError, match="keeps the run and the command"):
        operation_prepare(tenant=acme, action="payments.create", run=branch,
                          command_id="cmd_pay_01", supersedes=op,
                          payload={**PAYMENT, "amount_minor": 1})

    op.refresh_from_db()
    assert op.status == S.NOT_STARTED and not hasattr(op, "superseded_by")
    assert not branch.operations.exists()


@pytest.mark.django_db
def test_it_makes_a_changed_intent_a_new_operation_that_supersedes_the_old(acme, run):
    old = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                            command_id="cmd_pay_03")
    new = operation_prepare(tenant=acme, action="payments.create",
                            payload={**PAYMENT, "amount_minor": 1350000}, run=run,
                            command_id="cmd_pay_03", supersedes=old)
    old.refresh_from_db()
    assert new.id != old.id and new.supersedes_id == old.id
    assert new.payload_hash != old.payload_hash
    assert new.idempotency_key != old.idempotency_key
    assert old.status == S.CANCELLED and old.superseded_by == new
    with pytest.raises(AuthorizationRefused):
        operation_authorize(operation_id=old.id, approved_hash=old.payload_hash,
                            policy_version=old.policy_version, approved_by=None,
                            expires_at=timezone.now() + timedelta(hours=1))


@pytest.mark.django_db
def test_it_refuses_any_update_of_the_intent_in_the_database(acme):
    op = prepared_payment(acme)
    for field, value in [("payload", {**PAYMENT, "amount_minor": 1}),
                         ("payload_hash", "sha256:" + "0" * 64),
                         ("policy_version", "payments-v4"), ("idempotency_key", "ik_other")]:
        refused = pytest.raises((IntegrityError, InternalError), match="immutable")
        with refused, transaction.atomic():
            Operation.objects.filter(id=op.id).update(**{field: value})
    # Raw SQL: Django's own PROTECT checks would refuse first and hide the trigger.
    refused = pytest.raises((IntegrityError, InternalError), match="refused")
    with refused, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("DELETE FROM operations_operation WHERE id = %s", [op.id])
    # A full-row save() names every column, so the trigger sees it too.
    op.payload = {**PAYMENT, "amount_minor": 1}
    with pytest.raises((IntegrityError, InternalError), match="immutable"), transaction.atomic():
        op.save()
    op.refresh_from_db()
    assert op.payload == PAYMENT


@pytest.mark.django_db
def test_it_refuses_in_the_database_an_operation_whose_lineage_crosses_tenants(
    acme, globex, run
):
    from operations.ids import new_id
    from operations.models import Checkpoint

    theirs = Run.objects.create(conversation_id="conv_g", tenant=globex, workflow_name="pay",
                                workflow_version=1, state_schema_version=1)
    their_checkpoint = Checkpoint.objects.create(run=theirs, sequence=1, node="pay", state={},
                                                 state_hash="sha256:" + "c" * 64)
    other_action = operation_prepare(tenant=acme, action="mail.send", payload={
        "to": "a@example.com", "template": "receipt", "params": {}})
    theirs_superseded = prepared_payment(globex, invoice_id="inv_g")
    ours = prepared_payment(acme)

    def written_by_hand(**lineage) -> None:
        # What operation_prepare refuses, as a script or a data fix would write it.
        row = Operation.objects.get(id=ours.id)
        row.pk, row.idempotency_key, row.command_id = new_id("op"), "ik_by_hand", "cmd_x"
        row.run, row.checkpoint, row.supersedes = lineage.get("run"), None, None
        for name, value in lineage.items():
            setattr(row, name, value)
        row.save(force_insert=True)

    for lineage, refusal in [
        ({"run": theirs}, "is not a run of its tenant"),
        ({"run": run, "checkpoint": their_checkpoint}, "is not a checkpoint of its run"),
        ({"checkpoint": their_checkpoint}, "is not a checkpoint of its run"),
        ({"supersedes": theirs_superseded}, "of another tenant or action"),
        ({"supersedes": other_action}, "of another tenant or action"),
    ]:
        with pytest.raises(IntegrityError, match=refusal), transaction.atomic():
            written_by_hand(**lineage)
    written_by_hand(run=run)  # its own tenant's run: as prepare would write it
    assert Operation.objects.filter(tenant=acme, run=run).count() == 1


@pytest.mark.django_db
def test_it_keeps_unknown_since_exactly_while_the_operation_is_unknown(acme):
    op = prepared_payment(acme)
    with pytest.raises(IntegrityError), transaction.atomic():
        Operation.objects.filter(id=op.id).update(status=S.UNKNOWN)
    with pytest.raises(IntegrityError), transaction.atomic():
        Operation.objects.filter(id=op.id).update(unknown_since=timezone.now())
    op.refresh_from_db()
    assert op.status == S.NOT_STARTED and op.unknown_since is None


def test_it_names_the_workers_of_two_containers_as_two_lease_owners(monkeypatch):
    """Replicas of one deployment: pod names alike for their first 40 characters, each
    worker pid 1 in its own container."""
    from operations.engine import core

    names = []
    for host, token in (("agent-operations-console-celery-worker-7f9c8d7b6-x2k4p", "a1b2c3"),
                        ("agent-operations-console-celery-worker-7f9c8d7b6-q8m1z", "d4e5f6")):
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        monkeypatch.setattr("os.getpid", lambda: 1)
        monkeypatch.setattr(core, "_process_token", token)
        names.append(worker_name())
    assert names[0] != names[1]
    assert names[0] == "le-celery-worker-7f9c8d7b6-x2k4p:1:a1b2c3"  # the unique tail kept
    # Even the very same host and pid: another process, another token.
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 253)
    monkeypatch.setattr(core, "_process_token", "a1b2c3")
    first = worker_name()
    monkeypatch.setattr(core, "_process_token", "d4e5f6")
    assert worker_name() != first
    assert len(first) <= Operation._meta.get_field("lease_owner").max_length


def test_it_names_a_forked_worker_process_apart_from_its_parent():
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # Celery's prefork pool: the child holds leases of its own
        os.write(writing, worker_name().encode())
        os._exit(0)
    os.close(writing)
    os.waitpid(child, 0)
    childs = os.read(reading, 200).decode()
    os.close(reading)
    assert childs.split(":")[2] != worker_name().split(":")[2]


def test_it_names_each_thread_of_a_worker_process_as_its_own_lease_owner():
    names: list[str] = []
    threads = [threading.Thread(target=lambda: names.append(worker_name())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(names)) == 2 and worker_name() not in names
    assert all(len(name) <= Operation._meta.get_field("lease_owner").max_length for name in names)


@pytest.mark.django_db
def test_it_refuses_an_authorization_for_another_hash(acme, approver):
    op = prepared_payment(acme)
    with pytest.raises(AuthorizationRefused, match="not this intent"):
        operation_authorize(operation_id=op.id, approved_hash="sha256:" + "f" * 64,
                            policy_version=op.policy_version, approved_by=approver,
                            expires_at=timezone.now() + timedelta(hours=1))
    op.refresh_from_db()
    assert op.authorized_hash == ""


@pytest.mark.django_db
def test_it_refuses_an_authorization_that_has_already_expired(acme, approver):
    op = prepared_payment(acme)
    with pytest.raises(AuthorizationRefused, match="expired"):
        operation_authorize(operation_id=op.id, approved_hash=op.payload_hash,
                            policy_version=op.policy_version, approved_by=approver,
                            expires_at=timezone.now() - timedelta(seconds=1))
    op.refresh_from_db()
    assert op.authorized_hash == "" and op.authorization_expires_at is None
    assert not Evidence.objects.filter(operation=op, kind="authorization").exists()
    assert not AuditEvent.objects.filter(object_id=op.id, action="operation.authorize").exists()


@pytest.mark.django_db
def test_it_authorizes_an_intent_once_and_never_extends_that_authorization(acme, approver):
    op = authorized_payment(acme, approver)
    first_expiry = op.authorization_expires_at
    with pytest.raises(AuthorizationRefused, match="already authorized"):
        operation_authorize(operation_id=op.id, approved_hash=op.payload_hash,
                            policy_version=op.policy_version, approved_by=approver,
                            expires_at=timezone.now() + timedelta(days=30))
    op.refresh_from_db()
    assert op.authorization_expires_at == first_expiry
    assert Evidence.objects.filter(operation=op, kind="authorization").count() == 1
    assert AuditEvent.objects.filter(object_id=op.id, action="operation.authorize").count() == 1


@pytest.mark.django_db
def test_it_makes_no_call_without_an_authorization(acme):
    op = prepared_payment(acme)
    report = operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "awaiting_authorization"
    assert op.status == S.NOT_STARTED and op.provider_calls == 0
    assert not Attempt.objects.filter(operation=op).exists()


@pytest.mark.django_db
def test_it_cancels_instead_of_calling_when_the_authorization_expired(acme, approver):
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    report = operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "cancelled" and "expired" in report.detail
    assert op.status == S.CANCELLED and op.provider_calls == 0
    assert not Attempt.objects.filter(operation=op).exists()
    assert Evidence.objects.filter(operation=op, to_status=S.CANCELLED).exists()


@pytest.mark.django_db
def test_it_cancels_instead_of_calling_when_the_policy_version_moved_on(acme, approver, settings):
    op = authorized_payment(acme, approver)
    hash_before = op.payload_hash
    settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
    report = operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "cancelled" and "payments-v4" in report.detail
    assert op.status == S.CANCELLED and op.provider_calls == 0
    assert op.payload_hash == hash_before


@pytest.mark.django_db
def test_it_lets_the_policy_authorize_what_needs_no_approval(acme):
    op = operation_prepare(tenant=acme, action="mail.send", payload={
        "to": "anna@example.com", "template": "receipt", "params": {"invoice": "inv_1"}})
    assert not op.requires_approval
    assert op.authorized_hash == op.payload_hash and op.authorized_by is None
    assert Evidence.objects.filter(operation=op, kind="authorization").exists()


@pytest.mark.django_db
def test_it_links_a_webhook_only_to_one_operation_of_the_provider_that_sent_it(acme):
    first = prepared_payment(acme)
    second = prepared_payment(acme, invoice_id="inv_other")
    Operation.objects.filter(id__in=[first.id, second.id]).update(external_id="pi_shared")

    # Another provider naming a payment operation is not about it.
    result, message = webhook_apply(provider="crm", facts=WebhookFacts(
        event_id="evt_crm_1", event_type="deal.updated", operation_id=first.id,
        status=CallOutcome.SUCCEEDED))
    assert (result, message) == ("unlinked", "no matching operation")
    # Two payments carrying the same external id: a person decides, nothing is picked.
    result, message = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_pay_1", event_type="payment_intent.succeeded", external_id="pi_shared",
        status=CallOutcome.SUCCEEDED))
    assert result == "unlinked" and "several payments operations" in message

    assert WebhookEvent.objects.filter(operation__isnull=True).count() == 2
    assert not Evidence.objects.filter(operation__in=[first, second], kind="webhook").exists()
    assert set(Operation.objects.filter(id__in=[first.id, second.id])
               .values_list("status", flat=True)) == {S.NOT_STARTED}


@pytest.mark.django_db
@pytest.mark.parametrize("due", ["unknown_due", "lease_expired"])
def test_it_queues_a_due_reconcile_once_until_its_claim_runs_out(acme, settings, due):
    from operations.engine import (
        operations_claim_due_for_reconcile,
        operations_due_for_reconcile,
    )
    from tests.operations.engine_helpers import died_mid_call, make_unknown

    settings.PROVIDER_TIMEOUT_SECONDS = 10
    if due == "unknown_due":
        op = make_unknown(prepared_payment(acme))
        Operation.objects.filter(id=op.id).update(next_reconcile_at=timezone.now())
    else:
        # While workers are behind, or with a second beat in a deploy's overlap, each
        # sweep would queue another reconcile of it, and each would be a lookup.
        op = died_mid_call(prepared_payment(acme),
                           claimed=timezone.now() - timedelta(minutes=2))
    status = Operation.objects.get(id=op.id).status

    first = operations_claim_due_for_reconcile()
    again = operations_claim_due_for_reconcile()  # the next sweep, while the lookup runs

    assert first == [op.id] and again == []
    op.refresh_from_db()
    assert op.next_reconcile_at > timezone.now() + timedelta(seconds=25)
    assert op.status == status  # a claim moves nothing but the next check
    # A reconcile that never ran: once the claim runs out, the operation is due again.
    Operation.objects.filter(id=op.id).update(next_reconcile_at=timezone.now())
    assert operations_due_for_reconcile() == [op.id]
    assert operations_claim_due_for_reconcile() == [op.id]


@pytest.mark.parametrize(
    ("amount_minor", "currency", "needs_approval"),
    [
        (5_000_000, "EUR", True),  # 50,000.00 EUR
        (4_999_999, "EUR", False),
        (50_000, "JPY", True),  # 50,000 JPY: no minor unit
        (4_999_999, "JPY", True),  # was "under 50,000.00" when minor units were compared
        (49_999_999, "KWD", False),  # 49,999.999 KWD: three decimals
        (50_000_000, "KWD", True),
    ],
)
def test_it_sets_the_deal_threshold_in_the_deals_own_currency(
    amount_minor, currency, needs_approval
):
    from operations.policy import policy_for

    policy = policy_for("crm.create_deal")
    payload = {"name": "Deal", "amount_minor": amount_minor, "currency": currency,
               "owner": "dana"}
    assert policy.requires_approval(payload) is needs_approval
    assert policy.version == "crm-v3"


@pytest.mark.django_db
def test_it_backs_off_queueing_again_an_approved_operation_no_worker_claims(acme, settings):
    settings.EXECUTE_RECHECK_SECONDS = 60
    settings.EXECUTE_RECHECK_MAX_SECONDS = 900
    op = authorized_payment(acme)

    def next_wait(
        *, approved_ago: float, changed_ago: float | None = None, expires_in: float = 86400
    ) -> float:
        now = timezone.now()
        Operation.objects.filter(id=op.id).update(
            authorized_at=now - timedelta(seconds=approved_ago),
            authorization_expires_at=now + timedelta(seconds=expires_in),
            status_changed_at=now - timedelta(seconds=changed_ago or approved_ago),
            next_reconcile_at=now - timedelta(seconds=1),
        )
        assert operations_claim_waiting_for_execute() == [op.id]
        assert operations_claim_waiting_for_execute() == []  # claimed until then
        op.refresh_from_db()
        return (op.next_reconcile_at - now).total_seconds()

    # As long again as it has waited: queued again at 1, 2, 4, 8 minutes, ...
    assert 60 <= next_wait(approved_ago=60) < 62
    assert 240 <= next_wait(approved_ago=240) < 242
    # ...never sooner than the recheck interval, never later than the cap.
    assert 60 <= next_wait(approved_ago=10) < 62
    assert 900 <= next_wait(approved_ago=5 * 3600) < 902
    # Proven absent a moment ago (status changed back to not_started): waited from then.
    assert 60 <= next_wait(approved_ago=3600, changed_ago=30) < 62
    # Late in a 15-minute approval: half the time left, so a lost message still gets
    # another try before it runs out (not at 960 s, after the approval expired).
    assert 209 <= next_wait(approved_ago=480, expires_in=420) < 211
    assert 60 <= next_wait(approved_ago=855, expires_in=45) < 62


@pytest.mark.django_db
def test_it_applies_a_webhook_to_the_status_a_worker_recorded_meanwhile(acme, monkeypatch):
    from operations.engine import webhooks

    op = prepared_payment(acme)
    Operation.objects.filter(id=op.id).update(
        status=S.IN_PROGRESS, provider_calls=1, lease_owner="w",
        lease_expires_at=timezone.now() + timedelta(seconds=30))
    found = webhooks._webhook_operation

    def found_then_the_worker_records_accepted(**kwargs):
        linked, problem = found(**kwargs)  # read while in_progress...
        Operation.objects.filter(id=op.id).update(
            status=S.ACCEPTED, external_id="pi_1", lease_owner="", lease_expires_at=None)
        return linked, problem  # ...and the worker's answer lands before the decision

    monkeypatch.setattr(webhooks, "_webhook_operation", found_then_the_worker_records_accepted)
    result, message = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_1", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id="pi_1", status=CallOutcome.SUCCEEDED))

    op.refresh_from_db()
    assert (result, message) == ("applied", "applied: accepted → succeeded")
    assert op.status == S.SUCCEEDED
    assert WebhookEvent.objects.get(event_id="evt_1").applied


@pytest.mark.django_db
def test_it_keeps_a_newer_calls_schedule_when_an_older_lookup_ends(acme, monkeypatch):
    from operations.engine import core, operation_reconcile
    from operations.providers.base import LookupOutcome, LookupResult
    from tests.operations.engine_helpers import make_unknown

    op = make_unknown(prepared_payment(acme))
    newer_check = timezone.now() + timedelta(seconds=40)
    real = core.adapter("payments.create")

    class SlowLookup:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            # Meanwhile another reconcile proved absence and call 2 went out and was lost:
            # unknown again, with its own next check.
            Operation.objects.filter(id=op.id).update(provider_calls=2,
                                                      next_reconcile_at=newer_check)
            return LookupResult(outcome=LookupOutcome.INCONCLUSIVE, reason="ambiguous")

    monkeypatch.setattr(core, "adapter", lambda action: SlowLookup())
    operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert op.next_reconcile_at == newer_check  # not "waiting for a person" from the old one
    assert op.evidence.filter(summary__startswith="lookup inconclusive").exists()


@pytest.mark.django_db
def test_it_derives_the_idempotency_key_from_the_operation_never_at_random(acme, run):
    from operations.intents import idempotency_key_for

    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                           command_id="cmd_pay_11")
    derived = {"operation_id": op.id, "action": op.action, "run_id": run.id,
               "command_id": "cmd_pay_11"}
    assert op.idempotency_key == idempotency_key_for(**derived)
    assert idempotency_key_for(**derived) == idempotency_key_for(**derived)


@pytest.mark.django_db
def test_it_holds_a_webhook_about_a_payment_for_another_sum_for_a_person(acme):
    from tests.operations.engine_helpers import make_unknown

    op = make_unknown(prepared_payment(acme))

    def event(event_id: str, amount: int) -> tuple[str, str]:
        return webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type="payment_intent.succeeded", operation_id=op.id,
            external_id="pi_1", status=CallOutcome.SUCCEEDED,
            data={"id": "pi_1", "status": "succeeded", "amount": amount, "currency": "kzt"}))

    result, message = event("evt_other_sum", 99_900)

    op.refresh_from_db()
    assert (result, op.status, op.external_id) == ("held", S.UNKNOWN, "")
    assert message == (
        "held for review: pi_1 is for 99900 KZT, the approved intent for 1250000 KZT (minor "
        f"units); {op.id} stays unknown, a person decides"
    )
    assert WebhookEvent.objects.get(event_id="evt_other_sum").needs_review
    assert op.evidence.filter(summary__contains="is for 99900 KZT").count() == 1
    # The same event for the intent's own sum settles it.
    assert event("evt_own_sum", 1_250_000)[0] == "applied"
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.SUCCEEDED, "pi_1")
