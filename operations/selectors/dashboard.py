"""The dashboard's numbers: what waits for a person now, and what happened lately."""

from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.db.models import Count, Min
from django.utils import timezone

from operations import transitions
from operations.models import (
    Attempt,
    AttemptKind,
    Evidence,
    EvidenceKind,
    Operation,
    OperationStatus,
)
from operations.selectors.access import tenant_ids_for_user
from operations.selectors.queues import (
    answers_held_for_review,
    lookups_failing_too_long,
    not_run,
    webhooks_held_for_review,
)

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
        # COUNT(*), not COUNT(id): a count of a column must read it, which an index-only scan
        # of (tenant, status) cannot.
        ops.order_by().values_list("status").annotate(n=Count("*")).values_list("status", "n")
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
        # A worker's lease ran out and no sweep has turned it unknown yet, or an approved or
        # accepted one's next automatic step is overdue: the beat or the workers are down,
        # or behind. Nobody else would see them. Two counts, each a range of its partial
        # index.
        "stuck_count": ops.filter(
            status=OperationStatus.IN_PROGRESS, lease_expires_at__lte=now
        ).count() + ops.filter(not_run()).count(),
        # Accepted, and the provider has not answered a lookup for long (a range of the
        # partial index on lookups_failing_since): listed in the operators' queue.
        "lookup_failing_count": ops.filter(lookups_failing_too_long()).count(),
        "window": METRICS_WINDOW,
    }
