"""The operations app's data: tenants and their audit trail, runs and checkpoints, the
operation (the canonical intent and its execution state), and what each call, lookup and
provider event left on it. One module per group; everything is importable from here."""

from __future__ import annotations

from operations.models.calls import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    AttemptQuerySet,
    Evidence,
    EvidenceKind,
    WebhookEvent,
    WebhookEventQuerySet,
    nothing_held_for_review,
)
from operations.models.operation import Action, Operation, OperationStatus, _operation_id
from operations.models.runs import (
    Checkpoint,
    InputClass,
    Run,
    RunMode,
    RunStatus,
    _checkpoint_id,
    _run_id,
)
from operations.models.tenancy import AuditEvent, Role, Tenant, TenantRole

# The id defaults are named here because migrations refer to them as operations.models._…
__all__ = [
    "Action",
    "Attempt",
    "AttemptKind",
    "AttemptOutcome",
    "AttemptQuerySet",
    "AuditEvent",
    "Checkpoint",
    "Evidence",
    "EvidenceKind",
    "InputClass",
    "Operation",
    "OperationStatus",
    "Role",
    "Run",
    "RunMode",
    "RunStatus",
    "Tenant",
    "TenantRole",
    "WebhookEvent",
    "WebhookEventQuerySet",
    "_checkpoint_id",
    "_operation_id",
    "_run_id",
    "nothing_held_for_review",
]
