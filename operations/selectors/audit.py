"""The audit trail, as each user may read it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import Q, QuerySet

from operations.models import AuditEvent
from operations.selectors.access import tenant_ids_for_user


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


def audit_action_names(user, perm: str = "view_audit") -> list[str]:
    """The action names on the part of the trail the user may read, for the filter's
    suggestions: a name only another tenant's events carry would tell of what happened
    there. A skip scan over the (tenant, action) index per tenant: one probe per distinct
    name, not a pass over the trail."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT DISTINCT found.action
            FROM unnest(%s::bigint[]) AS tenant(id)
            CROSS JOIN LATERAL (
                WITH RECURSIVE names(action) AS (
                    (SELECT action FROM operations_auditevent
                     WHERE tenant_id = tenant.id ORDER BY action LIMIT 1)
                    UNION ALL
                    SELECT (SELECT a.action FROM operations_auditevent a
                            WHERE a.tenant_id = tenant.id AND a.action > names.action
                            ORDER BY a.action LIMIT 1)
                    FROM names WHERE names.action IS NOT NULL
                )
                SELECT action FROM names WHERE action IS NOT NULL
            ) AS found
            ORDER BY 1
            """,
            [tenant_ids_for_user(user, perm)],
        )
        return [row[0] for row in cursor.fetchall()]
