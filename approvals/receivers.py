"""Connected in ApprovalsConfig.ready(): operations announce intents; approvals listen."""

from __future__ import annotations

from django.urls import reverse
from django.utils import timezone

from operations.models import Operation
from operations.signals import RelatedPage


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


def on_operation_related_pages(
    sender, *, operation: Operation, **kwargs
) -> list[RelatedPage]:
    # The operation's page names who approved; the approval's page keeps the rest (the
    # comment, the diff against the intent it replaced), newest request first.
    from approvals.models import ApprovalStatus
    from approvals.selectors import approvals_of_operation

    now = timezone.now()
    pages = []
    for approval in approvals_of_operation(operation.id):
        note = approval.get_status_display().lower()
        if approval.decided_by:
            note += f" by {approval.decided_by.username}"
        if approval.status == ApprovalStatus.APPROVED:
            authorization = ""  # the operation's own authorization says by whom and until
        elif approval.is_pending:
            # Past its time but not yet swept, a decision sent now is refused.
            authorization = "expired" if approval.ran_out(now) else "awaiting approval"
        else:
            authorization = note
        pages.append(RelatedPage(
            label=f"Approval {approval.id}",
            url=reverse("approvals:detail", args=[approval.id]),
            note=note,
            authorization=authorization,
        ))
    return pages
