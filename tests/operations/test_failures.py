"""The failure cases of the design brief, broken on purpose against the real stack:
PostgreSQL, Redis, Celery worker processes, and the sandbox providers over real HTTP.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.models import Attempt, AttemptKind, Operation, OperationStatus, WebhookEvent
from operations.sandbox.models import Deal, IdempotencyRecord, PaymentIntent
from operations.sandbox.selectors import sandbox_counts, sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from operations.tasks import execute_operation, sweep_operations
from tests.helpers import Background, signed_in, wait_for
from tests.operations.engine_helpers import (
    async_payment,
    authorized_payment,
    died_mid_call,
    executing_in_flight,
)

S = OperationStatus


@pytest.fixture
def providers(sandbox, sandbox_worker_env) -> dict[str, str]:
    """Adapters here and in worker processes talk to the sandbox of the live server."""
    return sandbox_worker_env


def payment_posts(op: Operation):
    return sandbox_writes(provider="payments", operation_id=op.id)


def executed_into_a_fault(tenant, approver, kind: str) -> Operation:
    """An approved payment executed once while the sandbox answers with `kind`."""
    op = authorized_payment(tenant, approver)
    sandbox_fault_set(provider="payments", kind=kind, match=op.id)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    return op


def assert_left_to_a_person(op: Operation, report, *, detail: str, summary: str) -> None:
    """Proven absent and not called again: no automatic call or check is left, only the
    operators' queue, and the evidence says why."""
    assert (report.outcome, report.detail, report.may_call_again) == ("absent", detail, False)
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None
    assert op.id not in engine.operations_due_for_reconcile()
    assert summary in op.evidence.filter(kind="lookup").last().summary


WORKER_POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])


@pytest.mark.worker
@WORKER_POOLS
def test_it_finds_the_payment_after_the_worker_dies_between_commit_and_answer(
    acme, approver, providers, worker_pool, pool
):
    op = authorized_payment(acme, approver)
    # The sandbox commits the payment, then holds its answer far past any timeout.
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=8)
    worker_pool.start(concurrency=1, pool=pool, extra_env={
        **providers, "PROVIDER_TIMEOUT_SECONDS": "30", "OPERATION_LEASE_SECONDS": "2",
        "CELERY_VISIBILITY_TIMEOUT": "4",
    })
    first = execute_operation.apply_async(
        args=[op.id], queue=worker_pool.queue, ignore_result=False
    )
    wait_for(lambda: PaymentIntent.objects.filter(
        metadata__operation_id=op.id).exists(), what="the sandbox to commit the payment")
    # The provider has committed; the worker is waiting for an answer. Kill it outright.
    for proc in worker_pool.procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    worker_pool.procs.clear()
    op.refresh_from_db()
    assert op.status == S.IN_PROGRESS and op.external_id == ""

    # A new worker: the sweep turns the expired lease into `unknown` and reconciles; the
    # redelivered execute (acks_late) finds nothing left to do.
    worker_pool.start(concurrency=2, pool=pool, extra_env={
        **providers, "PROVIDER_TIMEOUT_SECONDS": "2", "OPERATION_LEASE_SECONDS": "2",
        "CELERY_VISIBILITY_TIMEOUT": "4", "CELERY_UNACKED_RESTORE_SECONDS": "1",
    })
    time.sleep(2.5)  # past the lease
    sweep_operations.apply_async(queue=worker_pool.queue, ignore_result=False).get(timeout=20)
    wait_for(lambda: Operation.objects.get(id=op.id).status == S.SUCCEEDED, timeout=40,
             what="reconciliation to find the payment")
    # The killed worker's message comes back (acks_late) and runs: it must call nobody.
    assert first.get(timeout=40) in {"reconciled", "already_succeeded"}

    op.refresh_from_db()
    intent = PaymentIntent.objects.get(metadata__operation_id=op.id)
    assert PaymentIntent.objects.count() == 1
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    posts = list(payment_posts(op))
    assert len(posts) == 1, "no POST may follow a lookup that found the payment"
    assert {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == 1
    assert op.attempts.filter(kind=AttemptKind.LOOKUP, outcome="found").exists()
    assert op.evidence.filter(kind="lookup", to_status=S.SUCCEEDED).exists()


@pytest.mark.worker
@WORKER_POOLS
def test_it_makes_one_call_when_eight_workers_receive_the_same_execute(
    acme, approver, providers, worker_pool, pool
):
    op = authorized_payment(acme, approver)
    # Slow the provider so all eight deliveries arrive while the first call is in flight.
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=1.5)
    worker_pool.start(concurrency=8, pool=pool,
                      extra_env={**providers, "PROVIDER_TIMEOUT_SECONDS": "10"})
    results = [execute_operation.apply_async(args=[op.id], queue=worker_pool.queue,
                                           ignore_result=False)
               for _ in range(8)]
    outcomes = sorted(r.get(timeout=60) for r in results)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert outcomes.count("called") == 1, outcomes
    # They overlapped: some delivery met the call in flight, not only its stored result.
    assert {"held_elsewhere", "lost_claim"} & set(outcomes), outcomes
    assert len(payment_posts(op)) == 1
    assert PaymentIntent.objects.count() == 1
    assert op.provider_calls == 1
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == 1


def lose_the_answer(op: Operation) -> Operation:
    """A real lost answer: the sandbox commits and the 1-second client timeout fires."""
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=3)
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "called" and op.status == S.UNKNOWN, report
    return op


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
def test_it_does_not_create_again_on_an_empty_search_inside_the_lag_window(
    acme, approver, providers, settings
):
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 3
    sandbox_fault_set(provider="payments", kind="search_lag", match="*", seconds=3, times=50)
    op = lose_the_answer(authorized_payment(acme, approver))
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "reconciled" and op.status == S.UNKNOWN
    assert "lag" in op.evidence.filter(kind="lookup").last().data["reason"]
    assert op.next_reconcile_at is not None  # checked again, automatically
    assert len(payment_posts(op)) == 1

    time.sleep(3.2)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    posts = list(payment_posts(op))
    assert len(posts) == 1 and posts[0].idempotency_key == op.idempotency_key
    assert PaymentIntent.objects.count() == 1


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
def test_it_applies_a_webhook_once_however_often_it_arrives(
    acme, approver, providers, live_server
):
    from operations.sandbox.services import sandbox_payment_settle, sandbox_webhooks_deliver

    op = async_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="duplicate_webhook", match="*", times=5)
    sandbox_payment_settle(payment_intent_id=op.external_id, status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    events = WebhookEvent.objects.filter(operation=op)
    assert events.filter(event_type="payment_intent.succeeded").count() == 1
    assert op.evidence.filter(kind="webhook", to_status=S.SUCCEEDED).count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    # The second copy was answered and changed nothing, but it is on the record.
    succeeded = events.get(event_type="payment_intent.succeeded")
    assert succeeded.deliveries == 2
    from operations.selectors import operation_timeline

    assert any("delivered 2 times, applied at most once" in entry.detail
               for entry in operation_timeline(op))


@pytest.mark.django_db(transaction=True)
def test_it_ignores_a_late_event_that_arrives_out_of_order(acme, approver, providers, client):
    from operations.providers.base import CallOutcome, WebhookFacts

    op = async_payment(acme, approver)
    result, _ = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_2", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id=op.external_id, status=CallOutcome.SUCCEEDED))
    assert result == "applied"
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_1", event_type="payment_intent.processing", operation_id=op.id,
        external_id=op.external_id, status=CallOutcome.ACCEPTED))
    op.refresh_from_db()
    assert result == "ignored" and "not allowed" in message
    assert op.status == S.SUCCEEDED
    assert WebhookEvent.objects.filter(operation=op).count() == 2
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    assert op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_ignores_an_event_about_another_object_carrying_the_operation(
    acme, approver, providers
):
    from operations.providers.base import CallOutcome, WebhookFacts

    op = async_payment(acme, approver)
    # A second PaymentIntent carries this operation id (a data incident) and fails.
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_other", event_type="payment_intent.payment_failed", operation_id=op.id,
        external_id="pi_someone_elses", status=CallOutcome.FAILED))

    op.refresh_from_db()
    assert result == "ignored" and "a person decides" in message
    assert op.status == S.ACCEPTED and op.external_id != "pi_someone_elses"
    assert op.evidence.filter(kind="webhook", summary__contains="pi_someone_elses").count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("event_type", "status", "said"), [
    ("payment_intent.succeeded", "succeeded", "succeeded"),
    ("payment_intent.processing", "accepted", "accepted"),
])
def test_it_holds_an_event_about_a_second_payment_carrying_the_operation_for_review(
    acme, approver, providers, event_type, status, said
):
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import webhooks_held_for_review

    op = async_payment(acme, approver)
    # Another PaymentIntent carries this operation id and moves money: one intent, two
    # effects. Ours stays as the provider reports it; the second is a person's to look at.
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_second", event_type=event_type, operation_id=op.id,
        external_id="pi_second", status=CallOutcome(status)))

    op.refresh_from_db()
    assert (result, message) == ("held", (
        f"held for review: the provider reports a second effect, pi_second ({said}), "
        f"carrying {op.id}, which records {op.external_id}; a person decides"))
    assert op.status == S.ACCEPTED and op.external_id != "pi_second"
    event = WebhookEvent.objects.get(event_id="evt_second")
    assert event.operation_id == op.id and not event.applied and event.needs_review
    assert list(webhooks_held_for_review(operation=op)) == [event]
    assert op.evidence.filter(kind="webhook", summary__contains="pi_second").count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_keeps_a_held_event_for_review_until_a_person_decides(
    acme, approver, operator, providers
):
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import webhooks_held_for_review

    op = async_payment(acme, approver)
    second = WebhookFacts(
        event_id="evt_second", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id="pi_second", status=CallOutcome.SUCCEEDED)
    assert engine.webhook_apply(provider="payments", facts=second)[0] == "held"
    # Then our own payment settles: the operation moves on, the second payment is still there.
    ours = WebhookFacts(
        event_id="evt_ours", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id=op.external_id, status=CallOutcome.SUCCEEDED)
    assert engine.webhook_apply(provider="payments", facts=ours)[0] == "applied"
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_second"]
    client = signed_in(operator)
    said = f"a second effect, pi_second (succeeded), carrying {op.id}"
    assert said in client.get(f"/operations/{op.id}/").content.decode()
    assert said in client.get("/operations/unknown/").content.decode()

    engine.operation_dispute(operation_id=op.id, actor=operator,
                             reason="two payments for one invoice: treasury reverses one")
    assert not webhooks_held_for_review(operation=op).exists()
    assert WebhookEvent.objects.get(event_id="evt_second").reviewed_at is not None
    disputed = op.evidence.get(kind="manual")
    assert disputed.data["reviewed_events"] == ["evt_second"]
    assert said not in client.get("/operations/unknown/").content.decode()
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_revives_an_operation_a_person_resolved(
    acme, approver, operator, providers, live_server
):
    from operations.sandbox.services import sandbox_payment_settle, sandbox_webhooks_deliver

    op = async_payment(acme, approver)
    engine.operation_resolve(operation_id=op.id, actor=operator, outcome=S.FAILED,
                             evidence_text="bank statement shows no debit",
                             reason="checked with treasury")
    sandbox_payment_settle(payment_intent_id=op.external_id, status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert op.status == S.FAILED and op.resolved_manually
    event = WebhookEvent.objects.get(operation=op, event_type="payment_intent.succeeded")
    assert not event.applied and "operator" in event.outcome
    engine.operation_dispute(operation_id=op.id, actor=operator, reason="treasury re-checking")
    assert engine.operation_reconcile(operation_id=op.id).outcome == "nothing_to_do"
    assert Operation.objects.get(id=op.id).status == S.DISPUTED
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    assert Operation.objects.get(id=op.id).provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_moves_a_disputed_operation_on_a_webhook(
    acme, approver, operator, providers, live_server
):
    from operations.sandbox.services import sandbox_payment_settle, sandbox_webhooks_deliver

    op = async_payment(acme, approver)
    engine.operation_dispute(operation_id=op.id, actor=operator,
                             reason="the beneficiary disputes the invoice")
    sandbox_payment_settle(payment_intent_id=op.external_id, status="succeeded")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert op.status == S.DISPUTED
    event = WebhookEvent.objects.get(operation=op, event_type="payment_intent.succeeded")
    assert not event.applied
    assert engine.operation_reconcile(operation_id=op.id).outcome == "nothing_to_do"
    assert Operation.objects.get(id=op.id).status == S.DISPUTED
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1
    assert op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_rejects_a_webhook_with_a_bad_signature_and_stores_nothing(
    acme, approver, providers, client
):
    op = async_payment(acme, approver)
    body = (b'{"id": "evt_forged", "type": "payment_intent.succeeded", "created": 1, '
            b'"data": {"object": {"id": "' + op.external_id.encode() + b'", "status": '
            b'"succeeded", "metadata": {"operation_id": "' + op.id.encode() + b'"}}}}')
    response = client.post("/webhooks/payments/", data=body, content_type="application/json",
                           HTTP_STRIPE_SIGNATURE=f"t={int(time.time())},v1={'0' * 64}")
    assert response.status_code == 400
    assert WebhookEvent.objects.count() == 0
    op.refresh_from_db()
    assert op.status == S.ACCEPTED
    assert Attempt.objects.filter(operation=op).count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("created", [{}, [1], "soon", 10**30])
def test_it_answers_400_to_a_signed_event_with_a_malformed_time(client, settings, created):
    from operations.providers.signing import stripe_signature_header

    body = json.dumps({"id": "evt_odd", "type": "payment_intent.succeeded", "created": created,
                       "data": {"object": {"id": "pi_1", "status": "succeeded",
                                           "metadata": {"operation_id": "op_1"}}}}).encode()
    response = client.post(
        "/webhooks/payments/", data=body, content_type="application/json",
        HTTP_STRIPE_SIGNATURE=stripe_signature_header(
            secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body),
    )
    assert response.status_code == 400
    assert WebhookEvent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_makes_one_deal_when_a_timed_out_create_lands_after_the_retry(acme, providers):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    # The first POST stalls at the CRM before it creates anything, past our 1 s timeout.
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=2.5)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and Deal.objects.count() == 0

    # The lookup truly finds nothing yet, so the engine calls again; then the stalled
    # request wakes up and tries to create the same deal.
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "called" and op.status == S.SUCCEEDED
    wait_for(lambda: all(w.response_status for w in sandbox_writes(
        provider="crm", operation_id=op.id)), what="the stalled create to finish")

    deal = Deal.objects.get(agent_operation_id=op.id)
    assert Deal.objects.count() == 1 and op.external_id == deal.id
    writes = sandbox_writes(provider="crm", operation_id=op.id).order_by("id")
    assert sorted(w.response_status for w in writes) == [201, 409]
    kinds = list(op.attempts.order_by("number").values_list("kind", "outcome"))
    assert kinds == [("call", "unknown"), ("lookup", "absent"), ("call", "succeeded")]


@pytest.mark.django_db(transaction=True)
def test_it_does_not_apply_an_absence_looked_up_before_a_newer_call(
    acme, approver, providers, settings
):
    from operations.sandbox.models import SandboxFault

    settings.PROVIDER_TIMEOUT_SECONDS = 5  # the slow lookup is answered, only late
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    engine.operation_execute(operation_id=op.id)  # call 1: refused before any write
    # A slow reconcile: its lookup is held at the provider while everything below happens.
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    slow = Background(lambda: engine.operation_reconcile(operation_id=op.id))
    wait_for(lambda: not SandboxFault.objects.filter(match=op.id, kind="delay",
                                                     remaining__gt=0).exists(),
             what="the slow lookup to take the delay fault")
    # A second reconcile proves absence; the execute after it makes call 2, whose answer
    # is lost too, so the operation is unknown again.
    assert engine.operation_reconcile(operation_id=op.id).may_call_again
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    report = slow.join()

    op.refresh_from_db()
    assert report.outcome == "stale" and not report.may_call_again
    assert op.status == S.UNKNOWN and op.provider_calls == 2
    assert len(payment_posts(op)) == 2 and PaymentIntent.objects.count() == 0
    assert op.evidence.filter(to_status=S.NOT_STARTED).count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_keeps_an_operators_settlement_when_a_late_answer_arrives(
    acme, approver, operator, providers, settings
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 8
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=4)

    call = Background(lambda: engine.operation_execute(operation_id=op.id))
    wait_for(lambda: Operation.objects.filter(
        id=op.id, status=S.IN_PROGRESS, lease_expires_at__lte=timezone.now()).exists(),
        what="the lease to run out while the call is in flight")
    engine.operation_dispute(operation_id=op.id, actor=operator,
                             reason="the worker looks stuck; treasury checks by hand")
    call.join()

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.DISPUTED and op.resolved_manually
    assert op.external_id == ""  # the late answer did not write over the operator's case
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert call.external_id == intent.id  # but is kept, and held for the person who holds it
    assert call.needs_review and call.reviewed_at is None
    assert len(payment_posts(op)) == 1


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
    from operations.sandbox.services import sandbox_payment_settle, sandbox_webhooks_deliver

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


@pytest.mark.django_db(transaction=True)
def test_it_lands_the_answer_that_its_own_payments_webhook_overtook(
    acme, approver, providers, live_server, settings
):
    from operations.sandbox.services import sandbox_webhooks_deliver

    op = authorized_payment(acme, approver)
    # The provider commits the payment and says so by webhook before its answer arrives.
    call = executing_in_flight(op, settings, fault="commit_then_drop", seconds=1.5)
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1
    event = WebhookEvent.objects.get(operation=op)
    # Kept while the call is in flight: which object is ours, only the answer says.
    assert Operation.objects.get(id=op.id).status == S.IN_PROGRESS and not event.applied
    call.join()

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id == event.external_id
    assert op.evidence.filter(from_status=S.IN_PROGRESS, to_status=S.SUCCEEDED).count() == 1
    event.refresh_from_db()
    assert not event.needs_review, "its own payment's event is not a second effect"
    assert len(payment_posts(op)) == op.provider_calls == 1


@pytest.mark.django_db
def test_it_answers_400_not_500_to_a_signature_header_that_is_not_ascii(client):
    from operations.sandbox.selectors import sandbox_requests

    body = b'{"id": "evt_x", "type": "payment_intent.succeeded", "data": {"object": {}}}'
    for provider, header in (("payments", {"HTTP_STRIPE_SIGNATURE": "t=1,v1=\xff"}),
                             ("crm", {"HTTP_X_CRM_SIGNATURE": "sha256=\xe9"}),
                             ("mail", {"HTTP_X_MAIL_SIGNATURE": "sha256=\xe9"})):
        response = client.post(f"/webhooks/{provider}/", data=body,
                               content_type="application/json", **header)
        assert response.status_code == 400, provider
    assert WebhookEvent.objects.count() == 0
    refused = client.get("/sandbox/payments/v1/payment_intents/pi_1",
                         HTTP_AUTHORIZATION="Bearer \xe9")
    assert refused.status_code == 401
    assert sandbox_requests(provider="payments").count() == 1  # logged, refused, nothing else


# --- an unanswered call, a stalled worker, and lookups that must not call it absence ----------


@pytest.mark.django_db(transaction=True)
def test_it_lands_a_slow_crm_answer_instead_of_cancelling_after_an_early_absence(
    acme, providers, settings
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 5
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    assert not op.requires_approval  # authorized by the policy
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=1.2))
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=3)  # the POST is slow
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    wait_for(lambda: Operation.objects.filter(
        id=op.id, status=S.IN_PROGRESS, lease_expires_at__lte=timezone.now()).exists(),
        what="the lease to run out while the POST is in flight")
    # The sweep's reconcile: no deal yet, but the unanswered call may still land.
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.outcome == "inconclusive" and not report.may_call_again
    call.join()

    op.refresh_from_db()
    deal = Deal.objects.get(agent_operation_id=op.id)
    assert op.status == S.SUCCEEDED and op.external_id == deal.id  # not cancelled
    assert op.provider_calls == 1 and Deal.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_sends_a_call_after_its_lease_ran_out(
    acme, approver, providers, settings, monkeypatch
):
    import threading

    from operations.engine import execute as execute_module

    settings.OPERATION_LEASE_SECONDS = 2
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=2.2))
    real_snapshot = execute_module.snapshot
    main = threading.get_ident()

    def stalled_after_the_claim(op_, **kwargs):
        if threading.get_ident() != main:
            time.sleep(3.5)  # a long GC pause, a frozen container
        return real_snapshot(op_, **kwargs)

    monkeypatch.setattr(execute_module, "snapshot", stalled_after_the_claim)
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    time.sleep(2.5)
    # The lease ran out: the sweep's reconcile finds nothing, which proves nothing yet.
    assert not engine.operation_reconcile(operation_id=op.id).may_call_again
    call.join()

    attempt = op.attempts.get(kind=AttemptKind.CALL)
    assert attempt.error_class == "lease_lost" and PaymentIntent.objects.count() == 0
    assert len(payment_posts(op)) == 0  # the stalled worker sent nothing
    # Nothing was sent, and the approval has run out meanwhile: closed as never done.
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "absent" and not report.may_call_again
    assert op.status == S.CANCELLED and PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_measures_the_search_lag_from_the_newest_call_a_concurrent_reconcile_allowed(
    acme, approver, providers, settings, monkeypatch
):
    import threading

    from operations.engine import reconcile as reconcile_module

    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    # Call 1: refused before any write, three minutes ago.
    op = executed_into_a_fault(acme, approver, "http_500")
    long_ago = timezone.now() - timedelta(minutes=3)
    Attempt.objects.filter(operation=op).update(started_at=long_ago, finished_at=long_ago)
    # Reconcile R stalls as it reads what it will tell the provider's search...
    stalled_once, go = threading.Event(), threading.Event()
    real_snapshot, main = reconcile_module.snapshot, threading.get_ident()

    def stalled_snapshot(op_, **kwargs):
        taken = real_snapshot(op_, **kwargs)
        if threading.get_ident() != main and not stalled_once.is_set():
            stalled_once.set()
            go.wait(3)
        return taken

    monkeypatch.setattr(reconcile_module, "snapshot", stalled_snapshot)
    stalled = Background(lambda: engine.operation_reconcile(operation_id=op.id))
    assert stalled_once.wait(10)
    # ...while another reconcile runs (it waits for R's row lock, or proves absence) and
    # call 2 commits a payment whose answer is lost, hidden from the search by its lag.
    engine.operation_reconcile(operation_id=op.id)
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=2)
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)
    engine.operation_execute(operation_id=op.id)
    go.set()
    stalled.join()
    wait_for(lambda: not payment_posts(op).filter(response_status__isnull=True).exists(),
             what="the dropped answer's request to end at the sandbox")

    op.refresh_from_db()
    assert PaymentIntent.objects.count() == 1 and op.provider_calls == 2
    assert op.status == S.UNKNOWN
    # Absence was proven once, before call 2; never again with call 1's age as the lag.
    assert op.evidence.filter(to_status=S.NOT_STARTED).count() == 1


@pytest.mark.django_db
def test_it_queues_a_policy_authorized_intent_its_caller_never_ran(acme, monkeypatch):
    op = engine.operation_prepare(tenant=acme, action="mail.send", payload={
        "to": "anna@example.com", "template": "receipt", "params": {"invoice": "inv_1"}})
    assert op.authorized_hash and op.status == S.NOT_STARTED
    assert engine.operations_claim_waiting_for_execute() == []  # its caller runs it first
    later = timezone.now() + timedelta(minutes=2)
    monkeypatch.setattr("django.utils.timezone.now", lambda: later)
    assert engine.operations_claim_waiting_for_execute() == [op.id]


@pytest.mark.django_db
def test_it_keeps_looking_up_an_accepted_payment_past_the_keys_retention(
    acme, approver, monkeypatch
):
    from operations.engine import core
    from operations.providers.base import LookupOutcome, LookupResult

    op = authorized_payment(acme, approver)
    then = timezone.now() - timedelta(hours=25)  # "processing" at the bank for a day
    Attempt.objects.create(operation=op, number=1, kind="call", worker="w", started_at=then,
                           finished_at=then, outcome="accepted",
                           idempotency_key=op.idempotency_key)
    Operation.objects.filter(id=op.id).update(status=S.ACCEPTED, external_id="pi_x",
                                              provider_calls=1, next_reconcile_at=timezone.now())
    real = core.adapter("payments.create")

    class FailingLookup:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            return LookupResult(outcome=LookupOutcome.INCONCLUSIVE,
                                reason="lookup failed (http_5xx)",
                                retry_after=timedelta(seconds=30))

    monkeypatch.setattr(core, "adapter", lambda action: FailingLookup())
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.ACCEPTED and op.next_reconcile_at is not None

    # A lookup that can never answer again (a mail key past its retention): a person's.
    FailingLookup.lookup = lambda self, op_: LookupResult(
        outcome=LookupOutcome.INCONCLUSIVE, reason="key retention window passed")
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None


@pytest.mark.django_db(transaction=True)
def test_it_confirms_a_given_up_call_did_not_land_before_closing_it_as_never_done(
    acme, providers, settings
):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=2))
    # The CRM takes 3 s; our client gives up after 1 s, and the deal lands later anyway.
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=3)
    engine.operation_execute(operation_id=op.id)
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # no deal yet
    wait_for(lambda: Operation.objects.get(id=op.id).authorization_expires_at < timezone.now(),
             what="the authorization to run out")
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    # Not cancelled while the given-up call may still land: a lookup confirms first.
    assert report.outcome == "confirming_absence" and op.status == S.UNKNOWN
    wait_for(lambda: Deal.objects.filter(agent_operation_id=op.id).exists(),
             what="the slow create to land")
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    deal = Deal.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id and op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_closes_as_never_done_once_no_call_can_land_and_the_approval_ran_out(
    acme, approver, providers
):
    op = executed_into_a_fault(acme, approver, "http_500")  # nothing written
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.outcome == "inconclusive" and not report.may_call_again  # may still land
    # The provider's late-landing window after the call has passed.
    earlier = timezone.now() - timedelta(minutes=5)
    Attempt.objects.filter(operation=op, kind=AttemptKind.CALL).update(
        started_at=earlier, finished_at=earlier)
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.CANCELLED and op.error_code == "authorization"
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 0


# --- the claim and the lease, broken on purpose at the moments between a read and a write ---


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("meanwhile", ["answer_lost", "call_in_flight"])
def test_it_does_not_claim_what_another_worker_moved_on_after_its_read(
    acme, approver, providers, settings, monkeypatch, meanwhile
):
    from operations.engine import execute as execute_module

    if meanwhile == "call_in_flight":
        settings.PROVIDER_TIMEOUT_SECONDS = 5  # B waits for its slow answer
    op = authorized_payment(acme, approver)
    real_check = execute_module.authorization_problem
    other: dict = {}

    def another_worker_goes_first(op_):
        # Worker A has read not_started; before its claim, worker B claims and calls.
        problem = real_check(op_)
        if not other:
            other["started"] = True
            if meanwhile == "answer_lost":  # B's call committed, its answer was lost
                sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id,
                                  seconds=3)
                other["report"] = engine.operation_execute(operation_id=op.id, worker="B")
                assert Operation.objects.get(id=op.id).status == S.UNKNOWN
            else:  # B's call is still in flight, under B's live lease
                sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
                other["call"] = Background(
                    lambda: engine.operation_execute(operation_id=op.id, worker="B"))
                wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS)
                         .exists(), what="worker B's claim")
        return problem

    monkeypatch.setattr(execute_module, "authorization_problem", another_worker_goes_first)
    report = engine.operation_execute(operation_id=op.id, worker="A")
    assert report.outcome == "lost_claim", report
    if "call" in other:
        assert other["call"].join().outcome == "called"

    op.refresh_from_db()
    assert len(payment_posts(op)) == 1, "A must not call what B claimed (or left unknown)"
    assert op.provider_calls == 1 and PaymentIntent.objects.count() == 1
    assert list(op.attempts.filter(kind=AttemptKind.CALL).values_list("worker", flat=True)) \
        == ["B"]
    if meanwhile == "answer_lost":  # unknown stays unknown until a lookup, never a call
        assert op.status == S.UNKNOWN and not op.attempts.filter(kind=AttemptKind.LOOKUP)


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_call_in_flight_to_its_worker_while_the_lease_runs(
    acme, approver, providers, settings
):
    settings.PROVIDER_TIMEOUT_SECONDS = 5  # the slow answer arrives; the lease is 30 s
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS).exists(),
             what="worker A's claim")
    # A second delivery and an operator's reconcile, both while A's lease runs: hands off.
    assert engine.operation_execute(operation_id=op.id, worker="B").outcome == "held_elsewhere"
    assert engine.operation_reconcile(operation_id=op.id).outcome == "nothing_to_do"
    assert op.id not in engine.operations_due_for_reconcile()
    assert call.join().outcome == "called"

    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert not op.evidence.filter(to_status=S.UNKNOWN).exists()
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("lapse", ["expired", "policy_moved_on"])
def test_it_does_not_call_when_the_authorization_lapses_between_its_check_and_the_claim(
    acme, approver, providers, settings, monkeypatch, lapse
):
    from operations.engine import execute as execute_module

    op = authorized_payment(acme, approver)
    hash_before = op.payload_hash
    real_check = execute_module.authorization_problem

    def lapses_right_after_the_check(op_):
        problem = real_check(op_)
        if lapse == "expired":
            Operation.objects.filter(id=op.id).update(authorization_expires_at=timezone.now())
        else:
            settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
        return problem

    monkeypatch.setattr(execute_module, "authorization_problem", lapses_right_after_the_check)
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "lost_claim" and op.status == S.NOT_STARTED
    assert op.provider_calls == 0 and not op.attempts.exists()
    assert sandbox_counts()["requests"] == 0 and PaymentIntent.objects.count() == 0
    # The next delivery sees the lapse at its check and closes it, still without a call.
    monkeypatch.setattr(execute_module, "authorization_problem", real_check)
    assert engine.operation_execute(operation_id=op.id).outcome == "cancelled"
    op.refresh_from_db()
    assert sandbox_counts()["requests"] == 0 and op.payload_hash == hash_before


@pytest.mark.django_db(transaction=True)
def test_it_never_records_a_stalled_workers_answer_over_the_next_workers_claim(
    acme, approver, providers, settings, monkeypatch
):
    import threading

    from operations.engine import execute as execute_module

    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)  # A: nothing written
    stalled, go = threading.Event(), threading.Event()
    real_record = execute_module._record_call_result

    def stalls_before_recording(op_, attempt, result, *, worker, adapter):
        if worker == "A":
            stalled.set()
            go.wait(15)  # A has its (5xx) answer, then freezes before writing it down
        return real_record(op_, attempt, result, worker=worker, adapter=adapter)

    monkeypatch.setattr(execute_module, "_record_call_result", stalls_before_recording)
    a = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    assert stalled.wait(10)
    time.sleep(2.3)  # past A's lease and the reach of its call
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # proven absent
    settings.PROVIDER_TIMEOUT_SECONDS = 5
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    b = Background(lambda: engine.operation_execute(operation_id=op.id, worker="B"))
    wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS,
                                              lease_owner="B").exists(), what="B's claim")
    go.set()
    a.join()
    # A's late "unknown" must not land on B's claim while B's call is in flight.
    held = Operation.objects.get(id=op.id)
    assert (held.status, held.lease_owner) == (S.IN_PROGRESS, "B")
    assert b.join().outcome == "called"

    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == PaymentIntent.objects.get().id
    posts = list(payment_posts(op))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert not op.evidence.filter(from_status=S.IN_PROGRESS, to_status=S.UNKNOWN,
                                  kind="call_result").exists()


@pytest.mark.django_db(transaction=True)
def test_it_finds_the_payment_by_the_sweep_alone_when_a_worker_died_holding_the_lease(
    acme, approver, providers, monkeypatch
):
    from operations import tasks
    from operations.engine.core import adapter, snapshot

    op = authorized_payment(acme, approver)
    # What a worker killed mid-call leaves: its claim with a lease that ran out, a call
    # attempt with no answer, and a payment the provider committed. No message redelivered.
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=2))
    assert adapter(op.action).call(snapshot(op)).external_id  # committed at the provider

    outcomes: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", outcomes.append)
    monkeypatch.setattr(
        tasks.reconcile_operation, "delay",
        lambda operation_id: outcomes.append(tasks.reconcile_operation(operation_id)),
    )
    assert tasks.sweep_operations() == 1
    assert outcomes == ["found"]

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert len(payment_posts(op)) == 1 and op.provider_calls == 1
    assert op.attempts.filter(kind=AttemptKind.LOOKUP, outcome="found").count() == 1


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
    Attempt.objects.filter(operation=op, number=1).update(provider_account=first_account)
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
def test_it_never_records_a_stalled_workers_refusal_over_a_newer_calls_payment(
    acme, approver, providers, settings, monkeypatch
):
    import threading

    from operations.engine import execute as execute_module

    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    # A's call is refused (a 400, nothing written), but A freezes before writing that down.
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    stalled, go = threading.Event(), threading.Event()
    real_record = execute_module._record_call_result

    def stalls_before_recording(op_, attempt, result, *, worker, adapter):
        if worker == "A":
            stalled.set()
            go.wait(15)
        return real_record(op_, attempt, result, worker=worker, adapter=adapter)

    monkeypatch.setattr(execute_module, "_record_call_result", stalls_before_recording)
    a = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    assert stalled.wait(10)
    time.sleep(2.3)  # past A's lease and the reach of its call
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # proven absent
    # B's call commits the payment, and its answer is lost.
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=3)
    assert engine.operation_execute(operation_id=op.id, worker="B").outcome == "called"
    assert Operation.objects.get(id=op.id).status == S.UNKNOWN
    go.set()
    a.join()

    # A's refusal is older than B's call: it must not close as failed what B may have done.
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.error_code != "validation"
    assert not op.evidence.filter(to_status=S.FAILED).exists()
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    posts = list(payment_posts(op))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert op.provider_calls == 2


@pytest.mark.django_db(transaction=True)
def test_it_measures_the_search_lag_from_the_last_moment_an_unanswered_call_could_land(
    acme, approver, providers, settings
):
    from operations.engine.core import adapter, call_reach, snapshot

    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    op = authorized_payment(acme, approver)
    # A worker claimed 70 s ago and died without an answer; its call may have reached the
    # provider as late as its claim plus call_reach() (31 s here), and did commit.
    claimed = timezone.now() - timedelta(seconds=70)
    op = died_mid_call(op, claimed=claimed)
    assert adapter(op.action).call(snapshot(op)).external_id
    # The provider's search does not show it yet (its lag, from when the call could land).
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "inconclusive" and not report.may_call_again
    assert op.status == S.UNKNOWN
    assert "lag" in op.evidence.filter(kind="lookup").last().data["reason"]
    # Checked again once the lag has passed after the call's reach, not before.
    lag_ends = claimed + call_reach() + timedelta(seconds=60)
    assert abs((op.next_reconcile_at - lag_ends).total_seconds()) < 5
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


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


@pytest.mark.django_db
@pytest.mark.parametrize(("retry_in", "scheduled"), [(5, True), (30, False)])
@pytest.mark.parametrize("sent_again_an_hour_ago", [False, True])
def test_it_hands_an_unknown_to_a_person_when_the_next_lookup_would_pass_the_keys_retention(
    acme, approver, monkeypatch, retry_in, scheduled, sent_again_an_hour_ago
):
    from operations.engine import core
    from operations.providers.base import LookupOutcome, LookupResult

    op = authorized_payment(acme, approver)
    # The lost call was made 24 hours less 15 seconds ago: the provider keeps its key for
    # 24 hours, so a lookup later than 15 seconds from now proves nothing about it.
    then = timezone.now() - timedelta(hours=24) + timedelta(seconds=15)
    calls = [then]
    if sent_again_an_hour_ago:
        # Sent again with the same key after a proven absence: Stripe ages a key from its
        # first use, so this call does not make it keep the key any longer.
        calls.append(timezone.now() - timedelta(hours=1))
    for number, sent in enumerate(calls, start=1):
        Attempt.objects.create(operation=op, number=number, kind="call", worker="w",
                               started_at=sent, finished_at=sent, outcome="unknown",
                               idempotency_key=op.idempotency_key)
    Operation.objects.filter(id=op.id).update(status=S.UNKNOWN, provider_calls=len(calls),
                                              unknown_since=calls[-1])
    real = core.adapter("payments.create")

    class FailingLookup:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            return LookupResult(outcome=LookupOutcome.INCONCLUSIVE,
                                reason="lookup failed (http_5xx)",
                                retry_after=timedelta(seconds=retry_in))

    monkeypatch.setattr(core, "adapter", lambda action: FailingLookup())
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "inconclusive" and op.status == S.UNKNOWN
    assert (op.next_reconcile_at is not None) is scheduled
    summary = op.evidence.filter(kind="lookup").last().summary
    assert ("waiting for a person" in summary) is not scheduled
    assert op.provider_calls == len(calls)


@pytest.mark.django_db(transaction=True)
def test_it_never_expires_a_lease_that_a_new_claim_replaced_after_the_read(
    acme, approver, providers, monkeypatch
):
    from django.db.models import F

    from operations.engine import reconcile as reconcile_module

    op = authorized_payment(acme, approver)
    claimed = timezone.now() - timedelta(minutes=2)
    Operation.objects.filter(id=op.id).update(
        status=S.IN_PROGRESS, status_changed_at=claimed, lease_owner="A",
        lease_expires_at=claimed + timedelta(seconds=30), provider_calls=1)
    real_expired = reconcile_module.lease_expired

    def b_claims_after_the_read(op_):
        expired = real_expired(op_)  # A's lease, as this reconcile read it: expired
        if expired and op_.lease_owner == "A":
            # Before its UPDATE: A's answer was recorded, a lookup proved absence, and B
            # claimed the operation again, with a live lease and its call in flight.
            Operation.objects.filter(id=op.id).update(
                lease_owner="B", lease_expires_at=timezone.now() + timedelta(seconds=30),
                provider_calls=F("provider_calls") + 1)
        return expired

    monkeypatch.setattr(reconcile_module, "lease_expired", b_claims_after_the_read)
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "nothing_to_do"
    assert (op.status, op.lease_owner, op.provider_calls) == (S.IN_PROGRESS, "B", 2)
    assert not op.evidence.filter(to_status=S.UNKNOWN).exists()
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert sandbox_counts()["requests"] == 0


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

def _signed_stripe_post(client, settings, body: bytes, *, header: str | None = None):
    from operations.providers.signing import stripe_signature_header

    signature = header if header is not None else stripe_signature_header(
        secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body)
    return client.post("/webhooks/payments/", data=body, content_type="application/json",
                       HTTP_STRIPE_SIGNATURE=signature)


def _stripe_event(op: Operation, *, event_id: str, status: str) -> bytes:
    """Stripe's event about the async payment's intent (async_payment's sum) now in `status`."""
    return json.dumps({
        "id": event_id, "object": "event", "type": f"payment_intent.{status}",
        "created": int(time.time()),
        "data": {"object": {"id": op.external_id, "status": status, "amount": 150_000_000,
                            "currency": "kzt", "metadata": {"operation_id": op.id}}},
    }).encode()


@pytest.mark.django_db(transaction=True)
def test_it_applies_a_signed_event_once_and_answers_its_duplicate_200(
    acme, approver, providers, client, settings
):
    op = async_payment(acme, approver)
    body = _stripe_event(op, event_id="evt_twice", status="succeeded")

    first = _signed_stripe_post(client, settings, body)
    again = _signed_stripe_post(client, settings, body)

    # A duplicate is answered 2xx too: anything else and the provider resends it for days.
    assert (first.status_code, first.json()["result"]) == (200, "applied")
    assert (again.status_code, again.json()["result"]) == (200, "duplicate")
    event = WebhookEvent.objects.get()
    assert (event.event_id, event.deliveries, event.applied) == ("evt_twice", 2, True)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert op.evidence.filter(kind="webhook", to_status=S.SUCCEEDED).count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_fails_a_pending_payment_on_stripes_canceled_event_without_calling_again(
    acme, approver, providers, client, settings
):
    # Stripe ends a PaymentIntent as canceled, not requires_payment_method, once an attempt
    # fails past its confirmation limit or a processing one is cancelled: a final answer.
    op = async_payment(acme, approver)
    body = _stripe_event(op, event_id="evt_canceled", status="canceled")

    answer = _signed_stripe_post(client, settings, body)

    assert (answer.status_code, answer.json()["result"]) == (200, "applied")
    op.refresh_from_db()
    assert (op.status, op.error_code) == (S.FAILED, "provider_failed")
    assert op.provider_calls == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'{"type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_1"}}}}',
        b'{"id": null, "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_1"}}}}',
        b'{"id": "", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_1"}}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": ["pi_1"]}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": "op_1"}}}',
        b'{"id": "evt_' + b"1" * 120 + b'", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_1"}}}}',
        b'{"id": "evt_1", "type": "payment_intent.' + b"x" * 80 + b'", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_1"}}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_' + b"1" * 120 + b'"}}}',
    ],
    ids=["not-json", "not-an-object", "no-id", "null-id", "empty-id", "no-data",
         "object-not-an-object", "metadata-not-an-object", "id-too-long", "type-too-long",
         "object-id-too-long"],
)
def test_it_answers_400_and_stores_nothing_for_a_signed_body_that_is_not_an_event(
    client, settings, body
):
    # Signed by the provider, yet nothing we can deduplicate or store: an event without an
    # id, stored once, would make every later id-less event its "duplicate"; a value wider
    # than its column would fail the INSERT with a 500, which the provider retries for days.
    response = _signed_stripe_post(client, settings, body)
    assert response.status_code == 400
    assert WebhookEvent.objects.count() == 0


@pytest.mark.django_db
def test_it_answers_404_to_an_unknown_provider_and_405_to_a_get(client, settings):
    from operations.providers.signing import hmac_signature_header

    body = b'{"id": "evt_1", "type": "deal.updated", "created": 1, "data": {"object": {}}}'
    unknown = client.post("/webhooks/bank/", data=body, content_type="application/json",
                          HTTP_X_CRM_SIGNATURE=hmac_signature_header(
                              secret=settings.CRM_WEBHOOK_SECRET, body=body))
    assert unknown.status_code == 404 and "unknown provider 'bank'" in unknown.json()["error"]
    assert client.get("/webhooks/payments/").status_code == 405
    assert WebhookEvent.objects.count() == 0
