"""Provider events, from the failure cases of the design brief, broken on purpose against
PostgreSQL and the sandbox providers over real HTTP: an event delivered twice or out of
order, one about another object carrying the operation, one that arrives after a person
decided or while the call is still in flight, and bodies that are forged, malformed or not
events at all.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.models import Attempt, Operation, OperationStatus, WebhookEvent
from operations.sandbox.models import PaymentIntent
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import signed_in
from tests.operations.engine_helpers import (
    async_payment,
    authorized_payment,
    executing_in_flight,
    replaced_and_run,
)
from tests.operations.failure_helpers import payment_posts

S = OperationStatus


@pytest.mark.django_db(transaction=True)
def test_it_applies_a_webhook_once_however_often_it_arrives(
    acme, approver, providers, live_server
):
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_payment_settle

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
@pytest.mark.parametrize(("made", "held"), [
    (-timedelta(seconds=5), False),  # before the failure: only out of order
    (timedelta(minutes=10), True),  # after it: the payment was confirmed again
    (None, True),  # the provider did not say when: a person looks
])
def test_it_holds_a_payment_under_way_again_after_it_failed_unless_made_before_the_failure(
    acme, approver, providers, live_server, made, held
):
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_payment_settle

    op = async_payment(acme, approver)
    sandbox_payment_settle(payment_intent_id=op.external_id, status="failed")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert op.status == S.FAILED
    failed_at = WebhookEvent.objects.get(
        operation=op, event_type="payment_intent.payment_failed").provider_created_at
    result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_processing", event_type="payment_intent.processing", operation_id=op.id,
        external_id=op.external_id, status=CallOutcome.ACCEPTED,
        created_at=None if made is None else failed_at + made,
        data={"id": op.external_id, "status": "processing",
              "amount": op.payload["amount_minor"], "currency": op.payload["currency"].lower()}))
    op.refresh_from_db()
    assert op.status == S.FAILED
    if held:
        assert (result, message) == ("held", (
            f"held for review: the provider reports accepted ({op.external_id}); {op.id} "
            "stays failed, a person decides"))
        # No replacement pays a second time while this one may.
        assert replaced_and_run(op, approver) is None
    else:
        assert result == "ignored" and "not allowed (late or out of order)" in message
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


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
def test_it_holds_a_deal_event_while_the_lookup_left_several_deals_to_a_person(
    acme, operator, providers, live_server
):
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.models import Deal
    from operations.sandbox.selectors import sandbox_writes
    from operations.selectors import webhooks_held_for_review

    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    # The deal is made, its answer lost, and its deal.created event held back until later.
    sandbox_fault_set(provider="crm", kind="commit_then_drop", match=op.id, seconds=3)
    engine.operation_execute(operation_id=op.id)
    original = Deal.objects.get(agent_operation_id=op.id)
    # Someone else's integration created a second record carrying the same operation id.
    Deal.objects.create(id="deal_dup", name=original.name, amount_minor=original.amount_minor,
                        currency=original.currency, owner=original.owner,
                        agent_operation_id=op.id)
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.outcome == "inconclusive" and "data incident" in report.detail

    # The CRM's event for the first deal arrives now: it must not pick that deal.
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1

    op.refresh_from_db()
    assert (op.status, op.external_id, op.next_reconcile_at) == (S.UNKNOWN, "", None)
    event = WebhookEvent.objects.get(operation_id=op.id)
    assert event.external_id == original.id and event.needs_review and not event.applied
    assert list(webhooks_held_for_review(operation=op)) == [event]
    assert "several objects carry" in event.outcome
    assert op.evidence.filter(kind="webhook", summary__contains="held for review").count() == 1
    # Nothing is called on top while it waits: execute hands it to the operators' queue.
    engine.operation_execute(operation_id=op.id)
    assert Deal.objects.filter(agent_operation_id=op.id).count() == 2
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == 1

    # A person decides, and only then does the operation leave their queue.
    engine.operation_dispute(operation_id=op.id, actor=operator,
                             reason="two deals for one renewal: sales merges them")
    assert not webhooks_held_for_review(operation=op).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["crm.create_deal", "crm.update_deal"])
def test_it_never_holds_someone_elses_deal_change_against_the_operation_that_made_the_deal(
    acme, approver, operator, providers, live_server, action
):
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.models import Deal
    from operations.sandbox.selectors import sandbox_counts, sandbox_writes
    from operations.sandbox.services import sandbox_deal_update
    from operations.selectors import webhooks_held_for_review

    if action == "crm.create_deal":
        payload = {"name": "Renewal", "amount_minor": 100000, "currency": "EUR",
                   "owner": "dana"}
    else:
        # A deal made outside the console: the one operation recording it is this update.
        made = Deal.objects.create(name="Renewal", amount_minor=100000, currency="EUR",
                                   owner="dana")
        payload = {"target": made.id, "expected_version": 1, "patch": {"stage": "won"}}
    op = engine.operation_prepare(tenant=acme, action=action, payload=payload)
    if op.requires_approval:
        engine.operation_authorize(
            operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
            approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30))
    engine.operation_execute(operation_id=op.id)
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1  # this op's event
    op.refresh_from_db()
    deal = Deal.objects.get()
    assert (op.status, op.external_id) == (S.SUCCEEDED, deal.id)
    # An operator puts the effect on hold while sales checks it ...
    engine.operation_dispute(operation_id=op.id, actor=operator, reason="sales double-checks")
    # ... and sales, in the CRM itself, moves the deal on: a change no operation of ours made.
    sandbox_deal_update(deal=deal, expected_version=deal.version, patch={"stage": "lost"},
                        operation_id="")
    assert sandbox_webhooks_deliver(target_base_url=live_server.url) == 1  # deal.updated

    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == op.provider_calls == 1
    assert sandbox_counts()["deals"] == 1
    # The event reports someone else's edit, not an outcome of the operation that made or
    # changed the deal: never put before the operators as "the provider reports succeeded"
    # against it, but stored unlinked.
    edit = WebhookEvent.objects.order_by("id").last()
    assert not webhooks_held_for_review(operation=op).exists(), edit.outcome
    assert (edit.event_type, edit.operation_id, edit.applied, edit.needs_review) == (
        "deal.updated", None, False, False)
    op.refresh_from_db()
    assert op.status == S.DISPUTED
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert "Held for review" not in html


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
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_payment_settle

    op = async_payment(acme, approver)
    # (Failed on words alone is refused while the provider holds the payment.)
    engine.operation_resolve(operation_id=op.id, actor=operator, outcome=S.SUCCEEDED,
                             evidence_text="bank statement shows the debit",
                             reason="checked with treasury")
    sandbox_payment_settle(payment_intent_id=op.external_id, status="failed")
    sandbox_webhooks_deliver(target_base_url=live_server.url)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.resolved_manually
    event = WebhookEvent.objects.get(operation=op, event_type="payment_intent.payment_failed")
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
    from operations.sandbox.delivery import sandbox_webhooks_deliver
    from operations.sandbox.services import sandbox_payment_settle

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
def test_it_lands_the_answer_that_its_own_payments_webhook_overtook(
    acme, approver, providers, live_server, settings
):
    from operations.sandbox.delivery import sandbox_webhooks_deliver

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


def _signed_stripe_post(client, settings, body: bytes, *, header: str | None = None):
    from operations.providers.signing import stripe_signature_header

    signature = header if header is not None else stripe_signature_header(
        secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body)
    return client.post("/webhooks/payments/", data=body, content_type="application/json",
                       HTTP_STRIPE_SIGNATURE=signature)


def _signed_post(client, settings, provider: str, body: bytes):
    """`body` signed and sent as `provider` sends its events."""
    from operations.providers.signing import hmac_signature_header

    if provider == "payments":
        return _signed_stripe_post(client, settings, body)
    signature = hmac_signature_header(
        secret=getattr(settings, f"{provider.upper()}_WEBHOOK_SECRET"), body=body)
    header = {"crm": "HTTP_X_CRM_SIGNATURE", "mail": "HTTP_X_MAIL_SIGNATURE"}[provider]
    return client.post(f"/webhooks/{provider}/", data=body, content_type="application/json",
                       **{header: signature})


def _provider_event(provider: str, *, event_id: str, obj: dict) -> bytes:
    """An event of `provider`'s envelope whose data.object is `obj`."""
    event_type = {"payments": "payment_intent.succeeded", "crm": "deal.created",
                  "mail": "message.delivered"}[provider]
    return json.dumps({"id": event_id, "object": "event", "type": event_type,
                       "created": int(time.time()), "data": {"object": obj}}).encode()


def _unknown_op(acme, provider: str) -> Operation:
    """An operation of `provider` whose call's answer was lost: what an event settles."""
    from tests.operations.engine_helpers import make_unknown, prepared_payment

    if provider == "payments":
        return make_unknown(prepared_payment(acme))
    action, payload = {
        "crm": ("crm.create_deal", {"name": "Renewal", "amount_minor": 100000,
                                    "currency": "EUR", "owner": "dana"}),
        "mail": ("mail.send", {"to": "cfo@acme.test", "template": "receipt",
                               "params": {"invoice": "inv_42"}}),
    }[provider]
    return make_unknown(engine.operation_prepare(tenant=acme, action=action, payload=payload))


def _naming(provider: str, operation_id: object) -> dict:
    """The part of `provider`'s object that names the operation it is about."""
    return {"payments": {"metadata": {"operation_id": operation_id}},
            "crm": {"agent_operation_id": operation_id},
            "mail": {"operation_id": operation_id}}[provider]


def _stripe_event(op: Operation, *, event_id: str, status: str) -> bytes:
    """Stripe's event about the async payment's intent (async_payment's sum) now in `status`."""
    return json.dumps({
        "id": event_id, "object": "event", "type": f"payment_intent.{status}",
        "created": int(time.time()),
        "data": {"object": {"id": op.external_id, "status": status, "amount": 15_000_000,
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
        # Python's json reads these; PostgreSQL's text and jsonb refuse them.
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "amount": NaN}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "amount": 1e400}}}',
        b'{"id": "evt_1\\u0000", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1"}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "metadata": {"operation_id": "op_\\u0000"}}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"id": "pi_1", "currency": "\\ud800"}}}',
        b'{"id": "evt_1", "type": "payment_intent.succeeded", "created": 1, '
        b'"data": {"object": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}",
    ],
    ids=["not-json", "not-an-object", "no-id", "null-id", "empty-id", "no-data",
         "object-not-an-object", "metadata-not-an-object", "id-too-long", "type-too-long",
         "object-id-too-long", "nan", "infinite", "nul-in-id", "nul-in-metadata",
         "lone-surrogate", "nested-past-the-parser"],
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


@pytest.mark.django_db
@pytest.mark.parametrize("provider", ["payments", "crm", "mail"])
def test_it_answers_400_to_a_signed_event_nested_deeper_than_the_limit(settings, provider):
    from django.test import Client

    limit = 64  # signing.EVENT_DEPTH_MAX; Stripe's events nest about 6 levels
    # json.loads reads ~1000 levels, but storing the event's facts (json.dumps, further down
    # the stack) overflows somewhat below that: a 500, which the provider retries for days.
    client = Client(raise_request_exception=False)
    stored = {"payments": "amount", "crm": "name", "mail": "status"}[provider]
    answers = {}
    for depth in [limit, limit + 1, *range(700, 1000, 2)]:
        # The event, data and object, then lists down to `depth` levels in a stored fact
        # (spliced into the text: too deep for this test's own stack to encode).
        body = _provider_event(provider, event_id=f"evt_{depth}",
                               obj={"id": "obj_1", stored: "NESTED"}).replace(
            b'"NESTED"', b"[" * (depth - 3) + b"]" * (depth - 3))
        answers[depth] = _signed_post(client, settings, provider, body).status_code

    assert answers.pop(limit) == 200  # the limit itself is an event
    assert set(answers.values()) == {400}, {d: s for d, s in answers.items() if s != 400}
    assert list(WebhookEvent.objects.values_list("event_id", flat=True)) == [f"evt_{limit}"]


@pytest.mark.django_db(transaction=True)
def test_it_applies_an_event_delivered_concurrently_once_and_counts_every_delivery(
    acme, approver, providers, settings
):
    import threading

    from django.db import connection
    from django.test import Client

    op = async_payment(acme, approver)
    body = _stripe_event(op, event_id="evt_raced", status="succeeded")
    barrier = threading.Barrier(6)
    answers: list[tuple[int, str]] = []

    def deliver() -> None:
        try:
            barrier.wait(timeout=10)
            response = _signed_stripe_post(Client(), settings, body)
            answers.append((response.status_code, response.json()["result"]))
        finally:
            connection.close()  # each thread has its own connection

    threads = [threading.Thread(target=deliver) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    # The copies wait on the unique index and count as duplicates, answered 200 all.
    assert sorted(answers) == [(200, "applied")] + [(200, "duplicate")] * 5
    event = WebhookEvent.objects.get()
    assert (event.deliveries, event.applied) == (6, True)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert op.evidence.filter(kind="webhook", to_status=S.SUCCEEDED).count() == 1
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("provider", ["payments", "crm", "mail"])
@pytest.mark.parametrize("object_id", [None, "", "  ", 42, "absent"])
def test_it_answers_400_to_a_signed_event_whose_object_has_no_id_and_settles_nothing(
    client, settings, acme, provider, object_id
):
    # The object's id tells the operation's own object from a second one carrying its id:
    # a null read as the object "None", or none at all, would settle the operation with an
    # object no later event can be told apart from.
    op = _unknown_op(acme, provider)
    obj = {"status": "succeeded", **_naming(provider, op.id)}
    if object_id != "absent":
        obj["id"] = object_id

    response = _signed_post(client, settings, provider,
                            _provider_event(provider, event_id="evt_no_object", obj=obj))

    assert response.status_code == 400
    assert "names no object id" in response.json()["error"]
    assert WebhookEvent.objects.count() == 0
    op.refresh_from_db()
    assert (op.status, op.external_id) == (S.UNKNOWN, "")
    assert not op.evidence.filter(kind="webhook").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("provider", ["payments", "crm", "mail"])
def test_it_reads_a_null_operation_id_as_none_and_refuses_one_that_is_not_text(
    settings, provider
):
    from operations.providers import webhook_verifier_for
    from operations.providers.base import WebhookSignatureError
    from operations.providers.signing import hmac_signature_header, stripe_signature_header

    def parsed(operation_id: object):
        body = _provider_event(provider, event_id="evt_1",
                               obj={"id": "obj_1", **_naming(provider, operation_id)})
        if provider == "payments":
            headers = {"Stripe-Signature": stripe_signature_header(
                secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body)}
        else:
            headers = {f"X-{provider.upper()}-Signature": hmac_signature_header(
                secret=getattr(settings, f"{provider.upper()}_WEBHOOK_SECRET"), body=body)}
        return webhook_verifier_for(provider).parse_webhook(headers=headers, body=body)

    # An object made outside the console names no operation: unset, the field is null.
    assert (parsed(None).operation_id, parsed(None).external_id) == ("", "obj_1")
    assert parsed("op_1").operation_id == "op_1"
    with pytest.raises(WebhookSignatureError, match="operation id that is not text"):
        parsed(42)


@pytest.mark.django_db
@pytest.mark.parametrize(("event_type", "result", "status"), [
    ("deal.created", "applied", S.SUCCEEDED),  # what the CRM sends when a deal is made
    ("deal.deleted", "ignored", S.UNKNOWN),  # the deal gone: no report that ours was made
    ("deal.exported", "ignored", S.UNKNOWN),  # a type its contract never sends
])
def test_it_settles_a_crm_operation_only_on_the_deal_events_its_contract_sends(
    client, settings, acme, event_type, result, status
):
    op = _unknown_op(acme, "crm")
    body = json.dumps({
        "id": "evt_deal", "object": "event", "type": event_type, "created": int(time.time()),
        "data": {"object": {"id": "deal_1", **_naming("crm", op.id)}},
    }).encode()

    response = _signed_post(client, settings, "crm", body)

    assert (response.status_code, response.json()["result"]) == (200, result)
    op.refresh_from_db()
    assert op.status == status
    # Stored and on the timeline either way, so a person sees what the CRM said.
    event = WebhookEvent.objects.get(event_id="evt_deal")
    assert event.applied is (result == "applied")
    assert op.evidence.filter(kind="webhook").exists()
    if result == "ignored":
        assert event.outcome == f"ignored: {event_type} carries no status"
        assert (event.reported_status, op.external_id) == ("", "")


def _payment_event(op: Operation, *, event_id: str, intent: str, status: str = "succeeded",
                   created: int | None = None) -> bytes:
    """Stripe's event about PaymentIntent `intent` of `op`'s sum, carrying `op`'s id."""
    return json.dumps({
        "id": event_id, "object": "event", "type": f"payment_intent.{status}",
        "created": int(time.time()) if created is None else created,
        "data": {"object": {"id": intent, "status": status,
                            "amount": op.payload["amount_minor"],
                            "currency": op.payload["currency"].lower(),
                            "metadata": {"operation_id": op.id}}},
    }).encode()


@pytest.mark.django_db
@pytest.mark.parametrize("by_person", [True, False])
def test_it_records_the_first_payment_reported_on_a_success_without_one_and_holds_a_second(
    client, settings, acme, operator, by_person
):
    from operations.selectors import dashboard_metrics, webhooks_held_for_review

    op = _unknown_op(acme, "payments")
    if by_person:
        # Resolved by evidence text alone: no provider reference, so no object recorded.
        engine.operation_resolve(operation_id=op.id, actor=operator, outcome=S.SUCCEEDED,
                                 evidence_text="the debit is on the bank statement",
                                 reason="checked with treasury")
    else:
        # Settled by the engine on an answer that named no object.
        Operation.objects.filter(id=op.id).update(
            status=S.SUCCEEDED, unknown_since=None, error_code="")

    first, second = (
        _signed_stripe_post(client, settings, _payment_event(
            op, event_id=f"evt_{intent}", intent=intent)).json()
        for intent in ("pi_first", "pi_second")
    )

    op.refresh_from_db()
    assert (op.status, op.resolved_manually, op.external_id) == (
        S.SUCCEEDED, by_person, "pi_first")
    settled = "succeeded by an operator's decision" if by_person else "already succeeded"
    assert first == {"result": "ignored",
                     "detail": f"ignored: {op.id} is {settled}; it records pi_first as its object"}
    assert second == {"result": "held", "detail": (
        f"held for review: the provider reports a second effect, pi_second (succeeded), "
        f"carrying {op.id}" + (", which records pi_first; a person decides" if not by_person
                               else f"; {op.id} stays succeeded by an operator's decision"))}
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_pi_second"]
    assert dashboard_metrics(operator)["held_for_review"] == 1
    recorded = WebhookEvent.objects.get(event_id="evt_pi_first")
    assert not recorded.applied and not recorded.needs_review
    assert op.evidence.filter(
        kind="webhook", from_status=S.SUCCEEDED, to_status=S.SUCCEEDED,
        summary__contains="records pi_first as its object").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("decision", "recorded", "intent", "said"), [
    # Its own payment's "processing", delivered again after a person confirmed the success.
    (S.SUCCEEDED, "pi_1", "pi_1", "ignored: {op} is succeeded by an operator's decision"),
    # The same, the person having gone by evidence text alone: it names the payment now.
    (S.SUCCEEDED, "", "pi_1", "ignored: {op} is succeeded by an operator's decision; it "
     "records pi_1 as its object"),
    (S.SUCCEEDED, "pi_1", "pi_other", "held for review: the provider reports a second "
     "effect, pi_other (accepted), carrying {op}; {op} stays succeeded by an operator's "
     "decision"),
    # A disputed operation is a person's open question: any other outcome is theirs to see.
    (S.DISPUTED, "pi_1", "pi_1", "held for review: the provider reports accepted (pi_1); {op} "
     "stays disputed by an operator's decision"),
], ids=["own-payment", "own-payment-unrecorded", "another-payment", "disputed"])
def test_it_tells_a_processing_event_trailing_a_persons_success_from_another_payment(
    client, settings, acme, operator, decision, recorded, intent, said
):
    from operations.selectors import dashboard_metrics, webhooks_held_for_review
    from tests.operations.engine_helpers import prepared_payment

    op = prepared_payment(acme)
    Operation.objects.filter(id=op.id).update(status=S.ACCEPTED, external_id=recorded)
    if decision == S.SUCCEEDED:
        op = engine.operation_resolve(operation_id=op.id, actor=operator, outcome=S.SUCCEEDED,
                                      evidence_text="credit confirmed by the beneficiary",
                                      reason="checked")
    else:
        op = engine.operation_dispute(operation_id=op.id, actor=operator,
                                      reason="the beneficiary disputes the invoice")
    # Made by the provider before the person decided: a retried delivery.
    made = int((op.status_changed_at - timedelta(minutes=10)).timestamp())

    answer = _signed_stripe_post(client, settings, _payment_event(
        op, event_id="evt_processing", intent=intent, status="processing", created=made)).json()

    held = said.startswith("held")
    assert answer == {"result": "held" if held else "ignored", "detail": said.format(op=op.id)}
    op.refresh_from_db()
    assert (op.status, op.external_id) == (decision, "pi_1")
    event = WebhookEvent.objects.get(event_id="evt_processing")
    assert (event.applied, event.needs_review) == (False, held)
    assert list(webhooks_held_for_review(operation=op)) == ([event] if held else [])
    assert dashboard_metrics(operator)["held_for_review"] == int(held)
    summary = f"webhook payment_intent.processing {answer['detail']}"
    assert op.evidence.filter(kind="webhook", summary=summary).count() == 1
