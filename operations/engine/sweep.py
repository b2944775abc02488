"""The sweep's queues: which operations are due a reconcile (an expired lease, a due
re-check) or should be running but no worker has claimed, each claimed so the sweeps that
follow every few seconds do not queue it again while its task runs."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import (
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    Q,
    QuerySet,
    Value,
)
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from operations.engine.core import S
from operations.engine.reconcile import reconcile_claim_seconds
from operations.models import Operation


def _due(now: datetime) -> tuple[QuerySet[Operation], QuerySet[Operation]]:
    """(expired leases, unknowns and accepteds whose next check is due), oldest first; each
    a range of its partial index."""
    expired = (
        Operation.objects.filter(status=S.IN_PROGRESS, lease_expires_at__lte=now)
        # Not while an earlier sweep's claim on it runs (see below).
        .filter(Q(next_reconcile_at__isnull=True) | Q(next_reconcile_at__lte=now))
        .order_by("lease_expires_at")
    )
    due = Operation.objects.filter(
        next_reconcile_at__lte=now, status__in=[S.UNKNOWN, S.ACCEPTED]
    ).order_by("next_reconcile_at")
    return expired, due


def operations_due_for_reconcile(*, limit: int = 200) -> list[str]:
    """What the sweep would reconcile now."""
    expired, due = _due(timezone.now())
    return list(dict.fromkeys([
        *expired.values_list("id", flat=True)[:limit],
        *due.values_list("id", flat=True)[:limit],
    ]))


def operations_claim_waiting_for_execute(*, limit: int = 200) -> list[str]:
    """Operations that should be running but no worker has claimed by their recheck time
    (approved, or proven absent): claimed like the reconcile queue, to be queued again. The
    execute's own claim makes a second message harmless."""
    now = timezone.now()
    # Backoff: the next re-queue waits as long as the operation has already waited (from
    # its approval, or from the lookup that proved absence), at least the recheck interval
    # and at most EXECUTE_RECHECK_MAX_SECONDS. A worker outage or a long backlog then adds a
    # handful of (harmless) duplicate messages per operation, not one every minute.
    # Never more than half the authorization's remaining time, though: a message lost late
    # in the window must still get another chance before the approval runs out.
    minimum = Value(timedelta(seconds=settings.EXECUTE_RECHECK_SECONDS))
    maximum = Value(timedelta(seconds=settings.EXECUTE_RECHECK_MAX_SECONDS))
    waiting_since = Greatest(F("status_changed_at"), F("authorized_at"))  # NULLs ignored
    waited = ExpressionWrapper(Value(now) - waiting_since, output_field=DurationField())
    half_left = ExpressionWrapper(
        (F("authorization_expires_at") - Value(now)) / 2, output_field=DurationField()
    )
    delay = Least(
        Greatest(waited, minimum),
        maximum,
        Greatest(Coalesce(half_left, maximum), minimum),
    )
    with transaction.atomic():
        claimed = list(
            Operation.objects.filter(status=S.NOT_STARTED, next_reconcile_at__lte=now)
            .order_by("next_reconcile_at")
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:limit]
        )
        Operation.objects.filter(id__in=claimed, status=S.NOT_STARTED).update(
            next_reconcile_at=ExpressionWrapper(
                Value(now) + delay, output_field=DateTimeField()
            )
        )
    return claimed


def operations_claim_due_for_reconcile(*, limit: int = 200) -> list[str]:
    """The sweep's claim: what is due now, each with its next check moved past the claim, so
    the following sweeps (every few seconds) do not queue it again while its reconcile runs.
    A reconcile that never runs leaves the claim to run out; the operation is due again."""
    now = timezone.now()
    claim_until = now + timedelta(seconds=reconcile_claim_seconds())
    expired, due = _due(now)
    with transaction.atomic():
        # SKIP LOCKED: a reconcile or transition holding the row is already dealing with it.
        claimed_expired = list(
            expired.select_for_update(skip_locked=True).values_list("id", flat=True)[:limit]
        )
        claimed = list(
            due.select_for_update(skip_locked=True).values_list("id", flat=True)[:limit]
        )
        # An expired lease is claimed too: while workers are behind (a provider outage),
        # every sweep, and a second beat in a deploy's overlap, would queue another
        # reconcile of it, each a lookup. Its reconcile's first transition (to unknown)
        # sets the next check anew; a worker finishing late clears it.
        Operation.objects.filter(id__in=claimed_expired, status=S.IN_PROGRESS).update(
            next_reconcile_at=claim_until
        )
        Operation.objects.filter(id__in=claimed, next_reconcile_at__lte=now).update(
            next_reconcile_at=claim_until
        )
    return list(dict.fromkeys([*claimed_expired, *claimed]))
