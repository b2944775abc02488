"""What operators do by hand: resolve, dispute, cancel. Always with a reason and evidence."""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from django.utils import timezone

from operations import transitions
from operations.engine.core import (
    S,
    TransitionRefused,
    person_text_check,
    require_perm,
    transition,
)
from operations.models import (
    EvidenceKind,
    Operation,
)


def operation_resolve(
    *,
    operation_id: str,
    actor,
    outcome: str,
    evidence_text: str,
    reason: str,
    provider_reference: str = "",
) -> Operation:
    """An operator settles an unknown (or disputed) operation by what they verified."""
    if outcome not in (S.SUCCEEDED, S.FAILED):
        raise TransitionRefused("resolve as succeeded or failed")
    if not reason.strip() or not (evidence_text.strip() or provider_reference.strip()):
        raise TransitionRefused("a reason and evidence (text or provider reference) are required")
    person_text_check(evidence=evidence_text, provider_reference=provider_reference,
                      reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    require_perm(actor, "operate_operations", op)
    fields: dict[str, Any] = {"resolved_manually": True}
    if provider_reference:
        fields["external_id"] = provider_reference
    if outcome == S.FAILED:
        fields.update(error_code="resolved_failed", error_message=evidence_text[:500])
    won = transition(
        op,
        to=outcome,
        sources=transitions.sources(outcome, manual=True) - {S.IN_PROGRESS},
        evidence_kind=EvidenceKind.MANUAL,
        manual=True,
        actor=actor,
        summary=f"resolved as {outcome} by {actor.username}: {evidence_text}",
        data={
            "evidence": evidence_text,
            "provider_reference": provider_reference,
            "reason": reason,
        },
        fields=fields,
        audit_action=f"operation.resolve_{outcome}",
        reason=reason,
    )
    if not won:
        op.refresh_from_db()
        raise TransitionRefused(f"{op.id} is {op.status}; it cannot be resolved as {outcome}")
    op.refresh_from_db()
    return op


def operation_dispute(*, operation_id: str, actor, reason: str) -> Operation:
    """Put an operation on hold: no webhook or lookup moves it until a person resolves it."""
    if not reason.strip():
        raise TransitionRefused("a reason is required")
    person_text_check(reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    require_perm(actor, "operate_operations", op)
    sources = transitions.sources(S.DISPUTED, manual=True)
    extra = ~Q(status=S.IN_PROGRESS) | Q(lease_expires_at__lte=timezone.now())
    won = transition(
        op,
        to=S.DISPUTED,
        sources=sources,
        extra=extra,
        evidence_kind=EvidenceKind.MANUAL,
        manual=True,
        actor=actor,
        summary=f"marked disputed by {actor.username}: {reason}",
        data={"reason": reason},
        fields={"resolved_manually": True},
        audit_action="operation.dispute",
        reason=reason,
    )
    if not won:
        op.refresh_from_db()
        raise TransitionRefused(f"{op.id} is {op.status} (or still leased); it cannot be disputed")
    op.refresh_from_db()
    return op


def operation_cancel(*, operation_id: str, actor, reason: str) -> bool:
    """Cancel an intent that never ran (a rejected or superseded approval)."""
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    return transition(
        op,
        to=S.CANCELLED,
        sources={S.NOT_STARTED},
        evidence_kind=EvidenceKind.TRANSITION,
        actor=actor,
        summary=f"cancelled: {reason}",
        data={"reason": reason},
        fields={"error_code": "cancelled", "error_message": reason},
        audit_action="operation.cancel" if actor is not None else "",
        reason=reason,
    )
