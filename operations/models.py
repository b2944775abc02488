from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.expressions import RawSQL
from django.utils import timezone

from operations.ids import new_id


class Tenant(models.Model):
    """A customer organisation. Every permission a person holds is held on one tenant."""

    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    # The legal entity that pays or acts on the tenant's behalf; shown to approvers.
    legal_entity = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        permissions = [
            ("approve_intents", "Approve or reject intents of the tenant"),
            ("operate_operations", "Reconcile, resolve and dispute operations of the tenant"),
            ("redeliver_effects", "Redeliver an effect of the tenant (privileged)"),
            ("replay_runs", "Continue, replay and branch runs of the tenant"),
            ("replay_live_irreversible", "Replay live with irreversible effects (privileged)"),
            ("view_unmasked", "See unmasked intent values of the tenant (audited)"),
            ("view_audit", "Browse the tenant's audit trail"),
            ("export_audit", "Download the tenant's audit trail as CSV"),
        ]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    APPROVER = "Approver"
    OPERATOR = "Operator"
    AUDITOR = "Auditor"
    ADMIN = "Admin"


class TenantRole(models.Model):
    """A role a person holds on one tenant. Their guardian permissions on the tenant are the
    union of what these roles give, so revoking one role keeps what another still grants."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_roles"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="user_roles")
    role = models.CharField(max_length=20, choices=Role)
    granted_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "role"]
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant", "role"], name="tenant_role_once"),
            models.CheckConstraint(
                condition=models.Q(role__in=Role.values), name="tenant_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.role} on {self.tenant_id}"


class AuditEvent(models.Model):
    """One human or system action. Append-only: a trigger refuses UPDATE and DELETE."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # PROTECT: an actor with audit history is deactivated, never deleted.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    # Kept as text too, so the trail reads the same after a rename.
    actor_username = models.CharField(max_length=150, blank=True)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=100)
    object_type = models.CharField(max_length=50, blank=True)
    # As long as the longest id it holds: a user's is their username (up to 150 characters).
    object_id = models.CharField(max_length=150, blank=True)
    reason = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="audit_tenant_id"),
            models.Index(fields=["object_type", "object_id"], name="audit_object"),
            models.Index(fields=["action", "-id"], name="audit_action_id"),
        ]

    def __str__(self) -> str:
        return f"{self.actor_username or 'system'} {self.action} {self.object_id}"


def _run_id() -> str:
    return new_id("run")


def _checkpoint_id() -> str:
    return new_id("cp")


def _operation_id() -> str:
    return new_id("op")


class RunStatus(models.TextChoices):
    RUNNING = "running", "Running"
    WAITING_APPROVAL = "waiting_approval", "Waiting for approval"
    PAUSED = "paused", "Paused"
    FAILED = "failed", "Failed"
    SUCCEEDED = "succeeded", "Succeeded"
    CANCELLED = "cancelled", "Cancelled"


class RunMode(models.TextChoices):
    ORIGINAL = "original", "Original"
    EVIDENCE = "evidence", "Evidence (recorded outputs, no calls)"
    SIMULATION = "simulation", "Simulation (sandbox providers only)"
    LIVE = "live", "Live (real calls)"
    BRANCH = "branch", "Branch with change"


class Run(models.Model):
    """One execution of a workflow graph. A replay or a branch is a new run."""

    id = models.CharField(primary_key=True, max_length=40, default=_run_id, editable=False)
    conversation_id = models.CharField(max_length=40, db_index=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="runs")
    workflow_name = models.CharField(max_length=100)
    workflow_version = models.PositiveIntegerField()
    state_schema_version = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=RunStatus, default=RunStatus.RUNNING)
    parent_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )
    parent_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    launch_reason = models.TextField(blank=True)
    mode = models.CharField(max_length=20, choices=RunMode, default=RunMode.ORIGINAL)
    launched_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=RunStatus.values), name="run_status_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(mode__in=RunMode.values), name="run_mode_valid"
            ),
            # Lineage is all or nothing: a derived run names its parent and its reason.
            models.CheckConstraint(
                condition=models.Q(mode=RunMode.ORIGINAL, parent_run__isnull=True)
                | (
                    ~models.Q(mode=RunMode.ORIGINAL)
                    & models.Q(parent_run__isnull=False, parent_checkpoint__isnull=False)
                ),
                name="run_lineage_complete",
            ),
        ]

    def __str__(self) -> str:
        return self.id


class InputClass(models.TextChoices):
    RECORDED_FACT = "recorded_fact", "Recorded fact"
    REPEATABLE = "repeatable", "Repeatable computation"
    LIVE_REQUEST = "live_request", "Live request"


class Checkpoint(models.Model):
    """An immutable snapshot of a run's state after a node; a trigger refuses changes."""

    id = models.CharField(
        primary_key=True, max_length=40, default=_checkpoint_id, editable=False
    )
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="checkpoints")
    sequence = models.PositiveIntegerField()
    node = models.CharField(max_length=100)
    state = models.JSONField()
    state_hash = models.CharField(max_length=71)
    # Recorded LLM responses and tool reads at this node, each tagged with its InputClass.
    recorded_inputs = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "sequence"]
        constraints = [
            models.UniqueConstraint(fields=["run", "sequence"], name="checkpoint_run_sequence"),
        ]

    def __str__(self) -> str:
        return self.id


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
            models.UniqueConstraint(fields=["action", "id"], name="operation_action_id_unique"),
        ]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="op_tenant_id"),
            models.Index(fields=["status", "-id"], name="op_status_id"),
            models.Index(fields=["run", "-id"], name="op_run_id"),
            models.Index(fields=["action", "-id"], name="op_action_id"),
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
        ]

    def __str__(self) -> str:
        return f"{self.operation_id}#{self.number} {self.kind} {self.outcome}"


class EvidenceKind(models.TextChoices):
    LOOKUP = "lookup", "Provider lookup"
    WEBHOOK = "webhook", "Webhook"
    CALL_RESULT = "call_result", "Call result"
    MANUAL = "manual", "Manual resolution"
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
