"""Connected in ApprovalsConfig.ready(): operations announce intents; approvals listen."""

from __future__ import annotations

from operations.models import Operation


def on_operation_prepared(
    sender, *, operation: Operation, supersedes: Operation | None = None, **kwargs
) -> None:
    # Runs inside operation_prepare's transaction: the request commits with the intent.
    from approvals.services import approval_request

    approval_request(operation=operation, supersedes=supersedes)
