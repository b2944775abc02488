from __future__ import annotations

from django.conf import settings
from django.db import models

from operations.ids import new_id
from operations.models.runs import Checkpoint, Run
from operations.models.tenancy import Tenant


def _operation_id() -> str:
    return new_id("op")


class Action(models.TextChoices):
    PAYMENTS_CREATE = "payments.create", "Create a payment"
    CRM_CREATE_DEAL = "crm.create_deal", "Create a CRM deal"
    CRM_UPDATE_DEAL = "crm.update_deal", "Update a CRM deal"
    MAIL_SEND = "mail.send", "Send an email"


class OperationStatus(models.TextChoices):
    NOT_STARTED = "not_started", "Not started"
    IN_PROGRESS = "in_progress", "In progress"
    ACCEPTED = "accepted", "Accepted, final result pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    UNKNOWN = "unknown", "Unknown"
    CANCELLED = "cancelled", "Cancelled"
    DISPUTED = "disputed", "Disputed (on hold)"


class Operation(models.Model):
    """One business effect in the outside world: the canonical intent and its execution.

    The intent columns never change after insert (a trigger refuses it); a changed intent is a
    new operation that `supersedes` this one.
    """

    id = models.CharField(
        primary_key=True, max_length=40, default=_operation_id, editable=False
    )
    # --- the intent (immutable) ---
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="operations")
    action = models.CharField(max_length=40, choices=Action)
    tool_name = models.CharField(max_length=60)
    payload = models.JSONField()
    canonical_intent = models.TextField()
    payload_hash = models.CharField(max_length=71)
    policy_version = models.CharField(max_length=40)
    idempotency_key = models.CharField(max_length=80, unique=True)
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    command_id = models.CharField(max_length=60, blank=True)
    supersedes = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="superseded_by"
    )
    requires_approval = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    # --- authorization (written once by operation_authorize) ---
    authorized_hash = models.CharField(max_length=71, blank=True)
    authorized_policy_version = models.CharField(max_length=40, blank=True)
    authorized_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    authorized_at = models.DateTimeField(null=True, blank=True)
    authorization_expires_at = models.DateTimeField(null=True, blank=True)

    # --- execution state (changed only by the engine's conditional updates) ---
    status = models.CharField(
        max_length=20, choices=OperationStatus, default=OperationStatus.NOT_STARTED
    )
    status_changed_at = models.DateTimeField(auto_now_add=True)
    lease_owner = models.CharField(max_length=64, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    unknown_since = models.DateTimeField(null=True, blank=True)
    # When set, the sweep reconciles again at this time (a lookup that may succeed later,
    # such as a search inside the provider's lag window). Null on `unknown` means a person.
    next_reconcile_at = models.DateTimeField(null=True, blank=True)
    # Accepted, and no lookup has had the provider's answer since then (the first of the
    # failing ones): past ACCEPTED_LOOKUP_FAILING_SECONDS a person looks at the provider
    # (its base, its key, its status), while the lookups go on.
    lookups_failing_since = models.DateTimeField(null=True, blank=True)
    external_id = models.CharField(max_length=120, blank=True, db_index=True)
    provider_request_id = models.CharField(max_length=120, blank=True)
    result = models.JSONField(null=True, blank=True)
    error_code = models.CharField(max_length=60, blank=True)
    error_message = models.TextField(blank=True)
    resolved_manually = models.BooleanField(default=False)
    provider_calls = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=OperationStatus.values),
                name="operation_status_valid",
            ),
            models.CheckConstraint(
                condition=models.Q(action__in=Action.values), name="operation_action_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(payload_hash__startswith="sha256:"),
                name="operation_payload_hash_form",
            ),
            # A lease exists exactly while a worker holds the operation.
            models.CheckConstraint(
                condition=models.Q(
                    status=OperationStatus.IN_PROGRESS, lease_expires_at__isnull=False
                )
                | (
                    ~models.Q(status=OperationStatus.IN_PROGRESS)
                    & models.Q(lease_expires_at__isnull=True)
                ),
                name="operation_lease_iff_in_progress",
            ),
            # The engine relies on this: a status other than unknown never has unknown_since,
            # so a transition from such a status need not read the row first.
            models.CheckConstraint(
                condition=models.Q(status=OperationStatus.UNKNOWN, unknown_since__isnull=False)
                | (
                    ~models.Q(status=OperationStatus.UNKNOWN)
                    & models.Q(unknown_since__isnull=True)
                ),
                name="operation_unknown_since_iff_unknown",
            ),
            # Only an accepted effect is looked up for its final answer on its own; any
            # transition starts the next status without that history.
            models.CheckConstraint(
                condition=models.Q(status=OperationStatus.ACCEPTED)
                | models.Q(lookups_failing_since__isnull=True),
                name="operation_lookups_failing_only_accepted",
            ),
            models.UniqueConstraint(fields=["action", "id"], name="operation_action_id_unique"),
        ]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="op_tenant_id"),
            models.Index(fields=["status", "-id"], name="op_status_id"),
            models.Index(fields=["run", "-id"], name="op_run_id"),
            models.Index(fields=["action", "-id"], name="op_action_id"),
            # The dashboard's counts by status: an index-only scan of a tenant's entries
            # instead of reading every row of a million-row journal.
            models.Index(fields=["tenant", "status"], name="op_tenant_status"),
            # Queues: the operators' unknown queue and the sweep's expired leases.
            models.Index(
                fields=["unknown_since"], condition=models.Q(status=OperationStatus.UNKNOWN),
                name="op_unknown_queue",
            ),
            models.Index(
                fields=["lease_expires_at"],
                condition=models.Q(status=OperationStatus.IN_PROGRESS),
                name="op_expired_lease_queue",
            ),
            models.Index(
                fields=["lookups_failing_since"],
                condition=models.Q(lookups_failing_since__isnull=False),
                name="op_lookup_failing_queue",
            ),
            models.Index(
                fields=["next_reconcile_at"],
                condition=models.Q(next_reconcile_at__isnull=False),
                name="op_reconcile_due_queue",
            ),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def is_authorized(self) -> bool:
        return bool(self.authorized_hash)
