from __future__ import annotations

import pytest

from operations.models import Operation
from tests.helpers import migrated_back_to
from tests.operations.engine_helpers import authorized_payment, prepared_payment


@pytest.mark.django_db(transaction=True)
def test_it_gives_operations_left_waiting_before_0007_a_recheck(acme, approver):
    with migrated_back_to([("operations", "0006_tenant_role")]) as forward:
        waiting = authorized_payment(acme, approver)  # approved, never claimed
        fresh = prepared_payment(acme, invoice_id="inv_fresh")  # not approved: not waiting
        Operation.objects.filter(id__in=[waiting.id, fresh.id]).update(next_reconcile_at=None)

        forward([("operations", "0007_recheck_waiting_operations")])

        assert Operation.objects.get(id=waiting.id).next_reconcile_at is not None
        assert Operation.objects.get(id=fresh.id).next_reconcile_at is None
