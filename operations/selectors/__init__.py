"""Reads, always filtered by what the user may see."""

from __future__ import annotations

from operations.selectors.access import (
    operation_for_user,
    operations_for_user,
    tenant_access_require,
    tenant_ids_for_user,
    tenant_perm_held,
    tenants_for_user,
)
from operations.selectors.audit import AuditFilters, audit_action_names, audit_events_for_user
from operations.selectors.dashboard import METRICS_WINDOW, dashboard_metrics
from operations.selectors.journal import (
    OperationFilters,
    OperationLineage,
    TimelineEntry,
    keyset_page,
    operation_lineage,
    operation_superseded_by,
    operation_timeline,
    operations_journal,
    related_pages_for_user,
    run_parent_in_tenant,
)
from operations.selectors.queues import (
    answers_for_review_count,
    answers_for_review_for_user,
    answers_held_for_review,
    operations_disputed_count,
    operations_disputed_queue,
    operations_lookup_failing_count,
    operations_lookup_failing_queue,
    operations_stuck_count,
    operations_stuck_queue,
    operations_unknown_count,
    operations_unknown_queue,
    webhooks_for_review_count,
    webhooks_for_review_for_user,
    webhooks_held_for_review,
)
from operations.selectors.runs import command_effects_in_runs, run_ancestors, runs_ancestors

__all__ = [
    "METRICS_WINDOW",
    "AuditFilters",
    "OperationFilters",
    "OperationLineage",
    "TimelineEntry",
    "answers_for_review_count",
    "answers_for_review_for_user",
    "answers_held_for_review",
    "audit_action_names",
    "audit_events_for_user",
    "command_effects_in_runs",
    "dashboard_metrics",
    "keyset_page",
    "operation_for_user",
    "operation_lineage",
    "operation_superseded_by",
    "operation_timeline",
    "operations_disputed_count",
    "operations_disputed_queue",
    "operations_for_user",
    "operations_journal",
    "operations_lookup_failing_count",
    "operations_lookup_failing_queue",
    "operations_stuck_count",
    "operations_stuck_queue",
    "operations_unknown_count",
    "operations_unknown_queue",
    "related_pages_for_user",
    "run_ancestors",
    "run_parent_in_tenant",
    "runs_ancestors",
    "tenant_access_require",
    "tenant_ids_for_user",
    "tenant_perm_held",
    "tenants_for_user",
    "webhooks_for_review_count",
    "webhooks_for_review_for_user",
    "webhooks_held_for_review",
]
