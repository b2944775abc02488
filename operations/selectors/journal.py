"""The operations journal: its pages, and one operation's lineage and timeline."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F, Lookup, QuerySet
from django.utils import timezone

from operations.ids import id_after
from operations.models import (
    AttemptKind,
    AttemptOutcome,
    AuditEvent,
    Checkpoint,
    Evidence,
    Operation,
    Run,
)
from operations.selectors.access import tenants_for_user
from operations.signals import RelatedPage, operation_related_pages


def keyset_page(qs: QuerySet, *, before: int | str | None, size: int, key: str = "id"):
    """One page ordered by `key` descending, and the cursor for the next page (or None).

    No OFFSET and no COUNT(*): the cost of a page is the same at row 10 and row 10 million.
    """
    if before not in (None, ""):
        qs = qs.filter(**{f"{key}__lt": before})
    rows = list(qs[: size + 1])
    next_cursor = getattr(rows[size - 1], key) if len(rows) > size else None
    return rows[:size], next_cursor


@dataclass(frozen=True)
class OperationFilters:
    status: str = ""
    tenant: str = ""  # slug
    action: str = ""
    run: str = ""
    older_than: timedelta | None = None


class _TenantAmong(Lookup):
    """`tenant_id = ANY(ARRAY[…])`, even for one tenant. Written as `tenant_id = 1`, the
    planner knows the tenant is constant, so the primary key read backwards "gives" the
    page's order too, and it prices that walk as if the tenant's rows were spread evenly
    through time. A quiet tenant beside a busy one is not: the walk reads every newer
    operation of the other tenant first (20,000 rows for a page after 100 s of 200/s, a
    million after 80 minutes). Through ANY the tenant is no constant to the planner, and only
    the (tenant, -id) index gives the order (tenant, -id) the page then asks for."""

    lookup_name = "tenant_among"
    prepare_rhs = False

    def as_sql(self, compiler, connection):
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"{lhs} = ANY({rhs}::bigint[])", [*lhs_params, *rhs_params]


def keyset_page_of_tenants(
    qs: QuerySet, *, tenant_ids: list[int], before: str | None, size: int
) -> tuple[list, str | None]:
    """keyset_page for rows of tenants with a (tenant, -id) index, newest first: each
    tenant's newest `size + 1` ids read through that index alone (see _TenantAmong), then
    merged, then those rows fetched by primary key through `qs` (with what it selects and
    annotates). What a page costs depends on how many tenants the user sees, never on how
    many rows other tenants wrote since."""
    if not tenant_ids:
        return [], None
    if before not in (None, ""):
        qs = qs.filter(id__lt=before)
    newest = [
        qs.filter(_TenantAmong(F("tenant_id"), [tenant_id]))
        .order_by("tenant_id", "-id")
        .values_list("id", flat=True)[: size + 1]
        for tenant_id in tenant_ids
    ]
    if len(newest) == 1:
        ids = list(newest[0])
    else:
        ids = list(newest[0].union(*newest[1:], all=True).order_by("-id")[: size + 1])
    rows = list(qs.filter(id__in=ids).order_by("-id")) if ids else []
    next_cursor = rows[size - 1].id if len(rows) > size else None
    return rows[:size], next_cursor


def operations_journal_page(
    user, *, filters: OperationFilters, before: str | None, size: int
) -> tuple[list[Operation], str | None]:
    """One page of the journal rows the user may see, newest first (ids are time-sortable),
    and the cursor for the next page (or None)."""
    tenants = tenants_for_user(user)
    if filters.tenant:
        # Resolved to its id here, not joined into the page's query: there the slug hides
        # from the planner which tenant it is, and a page of a quiet tenant is read off the
        # primary key through every newer operation of the others.
        tenants = tenants.filter(slug=filters.tenant)
    qs = Operation.objects.select_related("tenant")
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.action:
        qs = qs.filter(action=filters.action)
    if filters.run:
        qs = qs.filter(run_id=filters.run)
    if filters.older_than is not None:
        threshold = timezone.now() - filters.older_than
        # created_at has no index: alone, a page of "older than 1 hour" walks back through
        # every operation of that hour first. An operation's id is made from the same clock
        # just before its created_at (prepare), so none older than the threshold has an id
        # past it, and the bound starts the (tenant, -id) index there. created_at keeps the
        # answer exact; an id made while the clock had stepped back (ids stay monotonic)
        # only shows that operation here a step later.
        qs = qs.filter(id__lt=id_after("op", threshold), created_at__lt=threshold)
    return keyset_page_of_tenants(
        qs, tenant_ids=list(tenants.values_list("id", flat=True)), before=before, size=size
    )


@dataclass(frozen=True)
class OperationLineage:
    """Where an operation came from, as its pages may name it: only within its tenant."""

    run: Run | None
    checkpoint: Checkpoint | None
    supersedes: Operation | None


def operation_lineage(op: Operation) -> OperationLineage:
    """The operation's run, checkpoint and the intent it replaces, each left out when it is
    another tenant's (or the checkpoint another run's). Prepare and, since migration 0016, a
    trigger keep lineage inside the tenant; a row from before that, or written with the
    trigger off, would otherwise show one tenant another's run ids, amounts and the reasons
    its people gave. Reads the relations already loaded (select_related)."""
    run = op.run if op.run_id and op.run.tenant_id == op.tenant_id else None
    checkpoint = (
        op.checkpoint if run and op.checkpoint_id and op.checkpoint.run_id == run.id else None
    )
    supersedes = (
        op.supersedes
        if op.supersedes_id and op.supersedes.tenant_id == op.tenant_id
        else None
    )
    return OperationLineage(run=run, checkpoint=checkpoint, supersedes=supersedes)


def run_parent_in_tenant(run: Run) -> str | None:
    """The id of the run this one was replayed or branched from, if that is a run of its own
    tenant: as on the run's page, lineage never names another tenant's run (a row from before
    operations 0025 can)."""
    if not run.parent_run_id:
        return None
    return (
        Run.objects.filter(id=run.parent_run_id, tenant_id=run.tenant_id)
        .values_list("id", flat=True)
        .first()
    )


def operation_superseded_by(op: Operation) -> Operation | None:
    """The intent that replaced this one, if any, in its tenant (see operation_lineage)."""
    return (
        Operation.objects.filter(supersedes_id=op.id, tenant_id=op.tenant_id).only("id").first()
    )


def related_pages_for_user(user, op: Operation) -> list[RelatedPage]:
    """Pages other apps keep about the operation (its approvals), for a user who may see
    it: operation_for_user has already checked that."""
    return [
        page
        for _receiver, pages in operation_related_pages.send(
            sender=Operation, operation=op, user=user
        )
        for page in pages or ()
    ]


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    kind: str  # attempt / evidence / webhook / audit
    title: str
    detail: str = ""
    actor: str = ""
    status: str = ""
    code: str = ""  # an audit event's action, as the audit trail and its filter name it


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


def _reference_checks(evidence_rows: list[Evidence]) -> dict[int, str]:
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


def operation_timeline(op) -> list[TimelineEntry]:
    """Attempts, evidence, webhook events and audit events of one operation, in time order."""
    # (time, source rank, row id) orders entries written in the same instant stably.
    keyed: list[tuple[tuple[datetime, int, int], TimelineEntry]] = []
    attempts = list(op.attempts.order_by("number"))
    # Named only when requests of this operation reached more than one provider account:
    # then which went where is what a person needs to see (a lookup in one account cannot
    # see an effect made in the other).
    accounts = {a.provider_account for a in attempts if a.provider_account}
    evidence_rows = list(op.evidence.select_related("actor").order_by("id"))
    references = _reference_checks(evidence_rows)
    for attempt in attempts:
        http = f"HTTP {attempt.http_status}" if attempt.http_status else ""
        account = f"account {attempt.provider_account}" if len(accounts) > 1 else ""
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
        entry = TimelineEntry(
            at=attempt.started_at,
            kind="attempt",
            title=f"Attempt {attempt.number}: {what} → {outcome}",
            detail=" · ".join(p for p in parts if p),
            actor=attempt.worker,
            status=attempt.outcome,
        )
        keyed.append(((attempt.started_at, 0, attempt.id), entry))
    for evidence in evidence_rows:
        # A status left as it was says so: "Webhook: failed" read as if the webhook failed.
        moved = (
            f"{evidence.from_status} → {evidence.to_status}"
            if evidence.from_status != evidence.to_status
            else f"stays {evidence.to_status}" if evidence.to_status else ""
        )
        kind = evidence.get_kind_display()
        entry = TimelineEntry(
            at=evidence.created_at,
            kind="evidence",
            title=f"{kind}: {moved}" if moved else kind,
            detail=evidence.summary,
            actor=evidence.actor.username if evidence.actor else "",
            status=evidence.to_status,
        )
        keyed.append(((evidence.created_at, 1, evidence.id), entry))
    for event in op.webhooks.order_by("id"):
        entry = TimelineEntry(
            at=event.received_at,
            kind="webhook",
            title=f"Webhook {event.provider} {event.event_type}",
            detail=" · ".join(p for p in (
                event.event_id, event.outcome,
                f"delivered {event.deliveries} times, applied at most once"
                if event.deliveries > 1 else "",
            ) if p),
        )
        keyed.append(((event.received_at, 2, event.id), entry))
    audit = AuditEvent.objects.filter(object_type="operation", object_id=op.id).order_by("id")
    for event in audit:
        entry = TimelineEntry(
            at=event.created_at,
            kind="audit",
            title=_AUDIT_TITLES.get(event.action, "Audit event"),
            detail=event.reason,
            actor=event.actor_username or "system",
            code=event.action,
        )
        keyed.append(((event.created_at, 3, event.id), entry))
    keyed.sort(key=lambda pair: pair[0])
    return [entry for _, entry in keyed]
