from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Approval
from operations.engine import operation_prepare

BENEFICIARY = "vendor_778812345"
EMAIL = "anna.smith@example.com"


def payment_payload(**changes: Any) -> dict[str, Any]:
    return {
        "invoice_id": "inv_9182",
        "beneficiary_id": BENEFICIARY,
        "amount_minor": 1_250_000,
        "currency": "KZT",
        **changes,
    }


@pytest.fixture
def prepare_payment():
    """Prepare a payment intent (the signal files its approval); returns the approval."""

    def make(tenant, *, actor=None, supersedes=None, run=None, command_id="", **changes):
        op = operation_prepare(
            tenant=tenant, action="payments.create", payload=payment_payload(**changes),
            actor=actor, supersedes=supersedes, run=run, command_id=command_id,
        )
        return Approval.objects.get(operation=op, status="pending")

    return make


@pytest.fixture
def prepare_mail():
    def make(tenant, *, to: str = EMAIL):
        op = operation_prepare(
            tenant=tenant, action="mail.send",
            payload={"to": to, "template": "contract", "params": {"contact": to}},
        )
        return Approval.objects.get(operation=op, status="pending")

    return make


@pytest.fixture
def no_execute(monkeypatch):
    """Record what would be enqueued after commit instead of sending it to a broker."""
    enqueued: list[str] = []
    monkeypatch.setattr(
        "approvals.services.execute_on_commit", lambda operation_id: enqueued.append(operation_id)
    )
    return enqueued
