"""Reads, always filtered by what the user may see."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet
from guardian.shortcuts import get_objects_for_user

from operations.models import AuditEvent, Tenant


def tenants_for_user(user, perm: str = "view_tenant") -> QuerySet[Tenant]:
    if not user.is_authenticated:
        return Tenant.objects.none()
    return get_objects_for_user(
        user, f"operations.{perm}", klass=Tenant, accept_global_perms=False
    )


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
    tenant_ids = list(tenants_for_user(user, perm).values_list("id", flat=True))
    qs = AuditEvent.objects.filter(tenant_id__in=tenant_ids)
    if filters.actor:
        qs = qs.filter(actor_username=filters.actor)
    if filters.action:
        qs = qs.filter(action=filters.action)
    if filters.object:
        qs = qs.filter(object_id=filters.object)
    if filters.since:
        qs = qs.filter(created_at__gte=filters.since)
    if filters.until:
        qs = qs.filter(created_at__lt=filters.until)
    return qs.select_related("tenant").order_by("-id")


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
    from operations.models import Operation

    return Operation.objects.filter(tenant__in=tenants_for_user(user, perm))


def dashboard_metrics(user) -> dict:
    """Numbers for the dashboard, over the tenants the user may see."""
    from django.db import connection
    from django.db.models import Count, Min
    from django.utils import timezone

    from operations.models import Evidence, EvidenceKind, Operation, OperationStatus

    tenant_ids = list(tenants_for_user(user).values_list("id", flat=True))
    ops = Operation.objects.filter(tenant_id__in=tenant_ids)
    by_status = dict(
        ops.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    unknown = ops.filter(status=OperationStatus.UNKNOWN).aggregate(
        n=Count("id"), oldest=Min("unknown_since")
    )
    oldest_age = None
    if unknown["oldest"] is not None:
        oldest_age = timezone.now() - unknown["oldest"]
    # Time from `unknown` to a known status, recorded on the evidence that settled it.
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY (e.data->>'unknown_seconds')::float),
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY (e.data->>'unknown_seconds')::float)
            FROM operations_evidence e JOIN operations_operation o ON o.id = e.operation_id
            WHERE o.tenant_id = ANY(%s) AND e.data ? 'unknown_seconds'
            """,
            [tenant_ids],
        )
        p50, p95 = cursor.fetchone()
    return {
        "by_status": [
            (status, label, by_status.get(status, 0))
            for status, label in OperationStatus.choices
        ],
        "total": sum(by_status.values()),
        "unknown_count": unknown["n"],
        "unknown_oldest_age": oldest_age,
        "reconcile_p50": p50,
        "reconcile_p95": p95,
        "version_conflicts": ops.filter(error_code="version_conflict").count(),
        "manual_resolutions": Evidence.objects.filter(
            operation__tenant_id__in=tenant_ids, kind=EvidenceKind.MANUAL
        ).count(),
        "reapprovals": ops.filter(supersedes__isnull=False).count(),
    }
