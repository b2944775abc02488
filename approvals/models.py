"""An approval: one person's decision on exactly one intent (its payload hash), until expiry."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models

from operations.ids import new_id
from operations.models import Operation


def _approval_id() -> str:
    return new_id("apr")


class ApprovalStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"
    EXPIRED = "expired", "Expired"
    SUPERSEDED = "superseded", "Superseded"


class Approval(models.Model):
    """A request for a person's decision, bound to one `payload_hash` and policy version.

    Only `status`, `decided_*`, `comment` and `superseded_by` ever change, and only from
    `pending`, by the conditional updates in `approvals.services`.
    """

    id = models.CharField(primary_key=True, max_length=40, default=_approval_id, editable=False)
    operation = models.ForeignKey(Operation, on_delete=models.PROTECT, related_name="approvals")
    payload_hash = models.CharField(max_length=71)
    policy_version = models.CharField(max_length=40)
    status = models.CharField(
        max_length=20, choices=ApprovalStatus, default=ApprovalStatus.PENDING
    )
    requested_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True)
    # Who wrote this intent or one it replaces, or launched the run of any of them (user
    # ids): four eyes keeps each from approving it, since an intent changed or asked again
    # unchanged is still their words. Taken when the approval is requested.
    authors = ArrayField(models.BigIntegerField(), default=list, blank=True)
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="supersedes"
    )

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=ApprovalStatus.values),
                name="approval_status_valid",
            ),
            models.CheckConstraint(
                condition=models.Q(payload_hash__startswith="sha256:"),
                name="approval_payload_hash_form",
            ),
            # Pending means undecided; every decision (even the sweep's expiry) has a time.
            models.CheckConstraint(
                condition=models.Q(status=ApprovalStatus.PENDING, decided_at__isnull=True)
                | (~models.Q(status=ApprovalStatus.PENDING) & models.Q(decided_at__isnull=False)),
                name="approval_decided_iff_not_pending",
            ),
            # Only a superseded approval names a successor. It may name none: the changed
            # intent needed no approval (its operation's superseded_by says which it is).
            models.CheckConstraint(
                condition=models.Q(status=ApprovalStatus.SUPERSEDED)
                | models.Q(superseded_by__isnull=True),
                name="approval_successor_only_if_superseded",
            ),
            models.UniqueConstraint(
                fields=["operation"],
                condition=models.Q(status=ApprovalStatus.PENDING),
                name="approval_one_pending_per_operation",
            ),
        ]
        indexes = [
            # The queue and the expiry sweep: pending, soonest to expire first.
            models.Index(
                fields=["expires_at", "id"],
                condition=models.Q(status=ApprovalStatus.PENDING),
                name="approval_pending_queue",
            ),
            models.Index(fields=["status", "expires_at"], name="approval_status_expires"),
            models.Index(fields=["-decided_at", "-id"], name="approval_recent_decisions"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.status}"

    @property
    def is_pending(self) -> bool:
        return self.status == ApprovalStatus.PENDING

    def ran_out(self, now: datetime) -> bool:
        """Pending past its time: no decision is taken on it any more, though the expiry
        sweep has not closed it yet (the beat is down or behind)."""
        return self.is_pending and self.expires_at <= now
