"""Provider events a person must see: an effect of the operation that is not the one its
journal records is held for review whoever settled the operation, the engine or a person.

Against the sandbox over real HTTP and its signed webhooks: every test counts the provider's
writes and objects.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.engine import findings as findings_module
from operations.engine import webhooks as webhooks_module
from operations.engine.core import lease_expired
from operations.models import Operation, OperationStatus, WebhookEvent
from operations.providers.base import CallOutcome, WebhookFacts
from operations.sandbox.delivery import sandbox_webhooks_deliver
from operations.sandbox.models import Message, PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import (
    sandbox_fault_set,
    sandbox_message_create,
    sandbox_message_deliver,
    sandbox_payment_create,
    sandbox_payment_settle,
)
from operations.selectors import operations_unknown_queue, webhooks_held_for_review
from tests.helpers import Background, a_statement_waits_on_a_lock, signed_in, wait_for
from tests.operations.engine_helpers import (
    PAYMENT,
    async_payment,
    authorized_payment,
    died_mid_call,
    executing_in_flight,
    replaced_and_run,
)

S = OperationStatus


REPORTED = {"succeeded": CallOutcome.SUCCEEDED, "processing": CallOutcome.ACCEPTED}


def success_reported_in_flight(
    op: Operation, *, event_id: str, external_id: str, status: str = "succeeded"
) -> None:
    """The provider reports a payment of the approved sum carrying `op` succeeded (or under
    way), while the journal has its call in flight: kept for the answer (or a lookup, or a
    person)."""
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id=event_id, event_type=f"payment_intent.{status}", operation_id=op.id,
        external_id=external_id, status=REPORTED[status],
        data={"id": external_id, "status": status, "amount": PAYMENT["amount_minor"],
              "currency": PAYMENT["currency"].lower()}))
    assert result == "ignored" and message.startswith("kept while the call was in flight")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("amount", "with_reference"), [
    (PAYMENT["amount_minor"], True),  # a second payment of the approved sum
    # The same, resolved by evidence text alone: the operation records no object until
    # the provider's event about ours names it.
    (PAYMENT["amount_minor"], False),
    (PAYMENT["amount_minor"] + 1, False),  # a payment of another sum
])
def test_it_holds_a_second_payment_reported_after_a_person_resolved_the_operation(
    acme, approver, operator, sandbox, live_server, amount, with_reference
):
    op = authorized_payment(acme, approver)
    # The answer is lost; a person settles the operation by what they checked.
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=3)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    ours = PaymentIntent.objects.get(metadata__operation_id=op.id)
    assert op.status == S.UNKNOWN
    engine.operation_resolve(
        operation_id=op.id, actor=operator, outcome=S.SUCCEEDED,
        evidence_text="treasury sees the debit", reason="checked with treasury",
        provider_reference=ours.id if with_reference else "",
    )
    sandbox_webhooks_deliver(target_base_url=live_server.url)  # ours: agrees, nothing held
    assert not webhooks_held_for_review(operation=op).exists()
    assert Operation.objects.get(id=op.id).external_id == ours.id

    # Then the provider moves money a second time for this operation (made by hand in its
    # dashboard, or by another integration), and says so.
    second = sandbox_payment_create(
        amount=amount, currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    sandbox_webhooks_deliver(target_base_url=live_server.url)

    op.refresh_from_db()
    event = WebhookEvent.objects.get(external_id=second["id"])
    assert event.operation_id == op.id and not event.applied
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == [event.event_id], (
        "the provider reports a second effect and nobody is asked to look"
    )
    assert op.status == S.SUCCEEDED and op.external_id != second["id"]
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 2
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 1  # ours alone
    assert op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_second_payment_for_an_intent_whose_payment_was_held_after_it_failed(
    acme, approver, operator, sandbox, live_server
):
    op = async_payment(acme, approver)  # processing at the provider
    # A person sees no debit and settles the operation as failed. Refused now while the
    # provider holds the payment; one settled so before that rule stays in the journal.
    with pytest.raises(engine.TransitionRefused, match="may still complete"):
        engine.operation_resolve(
            operation_id=op.id, actor=operator, outcome=S.FAILED,
            evidence_text="no debit on the bank statement", reason="checked with treasury",
        )
    Operation.objects.filter(id=op.id).update(
        status=S.FAILED, resolved_manually=True, error_code="resolved_failed",
        error_message="no debit on the bank statement")
    # Then the bank settles the payment after all, and the provider says so: held for
    # that person.
    sandbox_payment_settle(payment_intent_id=op.external_id, status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    assert webhooks_held_for_review(operation=op).exists()

    # Before anyone looks, the agent replaces the intent that looks failed.
    replacement = replaced_and_run(op, approver)

    paid_for_the_invoice = PaymentIntent.objects.filter(
        metadata__invoice_id=PAYMENT["invoice_id"]
    ).count()
    assert paid_for_the_invoice == 1, "the first payment settled, and the replacement paid"
    assert replacement is None
    op.refresh_from_db()
    assert op.status == S.FAILED and webhooks_held_for_review(operation=op).exists()
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_reported_for_an_operation_waiting_to_be_called(
    acme, approver, operator, sandbox, live_server
):
    op = authorized_payment(acme, approver)  # approved, not called yet
    # A payment carrying this operation's id, made outside the console (or a call a lookup
    # proved absent, landing after all): the journal says nothing was done.
    made = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    sandbox_webhooks_deliver(target_base_url=live_server.url)

    op.refresh_from_db()
    event = WebhookEvent.objects.get(external_id=made["id"])
    assert op.status == S.NOT_STARTED and op.external_id == ""
    assert list(webhooks_held_for_review(operation=op)) == [event]
    assert event.outcome == (
        f"held for review: the provider reports succeeded ({made['id']}); {op.id} stays "
        "not_started, a person decides"
    )

    # Not called on top of it: a person looks first (the operators' queue, nothing scheduled).
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert (report.outcome, op.status, op.error_code) == (
        "held_for_review", S.UNKNOWN, "held_for_review")
    assert op.next_reconcile_at is None and op.provider_calls == 0
    assert op.id in [o.id for o in operations_unknown_queue(operator)]
    assert op.evidence.last().summary.startswith(
        f"not called: the provider reported an effect of this operation ({event.event_id})")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_call_when_an_event_is_held_while_a_worker_claims_the_operation(
    acme, approver, sandbox, monkeypatch
):
    op = authorized_payment(acme, approver)  # approved, not called yet
    # A payment carrying this operation's id, made outside the console: the journal says
    # nothing was done, so its event is held for a person and no call may follow.
    made = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    decided, go = threading.Event(), threading.Event()
    real = webhooks_module._webhook_transition

    def decides_then_lingers(op_, *, facts):
        answer = real(op_, facts=facts)
        decided.set()  # under the operation's row lock, not committed yet
        go.wait(10)
        return answer

    monkeypatch.setattr(webhooks_module, "_webhook_transition", decides_then_lingers)
    delivery = Background(lambda: engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_outside", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id=made["id"], status=CallOutcome.SUCCEEDED,
        data={"id": made["id"], "status": "succeeded", "amount": PAYMENT["amount_minor"],
              "currency": PAYMENT["currency"].lower()})))
    assert decided.wait(10)
    # A worker picks the operation up at that moment (its queue message, or the sweep), and
    # its claim comes to wait on the row the delivery holds.
    worker = Background(lambda: engine.operation_execute(operation_id=op.id))
    wait_for(a_statement_waits_on_a_lock, timeout=10, what="the claim to wait on the row lock")
    go.set()
    assert delivery.join()[0] == "held"
    report = worker.join()

    op.refresh_from_db()
    assert WebhookEvent.objects.get(event_id="evt_outside").needs_review
    # The held event says a payment for this intent exists: nothing is sent on top of it.
    assert (report.outcome, op.status) == ("held_for_review", S.UNKNOWN)
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert op.provider_calls == 0
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("needs_review", "answered", "called"), [
    (True, False, False), (True, True, True), (False, False, True),
])
def test_it_calls_only_once_no_held_event_is_left_unanswered(
    acme, approver, sandbox, needs_review, answered, called
):
    op = authorized_payment(acme, approver)
    # The claim's SQL and WebhookEvent.objects.held_for_review() must agree on "held".
    WebhookEvent.objects.create(
        provider="payments", event_id="evt_x", event_type="payment_intent.succeeded",
        operation=op, external_id="pi_x", needs_review=needs_review,
        reviewed_at=timezone.now() if answered else None,
    )
    report = engine.operation_execute(operation_id=op.id)
    assert (report.outcome == "called") is called
    assert webhooks_held_for_review(operation=op).exists() is not called
    assert sandbox_writes(provider="payments", operation_id=op.id).count() == int(called)
    assert PaymentIntent.objects.count() == int(called)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("second_is", "held", "ours"), [
    ("succeeded", True, S.SUCCEEDED),  # a second payment that moved money
    ("processing", True, S.ACCEPTED),  # one under way (the sandbox settles both later)
    ("declined", False, S.SUCCEEDED),  # one that moved none
])
def test_it_holds_a_second_payment_reported_while_its_own_call_is_in_flight(
    acme, approver, sandbox, live_server, settings, second_is, held, ours
):

    if second_is == "processing":
        settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1
    op = authorized_payment(acme, approver)
    call = executing_in_flight(op, settings, fault="delay", seconds=1.5)
    # While our call is in flight, a payment of the same sum carrying this operation's id is
    # made outside the console, and the provider reports it first.
    second = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        declined=second_is == "declined", metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1
    assert Operation.objects.get(id=op.id).status == S.IN_PROGRESS, (
        "another object's event stood for the answer of the call in flight")
    call.join()

    op.refresh_from_db()
    made = PaymentIntent.objects.exclude(id=second["id"]).get()
    assert op.status == ours and op.external_id == made.id
    held_events = list(webhooks_held_for_review(operation=op))
    if held:
        assert [e.external_id for e in held_events] == [second["id"]]
        reported = {"succeeded": S.SUCCEEDED, "processing": S.ACCEPTED}[second_is]
        assert held_events[0].outcome == (
            f"held for review: the provider reports a second effect, {second['id']} "
            f"({reported}), carrying {op.id}, which records {made.id}; a person decides")
        assert op.evidence.filter(summary__contains=held_events[0].outcome).count() == 1
    else:
        assert held_events == []
    assert not WebhookEvent.objects.filter(operation=op, applied=True).exists()
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == op.provider_calls == 1
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_second_payment_reported_in_flight_once_a_lookup_finds_its_own(
    acme, approver, sandbox, settings
):
    op = authorized_payment(acme, approver)
    # The payment is made, its answer lost: the journal says unknown.
    call = executing_in_flight(op, settings, fault="commit_then_drop", seconds=4, timeout=3)
    # Meanwhile the provider reports a payment carrying the operation that is not the one
    # our call made (which the provider's search does not show to the lookup below).
    success_reported_in_flight(op, event_id="evt_other", external_id="pi_other")
    call.join()
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and not webhooks_held_for_review(operation=op).exists()

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    ours = PaymentIntent.objects.get()
    assert (report.outcome, op.status, op.external_id) == ("found", S.SUCCEEDED, ours.id), (
        report)
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_other"]
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_settles_at_once_a_payment_whose_succeeded_event_overtook_its_processing_answer(
    acme, approver, sandbox, live_server, settings
):

    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1  # the answer says "processing"
    op = authorized_payment(acme, approver)
    call = executing_in_flight(op, settings, fault="commit_then_drop", seconds=1.5)
    # The bank settles it, and both events reach us before the answer does.
    made = PaymentIntent.objects.get()
    sandbox_payment_settle(payment_intent_id=made.id, status="succeeded")
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 2
    assert Operation.objects.get(id=op.id).status == S.IN_PROGRESS
    call.join()

    op.refresh_from_db()
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.SUCCEEDED, made.id, None), (
        "the settled payment waits for a lookup although its event is in hand")
    assert list(op.evidence.filter(kind__in=["call_result", "webhook"], to_status__in=[
        S.ACCEPTED, S.SUCCEEDED]).exclude(from_status=S.ACCEPTED, to_status=S.ACCEPTED)
        .values_list("from_status", "to_status")) == [
        (S.IN_PROGRESS, S.ACCEPTED), (S.ACCEPTED, S.SUCCEEDED)]
    events = dict(WebhookEvent.objects.filter(operation=op).values_list("event_type", "applied"))
    assert events == {"payment_intent.processing": False, "payment_intent.succeeded": True}
    assert not webhooks_held_for_review(operation=op).exists()
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_success_reported_in_flight_for_a_payment_a_lookup_then_finds_declined(
    acme, approver, sandbox
):


    op = authorized_payment(acme, approver)
    # The worker died mid-call; the provider made the payment, declined.
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=5))
    declined = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        declined=True, metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    # An event says that very payment succeeded (its customer paid with another card), while
    # the journal still has the call in flight.
    success_reported_in_flight(op, event_id="evt_paid", external_id=declined["id"])

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, op.status, op.external_id) == ("found", S.FAILED, declined["id"])
    [held] = webhooks_held_for_review(operation=op)
    assert held.event_id == "evt_paid" and held.outcome == (
        f"held for review: the provider reports succeeded ({declined['id']}); {op.id} stays "
        "failed, a person decides")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("about", "status", "held"), [
    ("other", S.UNKNOWN, True),  # a second payment, reported while the call was in flight
    ("own", S.SUCCEEDED, False),  # its customer's 3-D Secure answer, reported meanwhile
])
def test_it_decides_events_kept_in_flight_when_a_lookup_finds_the_payment_waiting_on_3ds(
    acme, approver, sandbox, about, status, held
):
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    waiting = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        needs_action=True, metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    paid = "pi_other" if about == "other" else waiting["id"]
    success_reported_in_flight(op, event_id="evt_paid", external_id=paid)

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, op.status, op.external_id) == ("found", status, waiting["id"])
    held_ids = [e.event_id for e in webhooks_held_for_review(operation=op)]
    assert held_ids == (["evt_paid"] if held else [])
    assert WebhookEvent.objects.get(event_id="evt_paid").applied is (about == "own")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("outcome", "held"), [
    (S.FAILED, True),  # the provider said the payment succeeded: not what they decided
    (S.SUCCEEDED, False),  # what they decided
])
def test_it_decides_events_kept_in_flight_against_a_persons_resolution(
    acme, approver, operator, sandbox, outcome, held
):
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    success_reported_in_flight(op, event_id="evt_paid", external_id="pi_paid")
    # No answer and no lookup named the payment (the provider's search was down); a person
    # settles the operation by what they checked.
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id, times=5)
    assert engine.operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    engine.operation_resolve(operation_id=op.id, actor=operator, outcome=outcome,
                             evidence_text="checked the bank statement", reason="treasury")

    op.refresh_from_db()
    event = WebhookEvent.objects.get(event_id="evt_paid")
    assert (op.status, op.resolved_manually, event.applied) == (outcome, True, False)
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == (
        ["evt_paid"] if held else [])
    # The payment that agrees is the one the person's evidence was about: recorded, so
    # another one reported later reads as a second payment.
    assert op.external_id == ("" if held else "pi_paid")
    assert event.outcome == (
        f"held for review: the provider reports succeeded (pi_paid); {op.id} stays failed by "
        "an operator's decision" if held
        else f"ignored: {op.id} is succeeded by an operator's decision; it records pi_paid "
        "as its object")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("expired", "status"), [
    (False, S.UNKNOWN),  # absence would allow another call: not made, a person looks first
    (True, S.CANCELLED),  # absence closes it as never done: the payment reported is held
])
def test_it_calls_no_more_for_a_payment_reported_in_flight_that_a_lookup_does_not_find(
    acme, approver, operator, sandbox, expired, status
):
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    # The provider reports a payment carrying this operation succeeded while the journal has
    # the call in flight; its search does not show it to the lookup (it lags, or the payment
    # lives where the search does not reach).
    success_reported_in_flight(op, event_id="evt_paid", external_id="pi_paid")
    if expired:
        Operation.objects.filter(id=op.id).update(
            authorization_expires_at=timezone.now() - timedelta(minutes=1))

    engine.operation_reconcile(operation_id=op.id)
    engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert op.status == status
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_paid"], (
        "the provider reported a payment of this operation and nobody is asked to look")
    assert replaced_and_run(op, approver) is None
    assert not sandbox_writes(provider="payments").exists()
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("reported", ["succeeded", "processing"])
def test_it_holds_a_payment_reported_while_the_call_the_provider_refuses_is_in_flight(
    acme, approver, sandbox, monkeypatch, reported
):
    from operations.engine import execute as execute_module

    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    real_snapshot = execute_module.snapshot

    def reported_while_in_flight(op_, **kwargs):
        # After the claim, before the call's answer: a payment carrying this operation
        # (made outside the console) is reported succeeded, or under way. Under way is no
        # late echo of the refusal, which named no payment: once it settles, the failed
        # intent's replacement would be a second payment.
        success_reported_in_flight(op, event_id="evt_paid", external_id="pi_paid",
                                   status=reported)
        return real_snapshot(op_, **kwargs)

    monkeypatch.setattr(execute_module, "snapshot", reported_while_in_flight)
    engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.FAILED, "")
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_paid"], (
        "the intent looks refused while the provider reported its payment, and nobody looks")
    assert replaced_and_run(op, approver) is None
    assert len(sandbox_writes(provider="payments")) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_second_payment_kept_in_flight_once_an_event_settles_the_operation(
    acme, approver, sandbox, live_server
):
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    # While the call is in flight, the provider reports a payment carrying the operation
    # that is not the one the call made.
    success_reported_in_flight(op, event_id="evt_other", external_id="pi_other")
    # The worker is gone; the provider's search is down, so no lookup names the payment.
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id, times=5)
    assert engine.operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    # Then the event about the call's own payment arrives, and settles the operation.
    ours = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1

    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.SUCCEEDED, ours["id"])
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_other"], (
        "the second payment stays kept for an answer that will never come, and nobody looks")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_two_payments_when_a_late_answer_names_another_than_the_event_that_settled_it(
    acme, approver, sandbox, live_server, settings
):
    settings.OPERATION_LEASE_SECONDS = 1
    op = authorized_payment(acme, approver)
    call = executing_in_flight(op, settings, fault="delay", seconds=3)
    # The call outlives its lease: the sweep's reconcile finds nothing yet, and meanwhile a
    # payment carrying the operation is made outside the console and reported, settling it.
    wait_for(lambda: lease_expired(Operation.objects.get(id=op.id)), what="the lease to end")
    engine.operation_reconcile(operation_id=op.id)
    other = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1
    assert Operation.objects.get(id=op.id).external_id == other["id"]
    # Then the call's answer arrives: our own payment, a second one.
    call.join()
    sandbox_webhooks_deliver(target_base_url=live_server.url)  # ours, reported too

    op.refresh_from_db()
    ours = PaymentIntent.objects.exclude(id=other["id"]).get()
    assert (op.status, op.external_id) == (S.SUCCEEDED, other["id"])
    assert op.attempts.get(kind="call").external_id == ours.id
    held = {e.external_id for e in webhooks_held_for_review(operation=op)}
    assert held == {other["id"], ours.id}, "two payments for one intent, and nobody is asked"
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == op.provider_calls == 1
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_under_way_reported_after_the_provider_refused_the_call(
    acme, approver, sandbox, live_server, settings
):
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1  # a payment made now stays "processing"
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.FAILED, "")
    # A payment carrying this operation (made outside the console) is under way, and the
    # provider says so after the refusal: not an out-of-order echo of a failure of its own.
    made = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        metadata={"operation_id": op.id, "tenant": acme.slug,
                  "invoice_id": PAYMENT["invoice_id"]},
    )
    assert made["status"] == "processing"
    sandbox_webhooks_deliver(target_base_url=live_server.url)

    assert [e.external_id for e in webhooks_held_for_review(operation=op)] == [made["id"]]
    # So the failed intent is not replaced while that payment may still settle.
    assert replaced_and_run(op, approver) is None
    sandbox_payment_settle(payment_intent_id=made["id"], status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.FAILED, "")
    assert op.provider_calls == 1
    assert PaymentIntent.objects.filter(metadata__invoice_id=PAYMENT["invoice_id"]).count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("found_declined", "held"), [
    (False, True),  # the one the lookup found succeeded too: two payments, one intent
    (True, False),  # it was declined: the one under way is the operation's effect
])
def test_it_keeps_the_payment_an_event_recorded_while_a_lookup_found_another(
    acme, approver, operator, sandbox, monkeypatch, found_declined, held
):
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    found, under_way = two_payments_one_hidden(op, acme, found_declined=found_declined)
    # The provider's event about the one under way lands while the lookup is on its way.
    adapter = engine.core.adapter(op.action)
    search = adapter.lookup

    def lookup_overtaken_by_the_event(snapshot):
        result, _ = engine.webhook_apply(provider="payments", facts=WebhookFacts(
            event_id="evt_under_way", event_type="payment_intent.processing",
            operation_id=op.id, external_id=under_way["id"], status=CallOutcome.ACCEPTED,
            data=under_way))
        assert result == "applied"
        return search(snapshot)

    monkeypatch.setattr(adapter, "lookup", lookup_overtaken_by_the_event)

    engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    # Never swapped for the one the search found, and never closed by it.
    assert (op.status, op.external_id) == (S.ACCEPTED, under_way["id"])
    lookup = op.attempts.get(kind="lookup")
    assert lookup.external_id == found["id"] and lookup.needs_review is held
    assert engine.core.held_reports(op.id).answers == ([lookup.number] if held else [])
    if held:
        assert lookup.review_note == (
            f"the provider reports a second effect, {found['id']} (succeeded), carrying "
            f"{op.id}, which records {under_way['id']}; a person decides")
        page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
        assert f"Lookup {lookup.number} found <code>{found['id']}</code>" in page
        queue = signed_in(operator).get("/operations/unknown/").content.decode()
        assert f"What lookup {lookup.number} found: <code>{found['id']}</code>" in queue
    else:
        assert op.evidence.last().summary.endswith(f"the next lookup follows {under_way['id']}")
    assert not sandbox_writes(provider="payments", operation_id=op.id).exists()
    assert PaymentIntent.objects.count() == 2


def two_payments_one_hidden(op, acme, *, found_declined=False, found_needs_action=False):
    """Two payments carrying `op`: one made long enough ago for the provider's search to
    see it, and one under way that its search has not caught up with."""
    metadata = {"operation_id": op.id, "tenant": acme.slug}
    amount, currency = PAYMENT["amount_minor"], PAYMENT["currency"].lower()
    found = sandbox_payment_create(amount=amount, currency=currency, metadata=metadata,
                                   confirm=True, declined=found_declined,
                                   needs_action=found_needs_action)
    PaymentIntent.objects.filter(id=found["id"]).update(
        created_at=timezone.now() - timedelta(minutes=10))
    under_way = sandbox_payment_create(amount=amount, currency=currency, metadata=metadata,
                                       confirm=True)
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)
    return found, under_way


def reported(op, obj, status):
    return WebhookFacts(
        event_id=f"evt_{obj['id']}_{status}", event_type=f"payment_intent.{status}",
        operation_id=op.id, external_id=obj["id"],
        status=CallOutcome.SUCCEEDED if status == "succeeded" else CallOutcome.ACCEPTED,
        data={**obj, "status": status})


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_second_payment_a_lookup_finds_once_an_event_settled_the_operation(
    acme, approver, sandbox, monkeypatch
):
    """The event that lands during the lookup settles the operation with its payment: the
    other succeeded payment the search finds is a second effect of one intent all the same."""
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    found, under_way = two_payments_one_hidden(op, acme)
    assert found["status"] == under_way["status"] == "succeeded"
    adapter = engine.core.adapter(op.action)
    search = adapter.lookup

    def lookup_overtaken_by_the_event(snapshot):
        result, _ = engine.webhook_apply(provider="payments",
                                         facts=reported(op, under_way, "succeeded"))
        assert result == "applied"
        return search(snapshot)

    monkeypatch.setattr(adapter, "lookup", lookup_overtaken_by_the_event)
    engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.SUCCEEDED, under_way["id"])
    lookup = op.attempts.get(kind="lookup")
    assert lookup.external_id == found["id"]
    assert lookup.needs_review
    assert engine.core.held_reports(op.id).answers == [lookup.number]


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_waiting_on_3ds_a_lookup_finds_after_an_event_recorded_another(
    acme, approver, sandbox, monkeypatch
):
    """An event records another payment after the lookup read the operation, just before
    it notes the payment it found waiting on its customer: that one is held, as it is when
    the event lands a moment earlier."""
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    found, under_way = two_payments_one_hidden(op, acme, found_needs_action=True)
    assert found["status"] == "requires_action"
    original = findings_module._lookup_noted
    fired = []

    def event_lands_first(op_, **kwargs):
        if not fired:
            fired.append(True)
            result, _ = engine.webhook_apply(provider="payments",
                                             facts=reported(op, under_way, "processing"))
            assert result == "applied"
        return original(op_, **kwargs)

    monkeypatch.setattr(findings_module, "_lookup_noted", event_lands_first)
    engine.operation_reconcile(operation_id=op.id)

    assert fired
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.ACCEPTED, under_way["id"])
    lookup = op.attempts.get(kind="lookup")
    assert lookup.external_id == found["id"]
    assert lookup.needs_review


@pytest.mark.django_db(transaction=True)
def test_it_ignores_a_processing_event_kept_in_flight_that_was_made_before_the_failure(
    acme, approver, sandbox
):
    """Decided once the lookup finds the payment declined: made before the decline, the
    event is only out of order, and holding it would block the replacement for nothing."""
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    declined = sandbox_payment_create(
        amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(), confirm=True,
        declined=True, metadata={"operation_id": op.id, "tenant": acme.slug},
    )
    made_at = timezone.now() - timedelta(minutes=4)
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_processing_early", event_type="payment_intent.processing",
        operation_id=op.id, external_id=declined["id"], status=CallOutcome.ACCEPTED,
        created_at=made_at,
        data={"id": declined["id"], "status": "processing", "amount": PAYMENT["amount_minor"],
              "currency": PAYMENT["currency"].lower()}))
    assert result == "ignored" and message.startswith("kept while the call was in flight")

    engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.FAILED, declined["id"])
    event = WebhookEvent.objects.get(event_id="evt_processing_early")
    assert event.provider_created_at < op.status_changed_at  # made before the failure
    assert not event.needs_review, event.outcome
    assert engine.core.held_reports(op.id).events == []


@pytest.mark.django_db(transaction=True)
def test_it_lets_an_operator_answer_a_held_lookup_from_the_operation_page(
    acme, approver, operator, sandbox, monkeypatch
):
    """The held lookup is listed on the page, and disputing from the page answers it."""
    import re

    from tests.helpers import signed_in

    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    _found, under_way = two_payments_one_hidden(op, acme)
    adapter = engine.core.adapter(op.action)
    search = adapter.lookup

    def lookup_overtaken_by_the_event(snapshot):
        engine.webhook_apply(provider="payments", facts=reported(op, under_way, "processing"))
        return search(snapshot)

    monkeypatch.setattr(adapter, "lookup", lookup_overtaken_by_the_event)
    engine.operation_reconcile(operation_id=op.id)
    lookup = op.attempts.get(kind="lookup")
    assert lookup.needs_review

    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    shown = re.search(r'name="dispute-held_answers_shown"[^>]*value="([^"]*)"', page) or \
        re.search(r'value="([^"]*)"[^>]*name="dispute-held_answers_shown"', page)
    assert shown and shown.group(1) == str(lookup.id)
    response = client.post(f"/operations/{op.id}/dispute", {
        "dispute-reason": "two payments carry it", "dispute-held_shown": "",
        "dispute-held_answers_shown": shown.group(1)})
    assert response.status_code == 302
    assert engine.core.held_reports(op.id).answers == []
    assert "What lookup" not in client.get("/operations/unknown/").content.decode()


@pytest.mark.django_db(transaction=True)
def test_it_settles_our_email_by_the_event_kept_in_flight_after_a_secret_key_rotation(
    acme, approver, sandbox, live_server, settings
):
    # An event about our message, reported while the call was in flight, is kept with the
    # recipient's and the parameters' digests, keyed by SECRET_KEY, and decided once a
    # lookup names the message. Rotated in between as Django documents it (a new key, the
    # old one in SECRET_KEY_FALLBACKS), those digests read as another recipient and other
    # parameters: our own delivered email was held for a person.
    mail = {"to": "anna@example.com", "template": "offer", "params": {"n": 3}}
    op = engine.operation_prepare(tenant=acme, action="mail.send", payload=mail)
    op = engine.operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=5))
    # The lost call landed, and the message was delivered before anyone asked.
    sent = sandbox_message_create(**mail, operation_id=op.id,
                                  idempotency_key=op.idempotency_key, fingerprint="")
    sandbox_message_deliver(message_id=sent.id)
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    event = WebhookEvent.objects.get(operation_id=op.id)
    assert event.outcome.startswith("kept while the call was in flight"), event.outcome

    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
    settings.SECRET_KEY = "rotated-" + "k" * 60
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, op.status, op.external_id) == ("found", S.SUCCEEDED, sent.id)
    event.refresh_from_db()
    assert not event.needs_review, event.outcome
    assert not webhooks_held_for_review(operation=op).exists()
    # Found, never sent again.
    assert not sandbox_writes(provider="mail", operation_id=op.id).exists()
    assert Message.objects.count() == 1
