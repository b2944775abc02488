from __future__ import annotations

from dataclasses import dataclass

from django.dispatch import Signal

# Sent inside the transaction that creates an operation, so what approvals does about it
# commits together with the intent (approvals listens; operations never imports approvals):
# a request when the operation needs a person's approval, and the end of the replaced
# intent's pending approval when it does not. kwargs: operation, supersedes (the replaced
# operation or None).
operation_prepared = Signal()


@dataclass(frozen=True)
class RelatedPage:
    """A page another app keeps about an operation, linked from the operation's page."""

    label: str
    url: str
    note: str = ""
    # What this page says of an operation's missing authorization, in the words of the
    # operation page's Authorization row: "awaiting approval" only while a decision can
    # still be made, else how the request ended ("rejected by …", "superseded", "expired").
    # Empty when it says nothing of it.
    authorization: str = ""


# Sent while an operation's page is rendered, for a user who may see the operation: each
# receiver answers with a list of RelatedPage (approvals: the requests for this intent and
# their decisions), so the page links to them while operations imports no other app.
# kwargs: operation, user.
operation_related_pages = Signal()
