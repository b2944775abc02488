from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.services import approval_approve, approval_reject, approvals_expire_overdue
from operations.engine import operation_prepare
from tests.approvals.conftest import payment_payload
from tests.helpers import migrated_back_to, updated_past_triggers


@pytest.mark.django_db(transaction=True)
def test_it_says_why_it_cannot_go_back_over_a_supersede_without_successor(acme):
    deal = {"name": "Renewal", "amount_minor": 6_000_000, "currency": "EUR", "owner": "dana"}
    old = operation_prepare(tenant=acme, action="crm.create_deal", payload=deal)
    operation_prepare(tenant=acme, action="crm.create_deal", supersedes=old,
                      payload={**deal, "amount_minor": 4_000_000})
    assert Approval.objects.get(operation=old).status == ApprovalStatus.SUPERSEDED

    with pytest.raises(RuntimeError, match="1 superseded approval"), migrated_back_to(
        [("approvals", "0001_initial")]
    ):
        pass
    assert Approval.objects.filter(superseded_by__isnull=True, status="superseded").count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_gives_each_pending_approval_its_authors_and_leaves_decided_ones_as_they_were(
    acme, approver, admin_user, monkeypatch
):
    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)

    def prepare(actor=None, supersedes=None, **changes):
        op = operation_prepare(tenant=acme, action="payments.create",
                               payload=payment_payload(**changes), actor=actor,
                               supersedes=supersedes)
        return Approval.objects.filter(operation=op).first()

    approved = prepare(invoice_id="inv_a")
    approval_approve(approval_id=approved.id, actor=admin_user)
    rejected = prepare(invoice_id="inv_r", actor=approver)
    approval_reject(approval_id=rejected.id, actor=admin_user, reason="no")
    expired = prepare(invoice_id="inv_e")
    Approval.objects.filter(id=expired.id).update(expires_at=timezone.now() - timedelta(1))
    assert approvals_expire_overdue() == 1
    first = prepare(invoice_id="inv_s", actor=approver)
    pending = prepare(invoice_id="inv_s", amount_minor=1_150_000, supersedes=first.operation)
    statuses = set(Approval.objects.values_list("status", flat=True))
    assert statuses >= {"approved", "rejected", "expired", "superseded", "pending"}

    with migrated_back_to([("approvals", "0003_approval_decision_kept")]) as forward:
        apps = forward([("approvals", "0004_approval_authors")])
        Old = apps.get_model("approvals", "Approval")
        assert list(Old.objects.get(id=pending.id).authors) == [approver.pk]
        assert list(Old.objects.get(id=first.id).authors) == []
    assert Approval.objects.get(id=pending.id).status == ApprovalStatus.PENDING


@pytest.mark.django_db(transaction=True)
def test_it_adds_the_authors_of_a_replayed_command_to_its_pending_approval(
    acme, approver, operator, admin_user, monkeypatch
):
    """Approvals requested before four eyes followed derived runs lack the original run's
    launcher; pending ones get it, a decided one stays the record it is, and `authors` is
    kept immutable again afterwards."""
    from django.db import utils

    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory

    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)
    deal = {"name": "Renewal", "amount_minor": 6_000_000, "currency": "EUR", "owner": "dana"}
    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme, launched_by=approver))
    operation_prepare(tenant=acme, action="crm.create_deal", payload=deal, run=checkpoint.run,
                      checkpoint=checkpoint, command_id="cmd_deal")
    replays = [
        RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launched_by=operator,
                   launch_reason="the CRM timed out")
        for _ in range(2)
    ]
    pending, decided = (
        Approval.objects.get(operation=operation_prepare(
            tenant=acme, action="crm.create_deal", payload=deal, run=run, command_id="cmd_deal"))
        for run in replays
    )
    assert set(pending.authors) == {approver.pk, operator.pk}
    approval_reject(approval_id=decided.id, actor=admin_user, reason="not twice")

    with migrated_back_to([("approvals", "0004_approval_authors")]) as forward:
        # As 0004 left them: the replay's own launcher only.
        updated_past_triggers(Approval.objects.filter(id__in=[pending.id, decided.id]),
                              authors=[operator.pk])
        forward([("approvals", "0005_replay_authors")])

    assert sorted(Approval.objects.get(id=pending.id).authors) == sorted(
        [approver.pk, operator.pk])
    assert list(Approval.objects.get(id=decided.id).authors) == [operator.pk]
    with pytest.raises(utils.DatabaseError, match="immutable"):
        Approval.objects.filter(id=pending.id).update(authors=[])
