"""A call's answer that arrives after the operation moved on without it is decided as the
provider's event reporting the same would be: when it contradicts what the journal now says
(money moved after a person disputed it, a second payment), it is held for a person, not
left as a line on the attempt row that nobody reads.

Against the sandbox over real HTTP, with no webhooks delivered (a provider whose events are
not set up): every test counts the provider's writes and objects.
"""

from __future__ import annotations

import re

import pytest

from operations import engine
from operations.engine.core import SEVERAL_MATCHES, lease_expired
from operations.intents import IntentError
from operations.models import Attempt, AttemptKind, Operation, OperationStatus
from operations.sandbox.models import PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set, sandbox_payment_create
from operations.selectors import answers_held_for_review, dashboard_metrics
from tests.factories import CallAttemptFactory
from tests.helpers import signed_in, wait_for
from tests.operations.engine_helpers import (
    PAYMENT,
    authorized_payment,
    executing_in_flight,
    replaced_and_run,
    stalled_before_recording,
)
from tests.operations.operator_helpers import payment_at_provider

S = OperationStatus


def answered_after_the_lease(op: Operation, settings, *, meanwhile) -> None:
    """Execute `op` while the sandbox holds the call back past the worker's 1 s lease; once
    the lease has run out, `meanwhile()` moves the operation on; then the answer arrives."""
    settings.OPERATION_LEASE_SECONDS = 1
    call = executing_in_flight(op, settings, fault="delay", seconds=3)
    wait_for(lambda: lease_expired(Operation.objects.get(id=op.id)), what="the lease to end")
    meanwhile()
    call.join()


def payment_posts(op: Operation) -> int:
    return len(sandbox_writes(provider="payments", operation_id=op.id))


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_answered_after_a_person_disputed_the_operation_until_resolved(
    acme, approver, operator, other_tenant_user, sandbox, settings
):
    op = authorized_payment(acme, approver)
    answered_after_the_lease(op, settings, meanwhile=lambda: engine.operation_dispute(
        operation_id=op.id, actor=operator, reason="the worker looks stuck; treasury checks"))

    op.refresh_from_db()
    ours = PaymentIntent.objects.get(metadata__operation_id=op.id)
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (op.status, op.external_id) == (S.DISPUTED, "")  # the person's hold stands
    assert list(answers_held_for_review(operation=op)) == [call], (
        "the provider says the payment went through, and the person who holds it is not told")
    assert call.external_id == ours.id and call.review_note == (
        f"the provider reports succeeded ({ours.id}); {op.id} stays disputed by an operator's "
        "decision"
    )
    held = op.evidence.get(summary__contains="arrived late and is held for review")
    assert (held.from_status, held.to_status, held.data["external_id"]) == (
        S.DISPUTED, S.DISPUTED, ours.id)
    assert payment_posts(op) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 1

    client = signed_in(operator)
    assert dashboard_metrics(operator)["held_for_review"] == 1
    assert dashboard_metrics(other_tenant_user)["held_for_review"] == 0
    queue = client.get("/operations/unknown/").content.decode()
    assert 'id="held"' in queue and "The late answer to call 1" in queue and ours.id in queue
    assert op.id not in signed_in(other_tenant_user).get("/operations/unknown/").content.decode()
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in page and "The answer to call 1" in page

    # The person checks at the provider and resolves it from the page they read.
    shown = re.search(r'name="resolve-held_answers_shown" value="([^"]*)"', page)
    assert shown and shown.group(1) == str(call.id)
    response = client.post(f"/operations/{op.id}/resolve", {
        "resolve-outcome": "succeeded", "resolve-evidence": "the payment went through",
        "resolve-provider_reference": ours.id, "resolve-reason": "checked at the provider",
        "resolve-seen": op.status_changed_at.isoformat(),
        "resolve-held_shown": "", "resolve-held_answers_shown": shown.group(1),
    })
    assert response.status_code == 302

    op.refresh_from_db()
    call.refresh_from_db()
    assert (op.status, op.external_id) == (S.SUCCEEDED, ours.id)
    assert call.needs_review and call.reviewed_at is not None  # answered, and the record says
    assert op.evidence.filter(kind="manual").last().data["reviewed_answers"] == [1]
    assert not answers_held_for_review(operation=op).exists()
    assert dashboard_metrics(operator)["held_for_review"] == 0
    assert 'id="held"' not in client.get("/operations/unknown/").content.decode()
    assert payment_posts(op) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_second_payment_answered_after_a_lookup_settled_the_operation_with_another(
    acme, approver, sandbox, settings
):
    op = authorized_payment(acme, approver)
    other: dict = {}

    def another_payment_found_by_the_sweep() -> None:
        # A payment carrying the operation is made outside the console while our call is
        # held back; the sweep's lookup finds it and settles the operation with it.
        other.update(sandbox_payment_create(
            amount=PAYMENT["amount_minor"], currency=PAYMENT["currency"].lower(),
            confirm=True, metadata={"operation_id": op.id, "tenant": acme.slug},
        ))
        engine.operation_reconcile(operation_id=op.id)
        assert Operation.objects.get(id=op.id).external_id == other["id"]

    answered_after_the_lease(op, settings, meanwhile=another_payment_found_by_the_sweep)

    op.refresh_from_db()
    ours = PaymentIntent.objects.exclude(id=other["id"]).get()
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (op.status, op.external_id) == (S.SUCCEEDED, other["id"])
    assert call.external_id == ours.id
    assert list(answers_held_for_review(operation=op)) == [call], (
        "two payments for one intent, and only an attempt row knows")
    assert call.review_note.startswith(
        f"the provider reports a second effect, {ours.id} (succeeded), carrying {op.id}")
    assert payment_posts(op) == op.provider_calls == 1
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_it_holds_nothing_when_the_late_answer_names_the_payment_a_lookup_settled(
    acme, approver, sandbox, settings
):
    op = authorized_payment(acme, approver)
    settings.OPERATION_LEASE_SECONDS = 1
    # The payment is made, its answer held back: the sweep's lookup finds it and settles
    # the operation; then the answer arrives, about the same payment.
    call = executing_in_flight(op, settings, fault="commit_then_drop", seconds=3, timeout=8)
    wait_for(lambda: lease_expired(Operation.objects.get(id=op.id)), what="the lease to end")
    engine.operation_reconcile(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == S.SUCCEEDED
    call.join()

    op.refresh_from_db()
    ours = PaymentIntent.objects.get()
    assert (op.status, op.external_id) == (S.SUCCEEDED, ours.id)
    assert not answers_held_for_review(operation=op).exists()
    assert not op.evidence.filter(summary__contains="held for review").exists()
    assert payment_posts(op) == op.provider_calls == 1


def held_answer(op: Operation) -> Attempt:
    """Test-only: what `late_answer_decide` leaves on a call whose late answer contradicted
    the journal."""
    call = CallAttemptFactory(
        operation=op, outcome="succeeded",
        external_id="pi_late", needs_review=True,
        review_note=f"the provider reports succeeded (pi_late); {op.id} stays {op.status}",
    )
    Operation.objects.filter(id=op.id).update(provider_calls=1)
    return call


@pytest.mark.django_db
def test_it_refuses_to_supersede_an_intent_with_a_held_answer(acme, approver):
    op = authorized_payment(acme, approver)
    engine.operation_cancel(operation_id=op.id, actor=None, reason="the agent changed its mind")
    held_answer(op)

    with pytest.raises(IntentError, match="the answer to attempt 1"):
        engine.operation_prepare(
            tenant=acme, action="payments.create", supersedes=op,
            payload={**PAYMENT, "amount_minor": PAYMENT["amount_minor"] + 1},
        )
    assert not Operation.objects.filter(supersedes=op).exists()


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_call_for_an_operation_with_a_held_answer(acme, approver, sandbox):
    op = authorized_payment(acme, approver)
    held_answer(op)

    report = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, op.status, op.next_reconcile_at) == (
        "held_for_review", S.UNKNOWN, None)
    assert op.evidence.last().data["held_answers"] == [1]
    assert payment_posts(op) == 0 and PaymentIntent.objects.count() == 0
    assert op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_of_another_sum_answered_after_the_lease_ran_out(
    acme, approver, sandbox, settings, monkeypatch
):
    from operations.providers.payments import PaymentsCreateAdapter

    op = authorized_payment(acme, approver)
    sent_params = PaymentsCreateAdapter.params
    # A faulty provider (or a proxy rewriting the request) moves a sum nobody approved.
    monkeypatch.setattr(PaymentsCreateAdapter, "params", lambda self, snapshot: {
        **sent_params(self, snapshot), "amount": "99900"})
    # The sweep's lookup runs before the payment is made: nothing yet, still unknown.
    answered_after_the_lease(op, settings, meanwhile=lambda: engine.operation_reconcile(
        operation_id=op.id))

    op.refresh_from_db()
    stray = PaymentIntent.objects.get()
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (op.status, op.external_id) == (S.UNKNOWN, "")
    assert list(answers_held_for_review(operation=op)) == [call]
    assert call.review_note == (
        f"{stray.id} is for 99900 KZT, the approved intent for 1250000 KZT (minor units); "
        f"{op.id} stays unknown, a person decides")
    assert payment_posts(op) == op.provider_calls == 1


def made_outside_the_console(op: Operation) -> dict:
    """A payment carrying the operation's id, for its approved sum, made outside the console
    (another integration, another key)."""
    return sandbox_payment_create(
        amount=op.payload["amount_minor"], currency=op.payload["currency"].lower(),
        confirm=True, metadata={"operation_id": op.id, "tenant": op.tenant.slug},
    )


@pytest.mark.django_db(transaction=True)
def test_it_leaves_several_payments_to_a_person_when_a_stalled_workers_answer_names_one(
    acme, approver, sandbox, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 1
    op = authorized_payment(acme, approver)
    # A's payment is made; A freezes before writing its answer down, past its lease.
    a, go = stalled_before_recording(op, monkeypatch)
    ours = PaymentIntent.objects.get(metadata__operation_id=op.id)
    other = made_outside_the_console(op)
    # The sweep's lookup finds both: which one is the operation's is a person's call.
    assert engine.operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    assert Operation.objects.get(id=op.id).error_code == SEVERAL_MATCHES
    go.set()
    a.join()

    op.refresh_from_db()
    call = op.attempts.get(kind=AttemptKind.CALL)
    # A's answer picks neither: not as the outcome, nor as the object lookups follow.
    assert (op.status, op.error_code, op.external_id, op.next_reconcile_at) == (
        S.UNKNOWN, SEVERAL_MATCHES, "", None)
    assert call.external_id == ours.id  # kept on its attempt, and held for the person
    assert list(answers_held_for_review(operation=op)) == [call]
    assert "several objects carry" in call.review_note
    assert not op.evidence.filter(to_status=S.SUCCEEDED).exists()
    # A person's reconcile still searches, and still finds both.
    assert engine.operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.UNKNOWN, "")
    assert payment_posts(op) == op.provider_calls == 1
    assert set(PaymentIntent.objects.values_list("id", flat=True)) == {ours.id, other["id"]}


@pytest.mark.django_db(transaction=True)
def test_it_never_closes_a_payment_a_lookup_found_processing_on_a_stalled_workers_decline(
    acme, approver, sandbox, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 1
    op = authorized_payment(acme, approver)
    # A's call is declined (Stripe's 402: a PaymentIntent in requires_payment_method), and A
    # freezes before writing that down, past its lease.
    sandbox_fault_set(provider="payments", kind="card_declined", match=op.id, times=1)
    a, go = stalled_before_recording(op, monkeypatch)
    declined = PaymentIntent.objects.get(metadata__operation_id=op.id)
    # Confirmed again meanwhile with another payment method (Stripe allows it on
    # requires_payment_method): money is moving, and the sweep's lookup finds it so.
    PaymentIntent.objects.filter(id=declined.id).update(
        status="processing", last_payment_error=None)
    engine.operation_reconcile(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == S.ACCEPTED
    go.set()
    a.join()

    # A's decline is older than the lookup's "processing": the payment stays under way.
    op.refresh_from_db()
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (op.status, op.external_id, op.error_code) == (S.ACCEPTED, declined.id, "")
    assert op.next_reconcile_at is not None  # its next lookup follows the payment
    assert (call.http_status, call.outcome, call.external_id) == (402, "failed", declined.id)
    assert not op.evidence.filter(to_status=S.FAILED).exists()
    # So the intent cannot be replaced, and nothing pays a second time.
    assert replaced_and_run(op, approver) is None
    assert payment_posts(op) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_closes_a_payment_a_lookup_found_processing_on_a_stalled_workers_refusal(
    acme, approver, sandbox, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 1
    # A sum the provider settles later (`processing`), as engine_helpers.async_payment.
    op = authorized_payment(acme, approver, amount_minor=15_000_000)
    # A's request is refused (a 400: nothing made), and A freezes before writing that down.
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id, times=1)
    a, go = stalled_before_recording(op, monkeypatch)
    assert not PaymentIntent.objects.exists()
    # A payment carrying the operation, for the approved sum, made outside the console; the
    # sweep's lookup finds it under way and records it.
    other = made_outside_the_console(op)
    engine.operation_reconcile(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == S.ACCEPTED
    go.set()
    a.join()

    # A's refusal names no payment: it says nothing about the one the operation records.
    op.refresh_from_db()
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (op.status, op.external_id, op.error_code) == (S.ACCEPTED, other["id"], "")
    assert (call.http_status, call.outcome, call.external_id) == (400, "failed", "")
    assert not op.evidence.filter(to_status=S.FAILED).exists()
    assert replaced_and_run(op, approver) is None
    assert payment_posts(op) == op.provider_calls == 1
    assert list(PaymentIntent.objects.values_list("id", flat=True)) == [other["id"]]


def reconciled_resolved_before_its_write(
    op, monkeypatch, *, write: str, resolver, outcome: str, **reconcile
):
    """A reconcile of `op` (`reconcile`: its actor and reason) whose lookup has read the
    operation after the provider answered; `resolver` resolves it as `outcome` on their
    words just before the lookup's own `write` (a function of operations.engine.findings)
    runs: the narrowest window there is."""
    from operations.engine import findings

    real = getattr(findings, write)
    decided = []

    def decided_first(*args, **kwargs):
        if not decided:
            decided.append(True)
            engine.operation_resolve(operation_id=op.id, actor=resolver, outcome=outcome,
                                     evidence_text="no debit on the statement",
                                     reason="checked with treasury")
        return real(*args, **kwargs)

    monkeypatch.setattr(findings, write, decided_first)
    report = engine.operation_reconcile(operation_id=op.id, **reconcile)
    monkeypatch.undo()
    assert decided
    return report


def reconciled_while_resolved(op, monkeypatch, *, actor, outcome: str, evidence_text: str):
    """A reconcile of `op` whose lookup, once it has the provider's answer and before it is
    recorded, sees `actor` resolve the operation as `outcome` on their words."""
    from operations.engine import core

    real = core.adapter(op.action)

    class ResolvedWhileLookingUp:
        contract = real.contract
        account = real.account
        disagreement = real.disagreement

        def lookup(self, op_):
            found = real.lookup(op_)
            engine.operation_resolve(
                operation_id=op.id, actor=actor, outcome=outcome,
                evidence_text=evidence_text, reason="checked with treasury",
            )
            return found

    monkeypatch.setattr(core, "adapter", lambda action: ResolvedWhileLookingUp())
    engine.operation_reconcile(operation_id=op.id)
    monkeypatch.undo()


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_decline_a_lookup_found_while_a_person_resolved_the_payment_as_succeeded(
    acme, approver, operator, sandbox, monkeypatch
):
    """An accepted payment (processing at the bank), no webhooks delivered. The sweep's lookup
    is out when an operator, told by treasury the money arrived, resolves it as succeeded; the
    bank had declined it, and the lookup reads the decline. The provider contradicts the
    person's decision: held for them, as the same report by event or late answer would be,
    not dropped as "settled meanwhile" with nothing on the timeline."""
    from operations.sandbox.services import sandbox_payment_settle

    op = authorized_payment(acme, approver, amount_minor=15_000_000)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert (op.status, op.external_id, intent.status) == (S.ACCEPTED, intent.id, "processing")
    sandbox_payment_settle(payment_intent_id=intent.id, status="failed")  # its event is lost

    reconciled_while_resolved(op, monkeypatch, actor=operator, outcome=S.SUCCEEDED,
                              evidence_text="treasury saw the credit")

    op.refresh_from_db()
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (op.status, op.resolved_manually, op.external_id) == (S.SUCCEEDED, True, intent.id)
    assert list(answers_held_for_review(operation=op)) == [lookup], (
        "the provider says the payment failed, and the person who settled it is not told")
    assert lookup.review_note == (
        f"the provider reports failed ({intent.id}); {op.id} stays succeeded by an operator's "
        "decision"
    )
    held = op.evidence.get(kind="lookup")
    assert (held.from_status, held.to_status) == (S.SUCCEEDED, S.SUCCEEDED)
    assert "held for review" in held.summary and intent.id in held.summary
    queue = signed_in(operator).get("/operations/unknown/").content.decode()
    assert f"What lookup {lookup.number} found:" in queue and intent.id in queue
    assert payment_posts(op) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_a_lookup_found_while_a_person_failed_the_operation_on_words(
    acme_unknown, approver, operator, sandbox, monkeypatch
):
    """The lookup finds the unknown operation's payment succeeded while a person, who saw no
    debit, resolves it as failed on their words. Dropped as "settled meanwhile", the failed
    intent could be replaced, and the replacement would pay a second time."""

    op = acme_unknown
    intent_id = payment_at_provider(op)
    reconciled_while_resolved(op, monkeypatch, actor=operator, outcome=S.FAILED,
                              evidence_text="no debit on the bank statement")

    op.refresh_from_db()
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (op.status, op.resolved_manually, lookup.external_id) == (S.FAILED, True, intent_id)
    assert list(answers_held_for_review(operation=op)) == [lookup]
    assert lookup.review_note.startswith(f"the provider reports succeeded ({intent_id})")
    assert replaced_and_run(op, approver) is None
    assert PaymentIntent.objects.count() == 1
    assert not sandbox_writes(provider="payments").exists()  # no replacement, no call


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_a_lookup_found_when_a_person_failed_it_just_before_its_write(
    acme_unknown, approver, operator, sandbox, monkeypatch
):
    """The person's failure lands after the lookup read the operation open and before its
    own transition: the transition loses, and the payment it found was dropped with it, so
    the failed intent could be replaced and paid a second time. A person's reconcile that
    lost so says on the trail it moved nothing."""
    from operations.models import AuditEvent

    op = acme_unknown
    intent_id = payment_at_provider(op)
    reconciled_resolved_before_its_write(
        op, monkeypatch, write="_transition_deciding_kept", resolver=operator,
        outcome=S.FAILED, actor=operator, reason="the vendor asks",
    )

    op.refresh_from_db()
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (op.status, op.resolved_manually) == (S.FAILED, True)
    assert list(answers_held_for_review(operation=op)) == [lookup]
    assert lookup.review_note.startswith(f"the provider reports succeeded ({intent_id})")
    audited = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert audited.after["moved"].startswith("nothing: held for review")
    assert replaced_and_run(op, approver) is None
    assert PaymentIntent.objects.count() == 1
    assert not sandbox_writes(provider="payments").exists()


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_waiting_on_its_customer_when_a_person_failed_it_meanwhile(
    acme_unknown, approver, operator, sandbox, monkeypatch
):
    """Found waiting for the customer's 3-D Secure, which no lookup settles; the person's
    failure lands just before the lookup notes it. Dropped, the customer could still
    confirm the payment after a replacement paid."""
    from operations.engine.core import adapter, snapshot

    op = acme_unknown
    sandbox_fault_set(provider="payments", kind="requires_action", match=op.id)
    assert adapter(op.action).call(snapshot(op)).outcome == "accepted"  # its answer lost
    intent_id = PaymentIntent.objects.get(status="requires_action").id
    reconciled_resolved_before_its_write(
        op, monkeypatch, write="_lookup_noted", resolver=operator, outcome=S.FAILED,
    )

    op.refresh_from_db()
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (op.status, op.resolved_manually) == (S.FAILED, True)
    assert list(answers_held_for_review(operation=op)) == [lookup]
    assert intent_id in lookup.review_note
    # The note of the lookup stands beside the status it found on arrival, not a stale one.
    noted = op.evidence.filter(kind="lookup").order_by("id").first()
    assert (noted.from_status, noted.to_status) == (S.FAILED, S.FAILED)
    assert replaced_and_run(op, approver) is None
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_records_the_payment_a_lookup_found_agreeing_with_a_person_who_resolved_on_words(
    acme_unknown, operator, sandbox, monkeypatch
):
    """The person resolves the unknown payment as succeeded on their words while the lookup
    is out; it finds the payment succeeded. Not recorded, the operation kept no object, and
    a second payment the provider later reported for it would be taken for its first."""
    from operations.engine import webhook_apply
    from operations.providers.base import WebhookFacts

    op = acme_unknown
    intent_id = payment_at_provider(op)
    reconciled_while_resolved(op, monkeypatch, actor=operator, outcome=S.SUCCEEDED,
                              evidence_text="treasury saw the debit")

    op.refresh_from_db()
    assert (op.status, op.resolved_manually, op.external_id) == (S.SUCCEEDED, True, intent_id)
    assert not answers_held_for_review(operation=op).exists()
    assert op.evidence.filter(kind="lookup", summary__contains="agreeing").count() == 1

    result, _ = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_second", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id="pi_second", status="succeeded"))
    assert result == "held"
    assert PaymentIntent.objects.count() == 1
