"""What operators do by hand: resolve, dispute, cancel. Always with a reason and evidence."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from operations import transitions
from operations.engine import core
from operations.engine.core import (
    LOOKUP_STATUS,
    ReferenceRefused,
    S,
    TransitionRefused,
    lookup_attempt_fields,
    lookup_data,
    lookup_guarded,
    next_attempt_number,
    person_text_check,
    require_perm,
    transition,
    unanswered_call_lands_by,
    worker_name,
)
from operations.engine.webhooks import webhook_events_decide_kept
from operations.models import (
    Attempt,
    AttemptKind,
    Evidence,
    EvidenceKind,
    Operation,
)
from operations.providers.base import LookupOutcome, LookupResult
from operations.services import audit_event_record

# What a provider id looks like (pi_…, deal_…, msg_…): anything else is a typo, and it goes
# into a URL path, where "/" or ".." would ask about another object.
REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


@dataclass(frozen=True)
class _Verified:
    """A provider's confirmation of a reference, and when it was asked."""

    found: LookupResult
    provider: str
    started_at: datetime
    finished_at: datetime
    problem: str  # why the answer does not back the resolution; empty when it does
    account: str  # the provider account asked (ProviderAdapter.account)


def operation_resolve(
    *,
    operation_id: str,
    actor: AbstractUser,
    outcome: str,
    evidence_text: str,
    reason: str,
    provider_reference: str = "",
    seen_status_changed_at: datetime | None = None,
    held_shown: Collection[int] | None = None,
    held_answers_shown: Collection[int] | None = None,
) -> Operation:
    """An operator settles an unknown (or disputed) operation by what they verified. A
    provider reference is first confirmed at the provider: it must name this operation's
    effect, in a state that agrees with the outcome.

    `seen_status_changed_at`: when the status the person looked at was set (the page says);
    refused if the operation has moved on since, say to accepted by a call made after.
    `held_shown`, `held_answers_shown`: the held provider events and call answers the page
    showed, which the decision answers (None: all of them)."""
    if outcome not in (S.SUCCEEDED, S.FAILED):
        raise TransitionRefused("resolve as succeeded or failed")
    reference = provider_reference.strip()
    if not reason.strip() or not (evidence_text.strip() or reference):
        raise TransitionRefused("a reason and evidence (text or provider reference) are required")
    person_text_check(evidence=evidence_text, provider_reference=reference, reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    require_perm(actor, "operate_operations", op)
    sources = transitions.sources(outcome, manual=True) - {S.IN_PROGRESS}
    if op.status not in sources:
        # Said before asking the provider: its answer could not change this.
        raise _unresolvable(op, outcome)
    if seen_status_changed_at is not None and op.status_changed_at != seen_status_changed_at:
        raise _moved_on(op)
    if outcome == S.FAILED and not reference:
        # A call the client gave up on may still be carried out: until then no one can know
        # it did nothing, and a failed intent may be replaced, whose new key would pay a
        # second time when it lands. (A reference the provider confirms as failed is the
        # call's own effect, which a late repeat with the key only finds again.)
        lands_by = unanswered_call_lands_by(
            op, late_landing=core.adapter(op.action).contract.late_landing
        )
        if lands_by is not None and lands_by > timezone.now():
            raise TransitionRefused(
                f"a call of {op.id} that got no answer may still be carried out by the "
                f"provider until {lands_by:%H:%M:%S} UTC, so nothing can show yet that it "
                "failed; reconcile after that, or resolve with the provider's reference."
            )
        if op.external_id:
            # The provider took the effect and holds its object (an accepted payment still
            # processing, say): it may yet complete, and a failed intent may be replaced
            # under a new key, which would pay twice. Only the provider can show it failed.
            raise _provider_holds(op)
    verified = _reference_verify(op, reference=reference, outcome=outcome) if reference else None
    if verified is not None and verified.problem:
        _reference_refusal_record(op, verified, actor=actor, facts={
            "outcome": outcome, "provider_reference": reference, "evidence": evidence_text,
            "reason": reason})
        raise ReferenceRefused(verified.problem)
    # A reference alone is the evidence (confirmed above): the timeline and the error line
    # say so rather than nothing.
    said = evidence_text.strip() or f"the provider's {reference}"
    fields: dict[str, Any] = {"resolved_manually": True}
    if outcome == S.FAILED:
        fields.update(error_code="resolved_failed", error_message=said[:500])
    data: dict[str, Any] = {
        "evidence": evidence_text,
        "provider_reference": reference,
        "reason": reason,
    }
    summary = f"resolved as {outcome} by {actor.username}: {said}"
    with transaction.atomic():
        # The verifying lookup and the resolution are recorded together or not at all.
        if verified is not None:
            attempt = _verification_attempt(op, verified)
            fields["external_id"] = verified.found.external_id or reference
            data["verified"] = lookup_data(verified.found, attempt=attempt.number)
            summary += f" ({reference} confirmed by {verified.provider})"
        won = transition(
            op,
            to=outcome,
            sources=sources,
            evidence_kind=EvidenceKind.MANUAL,
            manual=True,
            actor=actor,
            summary=summary,
            data=data,
            fields=fields,
            audit_action=f"operation.resolve_{outcome}",
            reason=reason,
            # The trail and its CSV must show what was verified, not only that it was.
            audit_facts={"evidence": evidence_text, "provider_reference": reference},
            extra=_resolution_condition(
                seen_status_changed_at=seen_status_changed_at,
                external_id=fields.get("external_id", ""),
                words_alone_fail=outcome == S.FAILED and not reference,
            ),
            held_shown=held_shown,
            held_answers_shown=held_answers_shown,
        )
        if not won:
            op.refresh_from_db()
            if op.status in sources and outcome == S.FAILED and not reference and (
                op.external_id
            ):
                raise _provider_holds(op)
            if op.status in sources:
                raise _moved_on(op)
            raise _unresolvable(op, outcome)
        webhook_events_decide_kept(op_id=op.id)
    op.refresh_from_db()
    return op


def _resolution_condition(
    *, seen_status_changed_at: datetime | None, external_id: str, words_alone_fail: bool
) -> Q:
    """What the resolution's UPDATE requires beyond its source statuses: the status the
    person saw, and, settled with a provider object, that the operation records no other
    (one an event or a lookup recorded while the reference was being confirmed).

    `words_alone_fail`: failed on evidence text alone, that it still records no provider
    object. A lookup may record one without moving the status (a payment found waiting for
    the customer's 3-D Secure stays unknown) after the check above read none."""
    condition = Q()
    if seen_status_changed_at is not None:
        condition &= Q(status_changed_at=seen_status_changed_at)
    if external_id:
        condition &= Q(external_id__in=["", external_id])
    if words_alone_fail:
        condition &= Q(external_id="")
    return condition


def _provider_holds(op: Operation) -> TransitionRefused:
    return TransitionRefused(
        f"the provider holds {op.external_id} for {op.id}, which may still complete; "
        "resolve as failed with that reference (its final state is looked up), or "
        "mark it disputed."
    )


def _unresolvable(op: Operation, outcome: str) -> TransitionRefused:
    return TransitionRefused(f"{op.id} is {op.status}; it cannot be resolved as {outcome}")


def _moved_on(op: Operation, *, doing: str = "resolving") -> TransitionRefused:
    return TransitionRefused(
        f"{op.id} is now {op.status} (since {op.status_changed_at:%H:%M:%S} UTC), not what the "
        f"page showed; reload and check again before {doing}"
    )


def _reference_verify(op: Operation, *, reference: str, outcome: str) -> _Verified:
    """Ask the provider about the reference, outside any transaction: what it answered, and
    why that does not confirm the outcome for this operation, if it does not. A reference
    that is not an id is refused without asking."""
    if len(reference) > 120 or not REFERENCE.fullmatch(reference):
        raise ReferenceRefused(
            f"{reference!r} is not a provider id (letters, digits and _ . : - only); "
            "check the reference."
        )
    adapter = core.adapter(op.action)
    provider = adapter.contract.provider
    started_at = timezone.now()
    found = lookup_guarded(op.id, lambda: adapter.retrieve(reference))
    problem = _reference_problem(op, found, reference=reference, outcome=outcome,
                                 provider=provider)
    return _Verified(found=found, provider=provider, started_at=started_at,
                     finished_at=timezone.now(), problem=problem, account=adapter.account())


def _reference_problem(
    op: Operation, found: LookupResult, *, reference: str, outcome: str, provider: str
) -> str:
    """Why the provider's answer does not back the resolution; empty when it does."""
    if found.outcome == LookupOutcome.ABSENT:
        return f"The {provider} provider says {found.reason}; check the reference."
    if found.outcome != LookupOutcome.FOUND:
        return (
            f"The {provider} provider could not be asked about {reference} ({found.reason}); "
            "try again, or resolve with the evidence text alone."
        )
    if op.id not in found.operation_ids:
        if not found.operation_ids:
            return (
                f"{reference} at the {provider} provider names no operation, so nothing ties "
                "it to this one; check the reference, or resolve with the evidence text alone."
            )
        # Named only within this tenant: an operator must not learn another tenant's ids.
        owners = sorted(
            Operation.objects.filter(id__in=found.operation_ids, tenant_id=op.tenant_id)
            .values_list("id", flat=True)
        )
        return (
            f"{reference} at the {provider} provider belongs to "
            f"{', '.join(owners) or 'an operation of another tenant'}, not to {op.id}; "
            "check the reference."
        )
    recorded, named = op.external_id, found.external_id or reference
    if recorded and named != recorded:
        # The provider made two objects under this operation's id: reconcile and webhooks
        # hold such a second one for a person. Settled with it, the operation would forget
        # the one it recorded, which may still be moving money.
        return (
            f"{op.id} records {recorded} at the {provider} provider, and {reference} is "
            "another object carrying its id: a second effect, which no resolution settles; "
            "mark the operation disputed while it is looked into."
        )
    mismatch = core.adapter(op.action).disagreement(payload=op.payload, facts=found.result)
    if mismatch:
        return (
            f"{mismatch}, so it is not this operation's approved effect; check the reference, "
            "or mark the operation disputed."
        )
    said = str(found.result.get("status") or found.status)
    settled = LOOKUP_STATUS.get(found.status)
    if settled == S.ACCEPTED:
        return (
            f"The {provider} provider reports {reference} as {said}, not final yet; resolve "
            "once it is, or with the evidence text alone."
        )
    if settled != outcome:
        return (
            f"The {provider} provider reports {reference} as {said}, which contradicts "
            f"resolving as {outcome}."
        )
    return ""


def _reference_refusal_record(
    op: Operation, verified: _Verified, *, actor: AbstractUser, facts: dict[str, str]
) -> None:
    """What the provider said about a reference it did not confirm is evidence too (it may
    name another operation's payment, or another sum), and the question was a call to the
    provider: its attempt, the lookup's evidence and the refused action's audit row. The
    status stays; no one's schedule changes."""
    with transaction.atomic():
        attempt = _verification_attempt(op, verified)
        status = Operation.objects.values_list("status", flat=True).get(id=op.id)
        Evidence.objects.create(
            operation_id=op.id, kind=EvidenceKind.LOOKUP, from_status=status,
            to_status=status, actor=actor,
            summary=f"{actor.username}'s reference {facts['provider_reference']} was not "
            f"accepted: {verified.problem}",
            # Not the provider's object itself: it may be another tenant's payment, which
            # the problem words without naming what is not theirs.
            data={"attempt": attempt.number, "method": verified.found.method or "",
                  "provider_request_id": verified.found.provider_request_id,
                  "problem": verified.problem, **facts},
        )
        audit_event_record(
            actor=actor, action=f"operation.resolve_{facts['outcome']}_refused",
            tenant=op.tenant, object_type="operation", object_id=op.id, reason=verified.problem,
            after=facts,
        )


def _verification_attempt(op: Operation, verified: _Verified) -> Attempt:
    """The lookup that confirmed the reference, as reconcile records its lookups. Written
    inside the resolution's transaction, only once the answer was kept."""
    # Locked first: attempt numbers are drawn under the row lock (next_attempt_number).
    Operation.objects.select_for_update().filter(id=op.id).values_list("id").first()
    return Attempt.objects.create(
        operation_id=op.id,
        number=next_attempt_number(op.id),
        kind=AttemptKind.LOOKUP,
        worker=worker_name(),
        started_at=verified.started_at,
        provider_account=verified.account,
        **lookup_attempt_fields(verified.found, finished_at=verified.finished_at),
    )


def operation_dispute(
    *, operation_id: str, actor: AbstractUser, reason: str,
    seen_status_changed_at: datetime | None = None,
    held_shown: Collection[int] | None = None,
    held_answers_shown: Collection[int] | None = None,
) -> Operation:
    """Put an operation on hold: no webhook or lookup moves it until a person resolves it.
    `seen_status_changed_at`, `held_shown`, `held_answers_shown`: as for operation_resolve.
    Disputing applies to settled effects too, so a page that showed unknown would otherwise
    put on hold a payment a webhook settled while the person decided."""
    if not reason.strip():
        raise TransitionRefused("a reason is required")
    person_text_check(reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    require_perm(actor, "operate_operations", op)
    sources = transitions.sources(S.DISPUTED, manual=True)
    extra = ~Q(status=S.IN_PROGRESS) | Q(lease_expires_at__lte=timezone.now())
    if seen_status_changed_at is not None:
        extra &= Q(status_changed_at=seen_status_changed_at)
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
        held_shown=held_shown,
        held_answers_shown=held_answers_shown,
    )
    if not won:
        op.refresh_from_db()
        if (
            op.status in sources
            and seen_status_changed_at is not None
            and op.status_changed_at != seen_status_changed_at
        ):
            raise _moved_on(op, doing="disputing")
        raise TransitionRefused(f"{op.id} is {op.status} (or still leased); it cannot be disputed")
    op.refresh_from_db()
    return op


def operation_cancel(
    *, operation_id: str, actor: AbstractUser | None, reason: str
) -> bool:
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
