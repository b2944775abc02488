"""Apply verified provider events: stored once, applied only as an allowed transition."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from operations import transitions
from operations.engine.core import (
    LOOKUP_STATUS,
    S,
    transition,
)
from operations.models import (
    Evidence,
    EvidenceKind,
    Operation,
    WebhookEvent,
)


def webhook_apply(*, provider: str, facts) -> tuple[str, str]:
    """Store a verified provider event once and apply it only as an allowed transition.

    Returns (result, message): result is "duplicate", "applied", "ignored" or "unlinked".
    """
    try:
        with transaction.atomic():
            event = WebhookEvent.objects.create(
                provider=provider,
                event_id=facts.event_id,
                event_type=facts.event_type,
                external_id=facts.external_id,
                data=facts.data,
                provider_created_at=facts.created_at,
            )
    except IntegrityError:
        return "duplicate", f"event {facts.event_id} already received"

    op = None
    if facts.operation_id:
        op = Operation.objects.select_related("tenant").filter(id=facts.operation_id).first()
    if op is None and facts.external_id:
        op = (
            Operation.objects.select_related("tenant").filter(external_id=facts.external_id).first()
        )
    if op is None:
        WebhookEvent.objects.filter(id=event.id).update(outcome="no matching operation")
        return "unlinked", "no matching operation"

    target = LOOKUP_STATUS.get(facts.status) if facts.status else None
    data = {
        "event_id": facts.event_id,
        "event_type": facts.event_type,
        "external_id": facts.external_id,
    }
    if op.resolved_manually or op.status == S.DISPUTED:
        message = f"ignored: {op.id} is {op.status} by an operator's decision"
    elif target is None:
        message = f"ignored: {facts.event_type} carries no status"
    elif target == op.status:
        message = f"ignored: {op.id} is already {op.status}"
    elif not transitions.allowed(op.status, target):
        message = f"ignored: {op.status} → {target} is not allowed (late or out of order)"
    else:
        fields: dict[str, Any] = {}
        if facts.external_id and not op.external_id:
            fields["external_id"] = facts.external_id
        if target == S.FAILED:
            fields.update(error_code="provider_failed", error_message=facts.event_type)
        # The transition and the event's link to it commit together.
        with transaction.atomic():
            won = transition(
                op,
                to=target,
                sources={op.status},
                extra=Q(resolved_manually=False),
                evidence_kind=EvidenceKind.WEBHOOK,
                summary=f"webhook {facts.event_type}",
                data=data,
                fields=fields,
            )
            message = (
                f"applied: {op.status} → {target}" if won else "ignored: status moved meanwhile"
            )
            WebhookEvent.objects.filter(id=event.id).update(
                operation=op, applied=won, outcome=message[:200]
            )
        return ("applied" if won else "ignored"), message
    with transaction.atomic():
        WebhookEvent.objects.filter(id=event.id).update(operation=op, outcome=message[:200])
        Evidence.objects.create(
            operation=op,
            kind=EvidenceKind.WEBHOOK,
            from_status=op.status,
            to_status=op.status,
            summary=f"webhook {facts.event_type} {message}",
            data=data,
        )
    return "ignored", message
