"""Shared by the modules that break the engine on purpose against the sandbox: what reached
the provider, a payment executed into a sandbox fault, and an answer lost on purpose."""

from __future__ import annotations

from datetime import timedelta

from operations import engine
from operations.engine import core
from operations.models import Operation, OperationStatus
from operations.providers.base import LookupOutcome, LookupResult
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.operations.engine_helpers import authorized_payment

S = OperationStatus


def payment_posts(op: Operation):
    return sandbox_writes(provider="payments", operation_id=op.id)


def executed_into_a_fault(tenant, approver, kind: str) -> Operation:
    """An approved payment executed once while the sandbox answers with `kind`."""
    op = authorized_payment(tenant, approver)
    sandbox_fault_set(provider="payments", kind=kind, match=op.id)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    return op


def lose_the_answer(op: Operation) -> Operation:
    """A real lost answer: the sandbox commits and the 1-second client timeout fires."""
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=3)
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "called" and op.status == S.UNKNOWN, report
    return op


def lookups_inconclusive(
    monkeypatch, *, reason: str = "lookup failed (http_5xx)",
    retry_after: timedelta | None = timedelta(seconds=30), backoff: bool = False,
) -> None:
    """Every payment lookup from now on answers inconclusive (the provider cannot be asked),
    the adapter otherwise the real one."""
    real = core.adapter("payments.create")

    class InconclusiveLookup:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            return LookupResult(outcome=LookupOutcome.INCONCLUSIVE, reason=reason,
                                retry_after=retry_after, backoff=backoff)

    monkeypatch.setattr(core, "adapter", lambda action: InconclusiveLookup())
