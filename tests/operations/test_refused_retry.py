"""A call sent again after a proven absence, and refused: the refusal is about that request
alone. An earlier call the client gave up on may still land; until a lookup has ruled that
out, the operation is not closed as failed, and its intent cannot be replaced.

Against the sandbox over real HTTP: every test counts the provider's writes and objects.
"""

from __future__ import annotations

import pytest

from operations import engine
from operations.models import AttemptKind, OperationStatus
from operations.sandbox.models import Deal, PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import updated_past_triggers, wait_for
from tests.operations.engine_helpers import PAYMENT, authorized_payment, replaced_and_run

S = OperationStatus


def the_first_call_stalls_and_the_retry_is_refused(op, *, provider: str) -> None:
    """Call 1 stalls at the provider past our 1 s timeout, then does its work; a lookup
    meanwhile truly finds nothing, so call 2 goes with the same key and is refused (400)."""
    sandbox_fault_set(provider=provider, kind="delay", match=op.id, seconds=2.5)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.error_code == "timeout"
    sandbox_fault_set(provider=provider, kind="validation_error", match=op.id)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()


def all_writes_answered(provider: str, op) -> bool:
    writes = sandbox_writes(provider=provider, operation_id=op.id)
    return len(writes) == 2 and all(w.response_status for w in writes)


@pytest.mark.django_db(transaction=True)
def test_it_does_not_close_as_failed_a_refused_retry_while_the_first_call_may_land(
    acme, approver, sandbox
):
    op = authorized_payment(acme, approver)
    the_first_call_stalls_and_the_retry_is_refused(op, provider="payments")
    wait_for(lambda: all_writes_answered("payments", op), what="the stalled create to land")
    intent = PaymentIntent.objects.get(metadata__operation_id=op.id)
    assert intent.status == "succeeded"  # the money moved, by call 1

    # Call 2's 400 says nothing about call 1: the operation waits for a lookup, not closed.
    assert op.status != S.FAILED, "closed as failed while an earlier call could still land"
    assert op.status == S.UNKNOWN and op.next_reconcile_at is not None

    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "found"
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert PaymentIntent.objects.count() == 1
    assert op.provider_calls == 2 and len(sandbox_writes(provider="payments",
                                                         operation_id=op.id)) == 2


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_second_payment_when_a_refused_retry_is_replaced_by_a_new_intent(
    acme, approver, sandbox
):
    op = authorized_payment(acme, approver)
    the_first_call_stalls_and_the_retry_is_refused(op, provider="payments")

    # The agent (or a person) replaces the intent that looks refused: a new operation, a
    # new key. Allowed only for an intent whose every call is known not to have landed.
    replacement = replaced_and_run(op, approver)
    wait_for(lambda: all_writes_answered("payments", op), what="the stalled create to land")

    paid_for_the_invoice = PaymentIntent.objects.filter(
        metadata__invoice_id=PAYMENT["invoice_id"]
    ).count()
    assert paid_for_the_invoice == 1, "call 1 paid, and so did the replacement"
    assert replacement is None


@pytest.mark.django_db(transaction=True)
def test_it_finds_the_deal_a_stalled_create_made_after_the_retry_was_refused(acme, sandbox):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    the_first_call_stalls_and_the_retry_is_refused(op, provider="crm")
    wait_for(lambda: all_writes_answered("crm", op), what="the stalled create to land")
    deal = Deal.objects.get(agent_operation_id=op.id)

    assert op.status == S.UNKNOWN, "closed as failed while an earlier call could still land"
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id
    assert Deal.objects.count() == 1
    kinds = list(op.attempts.order_by("number").values_list("kind", "outcome"))
    assert kinds == [
        (AttemptKind.CALL, "unknown"), (AttemptKind.LOOKUP, "absent"),
        (AttemptKind.CALL, "failed"), (AttemptKind.LOOKUP, "found"),
    ]


@pytest.mark.django_db(transaction=True)
def test_it_closes_a_refused_retry_as_failed_once_no_earlier_call_can_land(
    acme, approver, sandbox
):
    from datetime import timedelta

    from django.utils import timezone

    from operations.models import Attempt

    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)  # nothing written
    engine.operation_execute(operation_id=op.id)
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.error_code == "validation"

    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "inconclusive" and not report.may_call_again  # may still land
    assert op.status == S.UNKNOWN and op.next_reconcile_at is not None
    # The provider's late-landing window after the first call has passed.
    earlier = timezone.now() - timedelta(minutes=5)
    updated_past_triggers(Attempt.objects.filter(operation=op, kind=AttemptKind.CALL, number=1),
                          started_at=earlier, finished_at=earlier)
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()

    assert (report.outcome, report.may_call_again) == ("absent", False)
    assert op.status == S.FAILED and op.error_code == "validation"
    assert engine.operation_execute(operation_id=op.id).outcome == "nothing_to_do"
    assert op.provider_calls == 2
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 2
    assert PaymentIntent.objects.count() == 0
