from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.expressions import RawSQL
from django.utils import timezone

from operations.models.operation import Operation


class AttemptKind(models.TextChoices):
    CALL = "call", "Provider call"
    LOOKUP = "lookup", "Provider lookup"


class AttemptOutcome(models.TextChoices):
    STARTED = "started", "Started, no answer recorded"
    SUCCEEDED = "succeeded", "Succeeded"
    ACCEPTED = "accepted", "Accepted"
    FAILED = "failed", "Failed"
    UNKNOWN = "unknown", "Unknown (no reliable answer)"
    FOUND = "found", "Found"
    ABSENT = "absent", "Proven absent"
    INCONCLUSIVE = "inconclusive", "Inconclusive"


class AttemptQuerySet(models.QuerySet):
    def held_for_review(self) -> AttemptQuerySet:
        """Call answers held for a person and not answered yet, as events are
        (`WebhookEventQuerySet.held_for_review`)."""
        return self.filter(needs_review=True, reviewed_at__isnull=True)


class Attempt(models.Model):
    """One outbound call or lookup. `started` without an end means the answer was lost."""

    operation = models.ForeignKey(Operation, on_delete=models.PROTECT, related_name="attempts")
    number = models.PositiveIntegerField()
    kind = models.CharField(max_length=10, choices=AttemptKind)
    worker = models.CharField(max_length=64, blank=True)
    # When the request left: now for a call made as it is recorded; earlier for a lookup
    # recorded only once its answer was kept (a resolution's verifying lookup).
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(
        max_length=20, choices=AttemptOutcome, default=AttemptOutcome.STARTED
    )
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    provider_request_id = models.CharField(max_length=120, blank=True)
    external_id = models.CharField(max_length=120, blank=True)
    idempotency_key = models.CharField(max_length=80, blank=True)
    # sha256 of the parameters actually sent, to prove a retry sent the same thing.
    request_hash = models.CharField(max_length=71, blank=True)
    error_class = models.CharField(max_length=60, blank=True)
    error_message = models.TextField(blank=True)
    # Which provider account the request reached (a fingerprint of the endpoint and API key,
    # never the key): a lookup in another account cannot prove a call absent. Empty on rows
    # written before it was kept.
    provider_account = models.CharField(max_length=20, blank=True)
    # A call's latest moment to reach the provider: the end of its lease (nothing is sent
    # after it) plus the client's timeout, both as they were when it was made. Kept with the
    # call because a rolling deploy that shortens either setting must not shorten the wait
    # for calls the old workers made. None for a lookup.
    reach_until = models.DateTimeField(null=True, blank=True)
    # A call's answer that arrived too late to land (the operation had moved on without it)
    # and contradicts what the journal now says, as a provider event reporting the same
    # would: a payment after a person disputed or failed it, a second object. Shown to
    # operators until a person disputes or resolves the operation (`reviewed_at`).
    needs_review = models.BooleanField(default=False)
    review_note = models.CharField(max_length=500, blank=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)

    objects = AttemptQuerySet.as_manager()

    class Meta:
        ordering = ["operation", "number"]
        indexes = [
            # The operators' queue, the dashboard and every claim read the few held answers.
            models.Index(
                fields=["operation"],
                condition=models.Q(needs_review=True, reviewed_at__isnull=True),
                name="attempt_held_idx",
            ),
            # The dashboard's count of version conflicts: rare rows, read on every visit.
            models.Index(
                fields=["operation"],
                condition=models.Q(error_class="version_conflict"),
                name="attempt_version_conflict",
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["operation", "number"], name="attempt_number"),
            models.CheckConstraint(
                condition=models.Q(kind__in=AttemptKind.values), name="attempt_kind_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(outcome__in=AttemptOutcome.values),
                name="attempt_outcome_valid",
            ),
            models.CheckConstraint(
                condition=models.Q(needs_review=True) | models.Q(reviewed_at__isnull=True),
                name="attempt_reviewed_only_if_held",
            ),
            models.CheckConstraint(
                condition=models.Q(kind=AttemptKind.CALL, reach_until__isnull=False)
                | models.Q(kind=AttemptKind.LOOKUP, reach_until__isnull=True),
                name="attempt_call_has_reach",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation_id}#{self.number} {self.kind} {self.outcome}"


class EvidenceKind(models.TextChoices):
    LOOKUP = "lookup", "Provider lookup"
    WEBHOOK = "webhook", "Webhook"
    CALL_RESULT = "call_result", "Call result"
    MANUAL = "manual", "A person's decision"  # a resolution or a dispute
    AUTHORIZATION = "authorization", "Authorization check"
    TRANSITION = "transition", "Status transition"


class Evidence(models.Model):
    """What proved a status: a lookup result, a webhook, a person's resolution."""

    operation = models.ForeignKey(Operation, on_delete=models.PROTECT, related_name="evidence")
    kind = models.CharField(max_length=20, choices=EvidenceKind)
    from_status = models.CharField(max_length=20, blank=True)
    to_status = models.CharField(max_length=20, blank=True)
    summary = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["operation", "id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kind__in=EvidenceKind.values), name="evidence_kind_valid"
            ),
        ]
        # The dashboard's time to reconcile and manual resolutions, read on every visit: a
        # week of rare rows, never a scan of all the evidence there is.
        indexes = [
            models.Index(
                fields=["created_at"], condition=models.Q(data__has_key="unknown_seconds"),
                name="evidence_reconcile_sample",
            ),
            models.Index(
                fields=["created_at"], condition=models.Q(kind=EvidenceKind.MANUAL),
                name="evidence_manual",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation_id} {self.kind}: {self.summary[:60]}"


class WebhookEventQuerySet(models.QuerySet):
    def held_for_review(self) -> WebhookEventQuerySet:
        """Held for a person and not answered yet: what disputing or resolving the
        operation answers, and what a supersede or a call must wait for. The same condition
        as `nothing_held_for_review`."""
        return self.filter(needs_review=True, reviewed_at__isnull=True)


def nothing_held_for_review() -> RawSQL:
    """For a filter on operations: none of its provider events nor call answers is held for
    review (`held_for_review` of either). Written as SQL because it sits in execute's claim,
    where compiling the same `~Exists(...)` subqueries cost about 0.5 ms of worker CPU each
    per operation (a tenth of the end-to-end throughput)."""
    return RawSQL(
        "NOT EXISTS (SELECT 1 FROM operations_webhookevent held"
        " WHERE held.operation_id = operations_operation.id"
        " AND held.needs_review AND held.reviewed_at IS NULL)"
        " AND NOT EXISTS (SELECT 1 FROM operations_attempt held"
        " WHERE held.operation_id = operations_operation.id"
        " AND held.needs_review AND held.reviewed_at IS NULL)",
        (), output_field=models.BooleanField(),
    )


class WebhookEvent(models.Model):
    """A provider's event, stored once per (provider, event id)."""

    provider = models.CharField(max_length=20)
    event_id = models.CharField(max_length=120)
    event_type = models.CharField(max_length=80)
    operation = models.ForeignKey(
        Operation, null=True, blank=True, on_delete=models.PROTECT, related_name="webhooks"
    )
    external_id = models.CharField(max_length=120, blank=True)
    # Normalized facts only (status, ids, amounts), never the raw body.
    data = models.JSONField(default=dict)
    provider_created_at = models.DateTimeField(null=True, blank=True)
    received_at = models.DateTimeField(auto_now_add=True)
    # How often the provider sent it: duplicates are answered and change nothing, but an
    # auditor (or a demo of the duplicate fault) sees that they came.
    deliveries = models.PositiveIntegerField(default=1)
    # The operation status the event reports (succeeded, accepted, failed), "" for none:
    # an event kept while the call was in flight is decided on it once the answer arrives.
    reported_status = models.CharField(max_length=20, blank=True)
    applied = models.BooleanField(default=False)
    outcome = models.CharField(max_length=200, blank=True)
    # The provider reports another outcome for an operation a person settled or holds, or an
    # effect that is not the approved one: not applied (a person's decision stands), but shown
    # to operators until a person disputes or resolves the operation (`reviewed_at`). Not
    # until the status merely changes: a call's answer landing after the event must not
    # take a second payment's notice off the queue.
    needs_review = models.BooleanField(default=False)
    reviewed_at = models.DateTimeField(null=True, blank=True)

    objects = WebhookEventQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["provider", "event_id"], name="webhook_provider_event_unique"
            ),
            models.CheckConstraint(
                condition=models.Q(reported_status__in=["", "succeeded", "accepted", "failed"]),
                name="webhook_reported_status_valid",
            ),
        ]
        indexes = [
            # The operators' queue and the dashboard read the few events that need review.
            models.Index(
                fields=["operation", "received_at"],
                condition=models.Q(needs_review=True, reviewed_at__isnull=True),
                name="webhook_held_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.provider}:{self.event_id}"
