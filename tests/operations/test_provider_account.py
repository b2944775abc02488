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


@pytest.mark.django_db(transaction=True)
def test_it_claims_nothing_when_a_call_was_made_since_it_read_the_operation(
    acme, approver, sandbox, monkeypatch
):
    from operations.engine import core
    from operations.models import Operation

    op = authorized_payment(acme, approver)
    real = adapter(op.action)

    class CallMadeMeanwhile:
        """Another worker's call lands between this worker's read and its claim (it stalled
        there): what the read said of the calls made is stale."""

        contract = real.contract
        call, lookup, disagreement = real.call, real.lookup, real.disagreement

        def account(self) -> str:
            Operation.objects.filter(id=op.id).update(provider_calls=1)
            return real.account()

    monkeypatch.setattr(core, "adapter", lambda action: CallMadeMeanwhile())
    report = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "lost_claim" and op.status == S.NOT_STARTED
    assert not op.attempts.exists() and op.provider_calls == 1
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 0
