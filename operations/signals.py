from __future__ import annotations

from django.dispatch import Signal

# Sent inside the transaction that creates an operation that needs a person's approval, so
# the approval request commits together with the intent (approvals listens; operations
# never imports approvals). kwargs: operation, supersedes (the replaced operation or None).
operation_prepared = Signal()
