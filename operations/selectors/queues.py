"""What waits for a person: unknown, disputed and stuck operations, approved or accepted ones
no sweep has taken on, accepted ones the provider has not answered about for long, and
provider reports and call answers held for review."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from operations.models import Attempt, Evidence, Operation, OperationStatus, WebhookEvent
from operations.selectors.access import operations_for_user, tenant_ids_for_user


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
        limit=limit, **_lease_ran_out(),
    )


def operations_lookup_failing_queue(user, *, limit: int = 100):
    """Accepted, but no lookup of the final answer has had the provider's answer for longer
    than ACCEPTED_LOOKUP_FAILING_SECONDS (a wrong API base or key, a provider outage): the
    sweep keeps looking them up, and a person looks at the provider meanwhile. Failing
    longest first."""
    return _operations_waiting(
        user, lookups_failing_too_long(), order=("lookups_failing_since", "id"), limit=limit
    )


def lookups_failing_limit_from() -> datetime:
    """Lookups failing since before this have failed past ACCEPTED_LOOKUP_FAILING_SECONDS."""
    return timezone.now() - timedelta(seconds=settings.ACCEPTED_LOOKUP_FAILING_SECONDS)


def lookups_failing_too_long() -> Q:
    """The condition on an accepted operation whose lookups have failed past the limit."""
    return Q(
        status=OperationStatus.ACCEPTED, lookups_failing_since__lte=lookups_failing_limit_from()
    )


def operations_not_run_queue(user, *, limit: int = 100):
    """Approved (or proven absent) and not run, or accepted and not looked up, though the
    next automatic step is overdue: no sweep has run since (the beat, or the workers that run
    its sweep, are down or far behind), and the workers have not run them either. Nobody
    else would see them: the approval is decided, and the sweep that would queue them again
    is what is missing. One the failing-lookups list shows is left to it. Overdue longest
    first (a range of the partial index on next_reconcile_at)."""
    return _operations_waiting(user, not_run(), order=("next_reconcile_at", "id"), limit=limit)


def checks_overdue_before() -> datetime:
    """The sweep claims a due check within one of its rounds, moving it into the future;
    one due before this (two rounds ago) is one no sweep has taken."""
    every = settings.CELERY_BEAT_SCHEDULE["sweep-operations"]["schedule"]
    return timezone.now() - timedelta(seconds=2 * every)


def not_run() -> Q:
    """The condition on an approved or accepted operation no sweep has taken on."""
    return Q(
        status__in=[OperationStatus.NOT_STARTED, OperationStatus.ACCEPTED],
        next_reconcile_at__lte=checks_overdue_before(),
    ) & ~lookups_failing_too_long()


def _lease_ran_out() -> dict[str, Any]:
    return {"lease_expires_at__lte": timezone.now()}


def _operations_waiting(
    user, *where: Q, order: tuple[str, ...], limit: int, **conditions: Any
):
    last_evidence = Evidence.objects.filter(operation=OuterRef("pk")).order_by("-id")
    return list(
        operations_for_user(user)
        .filter(*where, **conditions)
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


# How many wait in all, for a queue whose page is full: each a range of a partial index (or
# of (status, id)), never a count of the whole table.


def operations_disputed_count(user) -> int:
    return operations_for_user(user).filter(status=OperationStatus.DISPUTED).count()


def operations_stuck_count(user) -> int:
    return (
        operations_for_user(user)
        .filter(status=OperationStatus.IN_PROGRESS, **_lease_ran_out())
        .count()
    )


def operations_not_run_count(user) -> int:
    return operations_for_user(user).filter(not_run()).count()


def operations_lookup_failing_count(user) -> int:
    return operations_for_user(user).filter(lookups_failing_too_long()).count()


def webhooks_for_review_count(user) -> int:
    return webhooks_held_for_review(tenant_ids=tenant_ids_for_user(user)).count()


def answers_for_review_count(user) -> int:
    return answers_held_for_review(tenant_ids=tenant_ids_for_user(user)).count()
