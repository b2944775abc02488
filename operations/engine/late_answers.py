"""A call's answer that arrives after the operation moved on without it: our lease ran out
while the call was in flight, and a lookup, a provider event or a person settled the
operation meanwhile. Execute records every answer on its attempt row; what here decides is
whether the answer contradicts the journal and is held for a person."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F, Q

from operations.engine import core
from operations.engine.core import S
from operations.engine.webhooks import provider_report_held
from operations.models import Attempt, Evidence, EvidenceKind, Operation, WebhookEvent
from operations.providers.base import CallResult


def webhook_events_hold_another_object(op: Operation, *, ours: str) -> None:
    """The call's answer names `ours` while the operation took another object from a
    provider event after our lease ran out: that event settled it with a payment our call
    did not make, so two carry the operation. Held for a person, in the transaction that
    keeps the answer on the attempt row (the provider's own event about ours then reads as
    a second effect too)."""
    WebhookEvent.objects.filter(
        ~Q(external_id__in=["", ours]), operation_id=op.id, applied=True, needs_review=False,
        operation__resolved_manually=False, operation__external_id=F("external_id"),
    ).update(
        needs_review=True,
        outcome=f"held for review: the call's answer named {ours}, not this event's object, "
        "which settled the operation; a person decides"[:200],
    )


def late_answer_decide(
    op: Operation, attempt: Attempt, result: CallResult, *, reported: str, worker: str
) -> None:
    """A definite answer that arrived too late to land: the operation moved on without it
    (our lease ran out, and a lookup, an event or a person settled it). Decided as the
    provider's event reporting the same would be: one that contradicts what the journal now
    says (a payment after a person disputed it, a second object, an outcome closed as
    failed) is held for a person, with a line on the timeline; one that agrees stays on its
    attempt row."""
    mismatch = (
        core.adapter(op.action).disagreement(payload=op.payload, facts=result.result)
        if result.error_class == core.NOT_THE_APPROVED_EFFECT else ""
    )
    with transaction.atomic():
        locked = Operation.objects.select_for_update(of=("self",)).get(id=op.id)
        if locked.status == S.NOT_STARTED or (
            locked.status == S.IN_PROGRESS and locked.lease_owner != worker
        ):
            # A lookup proved the call absent so far, and a call with the same key follows
            # (or is under way): the provider answers that one with this same object.
            return
        why = provider_report_held(
            locked, external_id=result.external_id, target=None if mismatch else reported,
            mismatch=mismatch,
        )
        if mismatch and not why:
            # Our call made an object that is not the approved effect: whatever the
            # operation records now, a person looks at it.
            why = f"{mismatch}; {op.id} stays {locked.status}, a person decides"
        if not why:
            return
        Attempt.objects.filter(id=attempt.id).update(needs_review=True, review_note=why[:500])
        Evidence.objects.create(
            operation_id=op.id,
            kind=EvidenceKind.CALL_RESULT,
            from_status=locked.status,
            to_status=locked.status,
            summary=f"the answer to call {attempt.number} arrived late and is held for "
            f"review: {why}",
            data={
                "attempt": attempt.number,
                "http_status": result.http_status,
                "provider_request_id": result.provider_request_id,
                "external_id": result.external_id,
                "reported": "" if mismatch else reported,
            },
        )
