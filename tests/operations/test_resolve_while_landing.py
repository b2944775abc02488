"""A person resolving an unknown operation as failed while a call it made may still land.

A call our client gave up on (a timeout) may still be carried out by the provider for a
while: nobody, a person included, can know before then that it did nothing. Resolved as
failed, the intent may be replaced, and the replacement's new key pays a second time when
the first call lands.

Against the sandbox over real HTTP: every test counts the provider's writes and objects.
"""

from __future__ import annotations

import pytest

from operations import engine
from operations.engine import TransitionRefused
from operations.models import OperationStatus
from operations.sandbox.models import PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import wait_for
from tests.operations.engine_helpers import PAYMENT, authorized_payment, replaced_and_run

S = OperationStatus


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_second_payment_when_a_person_fails_an_operation_whose_call_may_land(
    acme, approver, operator, providers_drained
):
    op = authorized_payment(acme, approver)
    # The provider takes 3 s over the POST; our client gives up after 1 s.
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=3)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and PaymentIntent.objects.count() == 0  # not yet

    # An operator sees no debit at the bank yet and settles it as failed; the agent then
    # replaces the intent that looks failed with a new one, which is approved and runs.
    replacement = None
    try:
        engine.operation_resolve(
            operation_id=op.id, actor=operator, outcome=S.FAILED,
            evidence_text="no debit on the bank statement", reason="checked with treasury",
        )
    except TransitionRefused:
        pass
    else:
        replacement = replaced_and_run(op, approver)
    wait_for(lambda: not sandbox_writes(provider="payments", operation_id=op.id).filter(
        response_status__isnull=True).exists(), what="the slow POST to land")

    paid_for_the_invoice = PaymentIntent.objects.filter(
        metadata__invoice_id=PAYMENT["invoice_id"]
    ).count()
    assert paid_for_the_invoice == 1, "the first call paid, and so did the replacement"
    assert replacement is None
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and not op.resolved_manually
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 1

    # Once it landed, the lookup finds it: the journal tells what happened.
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == PaymentIntent.objects.get().id


@pytest.mark.django_db(transaction=True)
def test_it_refuses_to_fail_by_words_a_payment_a_lookup_found_while_the_person_decided(
    acme_unknown, approver, operator, sandbox, monkeypatch
):
    """The page showed an unknown operation with no provider object. While the person
    resolved it as failed on their words, a reconcile found its payment waiting for the
    customer's 3-D Secure: the status stays unknown, but the operation now records the
    payment, which may yet complete. Failed anyway, its replacement would pay again."""
    from operations.engine import people
    from operations.sandbox.services import sandbox_payment_create

    op = acme_unknown
    seen = op.status_changed_at
    intent_id = sandbox_payment_create(
        amount=op.payload["amount_minor"], currency=op.payload["currency"].lower(),
        metadata={"operation_id": op.id}, confirm=True, needs_action=True,
    )["id"]
    real_lands_by = people.unanswered_call_lands_by

    def lookup_meanwhile(op_, **kwargs):
        lands_by = real_lands_by(op_, **kwargs)
        assert engine.operation_reconcile(operation_id=op.id).status == S.UNKNOWN
        return lands_by

    monkeypatch.setattr(people, "unanswered_call_lands_by", lookup_meanwhile)
    with pytest.raises(TransitionRefused, match=f"the provider holds {intent_id} for {op.id}"):
        engine.operation_resolve(
            operation_id=op.id, actor=operator, outcome=S.FAILED,
            evidence_text="no debit on the bank statement", reason="checked with treasury",
            seen_status_changed_at=seen,
        )

    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == (S.UNKNOWN, intent_id, False)
    assert not op.evidence.filter(kind="manual").exists()
    assert replaced_and_run(op, approver) is None
    assert PaymentIntent.objects.count() == 1
