"""Reads, always filtered by what the user may see."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import connection
from django.db.models import Count, Min, OuterRef, Q, QuerySet, Subquery
from django.http import Http404
from django.utils import timezone
from guardian.shortcuts import get_objects_for_user

from operations import transitions
from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    AuditEvent,
    Checkpoint,
    Evidence,
    EvidenceKind,
    Operation,
    OperationStatus,
    Run,
    Tenant,
    WebhookEvent,
)
from operations.signals import RelatedPage, operation_related_pages


def tenants_for_user(user, perm: str = "view_tenant") -> QuerySet[Tenant]:
    """The tenants on which the user was granted `perm`. Only a grant counts: Django's and
    guardian's superuser shortcut would hand the installation's administrator (README's
    `createsuperuser`, for /admin/) every tenant's approvals and unmasked data, unaudited;
    global (model) permissions count for nothing either."""
    if not (user.is_authenticated and user.is_active):
        return Tenant.objects.none()
    return get_objects_for_user(
        user, f"operations.{perm}", klass=Tenant, accept_global_perms=False,
        with_superuser=False,
    )


def tenant_perm_held(user, perm: str, tenant: Tenant) -> bool:
    """Whether the user was granted `perm` on this tenant (see tenants_for_user); used in
    place of `user.has_perm`, which answers yes to every superuser."""
    return user is not None and tenants_for_user(user, perm).filter(pk=tenant.pk).exists()


def tenant_ids_for_user(user, perm: str = "view_tenant") -> list[int]:
    return list(tenants_for_user(user, perm).values_list("id", flat=True))


@dataclass(frozen=True)
class AuditFilters:
    actor: str = ""
    action: str = ""
    object: str = ""
    since: datetime | None = None
    until: datetime | None = None


def audit_events_for_user(
    user, *, filters: AuditFilters, perm: str = "view_audit"
) -> QuerySet[AuditEvent]:
    qs = AuditEvent.objects.filter(tenant_id__in=tenant_ids_for_user(user, perm))
    if filters.actor:
        # People type names as they remember them; usernames are unique regardless of case.
        # "system" is how the trail shows the engine's own events (no actor).
        actor = Q(actor_username__iexact=filters.actor)
        if filters.actor.strip().lower() == "system":
            actor |= Q(actor_username="")
        qs = qs.filter(actor)
    if filters.action:
        # Action names are lower case in the code; matched exactly, so the index serves.
        qs = qs.filter(action=filters.action.strip().lower())
    if filters.object:
        qs = qs.filter(object_id=filters.object)
    if filters.since:
        qs = qs.filter(created_at__gte=filters.since)
    if filters.until:
        qs = qs.filter(created_at__lt=filters.until)
    return qs.select_related("tenant").order_by("-id")


def audit_action_names() -> list[str]:
    """Every action name on the trail, for the filter's suggestions. Names come from the
    code, not from any tenant's data. A skip scan over the (action, id) index: one probe per
    distinct name, not a pass over the whole trail."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH RECURSIVE names(action) AS (
                (SELECT action FROM operations_auditevent ORDER BY action LIMIT 1)
                UNION ALL
                SELECT (SELECT a.action FROM operations_auditevent a
                        WHERE a.action > names.action ORDER BY a.action LIMIT 1)
                FROM names WHERE names.action IS NOT NULL
            )
            SELECT action FROM names WHERE action IS NOT NULL
            """
        )
        return [row[0] for row in cursor.fetchall()]


def keyset_page(qs: QuerySet, *, before: int | str | None, size: int, key: str = "id"):
    """One page ordered by `key` descending, and the cursor for the next page (or None).

    No OFFSET and no COUNT(*): the cost of a page is the same at row 10 and row 10 million.
    """
    if before not in (None, ""):
        qs = qs.filter(**{f"{key}__lt": before})
    rows = list(qs[: size + 1])
    next_cursor = getattr(rows[size - 1], key) if len(rows) > size else None
    return rows[:size], next_cursor


def operations_for_user(user, perm: str = "view_tenant"):
    # The ids are fetched first on purpose: guardian's subquery compares text object_pk
    # with a cast, which hides the (tenant, id) index from the planner; a literal list keeps
    # a page of a million-row journal an index scan.
    return Operation.objects.filter(tenant_id__in=tenant_ids_for_user(user, perm))


# What a reconcile can find out from unknown: an outcome, or proven absence (not_started).
RECONCILED_STATUSES = transitions.AUTOMATIC[OperationStatus.UNKNOWN]
# The dashboard's counts of what happened (as opposed to what waits now) cover this much,
# and say so: "3 version conflicts" of all time could be this morning's or last year's, and
# an all-time read grows with the journal.
METRICS_WINDOW = timedelta(days=7)


def dashboard_metrics(user) -> dict:
    """Numbers for the dashboard, over the tenants the user may see: what waits now, and
    what happened within METRICS_WINDOW."""
    tenant_ids = tenant_ids_for_user(user)
    ops = Operation.objects.filter(tenant_id__in=tenant_ids)
    now = timezone.now()
    since = now - METRICS_WINDOW
    by_status = dict(
        ops.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    oldest_unknown = ops.filter(status=OperationStatus.UNKNOWN).aggregate(
        oldest=Min("unknown_since")
    )["oldest"]
    # Time from `unknown` to knowing what happened (an outcome, or proven absence), recorded
    # on the evidence that settled it. A dispute is a hold, not a finding: the resolution
    # that ends it carries the whole time instead.
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY (e.data->>'unknown_seconds')::float),
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY (e.data->>'unknown_seconds')::float)
            FROM operations_evidence e JOIN operations_operation o ON o.id = e.operation_id
            WHERE o.tenant_id = ANY(%s) AND e.data ? 'unknown_seconds'
              AND e.created_at >= %s AND e.to_status = ANY(%s)
            """,
            [tenant_ids, since, list(RECONCILED_STATUSES)],
        )
        p50, p95 = cursor.fetchone()
    return {
        "by_status": [
            (status, label, by_status.get(status, 0))
            for status, label in OperationStatus.choices
        ],
        "total": sum(by_status.values()),
        "unknown_count": by_status.get(OperationStatus.UNKNOWN, 0),
        "unknown_oldest_since": oldest_unknown,
        "disputed_count": by_status.get(OperationStatus.DISPUTED, 0),
        "reconcile_p50": p50,
        "reconcile_p95": p95,
        # From the calls that met one: the operation's own error is cleared when a person
        # later settles it, and the conflict still happened.
        "version_conflicts": Attempt.objects.filter(
            operation__tenant_id__in=tenant_ids, kind=AttemptKind.CALL,
            error_class="version_conflict", started_at__gte=since,
        ).values("operation_id").distinct().count(),
        # Operations with a held event or a held answer, each once (UNION, not UNION ALL).
        "held_for_review": webhooks_held_for_review(tenant_ids=tenant_ids)
        .order_by().values_list("operation_id")
        .union(answers_held_for_review(tenant_ids=tenant_ids).order_by()
               .values_list("operation_id"))
        .count(),
        # Resolutions only: a dispute (also a person's evidence) puts an effect on hold.
        "manual_resolutions": Evidence.objects.filter(
            operation__tenant_id__in=tenant_ids, kind=EvidenceKind.MANUAL,
            to_status__in=[OperationStatus.SUCCEEDED, OperationStatus.FAILED],
            created_at__gte=since,
        ).count(),
        # A changed intent that went to a person again. One the policy authorized on its
        # own (a small deal changed to another small one) was approved by nobody.
        "reapprovals": ops.filter(
            supersedes__isnull=False, requires_approval=True, created_at__gte=since
        ).count(),
        # A worker's lease ran out and no sweep has turned it unknown yet: the beat is down,
        # or behind. Nobody else would see it.
        "stuck_count": ops.filter(
            status=OperationStatus.IN_PROGRESS, lease_expires_at__lte=now
        ).count(),
        "window": METRICS_WINDOW,
    }


# --- the operations journal ---------------------------------------------------------------


@dataclass(frozen=True)
class OperationFilters:
    status: str = ""
    tenant: str = ""  # slug
    action: str = ""
    run: str = ""
    older_than: timedelta | None = None


def operations_journal(user, *, filters: OperationFilters):
    """The journal rows the user may see, newest first (ids are time-sortable)."""
    qs = operations_for_user(user)
    if filters.status:
        qs = qs.filter(status=filters.status)
    if filters.tenant:
        qs = qs.filter(tenant__slug=filters.tenant)
    if filters.action:
        qs = qs.filter(action=filters.action)
    if filters.run:
        qs = qs.filter(run_id=filters.run)
    if filters.older_than is not None:
        qs = qs.filter(created_at__lt=timezone.now() - filters.older_than)
    return qs.select_related("tenant").order_by("-id")


def operations_unknown_queue(user, *, limit: int = 100):
    """The operators' queue: unknown operations, oldest first, with the last evidence."""
    return _operations_waiting(
        user, status=OperationStatus.UNKNOWN, order=("unknown_since", "id"), limit=limit
    )


def operations_disputed_queue(user, *, limit: int = 100):
    """Disputed operations, on hold until a person resolves them: no lookup or event moves
    them, so they wait in the operators' queue too, longest on hold first."""
    return _operations_waiting(
        user, status=OperationStatus.DISPUTED, order=("status_changed_at", "id"), limit=limit
    )


def operations_stuck_queue(user, *, limit: int = 100):
    """In progress on a lease that ran out: the worker is gone, and the sweep turns each
    unknown within seconds. Listed at all only while the beat is down or behind; then nobody
    else would see them."""
    return _operations_waiting(
        user, status=OperationStatus.IN_PROGRESS, order=("lease_expires_at", "id"),
        limit=limit, lease_expires_at__lte=timezone.now(),
    )


def _operations_waiting(
    user, *, status: str, order: tuple[str, ...], limit: int, **conditions: Any
):
    last_evidence = Evidence.objects.filter(operation=OuterRef("pk")).order_by("-id")
    return list(
        operations_for_user(user)
        .filter(status=status, **conditions)
        .select_related("tenant")
        .annotate(
            last_evidence_summary=Subquery(last_evidence.values("summary")[:1]),
        )
        .order_by(*order)[:limit]
    )


def webhooks_held_for_review(
    *, tenant_ids: list[int] | None = None, operation: Operation | None = None
) -> QuerySet[WebhookEvent]:
    """Provider events held for a person (they contradict what a person decided, or report an
    effect that is not the approved one) that no person has answered yet: disputing or
    resolving the operation does."""
    return _held_of(WebhookEvent.objects.held_for_review(), tenant_ids, operation)


def _held_of(held: QuerySet, tenant_ids: list[int] | None, operation: Operation | None):
    if operation is not None:
        held = held.filter(operation=operation)
    if tenant_ids is not None:
        held = held.filter(operation__tenant_id__in=tenant_ids)
    return held


def webhooks_for_review_for_user(user, *, limit: int = 100) -> list[WebhookEvent]:
    """For the operators' queue: the contradicting events, newest first, with their
    operation."""
    return list(
        webhooks_held_for_review(tenant_ids=tenant_ids_for_user(user))
        .select_related("operation", "operation__tenant")
        .order_by("-received_at")[:limit]
    )


def answers_held_for_review(
    *, tenant_ids: list[int] | None = None, operation: Operation | None = None
) -> QuerySet[Attempt]:
    """Call answers that arrived too late to land and contradict the journal (held as an
    event reporting the same would be), that no person has answered yet."""
    return _held_of(Attempt.objects.held_for_review(), tenant_ids, operation)


def answers_for_review_for_user(user, *, limit: int = 100) -> list[Attempt]:
    """For the operators' queue: the contradicting late answers, newest first."""
    return list(
        answers_held_for_review(tenant_ids=tenant_ids_for_user(user))
        .select_related("operation", "operation__tenant")
        .order_by("-finished_at", "-id")[:limit]
    )


def operations_unknown_count(user) -> int:
    """How many unknown operations the user may see (a range of the unknown partial index)."""
    return operations_for_user(user).filter(status=OperationStatus.UNKNOWN).count()


def operation_for_user(user, operation_id: str, perm: str = "view_tenant"):
    """One operation: 404 when its tenant is not visible to the user, 403 without `perm`."""
    op = (
        Operation.objects.select_related(
            "tenant", "run", "checkpoint", "supersedes", "authorized_by"
        )
        .filter(id=operation_id)
        .first()
    )
    if op is None:
        raise Http404("no such operation")
    tenant_access_require(user, op.tenant, perm, what="operation")
    return op


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


def tenant_access_require(user, tenant: Tenant, perm: str, *, what: str) -> None:
    """The one access rule for anything of a tenant: 404 when the tenant is not visible to
    the user at all, 403 when it is visible but `perm` is missing."""
    if not tenant_perm_held(user, "view_tenant", tenant):
        raise Http404(f"no such {what}")
    if perm != "view_tenant" and not tenant_perm_held(user, perm, tenant):
        raise PermissionDenied(f"{perm} on {tenant.slug} is required for this {what}")


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    kind: str  # attempt / evidence / webhook / audit
    title: str
    detail: str = ""
    actor: str = ""
    status: str = ""


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
            title=f"Audit {event.action}",
            detail=event.reason,
            actor=event.actor_username or "system",
        )
        keyed.append(((event.created_at, 3, event.id), entry))
    keyed.sort(key=lambda pair: pair[0])
    return [entry for _, entry in keyed]
