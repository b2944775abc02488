"""The failure cases of the design brief where a call's answer is lost, broken on purpose
against PostgreSQL and the sandbox providers over real HTTP, and what the lookup after it may
conclude: found, the operation settles; proven absent, the same call goes again with the same
key; anything less (a failed or ambiguous lookup, a key that answers a kept error, a provider
that no longer has what it named, another account, another sum) leaves it to a person.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.engine import core
from operations.models import (
    Attempt,
    AttemptKind,
    AuditEvent,
    Evidence,
    Operation,
    OperationStatus,
)
from operations.providers.base import CallOutcome, LookupOutcome, LookupResult, WebhookFacts
from operations.sandbox.models import Deal, IdempotencyRecord, Message, PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import signed_in, updated_past_triggers, wait_for
from tests.operations.engine_helpers import (
    authorized_payment,
    died_mid_call,
    stalled_before_recording,
)
from tests.operations.failure_helpers import executed_into_a_fault, lose_the_answer, payment_posts

S = OperationStatus
DEAL = {"name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"}
MAIL = {"to": "cfo@acme.test", "template": "receipt", "params": {"invoice": "inv_42"}}
# Each way a CRM or mail call's answer goes missing or wrong, stalls cut short at 2.5 s.
LOST_ANSWERS = ["commit_then_drop", "delay", "http_500_after_commit", "http_500"]
LIVE_KEY = "sk_live_51RevIewSecretKeyValue0123456789"


def assert_left_to_a_person(op: Operation, report, *, detail: str, summary: str) -> None:
    """Proven absent and not called again: no automatic call or check is left, only the
    operators' queue, and the evidence says why."""
    assert (report.outcome, report.detail, report.may_call_again) == ("absent", detail, False)
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None
    assert op.id not in engine.operations_due_for_reconcile()
    assert summary in op.evidence.filter(kind="lookup").last().summary


@pytest.mark.django_db(transaction=True)
def test_it_stays_unknown_with_zero_calls_when_the_lookup_fails(acme, approver, providers):
    op = lose_the_answer(authorized_payment(acme, approver))
    sandbox_fault_set(provider="payments", kind="http_500", match="*", times=5)
    for _ in range(2):
        report = engine.operation_execute(operation_id=op.id)
        assert report.outcome == "reconciled"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN
    assert len(payment_posts(op)) == 1  # only the original, lost one
    assert PaymentIntent.objects.count() == 1
    assert op.attempts.filter(kind=AttemptKind.LOOKUP, outcome="inconclusive").count() == 2
    assert op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_stays_unknown_with_zero_calls_when_the_adapters_lookup_raises(
    acme, approver, providers, monkeypatch
):
    """An adapter bug in the lookup is an inconclusive answer, looked up again after the
    provider layer's own wait, never a 500 and never a call."""
    op = lose_the_answer(authorized_payment(acme, approver))
    real = core.adapter("payments.create")

    class BrokenLookup:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            raise KeyError("data")

    monkeypatch.setattr(core, "adapter", lambda action: BrokenLookup())
    monkeypatch.setattr(core, "LOOKUP_RETRY_AFTER", timedelta(seconds=45))
    before = timezone.now()
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "reconciled" and op.status == S.UNKNOWN
    assert op.evidence.filter(kind="lookup").last().data["reason"] == "lookup raised KeyError"
    assert before + timedelta(seconds=45) <= op.next_reconcile_at
    assert op.next_reconcile_at <= timezone.now() + timedelta(seconds=45)
    assert len(payment_posts(op)) == 1 and op.provider_calls == 1
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_stays_unknown_with_zero_calls_when_a_deal_updates_lookup_fails(
    acme, approver, providers
):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    op = engine.operation_prepare(tenant=acme, action="crm.update_deal", payload={
        "target": deal.id, "expected_version": 1, "patch": {"stage": "won"}})
    engine.operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    sandbox_fault_set(provider="crm", kind="http_500", match=op.id)  # the PATCH: not applied
    engine.operation_execute(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == S.UNKNOWN

    # The CRM cannot answer about this operation now: its only lookup, GET /deals/{target},
    # fails, and no second PATCH follows.
    sandbox_fault_set(provider="crm", kind="http_500", match=op.id)
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"

    op.refresh_from_db()
    deal.refresh_from_db()
    lookup = op.attempts.filter(kind=AttemptKind.LOOKUP).get()
    assert (lookup.outcome, lookup.http_status) == ("inconclusive", 500)
    assert op.status == S.UNKNOWN and op.provider_calls == 1
    assert [w.response_status for w in sandbox_writes(provider="crm", operation_id=op.id)] == [
        500]
    assert (deal.version, deal.applied_operation_ids) == (1, [])


@pytest.mark.django_db(transaction=True)
def test_it_leaves_an_ambiguous_crm_lookup_to_a_person(acme, operator, providers, client):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    assert not op.requires_approval
    sandbox_fault_set(provider="crm", kind="commit_then_drop", match=op.id, seconds=3)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN
    # Someone else's integration created a second record carrying the same operation id.
    original = Deal.objects.get(agent_operation_id=op.id)
    Deal.objects.create(id="deal_dup", name=original.name, amount_minor=original.amount_minor,
                        currency=original.currency, owner=original.owner,
                        agent_operation_id=op.id)
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "inconclusive" and "2" in report.detail
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None  # a person's queue
    assert Deal.objects.filter(agent_operation_id=op.id).count() == 2  # we made no third
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == 1
    evidence = op.evidence.filter(kind="lookup").last()
    assert len(evidence.data["matches"]) == 2
    assert op.id not in engine.operations_due_for_reconcile()
    client.force_login(operator)
    queue = client.get("/operations/unknown/").content.decode()
    assert op.id in queue and "a person decides" in queue


@pytest.mark.django_db(transaction=True)
def test_it_calls_again_with_the_same_key_only_after_absence_is_proven(
    acme, approver, providers
):
    # A 5xx before anything was written: unknown to us, absent at the provider.
    op = executed_into_a_fault(acme, approver, "http_500")
    assert op.status == S.UNKNOWN and PaymentIntent.objects.count() == 0
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "called" and op.status == S.SUCCEEDED
    posts = list(payment_posts(op))
    assert len(posts) == 2
    assert {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert len({p.params_hash for p in posts}) == 1
    kinds = list(op.attempts.order_by("number").values_list("kind", "outcome"))
    assert kinds == [("call", "unknown"), ("lookup", "absent"), ("call", "succeeded")]
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_stops_calling_a_provider_that_always_fails_and_asks_a_person(
    acme, approver, providers, settings
):
    settings.OPERATION_MAX_AUTOMATIC_CALLS = 2
    op = authorized_payment(acme, approver)
    for _ in range(2):
        # Every create answers 500 before writing anything; every lookup proves absence.
        sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
        assert engine.operation_execute(operation_id=op.id).outcome == "called"
        report = engine.operation_reconcile(operation_id=op.id)

    assert_left_to_a_person(op, report, detail="call limit reached",
                            summary="no more automatic calls")
    assert op.provider_calls == 2 and len(payment_posts(op)) == 2
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_stops_calling_with_a_key_the_provider_answers_with_a_kept_500(
    acme, approver, providers
):
    # Stripe kept the 500 of a request that began to run and created nothing: every call
    # with this key gets that 500 back, so only the first retry is worth making.
    op = executed_into_a_fault(acme, approver, "http_500_kept")
    assert (op.status, op.error_code) == (S.UNKNOWN, "http_5xx")
    first_lookup = engine.operation_reconcile(operation_id=op.id)
    assert (first_lookup.outcome, first_lookup.may_call_again) == ("absent", True)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    op.refresh_from_db()
    assert (op.status, op.error_code) == (S.UNKNOWN, "replayed_5xx")

    report = engine.operation_reconcile(operation_id=op.id)

    assert_left_to_a_person(op, report, detail="the key answers a kept error",
                            summary="only a new intent has a new key")
    posts = list(payment_posts(op))
    assert len(posts) == op.provider_calls == 2
    assert {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert len({p.params_hash for p in posts}) == 1
    assert [p.response_status for p in posts] == [500, 500]
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_clears_the_lost_answers_error_once_the_lookup_finds_the_payment(
    acme, approver, providers
):
    # Committed at the provider, then a 5xx: unknown to us until the lookup finds it.
    op = executed_into_a_fault(acme, approver, "http_500_after_commit")
    assert op.status == S.UNKNOWN and op.error_code == "http_5xx"
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id
    assert (op.error_code, op.error_message) == ("", "")
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert call.error_class == "http_5xx" and call.http_status == 500
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_payment_the_provider_named_and_no_longer_has_to_a_person(
    acme, approver, providers
):
    from operations.engine.core import adapter, snapshot

    op = authorized_payment(acme, approver)
    # The worker saved the provider's id (its own short transaction) and died before it
    # recorded the outcome. Then the API key in the settings was swapped for another
    # account's: that account has neither the payment nor the key (Stripe answers 404).
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=2))
    named = adapter(op.action).call(snapshot(op)).external_id
    Operation.objects.filter(id=op.id).update(external_id=named)
    PaymentIntent.objects.filter(id=named).delete()
    IdempotencyRecord.objects.filter(key=op.idempotency_key).delete()

    report = engine.operation_reconcile(operation_id=op.id)

    # Not proof that nothing was paid: a call now would pay a second time, in that account.
    assert (report.outcome, report.may_call_again) == ("inconclusive", False)
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    op.refresh_from_db()
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.UNKNOWN, named, None)
    assert op.id not in engine.operations_due_for_reconcile()
    assert op.evidence.filter(kind="lookup").last().summary == (
        f"lookup inconclusive: the provider no longer has {named}, which it named for this "
        "operation (deleted since, or asked of another account or mode); waiting for a person"
    )
    assert len(payment_posts(op)) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_call_made_in_another_provider_account_to_a_person(
    acme, approver, providers, settings
):
    from operations.engine.core import adapter, snapshot

    op = authorized_payment(acme, approver)
    # The worker died before the provider's answer (and its id) reached the journal; the
    # payment was made. Then the deployment's API key was switched to another account (test
    # mode to live mode, say): that account has neither the payment nor the key.
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=2))
    first_account = adapter(op.action).account()
    # The dead worker's call went to the first account.
    updated_past_triggers(Attempt.objects.filter(operation=op, number=1),
                          provider_account=first_account)
    assert adapter(op.action).call(snapshot(op)).external_id
    settings.PAYMENTS_API_KEY = "sk_live_another_account"
    PaymentIntent.objects.all().delete()
    IdempotencyRecord.objects.filter(key=op.idempotency_key).delete()
    second_account = adapter(op.action).account()
    assert second_account != first_account

    report = engine.operation_reconcile(operation_id=op.id)

    # The empty search asked the other account: calling on it would pay a second time there.
    assert (report.outcome, report.may_call_again) == ("inconclusive", False)
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    op.refresh_from_db()
    assert (op.status, op.next_reconcile_at) == (S.UNKNOWN, None)
    assert op.id not in engine.operations_due_for_reconcile()
    assert op.evidence.filter(kind="lookup").last().summary == (
        f"lookup inconclusive: no effect in provider account {second_account}, but calls of "
        f"this operation went to {first_account} (the API key or endpoint changed since): an "
        "empty answer here proves nothing about them; waiting for a person"
    )
    lookups = op.attempts.filter(kind=AttemptKind.LOOKUP)
    assert set(lookups.values_list("provider_account", flat=True)) == {second_account}
    from operations.selectors import operation_timeline

    details = [e.detail for e in operation_timeline(op) if e.kind == "attempt"]
    assert f"account {first_account}" in details[0]
    assert all(f"account {second_account}" in d for d in details[1:]) and details[1:]
    assert len(payment_posts(op)) == op.provider_calls == 1
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_key_reused_with_other_parameters_to_a_person(acme, approver, providers):
    from dataclasses import replace

    from operations.engine.core import adapter, snapshot

    op = authorized_payment(acme, approver)
    # Something already sent this operation's key with another amount (a data incident).
    other = replace(snapshot(op), payload={**op.payload, "amount_minor": 99_900})
    assert adapter(op.action).call(other).external_id

    report = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "called"
    assert (op.status, op.error_code) == (S.UNKNOWN, "idempotency_error")
    # Not for an automatic lookup: what it would find under this operation's id is the
    # other amount's payment, which settles nothing. A person decides.
    assert op.next_reconcile_at is None
    assert op.id not in engine.operations_due_for_reconcile()
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert PaymentIntent.objects.count() == 1
    assert PaymentIntent.objects.get().amount == 99_900
    assert op.payload["amount_minor"] == 1250000


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_mail_key_reused_with_other_parameters_to_a_person(acme, providers):
    from dataclasses import replace

    from operations.engine.core import adapter, snapshot

    op = engine.operation_prepare(tenant=acme, action="mail.send", payload=MAIL)
    # Something already sent under this operation's key to another recipient.
    adapter(op.action).call(replace(snapshot(op), payload={**MAIL, "to": "ceo@acme.test"}))

    engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert (op.status, op.error_code, op.next_reconcile_at) == (
        S.UNKNOWN, "idempotency_error", None)
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert Message.objects.count() == 1  # no second email
    assert len(sandbox_writes(provider="mail", operation_id=op.id)) == 2


@pytest.mark.django_db(transaction=True)
def test_it_changes_a_deal_again_at_its_expected_version_once_absence_is_proven(
    acme, approver, providers
):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    op = engine.operation_prepare(tenant=acme, action="crm.update_deal", payload={
        "target": deal.id, "expected_version": 1, "patch": {"stage": "won"}})
    assert op.requires_approval  # every deal change does
    engine.operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    sandbox_fault_set(provider="crm", kind="http_500", match=op.id)  # nothing applied
    engine.operation_execute(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == S.UNKNOWN

    # The deal has not applied this operation: the expected version makes a repeat safe
    # (a second change would be refused as a conflict), so it goes again on its own.
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.may_call_again
    assert engine.operation_execute(operation_id=op.id).outcome == "called"

    op.refresh_from_db()
    deal.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id
    assert (deal.version, deal.stage, deal.applied_operation_ids) == (2, "won", [op.id])
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == 2
    assert op.provider_calls == 2


@pytest.mark.django_db(transaction=True)
def test_it_never_settles_an_operation_with_a_payment_for_another_sum(acme, approver, providers):
    from dataclasses import replace

    from operations.engine.core import adapter, snapshot
    from operations.models import AttemptOutcome, EvidenceKind

    op = authorized_payment(acme, approver)
    hash_before = op.payload_hash
    # A payment carrying this operation's id and key, for another sum (made by something
    # else: a data incident). Our call is refused as a key reused with other parameters.
    other = replace(snapshot(op), payload={**op.payload, "amount_minor": 99_900})
    stray = adapter(op.action).call(other).external_id
    assert engine.operation_execute(operation_id=op.id).status == S.UNKNOWN
    posts = payment_posts(op).count()

    # An operator's "Reconcile now": the search finds that payment under this operation's id.
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "inconclusive"
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.UNKNOWN, "", None)
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (lookup.outcome, lookup.external_id) == (AttemptOutcome.INCONCLUSIVE, stray)
    noted = op.evidence.get(kind=EvidenceKind.LOOKUP)
    assert (f"{stray} is for 99900 KZT, the approved intent for 1250000 KZT (minor units): "
            "not the approved effect; a person decides") in noted.summary
    assert op.id not in engine.operations_due_for_reconcile()
    assert payment_posts(op).count() == posts  # the lookup made no call
    assert PaymentIntent.objects.count() == 1
    assert op.payload_hash == hash_before


@pytest.mark.django_db(transaction=True)
def test_it_never_settles_a_mail_with_a_message_to_another_recipient(
    acme, operator, providers, live_server
):
    from dataclasses import replace

    from operations.engine.core import adapter, snapshot
    from operations.models import AttemptOutcome, AuditEvent, EvidenceKind, WebhookEvent
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_message_deliver

    op = engine.operation_prepare(tenant=acme, action="mail.send", payload=MAIL)
    # A message sent under this operation's key to another recipient (by something else: a
    # data incident). Our call is refused as a key reused with other parameters.
    stray = adapter(op.action).call(
        replace(snapshot(op), payload={**MAIL, "to": "ceo@acme.test"})).external_id
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert (op.status, op.error_code) == (S.UNKNOWN, "idempotency_error")

    # An operator's "Reconcile now": the lookup by key finds that message.
    report = engine.operation_reconcile(operation_id=op.id, actor=operator, reason="checking")

    op.refresh_from_db()
    assert report.outcome == "inconclusive"
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.UNKNOWN, "", None)
    lookup = op.attempts.get(kind=AttemptKind.LOOKUP)
    assert (lookup.outcome, lookup.external_id) == (AttemptOutcome.INCONCLUSIVE, stray)
    noted = op.evidence.get(kind=EvidenceKind.LOOKUP).summary
    assert (f"{stray} has another recipient than the approved email: not the approved "
            "effect; a person decides") in noted
    assert "ceo@" not in noted and "cfo@" not in noted
    assert AuditEvent.objects.filter(object_id=op.id, action="operation.reconcile").count() == 1
    assert op.id not in engine.operations_due_for_reconcile()

    # A re-delivered execute reconciles first: the same message, still a person's.
    assert engine.operation_execute(operation_id=op.id).status == S.UNKNOWN
    # The provider then delivers that message: its event is held, not applied.
    sandbox_message_deliver(message_id=stray)
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1
    event = WebhookEvent.objects.get(operation_id=op.id)
    assert event.needs_review and not event.applied

    # Nor does a person settle it with that message's reference.
    refused = "has another recipient than the approved email"
    with pytest.raises(engine.ReferenceRefused, match=refused):
        engine.operation_resolve(
            operation_id=op.id, actor=operator, outcome=S.SUCCEEDED, evidence_text="",
            reason="the provider says delivered", provider_reference=stray)

    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.UNKNOWN, "")
    assert Message.objects.get().to == "ceo@acme.test"  # no second email either
    assert len(sandbox_writes(provider="mail", operation_id=op.id)) == 2


@pytest.mark.django_db(transaction=True)
def test_it_never_settles_an_operation_with_a_call_answer_for_another_sum(
    acme, approver, providers, monkeypatch
):
    from operations.models import AttemptOutcome, EvidenceKind
    from operations.providers.payments import PaymentsCreateAdapter

    op = authorized_payment(acme, approver)
    hash_before = op.payload_hash
    sent_params = PaymentsCreateAdapter.params

    def another_sum(self, snapshot):
        # What a faulty provider (or a proxy rewriting the request) does: it moves and
        # confirms a sum nobody approved.
        return {**sent_params(self, snapshot), "amount": "99900"}

    monkeypatch.setattr(PaymentsCreateAdapter, "params", another_sum)
    report = engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    stray = PaymentIntent.objects.get()
    assert (report.outcome, report.status) == ("called", S.UNKNOWN)
    # Not this operation's effect: it names no external id, and waits for a person.
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.UNKNOWN, "", None)
    assert op.error_code == "disagreement"
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert (call.outcome, call.external_id) == (AttemptOutcome.UNKNOWN, stray.id)
    noted = op.evidence.get(kind=EvidenceKind.CALL_RESULT)
    assert noted.summary == (
        f"the provider answered {stray.id} is for 99900 KZT, the approved intent for 1250000 "
        "KZT (minor units): not the approved effect; a person decides")
    assert op.id not in engine.operations_due_for_reconcile()
    assert payment_posts(op).count() == 1
    assert op.payload_hash == hash_before

    # Asked again (an operator's "Reconcile now"), the provider shows the same stray payment:
    # still a person's decision, and no second call.
    monkeypatch.undo()
    assert engine.operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    assert engine.operation_execute(operation_id=op.id).status == S.UNKNOWN
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.UNKNOWN, "")
    assert payment_posts(op).count() == 1
    assert PaymentIntent.objects.count() == 1


def _all_answered(provider: str, op: Operation) -> bool:
    return all(w.response_status for w in sandbox_writes(provider=provider, operation_id=op.id))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", LOST_ANSWERS)
def test_it_makes_one_deal_for_a_create_whatever_becomes_of_its_answer(
    acme, providers_drained, kind
):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload=DEAL)
    sandbox_fault_set(provider="crm", kind=kind, match=op.id, seconds=2.5)

    engine.operation_execute(operation_id=op.id)
    assert engine.operation_execute(operation_id=op.id).status == S.SUCCEEDED
    wait_for(lambda: _all_answered("crm", op), what="every POST to end")

    op.refresh_from_db()
    deal = Deal.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id
    assert deal.agent_operation_id == op.id
    # A second POST only where a lookup proved absence first (the 5xx before any write, or
    # the stalled one), and the CRM refused the late duplicate.
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == (
        2 if kind in ("delay", "http_500") else 1)
    assert op.attempts.filter(kind=AttemptKind.LOOKUP).count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_creates_again_a_deal_the_crm_named_for_the_operation_and_then_lost(
    acme, providers_drained
):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload=DEAL)
    # The first POST stalls 2.5 s at the CRM before creating; our client gives up at 1 s.
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=2.5)
    engine.operation_execute(operation_id=op.id)
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # not there yet
    first = wait_for(lambda: Deal.objects.filter(agent_operation_id=op.id).first(),
                     what="the stalled create to land")
    # The retry is refused as a second deal, and the CRM names the one the first call made.
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert (op.status, op.error_code, op.external_id) == (S.UNKNOWN, "already_exists", first.id)
    refused = op.attempts.get(number=3)
    assert (refused.kind, refused.http_status, refused.external_id) == (
        AttemptKind.CALL, 409, first.id)

    Deal.objects.filter(id=first.id).delete()  # someone deletes it in the CRM
    report = engine.operation_reconcile(operation_id=op.id)
    engine.operation_execute(operation_id=op.id)

    # The CRM named that deal for the operation: its absence proves nothing, and a create
    # now would be a second deal. A person decides.
    op.refresh_from_db()
    assert (report.outcome, report.may_call_again) == ("inconclusive", False)
    assert f"the provider no longer has {first.id}" in report.detail
    assert (op.status, op.next_reconcile_at) == (S.UNKNOWN, None)
    assert not Deal.objects.filter(agent_operation_id=op.id).exists()
    wait_for(lambda: _all_answered("crm", op), what="every POST to end")
    assert [w.response_status for w in sandbox_writes(provider="crm", operation_id=op.id)] == [
        201, 409]
    assert op.provider_calls == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", LOST_ANSWERS)
def test_it_applies_a_deal_update_once_whatever_becomes_of_its_answer(
    acme, approver, providers_drained, kind
):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    op = engine.operation_prepare(tenant=acme, action="crm.update_deal", payload={
        "target": deal.id, "expected_version": 1, "patch": {"stage": "won"}})
    engine.operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    sandbox_fault_set(provider="crm", kind=kind, match=op.id, seconds=2.5)

    engine.operation_execute(operation_id=op.id)
    engine.operation_execute(operation_id=op.id)
    wait_for(lambda: _all_answered("crm", op), what="every PATCH to end")
    engine.operation_execute(operation_id=op.id)

    op.refresh_from_db()
    deal.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id
    assert (deal.version, deal.stage, deal.applied_operation_ids) == (2, "won", [op.id])
    assert op.payload["expected_version"] == 1  # never retried with fresh data
    # A second PATCH only after a lookup proved the first had not applied (the 5xx, or the
    # stalled one, which the CRM then refused as a conflict).
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == (
        2 if kind in ("delay", "http_500") else 1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", LOST_ANSWERS)
def test_it_sends_one_email_with_one_key_whatever_becomes_of_its_answer(
    acme, providers_drained, kind
):
    op = engine.operation_prepare(tenant=acme, action="mail.send", payload=MAIL)
    sandbox_fault_set(provider="mail", kind=kind, match=op.id, seconds=2.5)

    engine.operation_execute(operation_id=op.id)
    assert engine.operation_execute(operation_id=op.id).status == S.ACCEPTED
    wait_for(lambda: _all_answered("mail", op), what="every POST to end")

    op.refresh_from_db()
    message = Message.objects.get()
    assert op.external_id == message.id and message.operation_id == op.id
    writes = list(sandbox_writes(provider="mail", operation_id=op.id))
    assert len(writes) == (2 if kind in ("delay", "http_500") else 1)
    assert {w.idempotency_key for w in writes} == {op.idempotency_key}
    assert len({w.params_hash for w in writes}) == 1


def _everything_kept(op: Operation) -> str:
    op.refresh_from_db()
    parts = [op.error_code, op.error_message, json.dumps(op.result)]
    for attempt in Attempt.objects.filter(operation=op):
        parts += [attempt.error_class, attempt.error_message, attempt.review_note]
    for evidence in Evidence.objects.filter(operation=op):
        parts += [evidence.summary, json.dumps(evidence.data)]
    for event in AuditEvent.objects.filter(object_id=op.id):
        parts += [event.reason, json.dumps(event.before), json.dumps(event.after)]
    return "\n".join(parts)


@pytest.mark.django_db(transaction=True)
def test_it_keeps_the_api_key_out_of_the_journal_when_the_request_cannot_be_sent(
    acme, approver, operator, auditor, maintenance_page, settings
):
    # A key read from a secret file ends in a newline: httpx refuses to send the request with
    # "Illegal header value b'Bearer <the key>\\n'", which was kept as the provider's answer.
    settings.PAYMENTS_API_KEY = LIVE_KEY + "\n"
    op = authorized_payment(acme, approver)

    engine.operation_execute(operation_id=op.id)
    engine.operation_reconcile(operation_id=op.id, actor=operator, reason="customer is asking")

    kept = _everything_kept(op)
    assert "[provider key]" in op.error_message
    assert LIVE_KEY not in kept, "the API key was written to the journal / audit trail"
    page = signed_in(auditor).get(f"/operations/{op.id}/").content.decode()
    assert LIVE_KEY not in page, "the API key is shown on the operation's page to an auditor"


@pytest.mark.django_db(transaction=True)
def test_it_never_shows_the_api_key_on_the_operation_page(
    acme, approver, auditor, maintenance_page, settings
):
    settings.PAYMENTS_API_KEY = LIVE_KEY + " "  # pasted with a trailing space
    op = authorized_payment(acme, approver)

    engine.operation_execute(operation_id=op.id)

    page = signed_in(auditor).get(f"/operations/{op.id}/").content.decode()
    assert LIVE_KEY not in page, "the API key is shown on the operation's page to an auditor"


@pytest.mark.django_db(transaction=True)
def test_it_keeps_an_event_recorded_while_a_lookup_was_out_over_the_lookups_empty_answer(
    acme, approver, monkeypatch
):
    """Reconcile searches an unknown payment by its operation id; the provider's
    `processing` event lands while the search is out and records the payment; the search,
    trailing the provider's writes, answers empty. That absence was read before the fact and
    says nothing against it: the operation stays accepted on the payment, looked up again by
    its id, not sent back to a person's queue with no lookup ever again."""
    op = died_mid_call(authorized_payment(acme, approver),
                       claimed=timezone.now() - timedelta(minutes=5))
    adapter = core.adapter(op.action)
    searched_with = []

    def search_overtaken_by_the_event(snapshot):
        searched_with.append(snapshot.external_id)
        result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
            event_id="evt_processing", event_type="payment_intent.processing",
            operation_id=op.id, external_id="pi_under_way", status=CallOutcome.ACCEPTED,
            data={"id": "pi_under_way", "status": "processing",
                  "amount": op.payload["amount_minor"],
                  "currency": op.payload["currency"].lower()}))
        assert result == "applied", message
        return LookupResult(outcome=LookupOutcome.ABSENT,
                            reason="no payment carries this operation id")

    monkeypatch.setattr(adapter, "lookup", search_overtaken_by_the_event)
    calls_before = Operation.objects.get(id=op.id).provider_calls

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert searched_with == [""]
    assert (op.status, op.external_id) == (S.ACCEPTED, "pi_under_way")
    assert op.next_reconcile_at is not None and op.provider_calls == calls_before
    assert report.outcome == "stale"
    noted = op.evidence.order_by("-id").first()
    assert (noted.kind, noted.from_status, noted.to_status) == ("lookup", S.ACCEPTED, S.ACCEPTED)
    assert "overtaken" in noted.summary


@pytest.mark.django_db(transaction=True)
def test_it_keeps_a_late_call_answer_recorded_while_a_lookup_was_out_over_the_lookups_empty_answer(
    acme, approver, providers, settings, monkeypatch
):
    """Worker A's call makes a `processing` payment; A freezes with the answer until past its
    lease, so a reconcile takes the operation to unknown and searches by operation id. A's
    answer lands while the search is out (late, over the expired lease: accepted on the
    payment); the search, trailing the provider's writes, answers empty. As with an event,
    that absence was read before the fact: the operation stays accepted on A's payment,
    looked up again by its id, and nothing is sent a second time."""
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = op.payload["amount_minor"]
    a, go = stalled_before_recording(op, monkeypatch, worker="A")
    adapter = core.adapter(op.action)
    searched_with = []

    def search_overtaken_by_the_late_answer(snapshot):
        searched_with.append((Operation.objects.get(id=op.id).status, snapshot.external_id))
        go.set()
        assert a.join().outcome == "called"
        return LookupResult(outcome=LookupOutcome.ABSENT,
                            reason="no payment carries this operation id")

    monkeypatch.setattr(adapter, "lookup", search_overtaken_by_the_late_answer)

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert intent.status == "processing"
    assert searched_with == [(S.UNKNOWN, "")]
    assert (op.status, op.external_id) == (S.ACCEPTED, intent.id)
    assert op.next_reconcile_at is not None and op.provider_calls == 1
    assert len(payment_posts(op)) == 1
    assert report.outcome == "stale"
    late = op.evidence.get(kind="call_result")
    assert (late.from_status, late.to_status) == (S.UNKNOWN, S.ACCEPTED)
    assert "arrived late" in late.summary
    noted = op.evidence.order_by("-id").first()
    assert (noted.kind, noted.from_status, noted.to_status) == ("lookup", S.ACCEPTED, S.ACCEPTED)
    assert "overtaken" in noted.summary
