"""One operation's timeline: its attempts, evidence, webhook events and audit events in time
order, bounded on its page however long the operation has been looked up."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import F, Func, IntegerField, OuterRef, Q, QuerySet, Subquery

from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    AuditEvent,
    Evidence,
    Operation,
    WebhookEvent,
)

# What the page shows of a long timeline: how it began (the intent, its approval, the first
# call) and the newest entries. An operation left unknown for weeks is looked up every few
# minutes; all of it was a page of thousands of entries that took a second to build.
TIMELINE_HEAD = 20
TIMELINE_TAIL = 180


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    kind: str  # attempt / evidence / webhook / audit
    title: str
    detail: str = ""
    actor: str = ""
    status: str = ""
    code: str = ""  # an audit event's action, as the audit trail and its filter name it


@dataclass(frozen=True)
class Timeline:
    """What the page shows: `head` then, after `left_out` entries not shown, `tail`."""

    head: list[TimelineEntry]
    left_out: int = 0
    tail: list[TimelineEntry] = field(default_factory=list)

    def __iter__(self) -> Iterator[TimelineEntry]:
        yield from self.head
        yield from self.tail


# What each audited action on an operation was, in a person's words; the code stays beside
# it, since the audit trail is filtered by code.
_AUDIT_TITLES = {
    "operation.prepare": "Intent recorded",
    "operation.authorize": "Approval recorded for this payload hash",
    "operation.execute": "Run asked for by a person",
    "operation.reconcile": "Reconcile asked for by a person",
    "operation.resolve_succeeded": "Resolved as succeeded by a person",
    "operation.resolve_failed": "Resolved as failed by a person",
    "operation.resolve_succeeded_refused": "Resolution as succeeded refused",
    "operation.resolve_failed_refused": "Resolution as failed refused",
    "operation.dispute": "Marked disputed",
    "operation.cancel": "Cancelled",
    "operation.view_unmasked": "Unmasked intent viewed",
}


_REFERENCE_OUTCOMES = {
    AttemptOutcome.FOUND: "found",
    AttemptOutcome.ABSENT: "not found at the provider",
}

# Entries of one instant keep an order: attempts, evidence, webhook events, audit events.
_ATTEMPT, _EVIDENCE, _WEBHOOK, _AUDIT = range(4)

_Keyed = tuple[tuple[datetime, int, int], TimelineEntry]


def _audit_of(op: Operation) -> QuerySet:
    return AuditEvent.objects.filter(object_type="operation", object_id=op.id)


def _reference_checks(evidence_rows: Iterable[Evidence]) -> dict[int, str]:
    """The lookups made to check a person's provider reference, by attempt number: the
    resolution that used it, or its refusal, names both."""
    checks: dict[int, str] = {}
    for evidence in evidence_rows:
        reference = evidence.data.get("provider_reference")
        # The refusal names its lookup's attempt; the resolution, the lookup it kept.
        number = evidence.data.get("attempt") or evidence.data.get("verified", {}).get("attempt")
        if reference and number:
            checks[number] = reference
    return checks


def _attempt_entries(
    attempts: Iterable[Attempt], *, references: dict[int, str], accounts: int
) -> Iterator[_Keyed]:
    for attempt in attempts:
        http = f"HTTP {attempt.http_status}" if attempt.http_status else ""
        # Named only when requests of this operation reached more than one provider account:
        # then which went where is what a person needs to see (a lookup in one account
        # cannot see an effect made in the other).
        account = f"account {attempt.provider_account}" if accounts > 1 else ""
        held = (
            "" if not attempt.needs_review
            else "held for review" if attempt.reviewed_at is None
            else "held for review, answered by a person's decision"
        )
        # A call with no answer at all (its worker died or stalled): until when it may still
        # reach the provider is what a lookup that finds nothing must wait out.
        unanswered = (
            f"no answer yet; may reach the provider until {attempt.reach_until:%H:%M:%S}"
            if attempt.kind == AttemptKind.CALL and attempt.finished_at is None else ""
        )
        parts = (http, account, attempt.external_id, attempt.error_class,
                 attempt.error_message[:200], unanswered, held)
        reference = references.get(attempt.number)
        if reference is not None:
            # Its answer is about a person's reference, not the operation's effect: "proven
            # absent" there would read as if the effect were proven never made.
            what = f"lookup of the reference {reference}"  # an id: its case is kept
            outcome = _REFERENCE_OUTCOMES.get(attempt.outcome, "")
        else:
            what = attempt.get_kind_display().lower()
            outcome = ""
        outcome = outcome or attempt.get_outcome_display().lower()
        yield (attempt.started_at, _ATTEMPT, attempt.id), TimelineEntry(
            at=attempt.started_at,
            kind="attempt",
            title=f"Attempt {attempt.number}: {what} → {outcome}",
            detail=" · ".join(p for p in parts if p),
            actor=attempt.worker,
            status=attempt.outcome,
        )


def _evidence_entries(evidence_rows: Iterable[Evidence]) -> Iterator[_Keyed]:
    for evidence in evidence_rows:
        # A status left as it was says so: "Webhook: failed" read as if the webhook failed.
        moved = (
            f"{evidence.from_status} → {evidence.to_status}"
            if evidence.from_status != evidence.to_status
            else f"stays {evidence.to_status}" if evidence.to_status else ""
        )
        kind = evidence.get_kind_display()
        yield (evidence.created_at, _EVIDENCE, evidence.id), TimelineEntry(
            at=evidence.created_at,
            kind="evidence",
            title=f"{kind}: {moved}" if moved else kind,
            detail=evidence.summary,
            actor=evidence.actor.username if evidence.actor else "",
            status=evidence.to_status,
        )


def _webhook_entries(events: Iterable[WebhookEvent]) -> Iterator[_Keyed]:
    for event in events:
        yield (event.received_at, _WEBHOOK, event.id), TimelineEntry(
            at=event.received_at,
            kind="webhook",
            title=f"Webhook {event.provider} {event.event_type}",
            detail=" · ".join(p for p in (
                event.event_id, event.outcome,
                f"delivered {event.deliveries} times, applied at most once"
                if event.deliveries > 1 else "",
            ) if p),
        )


def _audit_entries(events: Iterable[AuditEvent]) -> Iterator[_Keyed]:
    for event in events:
        yield (event.created_at, _AUDIT, event.id), TimelineEntry(
            at=event.created_at,
            kind="audit",
            title=_AUDIT_TITLES.get(event.action, "Audit event"),
            detail=event.reason,
            actor=event.actor_username or "system",
            code=event.action,
        )


def _timeline_end(op: Operation, *, newest: bool, limit: int | None) -> list[TimelineEntry]:
    """The first `limit` entries (the newest, with `newest`; all of them without a limit),
    oldest first. Each source is read in the timeline's own order, up to `limit` rows, so
    the merged first `limit` are the timeline's."""
    sign = "-" if newest else ""

    def end_of(qs: QuerySet, at: str) -> QuerySet:
        qs = qs.order_by(f"{sign}{at}", f"{sign}id")
        return qs if limit is None else qs[:limit]

    # Read apart from the rows shown: the attempts shown may be checks of a reference
    # recorded on evidence not shown, and one attempt to another account anywhere makes
    # each worth naming. No ordering: Attempt's own would join the operation and make every
    # row distinct.
    accounts = op.attempts.exclude(provider_account="").order_by().values(
        "provider_account").distinct()[:2].count()
    references = _reference_checks(op.evidence.filter(data__has_key="provider_reference"))
    merged = heapq.merge(
        _attempt_entries(end_of(op.attempts.all(), "started_at"), references=references,
                         accounts=accounts),
        _evidence_entries(end_of(op.evidence.select_related("actor"), "created_at")),
        _webhook_entries(end_of(op.webhooks.all(), "received_at")),
        _audit_entries(end_of(_audit_of(op), "created_at")),
        key=lambda pair: pair[0],
        reverse=newest,
    )
    entries = [entry for _, entry in merged][:limit]
    return entries[::-1] if newest else entries


def _count(qs: QuerySet) -> Subquery:
    # COUNT as a plain function, not an aggregate: no GROUP BY, one row for the operation.
    return Subquery(
        qs.order_by().annotate(n=Func(F("id"), function="COUNT")).values("n"),
        output_field=IntegerField(),
    )


def _timeline_length(op: Operation) -> int:
    counts = Operation.objects.filter(id=op.id).values(
        attempts_n=_count(Attempt.objects.filter(operation=OuterRef("id"))),
        evidence_n=_count(Evidence.objects.filter(operation=OuterRef("id"))),
        webhooks_n=_count(WebhookEvent.objects.filter(operation=OuterRef("id"))),
        audit_n=_count(AuditEvent.objects.filter(
            Q(object_type="operation") & Q(object_id=OuterRef("id")))),
    ).get()
    return sum(counts.values())


def operation_timeline(op: Operation, *, whole: bool = False) -> Timeline:
    """Attempts, evidence, webhook events and audit events of one operation, in time order:
    its first and newest entries when there are more than a page shows, or all of them
    (`whole`)."""
    if whole:
        return Timeline(_timeline_end(op, newest=False, limit=None))
    length = _timeline_length(op)
    if length <= TIMELINE_HEAD + TIMELINE_TAIL:
        return Timeline(_timeline_end(op, newest=False, limit=None))
    return Timeline(
        head=_timeline_end(op, newest=False, limit=TIMELINE_HEAD),
        left_out=length - TIMELINE_HEAD - TIMELINE_TAIL,
        tail=_timeline_end(op, newest=True, limit=TIMELINE_TAIL),
    )
