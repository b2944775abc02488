"""The effect engine: prepare, authorize, execute, reconcile, resolve.

This package is the only code that changes `Operation.status`. Every change is a conditional
UPDATE (`WHERE id = … AND status IN (…)`) checked for one row, written together with its
evidence / attempt / audit row in one transaction, and allowed by `transitions`. No network
I/O happens inside a transaction: a provider is called only between two short ones.
"""

from __future__ import annotations

from operations.engine.core import (
    AuthorizationRefused,
    EngineError,
    ReferenceRefused,
    TransitionRefused,
    dispute_applies,
    lease_expired,
    reconcile_applies,
)
from operations.engine.execute import ExecuteReport, operation_execute
from operations.engine.people import operation_cancel, operation_dispute, operation_resolve
from operations.engine.prepare import operation_authorize, operation_prepare, run_mode_problem
from operations.engine.reconcile import (
    ReconcileReport,
    operation_reconcile,
    reconcile_claim_seconds,
)
from operations.engine.sweep import (
    operations_claim_due_for_reconcile,
    operations_claim_waiting_for_execute,
    operations_due_for_reconcile,
)
from operations.engine.webhooks import webhook_apply

__all__ = [
    "AuthorizationRefused",
    "EngineError",
    "ExecuteReport",
    "ReconcileReport",
    "ReferenceRefused",
    "TransitionRefused",
    "dispute_applies",
    "lease_expired",
    "operation_authorize",
    "operation_cancel",
    "operation_dispute",
    "operation_execute",
    "operation_prepare",
    "operation_reconcile",
    "operation_resolve",
    "operations_claim_due_for_reconcile",
    "operations_claim_waiting_for_execute",
    "operations_due_for_reconcile",
    "reconcile_applies",
    "reconcile_claim_seconds",
    "run_mode_problem",
    "webhook_apply",
]
