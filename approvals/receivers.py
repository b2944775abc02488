"""Connected in ApprovalsConfig.ready(): operations announce intents; approvals listen."""

from __future__ import annotations

from operations.models import Operation


def on_operation_prepared(
    sender, *, operation: Operation, supersedes: Operation | None = None, **kwargs
) -> None:
    # Runs inside operation_prepare's transaction: the request commits with the intent.
    from approvals.services import approval_request, approvals_supersede_for

    if operation.requires_approval:
        approval_request(operation=operation, supersedes=supersedes)
    elif supersedes is not None:
        # The new intent needs no person; the old one's request must not stay approvable.
        approvals_supersede_for(operation=supersedes, new_approval=None)
