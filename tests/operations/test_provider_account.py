"""A call sent again goes to the provider account the earlier calls went to, or nowhere.

The idempotency key dedups a repeat only inside the account that saw it first: a same-key
call in another account (the deployment's API key or endpoint switched, test mode to live
mode, say) is a new effect there, whatever a lookup proved in the first account.

Against the sandbox over real HTTP: every test counts the provider's writes and objects.
"""

from __future__ import annotations

import pytest

from operations import engine
from operations.engine.core import adapter
from operations.models import AttemptKind, OperationStatus
from operations.sandbox.models import IdempotencyRecord, PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import wait_for
from tests.operations.engine_helpers import authorized_payment

S = OperationStatus


@pytest.mark.django_db(transaction=True)
def test_it_never_calls_again_in_another_provider_account_than_the_earlier_calls(
    acme, approver, sandbox, settings
):
    op = authorized_payment(acme, approver)
    first_account = adapter(op.action).account()
    # Call 1 stalls at the provider past our 1 s timeout, then pays; a lookup meanwhile, in
    # the same account, truly finds nothing: the same key may go again (it dedups there).
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2.5)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    report = engine.operation_reconcile(operation_id=op.id)
    assert (report.outcome, report.may_call_again) == ("absent", True)
    wait_for(lambda: all(w.response_status for w in sandbox_writes(
        provider="payments", operation_id=op.id)), what="the stalled create to land")
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 1

    # Before the call goes again, the deployment's API key is switched to another account,
    # which has never seen this operation's key (the sandbox stands in for both accounts).
    settings.PAYMENTS_API_KEY = "sk_live_another_account"
    IdempotencyRecord.objects.filter(key=op.idempotency_key).delete()
    assert adapter(op.action).account() != first_account

    report = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 1, (
        "the first account paid, and so did the second"
    )
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 1
    assert op.provider_calls == 1
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == 1
    # Not called, and not closed: the operators' queue, with nothing scheduled to call it.
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None
    assert op.id not in engine.operations_due_for_reconcile()
    assert first_account in op.evidence.last().summary
