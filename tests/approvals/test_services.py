from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, InternalError, transaction
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.services import (
    ApprovalRefused,
    approval_approve,
    approval_expire,
    approval_reject,
    approvals_expire_overdue,
)
from operations.engine import operation_cancel, operation_prepare
from operations.models import AuditEvent, Operation, OperationStatus, Run, RunMode
from tests.factories import UserFactory
from tests.helpers import updated_past_triggers

pytestmark = pytest.mark.django_db


def _audits(action: str, approval: Approval) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action, object_id=approval.id))


def test_it_files_one_pending_approval_bound_to_the_intent(acme, prepare_payment):
    approval = prepare_payment(acme)
    op = approval.operation
    assert approval.id.startswith("apr_")
    assert approval.payload_hash == op.payload_hash
    assert approval.policy_version == "payments-v3"
    assert approval.status == ApprovalStatus.PENDING
    ttl = approval.expires_at - approval.requested_at
    assert timedelta(hours=3, minutes=59) < ttl <= timedelta(hours=4)
    assert len(_audits("approval.request", approval)) == 1


def test_it_refuses_a_second_pending_approval_for_one_operation(acme, prepare_payment):
    approval = prepare_payment(acme)
    with pytest.raises(IntegrityError), transaction.atomic():
        Approval.objects.create(
            operation=approval.operation, payload_hash=approval.payload_hash,
            policy_version=approval.policy_version, expires_at=approval.expires_at,
        )


def test_it_refuses_an_unknown_status_in_the_database(acme, prepare_payment):
    approval = prepare_payment(acme)
    with pytest.raises(IntegrityError), transaction.atomic():
        Approval.objects.filter(id=approval.id).update(status="maybe")


def test_it_refuses_a_successor_on_an_approval_that_is_not_superseded(acme, prepare_payment):
    first, second = prepare_payment(acme), prepare_payment(acme)
    with pytest.raises(IntegrityError), transaction.atomic():
        Approval.objects.filter(id=first.id).update(superseded_by=second)


def test_it_approves_authorizes_and_enqueues_execution(acme, approver, prepare_payment,
                                                       no_execute):
    approval = prepare_payment(acme)
    approved = approval_approve(approval_id=approval.id, actor=approver, comment="invoice ok")
    assert approved.status == ApprovalStatus.APPROVED
    assert approved.decided_by == approver
    assert approved.comment == "invoice ok"
    op = Operation.objects.get(id=approval.operation_id)
    assert op.authorized_hash == op.payload_hash == approval.payload_hash
    assert op.authorization_expires_at == approval.expires_at
    assert op.authorized_by == approver
    assert no_execute == [op.id]
    assert len(_audits("approval.approve", approval)) == 1


def test_it_leaves_the_worker_time_to_start_after_a_last_minute_approval(
    acme, approver, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() + timedelta(seconds=5))
    approval_approve(approval_id=approval.id, actor=approver)
    op = Operation.objects.get(id=approval.operation_id)
    assert op.authorization_expires_at >= timezone.now() + timedelta(minutes=14)
    assert no_execute == [op.id]


def test_it_refuses_an_expired_approval_marks_it_expired_and_audits(
    acme, approver, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(ApprovalRefused, match="expired"):
        approval_approve(approval_id=approval.id, actor=approver)
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.EXPIRED
    refused = _audits("approval.approve_refused", approval)
    assert refused and "expired" in refused[0].reason
    op = Operation.objects.get(id=approval.operation_id)
    assert op.authorized_hash == ""
    assert op.status == OperationStatus.CANCELLED
    assert no_execute == []


def test_it_keeps_a_decided_approval_as_it_was_decided(acme, approver, prepare_payment,
                                                        no_execute):
    approval = prepare_payment(acme)
    approval_approve(approval_id=approval.id, actor=approver, comment="checked the invoice")
    refused = (IntegrityError, InternalError)
    for change in (
        lambda: Approval.objects.filter(id=approval.id).update(
            status=ApprovalStatus.REJECTED, comment="never approved"),
        lambda: Approval.objects.filter(id=approval.id).update(decided_by=None),
        lambda: Approval.objects.filter(id=approval.id).update(status=ApprovalStatus.PENDING),
        lambda: Approval.objects.filter(id=approval.id).delete(),
    ):
        with pytest.raises(refused, match=r"decided|DELETE"), transaction.atomic():
            change()
    approval.refresh_from_db()
    assert (approval.status, approval.decided_by, approval.comment) == (
        ApprovalStatus.APPROVED, approver, "checked the invoice")


def test_it_refuses_a_tampered_hash(acme, approver, prepare_payment, no_execute):
    approval = prepare_payment(acme)
    # PostgreSQL keeps an approval to the intent it binds...
    with pytest.raises((IntegrityError, InternalError), match="immutable"), transaction.atomic():
        Approval.objects.filter(id=approval.id).update(payload_hash="sha256:" + "0" * 64)
    # ...and should a row be tampered with past it, approving it still does nothing.
    updated_past_triggers(Approval.objects.filter(id=approval.id),
                          payload_hash="sha256:" + "0" * 64)
    with pytest.raises(ApprovalRefused, match="hash mismatch"):
        approval_approve(approval_id=approval.id, actor=approver)
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING
    assert Operation.objects.get(id=approval.operation_id).authorized_hash == ""
    (refused,) = _audits("approval.approve_refused", approval)
    assert refused.after["refusal"] == "tampered"


def test_it_refuses_when_the_policy_version_moved_on(acme, approver, prepare_payment,
                                                     settings, no_execute):
    approval = prepare_payment(acme)
    settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
    with pytest.raises(ApprovalRefused, match="payments-v4"):
        approval_approve(approval_id=approval.id, actor=approver)
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert no_execute == []



def test_it_keeps_what_the_person_wrote_on_a_refused_decision(
    acme, approver, prepare_payment, settings, no_execute
):
    approval = prepare_payment(acme)
    settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
    with pytest.raises(ApprovalRefused):
        approval_approve(approval_id=approval.id, actor=approver,
                         comment="  vendor confirmed by phone  ")
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(ApprovalRefused, match="expired"):
        approval_reject(approval_id=approval.id, actor=approver, reason="duplicate invoice")

    (approve,) = _audits("approval.approve_refused", approval)
    assert approve.after == {"operation": approval.operation_id, "status": "pending",
                             "refusal": "policy_changed", "comment": "vendor confirmed by phone"}
    assert "payments-v4" in approve.reason
    (reject,) = _audits("approval.reject_refused", approval)
    assert reject.after == {"operation": approval.operation_id, "status": "expired",
                            "refusal": "expired", "reason": "duplicate invoice"}
    assert no_execute == []

def test_it_refuses_an_approver_of_another_tenant(acme, other_tenant_user, prepare_payment):
    approval = prepare_payment(acme)
    with pytest.raises(ApprovalRefused, match="tenant acme"):
        approval_approve(approval_id=approval.id, actor=other_tenant_user)
    (refused,) = _audits("approval.approve_refused", approval)
    assert refused.actor == other_tenant_user


def test_it_refuses_an_auditor(acme, auditor, prepare_payment):
    approval = prepare_payment(acme)
    with pytest.raises(ApprovalRefused, match="approver role"):
        approval_approve(approval_id=approval.id, actor=auditor)


def test_it_refuses_the_creator_of_the_intent(acme, approver, prepare_payment):
    approval = prepare_payment(acme, actor=approver)
    with pytest.raises(ApprovalRefused, match="Four eyes"):
        approval_approve(approval_id=approval.id, actor=approver)


def test_it_refuses_the_launcher_of_the_run(acme, approver, prepare_payment):
    run = Run.objects.create(
        conversation_id="conv_1", tenant=acme, workflow_name="pay", workflow_version=1,
        state_schema_version=1, launched_by=approver,
    )
    approval = prepare_payment(acme, run=run, command_id="cmd_pay_1")
    with pytest.raises(ApprovalRefused, match="Four eyes"):
        approval_approve(approval_id=approval.id, actor=approver)


@pytest.mark.parametrize("changes", [{}, {"amount_minor": 1_150_000}],
                         ids=["asked-again-unchanged", "changed-by-the-agent"])
def test_it_refuses_the_author_of_an_intent_the_one_waiting_replaces(
    acme, approver, admin_user, prepare_payment, no_execute, changes
):
    # The approver writes a payment; a second person rejects it.
    first = prepare_payment(acme, actor=approver)
    approval_reject(approval_id=first.id, actor=admin_user, reason="not this vendor")
    # The agent asks again (unchanged, or changed), replacing it: still the approver's words.
    again = prepare_payment(acme, supersedes=first.operation, **changes)
    assert again.authors == [approver.pk]
    with pytest.raises(ApprovalRefused, match="Four eyes"):
        approval_approve(approval_id=again.id, actor=approver)
    assert Approval.objects.get(id=again.id).status == ApprovalStatus.PENDING
    # Another approver may.
    approval_approve(approval_id=again.id, actor=admin_user)
    assert no_execute == [again.operation_id]


@pytest.mark.parametrize("changes", [{}, {"amount_minor": 12_000_000}],
                         ids=["asked-again-unchanged", "changed-in-the-branch"])
def test_it_refuses_the_launcher_of_the_run_a_replay_repeats_a_command_of(
    acme, approver, operator, admin_user, no_execute, changes
):
    """The approver launched a run, so four eyes keeps them from approving its deal. A
    colleague replays the run live; the copy asks the same command again, under its own
    key: it is still the approver's, as an intent the agent asks again is."""
    from tests.factories import CheckpointFactory, RunFactory

    deal = {"name": "Renewal 2027", "amount_minor": 9_000_000, "currency": "EUR",
            "owner": "anna"}
    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme, launched_by=approver))
    first = operation_prepare(tenant=acme, action="crm.create_deal", payload=deal,
                              run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_deal")
    with pytest.raises(ApprovalRefused, match="Four eyes"):
        approval_approve(approval_id=Approval.objects.get(operation=first).id, actor=approver)
    replay = RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launched_by=operator,
                        launch_reason="the CRM timed out")
    again = Approval.objects.get(operation=operation_prepare(
        tenant=acme, action="crm.create_deal", payload={**deal, **changes}, run=replay,
        command_id="cmd_deal"))
    # Another command of the copy is the copy's launcher's alone.
    other = Approval.objects.get(operation=operation_prepare(
        tenant=acme, action="crm.create_deal", payload={**deal, "name": "Upsell"}, run=replay,
        command_id="cmd_other"))
    assert sorted(again.authors) == sorted([approver.pk, operator.pk])
    assert other.authors == [operator.pk]

    with pytest.raises(ApprovalRefused, match="one it replaces or repeats"):
        approval_approve(approval_id=again.id, actor=approver)
    (refused,) = _audits("approval.approve_refused", again)
    assert refused.actor == approver
    assert Approval.objects.get(id=again.id).status == ApprovalStatus.PENDING
    approval_approve(approval_id=other.id, actor=approver)
    approval_approve(approval_id=again.id, actor=admin_user)
    assert no_execute == [other.operation_id, again.operation_id]


def test_it_refuses_the_person_who_prepared_the_intent_from_a_shell(
    acme, approver, admin_user, monkeypatch, no_execute
):
    import io
    import json

    from django.core.management import call_command

    from tests.approvals.conftest import payment_payload

    # The approver, on the console's host as themselves (behind sudo), prepares a payment.
    monkeypatch.setenv("SUDO_USER", approver.username)
    out = io.StringIO()
    call_command("operations", "prepare", "--tenant", "acme", "--action", "payments.create",
                 "--payload", json.dumps(payment_payload()), stdout=out)
    op = Operation.objects.get(id=out.getvalue().strip())
    assert op.created_by == approver
    # The trail still names the shell's user, as for every command.
    prepared = AuditEvent.objects.get(action="operation.prepare", object_id=op.id)
    assert prepared.actor is None and prepared.actor_username == f"shell:{approver.username}"
    approval = Approval.objects.get(operation=op)
    with pytest.raises(ApprovalRefused, match="Four eyes"):
        approval_approve(approval_id=approval.id, actor=approver)
    approval_approve(approval_id=approval.id, actor=admin_user)
    assert no_execute == [op.id]
    # A shell user with no console account of that name prepares with no author.
    monkeypatch.setenv("SUDO_USER", "deploy")
    out = io.StringIO()
    call_command("operations", "prepare", "--tenant", "acme", "--action", "payments.create",
                 "--payload", json.dumps(payment_payload(invoice_id="inv_deploy")), stdout=out)
    assert Operation.objects.get(id=out.getvalue().strip()).created_by is None


def test_it_refuses_an_already_decided_approval_naming_who_and_when(
    acme, approver, admin_user, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    approval_approve(approval_id=approval.id, actor=approver)
    with pytest.raises(ApprovalRefused, match=r"Already approved by approver at \d{4}-"):
        approval_approve(approval_id=approval.id, actor=admin_user)
    with pytest.raises(ApprovalRefused, match="Already approved by approver"):
        approval_reject(approval_id=approval.id, actor=admin_user, reason="no")
    assert no_execute == [approval.operation_id]


def test_it_rejects_with_a_reason_and_cancels_the_operation(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    rejected = approval_reject(approval_id=approval.id, actor=approver, reason="wrong vendor")
    assert rejected.status == ApprovalStatus.REJECTED
    assert rejected.comment == "wrong vendor"
    op = Operation.objects.get(id=approval.operation_id)
    assert op.status == OperationStatus.CANCELLED
    (event,) = _audits("approval.reject", approval)
    assert event.reason == "wrong vendor"


def test_it_records_no_rejection_when_the_operation_already_left_not_started(
    acme, approver, prepare_payment
):
    approval = prepare_payment(acme)
    operation_cancel(operation_id=approval.operation_id, actor=None, reason="withdrawn")
    with pytest.raises(ApprovalRefused, match="already cancelled; nothing was rejected"):
        approval_reject(approval_id=approval.id, actor=approver, reason="wrong vendor")
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert not _audits("approval.reject", approval)
    assert len(_audits("approval.reject_refused", approval)) == 1
    # Its expiry still comes, and says the operation was not the one it cancelled.
    Approval.objects.filter(id=approval.id).update(expires_at=timezone.now())
    assert approval_expire(approval_id=approval.id) is True
    (event,) = _audits("approval.expire", approval)
    assert event.after["operation_cancelled"] is False


def test_it_refuses_a_rejection_without_a_reason(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    with pytest.raises(ApprovalRefused, match="needs a reason"):
        approval_reject(approval_id=approval.id, actor=approver, reason="  ")
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_supersedes_the_old_approval_when_the_intent_changes(
    acme, approver, prepare_payment, no_execute
):
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_350_000)
    old.refresh_from_db()
    assert old.status == ApprovalStatus.SUPERSEDED
    assert old.superseded_by == new
    assert new.payload_hash != old.payload_hash
    with pytest.raises(ApprovalRefused, match=f"superseded by a changed one \\({new.id}\\)"):
        approval_approve(approval_id=old.id, actor=approver)
    assert no_execute == []
    approval_approve(approval_id=new.id, actor=approver)
    assert no_execute == [new.operation_id]


def test_it_tells_an_approver_an_intent_asked_again_unchanged_was_not_changed(
    acme, approver, prepare_payment, no_execute
):
    """The agent asks again for the very same intent (its request ran out, and the sweep is
    behind): the refusal named a change that never happened, on the approver's screen and in
    the audit trail."""
    old = prepare_payment(acme)
    Approval.objects.filter(id=old.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    new = prepare_payment(acme, supersedes=old.operation)
    assert new.payload_hash == old.payload_hash

    with pytest.raises(ApprovalRefused) as refused:
        approval_approve(approval_id=old.id, actor=approver)
    assert refused.value.code == "already_superseded"
    assert f"asked again unchanged ({new.id})" in refused.value.message
    assert "changed one" not in refused.value.message
    (event,) = _audits("approval.approve_refused", old)
    assert event.reason == refused.value.message
    assert no_execute == []


def test_it_tells_an_intent_asked_again_unchanged_that_needs_no_approval_was_not_changed(
    acme, admin_user, monkeypatch
):
    from dataclasses import replace

    from operations.policy import POLICIES

    deal = {"name": "Renewal", "amount_minor": 6_000_000, "currency": "EUR", "owner": "dana"}
    old_op = operation_prepare(tenant=acme, action="crm.create_deal", payload=deal)
    old = Approval.objects.get(operation=old_op)
    # The same policy version, which now authorizes the very same intent itself.
    monkeypatch.setitem(POLICIES, "crm.create_deal", replace(
        POLICIES["crm.create_deal"], requires_approval=lambda payload: False))
    new_op = operation_prepare(tenant=acme, action="crm.create_deal", supersedes=old_op,
                               payload=deal)
    assert new_op.payload_hash == old_op.payload_hash and not new_op.requires_approval

    with pytest.raises(ApprovalRefused) as refused:
        approval_approve(approval_id=old.id, actor=admin_user)
    assert "by the same intent asked again, which needs no approval" in refused.value.message
    assert "changed one" not in refused.value.message


def test_it_supersedes_the_old_approval_when_the_new_intent_needs_none(acme, admin_user):
    from operations.engine import operation_prepare
    from tests.helpers import signed_in

    deal = {"name": "Renewal", "amount_minor": 6_000_000, "currency": "EUR", "owner": "dana"}
    old_op = operation_prepare(tenant=acme, action="crm.create_deal", payload=deal)
    old = Approval.objects.get(operation=old_op)
    # Cut under the approval threshold: the policy itself authorizes the new intent.
    new_op = operation_prepare(tenant=acme, action="crm.create_deal", supersedes=old_op,
                               payload={**deal, "amount_minor": 4_000_000})

    old.refresh_from_db()
    assert not new_op.requires_approval and not Approval.objects.filter(operation=new_op)
    assert (old.status, old.superseded_by) == (ApprovalStatus.SUPERSEDED, None)
    (event,) = _audits("approval.supersede", old)
    assert event.after == {"operation": old_op.id, "status": "superseded", "superseded_by": None}
    page = signed_in(admin_user).get(f"/approvals/{old.id}/").content.decode()
    assert new_op.id in page and "needs no approval" in page
    assert ">Approve</button>" not in page
    with pytest.raises(ApprovalRefused, match="needs no approval; there is nothing to decide"):
        approval_approve(approval_id=old.id, actor=admin_user)
    assert Operation.objects.get(id=old_op.id).status == OperationStatus.CANCELLED


def test_it_expires_the_others_when_one_overdue_approval_cannot_be(
    acme, prepare_payment, monkeypatch, caplog
):
    first, second = prepare_payment(acme), prepare_payment(acme, invoice_id="inv_2")
    Approval.objects.filter(id=first.id).update(expires_at=timezone.now() - timedelta(minutes=2))
    Approval.objects.filter(id=second.id).update(expires_at=timezone.now() - timedelta(minutes=1))
    real_cancel = operation_cancel

    def cancel_breaking_on_the_first(*, operation_id, **kwargs):
        if operation_id == first.operation_id:
            raise RuntimeError("a fault no sweep can mend")
        return real_cancel(operation_id=operation_id, **kwargs)

    monkeypatch.setattr("approvals.services.operation_cancel", cancel_breaking_on_the_first)
    # Soonest first, the broken one heads every sweep: it must not hold the others back.
    assert approvals_expire_overdue() == 1
    assert Approval.objects.get(id=first.id).status == ApprovalStatus.PENDING  # rolled back
    assert Approval.objects.get(id=second.id).status == ApprovalStatus.EXPIRED
    assert f"approval {first.id} could not be expired" in caplog.text
    assert len(_audits("approval.expire", second)) == 1 and not _audits("approval.expire", first)


def test_it_expires_overdue_approvals_only(acme, prepare_payment):
    overdue = prepare_payment(acme)
    fresh = prepare_payment(acme, invoice_id="inv_2")
    Approval.objects.filter(id=overdue.id).update(
        expires_at=timezone.now() - timedelta(minutes=1)
    )
    assert approvals_expire_overdue() == 1
    assert approvals_expire_overdue() == 0
    assert Approval.objects.get(id=overdue.id).status == ApprovalStatus.EXPIRED
    assert Approval.objects.get(id=fresh.id).status == ApprovalStatus.PENDING
    assert approval_expire(approval_id=fresh.id) is False
    assert len(_audits("approval.expire", overdue)) == 1


def test_it_schedules_the_expiry_sweep_every_30_seconds(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["expire-approvals"]
    # A run still queued after five minutes (a worker outage) is dropped: the next does all.
    assert entry == {"task": "approvals.expire_overdue", "schedule": 30.0,
                     "options": {"expires": 300.0}}
    from console.celery import app

    app.loader.import_default_modules()
    assert "approvals.expire_overdue" in app.tasks


def test_it_refuses_a_stranger_and_records_the_attempt(acme, prepare_payment, no_execute):
    approval = prepare_payment(acme)
    with pytest.raises(ApprovalRefused, match="the approver role on that tenant is needed"):
        approval_approve(approval_id=approval.id, actor=UserFactory(username="nobody"))
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    (event,) = _audits("approval.approve_refused", approval)
    assert event.actor_username == "nobody" and event.after["refusal"] == "other_tenant"
    assert not Operation.objects.get(id=approval.operation_id).authorized_hash
    assert no_execute == []


def test_it_enqueues_execution_only_when_the_approval_commits(
    acme, approver, prepare_payment, django_capture_on_commit_callbacks, monkeypatch
):
    from operations import tasks

    sent: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", sent.append)
    approval = prepare_payment(acme)

    with django_capture_on_commit_callbacks() as callbacks:
        approval_approve(approval_id=approval.id, actor=approver)
        assert sent == []  # nothing reaches the broker inside the transaction
    with django_capture_on_commit_callbacks() as refused_callbacks, pytest.raises(
        ApprovalRefused
    ):
        approval_approve(approval_id=approval.id, actor=approver)

    assert len(callbacks) == 1 and refused_callbacks == []
    callbacks[0]()
    assert sent == [approval.operation_id]


@pytest.mark.django_db(transaction=True)
def test_it_enqueues_nothing_for_an_approval_its_callers_transaction_rolls_back(
    acme, approver, monkeypatch
):
    """The execute message goes out on commit: a worker must never run an operation whose
    approval was rolled back with the caller's transaction."""
    from operations import tasks
    from tests.operations.engine_helpers import PAYMENT

    sent: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", sent.append)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT)
    approval = Approval.objects.get(operation=op)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        approval_approve(approval_id=approval.id, actor=approver)
        assert sent == []
        raise Abort

    assert sent == []
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert not Operation.objects.get(id=op.id).authorized_hash
    assert not AuditEvent.objects.filter(action="approval.approve").exists()
    # Approved for real, it is sent once, after its commit.
    approval_approve(approval_id=approval.id, actor=approver)
    assert sent == [op.id]


@pytest.mark.django_db(transaction=True)
def test_it_keeps_an_approval_and_runs_it_later_when_the_broker_is_down(
    acme, approver, prepare_payment, monkeypatch, caplog
):
    from kombu.exceptions import OperationalError

    from operations import engine, tasks

    approval = prepare_payment(acme)

    def broker_down(operation_id: str) -> None:
        raise OperationalError("Error 111 connecting to redis")

    monkeypatch.setattr(tasks.execute_operation, "delay", broker_down)
    approved = approval_approve(approval_id=approval.id, actor=approver)  # no error page

    assert approved.status == ApprovalStatus.APPROVED
    assert "Error 111" in caplog.text  # logged, not raised
    op = Operation.objects.get(id=approval.operation_id)
    assert op.status == OperationStatus.NOT_STARTED and op.authorized_hash == op.payload_hash
    assert op.next_reconcile_at > timezone.now() + timedelta(seconds=50)
    assert engine.operations_claim_waiting_for_execute() == []  # not yet: it may still run

    # The broker is back; a minute on, no worker has claimed it: the sweep queues it again.
    queued: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", queued.append)
    monkeypatch.setattr(tasks.reconcile_operation, "apply_async",
                        lambda args, **options: queued.append(*args))
    Operation.objects.filter(id=op.id).update(next_reconcile_at=timezone.now())
    assert tasks.sweep_operations() == 1
    assert queued == [op.id]
    assert tasks.sweep_operations() == 0  # claimed: not queued at every sweep


def test_it_records_who_why_and_the_status_before_and_after_each_decision(
    acme, approver, prepare_payment, no_execute
):
    approved = prepare_payment(acme)
    rejected = prepare_payment(acme, invoice_id="inv_2")
    approval_approve(approval_id=approved.id, actor=approver, comment="invoice matches the PO")
    approval_reject(approval_id=rejected.id, actor=approver, reason="wrong vendor")

    (event,) = _audits("approval.approve", approved)
    assert (event.actor, event.tenant, event.reason) == (approver, acme, "invoice matches the PO")
    assert event.before == {"status": "pending"}
    assert event.after == {"operation": approved.operation_id, "status": "approved",
                           "payload_hash": approved.payload_hash}
    (event,) = _audits("approval.reject", rejected)
    assert (event.actor, event.tenant, event.reason) == (approver, acme, "wrong vendor")
    assert event.before == {"status": "pending"}
    assert event.after == {"operation": rejected.operation_id, "status": "rejected"}
