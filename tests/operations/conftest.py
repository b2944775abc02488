from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from operations.engine import operation_prepare
from operations.models import Operation

PAYMENT = {
    "invoice_id": "inv_9182",
    "beneficiary_id": "vendor_77",
    "amount_minor": 1250000,
    "currency": "KZT",
}


def payment(tenant, **changes) -> Operation:
    return operation_prepare(
        tenant=tenant, action="payments.create", payload={**PAYMENT, **changes}
    )


def make_unknown(op: Operation, *, ago: timedelta = timedelta(minutes=5)) -> Operation:
    """Test-only: put an operation in `unknown` as a lost provider answer would."""
    since = timezone.now() - ago
    Operation.objects.filter(id=op.id).update(
        status="unknown",
        unknown_since=since,
        status_changed_at=since,
        error_code="timeout",
        attempt_count=1,
        provider_calls=1,
    )
    op.refresh_from_db()
    return op


@pytest.fixture
def acme_payment(acme) -> Operation:
    return payment(acme)


@pytest.fixture
def acme_unknown(acme) -> Operation:
    return make_unknown(payment(acme, invoice_id="inv_unknown"))
