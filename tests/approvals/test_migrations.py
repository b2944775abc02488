from __future__ import annotations

import pytest

from approvals.models import Approval, ApprovalStatus
from operations.engine import operation_prepare
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
