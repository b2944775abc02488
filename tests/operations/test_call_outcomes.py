"""The failure cases of the design brief where the provider does answer, broken on purpose
against PostgreSQL and the sandbox providers over real HTTP: a refusal or a decline is final,
a success is returned again rather than repeated, an approval that ran out before the worker
got to it is cancelled, a pending payment is checked again later and one waiting for the
customer's 3-D Secure goes to a person, and an intent nobody ran is queued again.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.models import AttemptKind, Operation, OperationStatus
from operations.sandbox.models import Deal, Message, PaymentIntent
from operations.sandbox.selectors import sandbox_counts, sandbox_writes
from operations.sandbox.services import sandbox_deal_update, sandbox_fault_set
from tests.helpers import signed_in
from tests.operations.engine_helpers import async_payment, authorized_payment, died_mid_call
from tests.operations.failure_helpers import executed_into_a_fault, payment_posts

S = OperationStatus


def _authorized(tenant, approver, action: str, payload: dict) -> Operation:
    op = engine.operation_prepare(tenant=tenant, action=action, payload=payload)
    if op.requires_approval:
        engine.operation_authorize(
            operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
            approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    return op


@pytest.mark.django_db(transaction=True)
def test_it_fails_a_refused_intent_without_retrying(acme, approver, providers):
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    engine.operation_execute(operation_id=op.id)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.FAILED and op.error_code == "validation"
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_fails_a_declined_payment_once_and_keeps_the_intent_stripe_made(
    acme, approver, providers
):
    op = executed_into_a_fault(acme, approver, "card_declined")
    engine.operation_execute(operation_id=op.id)
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    # The decline is final, and the intent it left at Stripe is this operation's.
    assert (op.status, op.error_code, op.external_id) == (S.FAILED, "card_declined", intent.id)
    # Stripe's words are what an operator answering the customer reads as the reason.
    assert op.error_message == "Your card was declined."
    assert intent.status == "requires_payment_method"
    assert report.outcome == "nothing_to_do"
    assert op.provider_calls == 1 and len(payment_posts(op)) == 1
    assert op.attempts.get().http_status == 402


@pytest.mark.django_db(transaction=True)
def test_it_fails_a_deal_update_on_a_version_conflict_for_a_person_and_never_retries_it(
    acme, approver, providers
):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    op = engine.operation_prepare(tenant=acme, action="crm.update_deal", payload={
        "target": deal.id, "expected_version": 1, "patch": {"stage": "won"}})
    engine.operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    # Someone changed the deal since the agent read it.
    Deal.objects.filter(pk=deal.pk).update(version=2, stage="lost")

    engine.operation_execute(operation_id=op.id)
    again = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    deal.refresh_from_db()
    assert (op.status, op.error_code) == (S.FAILED, "version_conflict")
    assert again.outcome == "nothing_to_do"
    # What a person decides on: the deal as it is now, never a retry with fresh data.
    assert op.result["current_version"] == 2 and op.result["current"]["stage"] == "lost"
    assert (deal.version, deal.stage, deal.applied_operation_ids) == (2, "lost", [])
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == 1
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()


@pytest.mark.django_db(transaction=True)
def test_it_shows_a_person_the_deal_as_it_is_now_when_an_update_meets_a_version_conflict(
    acme, approver, operator, providers
):
    from approvals.models import Approval

    deal = Deal.objects.create(name="Acme renewal", amount_minor=100, currency="EUR",
                               owner="dana@acme.test")
    op = _authorized(acme, approver, "crm.update_deal", {
        "target": deal.id, "expected_version": 1, "patch": {"stage": "won"}})
    hash_before = op.payload_hash
    # Someone moves the deal on in the CRM after the agent read it.
    sandbox_deal_update(deal=deal, expected_version=1, patch={"stage": "churn_review"},
                        operation_id="")

    engine.operation_execute(operation_id=op.id)
    engine.operation_execute(operation_id=op.id)  # never retried with fresh data

    op.refresh_from_db()
    deal.refresh_from_db()
    assert (op.status, op.error_code) == (S.FAILED, "version_conflict")
    assert op.payload_hash == hash_before and op.payload["expected_version"] == 1
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == op.provider_calls == 1
    assert sandbox_counts()["deals"] == 1
    assert (deal.version, deal.stage, op.id in deal.applied_operation_ids) == (
        2, "churn_review", False)
    # The journal keeps the deal as the conflict found it, for the person who decides on a
    # new intent ...
    assert op.result["current"]["stage"] == "churn_review"
    # ... and that person sees it: what the deal now holds beside the change, not only that
    # its version moved; masked as the intent is.
    html = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "The deal as the CRM held it at the version conflict" in html
    assert "<td>Stage</td><td>churn_review</td><td><ins class=\"new\">won</ins></td>" in html
    assert "<td>Version</td><td>2</td>" in html
    assert "d***@acme.test" in html and "dana@acme.test" not in html

    # The approver of the intent that replaces it sees the same, beside its own change.
    new = engine.operation_prepare(tenant=acme, action="crm.update_deal", supersedes=op,
                                   payload={"target": deal.id, "expected_version": 2,
                                            "patch": {"stage": "won"}})
    card = Approval.objects.get(operation=new)
    html = signed_in(approver).get(f"/approvals/{card.id}/").content.decode()
    assert "when the intent it replaces met a version conflict" in html
    assert "<td>Stage</td><td>churn_review</td><td><ins class=\"new\">won</ins></td>" in html
    assert "<td>Version</td><td>2</td><td><ins class=\"new\">expects 2</ins></td>" in html
    assert "dana@acme.test" not in html
    assert len(sandbox_writes(provider="crm")) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["crm.create_deal", "crm.update_deal"])
def test_it_leaves_a_deal_change_answered_200_without_the_deal_unknown(
    acme, approver, maintenance_page, action
):
    # A 200 that names no deal (a proxy's maintenance page) proves nothing was made or
    # changed: closed as succeeded, the journal would claim a deal that does not exist.
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    payload = {"target": deal.id, "expected_version": 1, "patch": {"stage": "won"}} \
        if action == "crm.update_deal" else \
        {"name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"}
    op = engine.operation_prepare(tenant=acme, action=action, payload=payload)
    if op.requires_approval:
        engine.operation_authorize(
            operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
            approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))

    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert (op.status, op.error_code, op.external_id) == (S.UNKNOWN, "unexpected_body", "")
    # Its lookup reaches the same page: nothing is proven, so nothing is called again.
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"

    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.provider_calls == 1
    assert [method for method, _ in maintenance_page.requests] == [
        "PATCH" if action == "crm.update_deal" else "POST", "GET"]
    deal.refresh_from_db()
    assert (Deal.objects.count(), deal.version, deal.applied_operation_ids) == (1, 1, [])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["crm.update_deal", "mail.send"])
def test_it_does_not_close_an_approved_effect_as_refused_when_the_provider_was_never_reached(
    acme, approver, providers, settings, action
):
    deal = Deal.objects.create(name="Acme renewal", amount_minor=100, currency="EUR",
                               owner="dana")
    payload = (
        {"target": deal.id, "expected_version": 1, "patch": {"stage": "won"}}
        if action == "crm.update_deal"
        else {"to": "cfo@acme.test", "template": "invoice_paid", "params": {"invoice": "inv_42"}}
    )
    op = _authorized(acme, approver, action, payload)
    provider = "crm" if action == "crm.update_deal" else "mail"
    setting = f"{provider.upper()}_API_BASE"
    right = getattr(settings, setting)
    # A deploy points the base one segment off (".../v1", as the lookups already allow for):
    # whatever answers there says 404 with no word from the provider about the deal or the
    # message. Nothing reached the provider's API.
    setattr(settings, setting, right + "/v1")

    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert len(sandbox_writes(provider=provider)) == 0  # the provider's API saw nothing
    assert sandbox_counts()["messages"] == 0
    deal.refresh_from_db()
    assert deal.version == 1
    # The approved intent was never refused by the provider: it is not closed as failed
    # ("the provider refused the intent"), which only a new intent and a new approval undo.
    assert (op.status, op.error_code) == (S.UNKNOWN, "http_4xx"), op.error_message

    # Once the base is put right (another account's fingerprint, but the call before reached
    # none), the same approved intent is carried out, once.
    setattr(settings, setting, right)
    for _ in range(3):
        engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status in (S.SUCCEEDED, S.ACCEPTED)
    assert len(sandbox_writes(provider=provider, operation_id=op.id)) == 1
    if action == "mail.send":
        assert Message.objects.count() == 1
    else:
        deal.refresh_from_db()
        assert deal.applied_operation_ids == [op.id]
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == op.provider_calls


@pytest.mark.django_db(transaction=True)
def test_it_returns_the_stored_result_when_already_succeeded(acme, approver, providers):
    op = authorized_payment(acme, approver)
    assert op.next_reconcile_at is not None  # queued again if no worker ever claims it
    engine.operation_execute(operation_id=op.id)
    assert Operation.objects.get(id=op.id).next_reconcile_at is None  # claimed: no recheck
    first_hash = Operation.objects.get(id=op.id).payload_hash
    report = engine.operation_execute(operation_id=op.id)
    assert report.outcome == "already_succeeded"
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    assert Operation.objects.get(id=op.id).payload_hash == first_hash == op.payload_hash


@pytest.mark.django_db(transaction=True)
def test_it_cancels_an_approval_that_expired_before_the_worker_got_to_it(
    acme, approver, providers
):
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.CANCELLED
    assert sandbox_counts()["requests"] == 0 and PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_shows_the_claim_before_the_call_it_started_in_the_timeline(
    acme, approver, providers
):
    from operations.engine.core import adapter
    from operations.selectors import operation_timeline

    op = authorized_payment(acme, approver)
    engine.operation_execute(operation_id=op.id)
    titles = [entry.title for entry in operation_timeline(op)]
    claim = titles.index("Status transition: not_started → in_progress")
    call = titles.index("Attempt 1: provider call → succeeded")
    result = titles.index("Call result: in_progress → succeeded")
    assert claim < call < result
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    # The call kept the account it reached; one account is not worth a word on the page.
    account = op.attempts.get().provider_account
    assert account == adapter(op.action).account()
    assert not any("account" in entry.detail for entry in operation_timeline(op))


@pytest.mark.django_db(transaction=True)
def test_it_checks_a_pending_payment_again_later_not_at_every_sweep(
    acme, approver, providers
):
    op = async_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        next_reconcile_at=timezone.now() - timedelta(seconds=1))
    assert op.id in engine.operations_due_for_reconcile()

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (report.outcome, report.detail, op.status) == ("found", "unchanged", S.ACCEPTED)
    assert op.next_reconcile_at > timezone.now() + timedelta(seconds=60)
    assert op.id not in engine.operations_due_for_reconcile()
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_hands_a_payment_waiting_for_the_customers_3d_secure_to_a_person(
    acme, approver, providers, live_server
):
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_payment_settle

    op = executed_into_a_fault(acme, approver, "requires_action")
    intent = PaymentIntent.objects.get()
    assert (op.status, op.external_id, intent.status) == (S.ACCEPTED, intent.id,
                                                          "requires_action")

    report = engine.operation_reconcile(operation_id=op.id)

    # Nobody authenticates an agent's payment here: looking again every two minutes
    # forever would settle nothing, so it waits in the operators' queue.
    op.refresh_from_db()
    assert (report.outcome, op.status, op.external_id, op.error_code) == (
        "found", S.UNKNOWN, intent.id, "outside_action"
    )
    assert op.next_reconcile_at is None and op.id not in engine.operations_due_for_reconcile()
    assert op.evidence.filter(kind="lookup").last().summary == (
        f"provider lookup (external_id) found {intent.id}, still pending: the customer must "
        "authenticate the payment (3-D Secure, Stripe's requires_action), which nobody does "
        "from this console; a person decides"
    )
    # An operator's "Reconcile now" finds the same: it stays with them, and calls nothing.
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert (op.status, op.next_reconcile_at) == (S.UNKNOWN, None)

    # The customer authenticates after all: Stripe's event settles it.
    sandbox_payment_settle(payment_intent_id=intent.id, status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert (op.status, op.external_id, op.error_code) == (S.SUCCEEDED, intent.id, "")
    assert len(payment_posts(op)) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_hands_an_unknown_payment_found_waiting_for_3d_secure_to_a_person(
    acme, approver, providers
):
    from operations.engine.core import adapter, snapshot

    # The worker died mid-call; the provider made the intent, which waits for the customer.
    op = authorized_payment(acme, approver)
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=2))
    sandbox_fault_set(provider="payments", kind="requires_action", match=op.id)
    assert adapter(op.action).call(snapshot(op)).outcome == "accepted"

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert (report.outcome, op.status, op.external_id, op.error_code) == (
        "found", S.UNKNOWN, intent.id, "outside_action"
    )
    assert op.next_reconcile_at is None and op.id not in engine.operations_due_for_reconcile()
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    assert len(payment_posts(op)) == op.provider_calls == 1


@pytest.mark.django_db
def test_it_queues_a_policy_authorized_intent_its_caller_never_ran(acme, monkeypatch):
    op = engine.operation_prepare(tenant=acme, action="mail.send", payload={
        "to": "anna@example.com", "template": "receipt", "params": {"invoice": "inv_1"}})
    assert op.authorized_hash and op.status == S.NOT_STARTED
    assert engine.operations_claim_waiting_for_execute() == []  # its caller runs it first
    later = timezone.now() + timedelta(minutes=2)
    monkeypatch.setattr("django.utils.timezone.now", lambda: later)
    assert engine.operations_claim_waiting_for_execute() == [op.id]


@pytest.mark.django_db(transaction=True)
def test_it_queues_a_proven_absent_operation_again_when_no_worker_calls_it(
    acme, approver, providers, monkeypatch
):
    op = executed_into_a_fault(acme, approver, "http_500")  # nothing written
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.may_call_again
    op.refresh_from_db()
    assert op.status == S.NOT_STARTED and op.next_reconcile_at is not None
    # Its execute message is lost (the broker was down): the sweep queues it again, once
    # the recheck interval has passed, and the call that follows carries the same key.
    assert engine.operations_claim_waiting_for_execute() == []
    later = timezone.now() + timedelta(minutes=2)
    monkeypatch.setattr("django.utils.timezone.now", lambda: later)
    assert engine.operations_claim_waiting_for_execute() == [op.id]
    monkeypatch.undo()
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.provider_calls == 2
    posts = list(payment_posts(op))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert PaymentIntent.objects.count() == 1
