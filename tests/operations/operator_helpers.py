"""Shared by the operator-action modules: the resolve form as a browser posts it, a payment
the provider holds, a resolution by reference, and counts of what was recorded or asked."""

from __future__ import annotations

from operations.engine import operation_resolve
from operations.models import AuditEvent, Operation
from operations.sandbox.selectors import sandbox_counts
from operations.sandbox.services import sandbox_payment_create

RESOLVE = {
    "resolve-outcome": "succeeded",
    "resolve-evidence": "pi_123 seen as succeeded in the provider dashboard",
    "resolve-provider_reference": "pi_123",
    "resolve-reason": "customer confirmed the transfer",
}
# Evidence in words only: nothing to ask the provider.
TEXT_ONLY = {**RESOLVE, "resolve-provider_reference": ""}


def audit_count(op, action: str) -> int:
    return AuditEvent.objects.filter(
        object_type="operation", object_id=op.id, action=action
    ).count()


def payment_at_provider(op: Operation, *, amount: int | None = None, **metadata: str) -> str:
    """A payment the sandbox holds (made there directly, so no request is logged); for the
    intent's own sum unless told otherwise."""
    return sandbox_payment_create(
        amount=op.payload["amount_minor"] if amount is None else amount,
        currency=op.payload["currency"].lower(), metadata={"operation_id": op.id, **metadata},
        confirm=True,
    )["id"]


def resolved_by_reference(
    op: Operation, actor, reference: str, *, outcome: str = "succeeded"
) -> Operation:
    return operation_resolve(
        operation_id=op.id, actor=actor, outcome=outcome, evidence_text="seen in the dashboard",
        reason="customer asked", provider_reference=reference,
    )


def sandbox_request_count() -> int:
    return sandbox_counts()["requests"]
