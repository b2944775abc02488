from __future__ import annotations

from django.dispatch import Signal

# Sent inside the transaction that creates an operation, so what approvals does about it
# commits together with the intent (approvals listens; operations never imports approvals):
# a request when the operation needs a person's approval, and the end of the replaced
# intent's pending approval when it does not. kwargs: operation, supersedes (the replaced
# operation or None).
operation_prepared = Signal()
