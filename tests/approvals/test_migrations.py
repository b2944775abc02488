from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.services import approval_approve, approval_reject, approvals_expire_overdue
from operations.engine import operation_prepare
from tests.approvals.conftest import payment_payload
from tests.helpers import migrated_back_to


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
