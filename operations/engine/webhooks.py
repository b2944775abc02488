"""Apply verified provider events: stored once, applied only as an allowed transition."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Q, QuerySet

from operations import transitions
from operations.engine import core
from operations.engine.core import (
    LOOKUP_STATUS,
    S,
    transition,
)
from operations.models import (
    Action,
    Evidence,
    EvidenceKind,
    Operation,
    WebhookEvent,
)
from operations.providers.base import WebhookFacts

# The outcome of an event about an object that arrives while the operation's call is in
# flight and before its answer names the object: `webhook_events_decide_kept` looks for it
# once the answer, a lookup or a person has decided.
KEPT_IN_FLIGHT = "kept while the call was in flight"
# What an event reported, as the adapters parse it, from the status it recorded.
REPORTED_OUTCOME = {status: outcome for outcome, status in LOOKUP_STATUS.items()}


def webhook_apply(*, provider: str, facts: WebhookFacts) -> tuple[str, str]:
    """Store a verified provider event once and apply it only as an allowed transition.

    Returns (result, message): result is "duplicate", "applied", "ignored", "held" (for a
    person: the provider contradicts their decision) or "unlinked".
    One transaction: a crash after storing the event but before applying it would otherwise
    leave it stored, so the provider's redelivery would be answered "duplicate" and the
    event never applied. A concurrent delivery of the same event waits on the unique index
    and then counts as the duplicate.
    """
    with transaction.atomic():
        try:
            with transaction.atomic():
                event = WebhookEvent.objects.create(
                    provider=provider,
                    event_id=facts.event_id,
                    event_type=facts.event_type,
                    external_id=facts.external_id,
                    reported_status=LOOKUP_STATUS.get(facts.status, "") if facts.status else "",
                    data=facts.data,
                    provider_created_at=facts.created_at,
                )
        except IntegrityError:
            WebhookEvent.objects.filter(provider=provider, event_id=facts.event_id).update(
                deliveries=F("deliveries") + 1
            )
            return "duplicate", f"event {facts.event_id} already received"
        op, problem = _webhook_operation(provider=provider, facts=facts)
        if op is None:
            WebhookEvent.objects.filter(id=event.id).update(outcome=problem[:200])
            return "unlinked", problem
        # Decided on the status as it is under the row lock: read unlocked, a worker could
        # record its answer in between, and the event (answered 200, never sent again)
        # would be ignored as "moved meanwhile" instead of applied to the new status.
        op = Operation.objects.select_for_update(of=("self",)).select_related("tenant").get(
            id=op.id
        )
        result, message = _webhook_transition(op, facts=facts)
        WebhookEvent.objects.filter(id=event.id).update(
            operation=op, applied=result == "applied", needs_review=result == "held",
            outcome=message[:200],
        )
        if result == "applied" and facts.external_id:
            # This event named the object (on an operation no answer or lookup settled: its
            # worker gone, the search down): what was kept while the call was in flight is
            # decided now, or it would wait for an answer that never comes.
            webhook_events_decide_kept(op_id=op.id)
        return result, message


def _webhook_operation(*, provider: str, facts: WebhookFacts) -> tuple[Operation | None, str]:
    """The one operation of this provider the event is about, or why there is none."""
    actions = [a for a in Action.values if core.adapter(a).contract.provider == provider]
    ours = Operation.objects.select_related("tenant").filter(action__in=actions)
    if facts.operation_id:
        op = ours.filter(id=facts.operation_id).first()
        if op is not None:
            return op, ""
    if facts.external_id and facts.linked_by_object:
        # An external id is not unique across operations (every update of a CRM deal carries
        # the deal's id): several matches are for a person, never "pick one". A deal's id is
        # never enough (`WebhookFacts.linked_by_object`): a change someone made in the CRM
        # would count as the outcome of the one operation that recorded the deal.
        matches = list(ours.filter(external_id=facts.external_id)[:2])
        if len(matches) == 1:
            return matches[0], ""
        if matches:
            return None, f"several {provider} operations carry {facts.external_id}"
    return None, "no matching operation"


def _webhook_transition(op: Operation, *, facts: WebhookFacts) -> tuple[str, str]:
    target = LOOKUP_STATUS.get(facts.status) if facts.status else None
    data = {
        "event_id": facts.event_id,
        "event_type": facts.event_type,
        "external_id": facts.external_id,
    }
    other_object = bool(
        facts.external_id and op.external_id and facts.external_id != op.external_id
    )
    mismatch = (
        core.adapter(op.action).disagreement(payload=op.payload, facts=facts.data)
        if target is not None
        else ""
    )
    held = provider_report_held(
        op, external_id=facts.external_id, target=target, mismatch=mismatch, event=facts
    )
    # An event that moves nothing is kept on the timeline; a "held" one is also shown to
    # operators until a person disputes or resolves the operation.
    result = "ignored"
    if held:
        result, message = "held", f"held for review: {held}"
    elif first_object_reported(op, external_id=facts.external_id, target=target):
        return _webhook_object_record(op, facts=facts, data=data)
    elif op.resolved_manually or op.status == S.DISPUTED:
        message = f"ignored: {op.id} is {op.status} by an operator's decision"
    elif other_object:
        # Two provider objects carry this operation (a data incident): an event about the one
        # we did not record says nothing certain about ours.
        message = (
            f"ignored: the event is about {facts.external_id}, the operation records "
            f"{op.external_id}; a person decides"
        )
    elif op.status == S.IN_PROGRESS and not op.external_id and target is not None:
        # Our call is in flight and its answer has not named its object yet: the event may
        # be about that object, or about another one carrying this operation's id (made
        # outside the console). Applied now, another object's status and id would stand for
        # ours, and its "succeeded" or "failed" could not be undone by the answer. Kept on
        # the timeline, and decided as if it arrived then once the answer (a lookup, if it
        # is lost; a person, if neither names it) has: `webhook_events_decide_kept`.
        if facts.external_id:
            message = f"{KEPT_IN_FLIGHT}: decided once its answer names {op.id}'s object"
        else:
            message = f"ignored: the call of {op.id} is in flight; its answer decides"
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
        won = transition(
            op,
            to=target,
            sources={op.status},
            extra=Q(resolved_manually=False)
            & (Q(external_id="") | Q(external_id=facts.external_id or op.external_id)),
            evidence_kind=EvidenceKind.WEBHOOK,
            summary=f"webhook {facts.event_type}",
            data=data,
            fields=fields,
        )
        if won:
            return "applied", f"applied: {op.status} → {target}"
        return "ignored", "ignored: status moved meanwhile"
    _webhook_evidence(op, facts=facts, data=data, message=message)
    return result, message


def first_object_reported(op: Operation, *, external_id: str, target: str | None) -> bool:
    """A succeeded operation that records no object (a person resolved it by evidence text
    alone, or an answer that named none settled it) and a report, not held (an event, a
    lookup), of an object that moved money for it (or is moving it). That object is recorded
    as the operation's (`first_object_record`): without one, nothing tells a second effect
    from ours, and every later payment reported for the operation would be ignored as
    "already succeeded"."""
    return bool(
        op.status == S.SUCCEEDED and not op.external_id and external_id
        and target in (S.SUCCEEDED, S.ACCEPTED)
    )


def first_object_record(op: Operation, *, external_id: str) -> bool:
    """Record the reported object on the operation; its status does not change. False when
    the operation moved on or recorded one meanwhile."""
    return Operation.objects.filter(
        id=op.id, status=S.SUCCEEDED, external_id=""
    ).update(external_id=external_id) == 1


def _webhook_object_record(
    op: Operation, *, facts: WebhookFacts, data: dict[str, Any]
) -> tuple[str, str]:
    """Record the event's object on the operation; its status does not change (not applied:
    whoever settled it, a person or the engine, did so without this event)."""
    if first_object_record(op, external_id=facts.external_id):
        settled = (
            f"{op.status} by an operator's decision" if op.resolved_manually
            else f"already {op.status}"
        )
        message = f"ignored: {op.id} is {settled}; it records {facts.external_id} as its object"
    else:
        message = f"ignored: {op.id} moved meanwhile"
    _webhook_evidence(op, facts=facts, data=data, message=message)
    return "ignored", message


def provider_report_held(
    op: Operation, *, external_id: str, target: str | None, mismatch: str,
    event: WebhookFacts | None = None,
) -> str:
    """Why what the provider reports about `op` is for a person, or "" when it is not: an
    event (`event`), or a call's answer that arrived too late to land (`target`: the status
    it reports; `mismatch`: how its object differs from the approved effect). Read under the
    operation's row lock."""
    other_object = bool(external_id and op.external_id and external_id != op.external_id)
    # Another object than the one recorded that moved money (or is moving it): one intent,
    # two effects.
    second_effect = other_object and target in (S.SUCCEEDED, S.ACCEPTED)
    if op.resolved_manually or op.status == S.DISPUTED:
        if second_effect or mismatch:
            # A person's decision was about the effect they checked, not this one: even when
            # its status agrees with theirs, held for that person, as for any operation.
            what = (
                f"a second effect, {external_id} ({target}), carrying {op.id}"
                if second_effect else mismatch
            )
            return (
                f"the provider reports {what}; {op.id} stays {op.status} by an operator's "
                "decision"
            )
        # The payment's own "processing", made before it succeeded (a retried or late
        # delivery), trails a person's success as it trails the engine's (succeeded →
        # accepted is late or out of order): not a contradiction. Another object under way
        # is a second effect, held above; a disputed operation holds every other outcome.
        trails = op.status == S.SUCCEEDED and target == S.ACCEPTED
        if target is not None and target != op.status and not trails:
            # A person's decision stands, but the provider now says otherwise (money may have
            # moved after all): held for that person, loudly, not only a line on a timeline.
            return (
                f"the provider reports {target} ({external_id or 'no id'}); {op.id} stays "
                f"{op.status} by an operator's decision"
            )
        return ""
    if other_object:
        # Two provider objects carry this operation: one that moved money (or is moving it)
        # is a second effect of one intent, loudly, for a person.
        if second_effect:
            return (
                f"the provider reports a second effect, {external_id} ({target}), carrying "
                f"{op.id}, which records {op.external_id}; a person decides"
            )
        return ""
    if mismatch:
        # It names this operation but its object is not the approved effect (another sum):
        # applying its status would settle the operation with it.
        return f"{mismatch}; {op.id} stays {op.status}, a person decides"
    if target is not None and op.error_code == core.SEVERAL_MATCHES:
        # The last lookup found several objects carrying this operation: applied, this report
        # would pick one of them (the first to be reported) and forget the others.
        return (
            f"the provider reports {target} ({external_id or 'no id'}), but several objects "
            f"carry {op.id} ({op.error_message}); {op.id} stays {op.status}, a person decides"
        )
    if target is not None and _outcome_contradicted(op, target, event=event):
        # The journal closed it (the provider refused it, or lookups proved it never done),
        # and the provider now reports the effect: no reordering of events explains that.
        return (
            f"the provider reports {target} ({external_id or 'no id'}); {op.id} stays "
            f"{op.status}, a person decides"
        )
    return ""


def webhook_events_kept_exist(*, op_id: str) -> bool:
    """Whether events kept while the operation's call was in flight wait for a decision."""
    return _kept_in_flight(op_id).exists()


def _kept_in_flight(op_id: str) -> QuerySet[WebhookEvent]:
    return WebhookEvent.objects.filter(
        operation_id=op_id, applied=False, needs_review=False, outcome__startswith=KEPT_IN_FLIGHT
    )


def webhook_events_decide_kept(*, op_id: str) -> None:
    """Decide the events kept while the operation's call was in flight, once what they were
    waiting for is recorded: the object its answer or a lookup named, or a person's
    resolution. Each is applied, held or ignored as if it arrived now, oldest first: an
    effect of another object is a second effect (held); one about the operation's own object
    moves it as an allowed transition (a "succeeded" that overtook a "processing" answer
    settles it at once) or is held when it contradicts the outcome (a "succeeded" for the
    payment the answer declined). Call inside the transaction that records that outcome, so
    an agent never sees the outcome without the holds (a failed intent may be replaced)."""
    for event in _kept_in_flight(op_id).order_by("id"):
        op = Operation.objects.select_for_update(of=("self",)).select_related("tenant").get(
            id=op_id
        )
        facts = WebhookFacts(
            event_id=event.event_id, event_type=event.event_type, operation_id=op_id,
            external_id=event.external_id, status=REPORTED_OUTCOME.get(event.reported_status),
            data=event.data, created_at=event.provider_created_at,
        )
        result, message = _webhook_transition(op, facts=facts)
        WebhookEvent.objects.filter(id=event.id).update(
            applied=result == "applied", needs_review=result == "held", outcome=message[:200]
        )


def _outcome_contradicted(op: Operation, target: str, *, event: WebhookFacts | None) -> bool:
    """Whether an event's outcome contradicts a closed one rather than trailing it. A
    "processing" after the failure of that same object is only out of order when the
    provider made it before the failure (a call's late answer always was); made after it,
    or at a time it does not say, the payment was confirmed again (a failed PaymentIntent
    takes another payment method) and money is moving. "Succeeded" after it is money that
    moved after all. Anything
    under way on an operation closed as never done is an effect the lookups did not see; so
    it is on one waiting to be called, never called yet or proven absent so far (a search
    that lagged past its window, or an effect made outside the console with this operation's
    id). A failure that named no object (the provider refused the request) is never done
    too: a payment under way for it is not trailing that failure, and left unheld, the
    failed intent's replacement would pay a second time once it settles."""
    if op.status == S.FAILED and op.external_id:
        if target == S.ACCEPTED and event is not None:
            return not _made_before_the_failure(op, event.created_at)
        return target == S.SUCCEEDED
    if op.status in (S.FAILED, S.CANCELLED, S.NOT_STARTED):
        return target in (S.SUCCEEDED, S.ACCEPTED)
    return False


def _made_before_the_failure(op: Operation, created_at: datetime | None) -> bool:
    """Whether the provider made an event about a failed operation's object before the
    failure: by the time the provider gave its failure event, when one failed it (both on
    the provider's clock), else the time the journal recorded the failure, which is after
    the provider's."""
    if created_at is None:
        return False
    failed_at = WebhookEvent.objects.filter(
        operation_id=op.id, applied=True, reported_status=S.FAILED,
        external_id=op.external_id, provider_created_at__isnull=False,
    ).order_by("-provider_created_at").values_list("provider_created_at", flat=True).first()
    return created_at < (failed_at or op.status_changed_at)


def _webhook_evidence(
    op: Operation, *, facts: WebhookFacts, data: dict[str, Any], message: str
) -> None:
    """An event that moved nothing, kept on the operation's timeline."""
    Evidence.objects.create(
        operation=op,
        kind=EvidenceKind.WEBHOOK,
        from_status=op.status,
        to_status=op.status,
        summary=f"webhook {facts.event_type} {message}",
        data=data,
    )
