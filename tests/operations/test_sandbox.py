from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from operations.providers import adapter_for, webhook_verifier_for
from operations.providers.base import CallOutcome, LookupOutcome, request_fingerprint
from operations.sandbox import services
from operations.sandbox.delivery import sandbox_webhooks_deliver
from operations.sandbox.models import (
    Deal,
    IdempotencyRecord,
    Message,
    PaymentIntent,
    SandboxFault,
)
from operations.sandbox.selectors import (
    sandbox_counts,
    sandbox_requests,
    sandbox_writes,
)
from operations.sandbox.services import (
    SandboxStateError,
    fault_seconds,
    sandbox_fault_clear,
    sandbox_fault_set,
    sandbox_message_deliver,
    sandbox_payment_settle,
)
from tests.helpers import Background, wait_for
from tests.operations.providers_support import payment, snapshot

PAYMENTS = adapter_for("payments.create")


class Receiver:
    """A stand-in for the console's webhook endpoint that keeps what it was sent."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.status = 200  # what the console answers each delivery
        self.delay = 0.0  # how long it takes to answer, as a slow console would
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.received.append((self.path, dict(self.headers.items()), body))
                time.sleep(outer.delay)
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def facts(self, provider: str) -> list:
        verifier = webhook_verifier_for(provider)
        return [verifier.parse_webhook(headers=headers, body=body)
                for path, headers, body in self.received if path == f"/webhooks/{provider}/"]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def test_it_refuses_a_wrong_key_and_stamps_every_answer_with_a_request_id(sandbox):
    wrong = httpx.post(f"{sandbox}/payments/v1/payment_intents",
                       headers={"Authorization": "Bearer sk_wrong"},
                       data={"amount": "100", "currency": "eur"})
    missing = httpx.get(f"{sandbox}/crm/deals/deal_nope",
                        headers={"Authorization": "Bearer crm_sandbox_key"})

    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "resource_missing"
    assert wrong.headers["Request-Id"].startswith("req_")
    assert missing.headers["Request-Id"] != wrong.headers["Request-Id"]
    assert PaymentIntent.objects.count() == 0
    logged = list(sandbox_requests().values_list("provider", "method", "response_status"))
    assert logged == [("payments", "POST", 401), ("crm", "GET", 404)]


def test_it_answers_409_while_the_same_key_is_in_flight(sandbox):
    op = payment()
    params = PAYMENTS.params(op)
    IdempotencyRecord.objects.create(
        key=op.idempotency_key,
        fingerprint=request_fingerprint(params), created_at=timezone.now(),
    )

    result = PAYMENTS.call(op)

    assert (result.outcome, result.error_class, result.http_status) == (
        CallOutcome.UNKNOWN, "concurrent_request", 409
    )
    assert PaymentIntent.objects.count() == 0


def test_it_answers_409_to_a_same_key_request_while_a_slow_one_holds_the_key(
    sandbox, settings
):
    # Stripe's in-flight answer, end to end: `delay` stalls before the key is claimed (a
    # retry meanwhile runs), `slow` after, so the request the retry meets holds the key.
    settings.PROVIDER_TIMEOUT_SECONDS = 5
    op = payment()
    sandbox_fault_set(provider="payments", kind="slow", match=op.id, seconds=1.5)

    first = Background(lambda: PAYMENTS.call(op))
    wait_for(lambda: IdempotencyRecord.objects.filter(key=op.idempotency_key).exists(),
             what="the first request to claim its key")
    second = PAYMENTS.call(op)
    made = first.join()
    third = PAYMENTS.call(op)

    assert (made.outcome, made.http_status) == (CallOutcome.SUCCEEDED, 200)
    assert (second.outcome, second.error_class, second.http_status) == (
        CallOutcome.UNKNOWN, "concurrent_request", 409)
    assert (third.external_id, third.http_status) == (made.external_id, 200)
    assert PaymentIntent.objects.count() == 1 and IdempotencyRecord.objects.count() == 1
    assert list(sandbox_requests(idempotency_key=op.idempotency_key).values_list(
        "response_status", flat=True)) == [200, 409, 200]


def test_it_describes_every_fault_kind_to_the_operator(db, monkeypatch):
    from operations.sandbox.management.commands.sandbox_fault import Command

    monkeypatch.setenv("COLUMNS", "10000")  # one line each: nothing wrapped mid-word
    described = Command().create_parser("manage.py", "sandbox_fault").format_help()

    for kind, label in SandboxFault.kind.field.choices:
        assert f"{kind}: {label}" in described


def test_it_takes_each_fault_once_and_only_for_its_operation(sandbox):
    target, bystander = payment(), payment()
    sandbox_fault_set(provider="payments", kind="http_500", match=target.id, times=2)

    assert PAYMENTS.call(bystander).outcome is CallOutcome.SUCCEEDED
    assert PAYMENTS.call(target).error_class == "http_5xx"
    assert PAYMENTS.call(target).error_class == "http_5xx"
    assert PAYMENTS.call(target).outcome is CallOutcome.SUCCEEDED

    assert PaymentIntent.objects.count() == 2
    statuses = list(sandbox_requests(operation_id=target.id).values_list(
        "response_status", flat=True))
    assert statuses == [500, 500, 200]
    assert SandboxFault.objects.get().remaining == 0


def test_it_settles_a_processing_payment_and_delivers_signed_webhooks(
    sandbox, settings, receiver
):
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1_000
    op = payment(amount_minor=5_000)
    accepted = PAYMENTS.call(op)
    assert accepted.outcome is CallOutcome.ACCEPTED
    assert accepted.result["status"] == "processing"

    sandbox_payment_settle(payment_intent_id=accepted.external_id)
    with pytest.raises(SandboxStateError):
        sandbox_payment_settle(payment_intent_id=accepted.external_id)
    sandbox_fault_set(provider="payments", kind="duplicate_webhook")
    sent = sandbox_webhooks_deliver(target_base_url=receiver.url)

    facts = receiver.facts("payments")
    assert sent == 3
    assert [f.event_type for f in facts] == [
        "payment_intent.processing", "payment_intent.processing", "payment_intent.succeeded"
    ]
    assert facts[0].event_id == facts[1].event_id
    assert {f.operation_id for f in facts} == {op.id}
    assert facts[-1].status is CallOutcome.SUCCEEDED
    assert PAYMENTS.lookup(op).status is CallOutcome.SUCCEEDED
    assert sandbox_counts()["payment_intents"] == 1
    assert sandbox_counts()["webhooks_undelivered"] == 0
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 0


def test_it_holds_back_and_reorders_webhooks(sandbox, settings, receiver):
    first, second = payment(), payment()
    PAYMENTS.call(first)
    PAYMENTS.call(second)
    sandbox_fault_set(provider="payments", kind="out_of_order_webhooks")
    sandbox_fault_set(provider="payments", kind="late_webhook", match=second.id)

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 1
    assert [f.operation_id for f in receiver.facts("payments")] == [first.id]
    PAYMENTS.call(payment())  # a later event overtakes the held one
    sandbox_fault_set(provider="payments", kind="out_of_order_webhooks")
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2

    order = [f.operation_id for f in receiver.facts("payments")]
    assert order[0] == first.id and order[2] == second.id
    assert len(order) == 3 and PaymentIntent.objects.count() == 3


def test_it_spends_a_reordering_only_on_a_round_it_can_reorder(sandbox, receiver):
    PAYMENTS.call(payment())  # one event in the round: nothing to reorder
    sandbox_fault_set(provider="payments", kind="out_of_order_webhooks")
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 1
    assert SandboxFault.objects.get().remaining == 1
    slow = payment(amount_minor=15_000_000)  # processing now, succeeded when settled
    accepted = PAYMENTS.call(slow)
    sandbox_payment_settle(payment_intent_id=accepted.external_id)
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2
    assert [f.event_type for f in receiver.facts("payments")[1:]] == [
        "payment_intent.succeeded", "payment_intent.processing"
    ]
    assert SandboxFault.objects.get().remaining == 0


def test_it_switches_faults_from_the_command_line(db):
    call_command("sandbox_fault", "payments", "commit_then_drop", "--match", "op_x",
                 "--times", "2", "--seconds", "3")

    fault = SandboxFault.objects.get()
    assert (fault.provider, fault.kind, fault.match, fault.remaining, fault.params) == (
        "payments", "commit_then_drop", "op_x", 2, {"seconds": 3.0}
    )
    call_command("sandbox_fault", "payments", "http_500", "--times", "5")
    call_command("sandbox_fault", "payments", "clear", "--kind", "http_500")
    assert list(SandboxFault.objects.values_list("kind", flat=True)) == ["commit_then_drop"]
    call_command("sandbox_fault", "payments", "clear")
    assert SandboxFault.objects.count() == 0
    # A standing condition says so, not "x1": it ignores --times.
    out = io.StringIO()
    call_command("sandbox_fault", "payments", "search_lag", "--seconds", "90", stdout=out)
    assert out.getvalue().rstrip().endswith("payments:search_lag[*] until cleared")
    call_command("sandbox_fault", "payments", "clear")
    with pytest.raises(ValueError):
        sandbox_fault_set(provider="payments", kind="meteor_strike")
    assert sandbox_fault_clear() == 0


def test_it_keeps_search_lag_on_until_cleared(sandbox):
    sandbox_fault_set(provider="payments", kind="search_lag", seconds=60)
    op = payment()
    PAYMENTS.call(op)
    search = f"{sandbox}/payments/v1/payment_intents/search"
    headers = {"Authorization": "Bearer sk_test_sandbox"}
    query = {"query": f"metadata['operation_id']:'{op.id}'"}

    for _ in range(2):
        assert httpx.get(search, params=query, headers=headers).json()["data"] == []
    sandbox_fault_clear(provider="payments", kind="search_lag")
    found = httpx.get(search, params=query, headers=headers).json()["data"]

    assert [intent["metadata"]["operation_id"] for intent in found] == [op.id]
    bad = httpx.get(search, params={"query": "amount>0"}, headers=headers)
    assert bad.status_code == 400 and json.loads(bad.content)["error"]["param"] == "query"


def test_it_forgets_a_payment_key_after_24_hours_as_stripe_does(sandbox):
    op = payment()
    first = PAYMENTS.call(op)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=25))

    again = PAYMENTS.call(op)

    assert again.outcome is CallOutcome.SUCCEEDED
    assert again.external_id != first.external_id
    assert PaymentIntent.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 1


def test_it_forgets_a_mail_key_after_the_7_days_the_mail_contract_declares(sandbox):
    # The engine's safety past the key's retention rests on the contract being true: a
    # sandbox that deduplicated forever would show a same-key send after it as harmless.
    adapter = adapter_for("mail.send")
    assert services.MAIL_KEY_RETENTION == adapter.contract.key_retention == timedelta(days=7)
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {}})
    first = adapter.call(op)
    Message.objects.filter(pk=first.external_id).update(
        created_at=timezone.now() - timedelta(days=6, hours=23))
    assert adapter.call(op).external_id == first.external_id  # still kept
    Message.objects.filter(pk=first.external_id).update(
        created_at=timezone.now() - timedelta(days=8))
    # Asked by the forgotten key, the provider has nothing: which proves nothing.
    forgotten = adapter.lookup(replace(op, key_first_sent_at=timezone.now() - timedelta(days=8)))
    assert (forgotten.outcome, forgotten.reason) == (
        LookupOutcome.INCONCLUSIVE, "key retention window passed")

    again = adapter.call(op)

    assert again.outcome is CallOutcome.ACCEPTED and again.external_id != first.external_id
    assert Message.objects.count() == 2
    # The key now names the new message only; the old one is still there by its id.
    assert adapter.lookup(op).external_id == again.external_id
    assert adapter.retrieve(first.external_id).outcome is LookupOutcome.FOUND


def test_it_refuses_overlong_values_with_400_not_500(sandbox):
    result = PAYMENTS.call(payment(idempotency_key="k" * 256))

    assert (result.outcome, result.error_class, result.http_status) == (
        CallOutcome.FAILED, "validation", 400
    )
    assert "Idempotency-Key" in result.error_message
    assert PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_settles_and_tells_the_console_on_the_beat_as_a_bank_would(
    sandbox, settings, live_server, acme, approver
):
    from operations.models import Operation, WebhookEvent
    from operations.sandbox.models import Message
    from operations.sandbox.tasks import sandbox_tick
    from tests.operations.engine_helpers import async_payment

    assert settings.CELERY_BEAT_SCHEDULE["sandbox-tick"]["task"] == "sandbox.tick"
    settings.SANDBOX_WEBHOOK_TARGET = live_server.url
    settings.SANDBOX_SETTLE_SECONDS = 10
    op = async_payment(acme, approver)
    mail = adapter_for("mail.send").call(snapshot(
        "mail.send", {"to": "cfo@acme.test", "template": "invoice_paid", "params": {}}))
    assert Operation.objects.get(id=op.id).status == "accepted"

    sandbox_tick()  # too early: the bank has not settled yet; the processing event goes out
    assert Operation.objects.get(id=op.id).status == "accepted"
    PaymentIntent.objects.update(created_at=timezone.now() - timedelta(seconds=11))
    Message.objects.update(created_at=timezone.now() - timedelta(seconds=11))
    sandbox_tick()
    sandbox_tick()  # twice: nothing more happens

    assert Operation.objects.get(id=op.id).status == "succeeded"
    assert PaymentIntent.objects.get().status == "succeeded"
    assert Message.objects.get(pk=mail.external_id).status == "delivered"
    assert WebhookEvent.objects.filter(event_type="payment_intent.succeeded").count() == 1
    assert sandbox_counts()["webhooks_undelivered"] == 0
    assert sandbox_counts()["payment_intents"] == 1


@pytest.mark.django_db(transaction=True)
def test_it_does_nothing_on_a_tick_that_reaches_a_worker_with_the_sandbox_off(
    sandbox, settings, live_server, acme, approver
):
    """A tick queued before a deployment moved to the real provider signed the sandbox's
    events with the real provider's secret, and the console applied them as its facts."""
    from operations.models import Operation, WebhookEvent
    from operations.sandbox.models import SandboxWebhook
    from operations.sandbox.tasks import sandbox_tick
    from tests.operations.engine_helpers import async_payment

    op = async_payment(acme, approver)  # accepted: the sandbox's payment is `processing`
    PaymentIntent.objects.update(created_at=timezone.now() - timedelta(hours=1))
    undelivered = SandboxWebhook.objects.filter(delivered_at__isnull=True).count()
    assert undelivered
    settings.SANDBOX_ENABLED = False
    settings.PAYMENTS_WEBHOOK_SECRET = "whsec_the_real_providers_secret"
    settings.SANDBOX_WEBHOOK_TARGET = live_server.url

    assert sandbox_tick() == {}

    assert WebhookEvent.objects.count() == 0
    assert Operation.objects.get(id=op.id).status == "accepted"
    assert SandboxWebhook.objects.filter(delivered_at__isnull=True).count() == undelivered
    assert PaymentIntent.objects.get().status == "processing"


def test_it_refuses_a_fault_that_could_never_fire(db):
    # A fault that silently never fires would let a test pass without its failure happening.
    for wrong in ({"provider": "sms"}, {"times": 0}):
        with pytest.raises(ValueError):
            sandbox_fault_set(**{"provider": "payments", "kind": "http_500", **wrong})
    with pytest.raises(CommandError):
        call_command("sandbox_fault", "payments", "http_500", "--times", "0")

    assert sandbox_fault_set(provider="payments", kind="http_500", match="").match == "*"
    assert SandboxFault.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("provider", "kind"), [
    ("crm", "search_lag"), ("mail", "search_lag"),  # only payments has a search
    ("crm", "slow"), ("mail", "slow"),  # only payments holds a key while a request runs
    ("crm", "http_500_kept"), ("mail", "http_500_kept"),  # only payments keeps answers by key
    ("crm", "card_declined"), ("mail", "requires_action"),  # only payments takes cards
])
def test_it_refuses_a_payments_fault_for_a_provider_that_cannot_carry_it_out(provider, kind):
    # Taken, it would never fire, or fire as a plain 500: a test would pass without its
    # failure happening.
    with pytest.raises(ValueError, match=f"^{kind} is a payments fault: only "):
        sandbox_fault_set(provider=provider, kind=kind)
    with pytest.raises(CommandError, match=f"{kind} is a payments fault"):
        call_command("sandbox_fault", provider, kind, stdout=io.StringIO())

    assert not SandboxFault.objects.exists()
    assert sandbox_fault_set(provider="payments", kind=kind).provider == "payments"


def test_it_aims_a_fault_at_an_idempotency_key(sandbox):
    # "Per request or per key": a key as long as the provider takes one (255).
    op, bystander = payment(idempotency_key=f"idem-{'k' * 250}"), payment()
    sandbox_fault_set(provider="payments", kind="http_500", match=op.idempotency_key)
    mail = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                  "params": {}})
    sandbox_fault_set(provider="mail", kind="http_500", match=mail.idempotency_key)

    assert PAYMENTS.call(bystander).outcome is CallOutcome.SUCCEEDED
    refused = PAYMENTS.call(op)
    # A lookup by the key, before any send carried it, is aimed at as well.
    asked = adapter_for("mail.send").lookup(mail)

    assert (refused.outcome, refused.http_status) == (CallOutcome.UNKNOWN, 500)
    assert (asked.outcome, asked.http_status) == (LookupOutcome.INCONCLUSIVE, 500)
    assert PaymentIntent.objects.count() == 1 and Message.objects.count() == 0
    assert list(sandbox_requests(idempotency_key=op.idempotency_key).values_list(
        "method", "response_status")) == [("POST", 500)]
    assert not SandboxFault.objects.filter(remaining__gt=0).exists()


def test_it_aims_webhook_faults_and_search_lag_at_an_idempotency_key(
    sandbox, settings, receiver
):
    # An event or a search carries no key: a fault aimed at one reaches those of the
    # operation whose writes carried it. Taken and left unfired, a test would pass without
    # its failure happening.
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1_000
    late, twice, swapped = payment(500), payment(500), payment(5_000)
    bystander = payment(500)
    PAYMENTS.call(late)
    PAYMENTS.call(twice)
    intent = PAYMENTS.call(swapped).external_id
    PAYMENTS.call(bystander)
    sandbox_payment_settle(payment_intent_id=intent)
    for kind, op in [("late_webhook", late), ("duplicate_webhook", twice),
                     ("out_of_order_webhooks", swapped)]:
        sandbox_fault_set(provider="payments", kind=kind, match=op.idempotency_key)
    sandbox_fault_set(provider="payments", kind="search_lag", match=late.idempotency_key,
                      seconds=60)

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 5

    assert [(f.operation_id, f.event_type) for f in receiver.facts("payments")] == [
        (twice.id, "payment_intent.succeeded"), (twice.id, "payment_intent.succeeded"),
        (swapped.id, "payment_intent.succeeded"), (bystander.id, "payment_intent.succeeded"),
        (swapped.id, "payment_intent.processing"),
    ]
    assert list(SandboxFault.objects.exclude(kind="search_lag").values_list(
        "remaining", flat=True)) == [0, 0, 0]
    search = f"{sandbox}/payments/v1/payment_intents/search"
    headers = {"Authorization": "Bearer sk_test_sandbox"}

    def found(op) -> list[str]:
        query = {"query": f"metadata['operation_id']:'{op.id}'"}
        answer = httpx.get(search, params=query, headers=headers).json()["data"]
        return [each["metadata"]["operation_id"] for each in answer]

    assert (found(late), found(bystander)) == ([], [bystander.id])


def test_it_clears_only_the_faults_it_is_told_to(db):
    sandbox_fault_set(provider="payments", kind="http_500")
    sandbox_fault_set(provider="payments", kind="http_500", match="op_x")
    sandbox_fault_set(provider="crm", kind="http_500")

    call_command("sandbox_fault", "payments", "clear", "--match", "op_x")
    assert sorted(SandboxFault.objects.values_list("provider", "match")) == [
        ("crm", "*"), ("payments", "*")
    ]
    call_command("sandbox_fault", "crm", "clear")
    assert list(SandboxFault.objects.values_list("provider", "match")) == [("payments", "*")]


def test_it_keeps_a_fault_to_its_own_provider(sandbox):
    sandbox_fault_set(provider="payments", kind="http_500")

    deal = adapter_for("crm.create_deal").call(snapshot("crm.create_deal", {
        "name": "Acme", "amount_minor": 100, "currency": "EUR", "owner": "dana"}))

    assert deal.outcome is CallOutcome.SUCCEEDED
    assert SandboxFault.objects.get().remaining == 1
    assert PAYMENTS.call(payment()).error_class == "http_5xx"


def test_it_takes_the_fault_aimed_at_the_operation_before_a_blanket_one(sandbox):
    op, bystander = payment(), payment()
    sandbox_fault_set(provider="payments", kind="http_500")
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)

    assert PAYMENTS.call(op).error_class == "validation"
    assert PAYMENTS.call(op).error_class == "http_5xx"
    assert PAYMENTS.call(bystander).outcome is CallOutcome.SUCCEEDED
    assert PaymentIntent.objects.count() == 1


def test_it_never_takes_a_fault_another_request_took_meanwhile(db, monkeypatch):
    fault = sandbox_fault_set(provider="payments", kind="http_500")
    # This request read the fault while it was left; a concurrent one took it since.
    monkeypatch.setattr(services, "sandbox_faults_matching", lambda **_: [fault])
    SandboxFault.objects.update(remaining=0)

    assert services.sandbox_fault_take(provider="payments", kinds=["http_500"]) is None
    assert SandboxFault.objects.get().remaining == 0


def test_it_leaves_a_write_fault_to_the_write(sandbox):
    op = payment()
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)

    assert PAYMENTS.lookup(op).outcome is LookupOutcome.ABSENT  # a read takes no write fault
    assert PAYMENTS.call(op).error_class == "validation"
    assert PaymentIntent.objects.count() == 0


def test_it_answers_500_after_commit_only_when_something_was_committed(sandbox):
    sandbox_fault_set(provider="crm", kind="http_500_after_commit")

    refused = httpx.post(f"{sandbox}/crm/deals", json={"name": "", "amount_minor": 100,
                                                       "currency": "EUR"},
                         headers={"Authorization": "Bearer crm_sandbox_key"})

    # Nothing was saved, so the refusal stands: a 500 would make a definite failure unknown.
    assert refused.status_code == 400
    assert Deal.objects.count() == 0


def test_it_aims_faults_at_an_operations_search_and_mail_by_its_id(sandbox):
    op = payment()
    mail = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                  "params": {}})
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    sandbox_fault_set(provider="mail", kind="http_500", match=mail.id)

    search = PAYMENTS.lookup(op)
    sent = adapter_for("mail.send").call(mail)

    assert (search.outcome, search.http_status) == (LookupOutcome.INCONCLUSIVE, 500)
    assert sent.error_class == "http_5xx" and Message.objects.count() == 0
    assert list(sandbox_requests(operation_id=op.id).values_list("method", "response_status")) \
        == [("GET", 500)]
    assert list(sandbox_requests(operation_id=mail.id).values_list("method", "response_status")) \
        == [("POST", 500)]


@pytest.mark.parametrize("lookup", ["mail_by_key", "mail_by_id", "payment_by_id",
                                    "deal_by_id_unapplied"])
def test_it_aims_a_fault_at_an_operations_lookups_by_id_and_by_key(sandbox, lookup):
    # A read names no operation: the object it reads does, or the writes that reached it
    # (an update whose PATCH got a 500 is not among the deal's applied_operation_ids).
    if lookup.startswith("mail"):
        adapter = adapter_for("mail.send")
        op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                    "params": {}})
    elif lookup == "payment_by_id":
        adapter, op = PAYMENTS, payment()
    else:
        deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
        adapter = adapter_for("crm.update_deal")
        op = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1,
                                          "patch": {"stage": "won"}})
        sandbox_fault_set(provider="crm", kind="http_500", match=op.id)
    sent = adapter.call(op)
    if lookup.endswith("by_id"):
        op = replace(op, external_id=sent.external_id)
    provider = adapter.contract.provider
    sandbox_fault_set(provider=provider, kind="http_500", match=op.id)

    found = adapter.lookup(op)

    assert (found.outcome, found.http_status) == (LookupOutcome.INCONCLUSIVE, 500)
    assert SandboxFault.objects.filter(remaining__gt=0).count() == 0  # none left for a write
    assert list(sandbox_requests(provider=provider, method="GET").values_list(
        "operation_id", "response_status")) == [(op.id, 500)]
    assert len(sandbox_writes(provider=provider, operation_id=op.id)) == 1
    counts = sandbox_counts()
    assert (counts["payment_intents"], counts["messages"], counts["deals"]) == {
        "mail_by_key": (0, 1, 0), "mail_by_id": (0, 1, 0), "payment_by_id": (1, 0, 0),
        "deal_by_id_unapplied": (0, 0, 1)}[lookup]
    assert all(not deal.applied_operation_ids for deal in Deal.objects.all())


def test_it_stalls_past_the_clients_timeout_unless_told_how_long(settings):
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0

    assert fault_seconds(SandboxFault(kind="commit_then_drop", params={})) > 1.0
    assert fault_seconds(SandboxFault(kind="delay", params={"seconds": 0.2})) == 0.2


def test_it_logs_each_request_with_what_tests_count_it_by(sandbox):
    op = payment()
    PAYMENTS.call(op)
    PAYMENTS.lookup(op)
    adapter_for("crm.create_deal").lookup(snapshot("crm.create_deal", {}))

    assert sandbox_requests(provider="payments").count() == 2
    assert sandbox_requests(provider="payments", method="get").get().path.endswith("/search")
    assert sandbox_requests(path_endswith="/deals").get().provider == "crm"
    assert sandbox_requests(idempotency_key=op.idempotency_key).get().method == "POST"
    assert sandbox_requests(operation_id=op.id).count() == 2
    assert sandbox_counts()["requests"] == 3


def test_it_keeps_an_event_whose_delivery_failed_for_the_next_round(sandbox, receiver):
    op = payment()
    PAYMENTS.call(op)

    assert sandbox_webhooks_deliver(target_base_url="http://127.0.0.1:9") == 0  # nobody there
    receiver.status = 500
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 0
    assert sandbox_counts()["webhooks_undelivered"] == 1
    receiver.status = 200
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 1

    assert [f.operation_id for f in receiver.facts("payments")] == [op.id, op.id]
    assert sandbox_counts()["webhooks_undelivered"] == 0


def test_it_keeps_a_duplicate_fault_for_a_round_the_console_acknowledges(sandbox, receiver):
    # A round the console refused sent nothing to duplicate: the fault waits for one that
    # counts, or the console would never see the copy it was meant to handle.
    op = payment()
    PAYMENTS.call(op)
    sandbox_fault_set(provider="payments", kind="duplicate_webhook")
    receiver.status = 500
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 0
    assert SandboxFault.objects.get().remaining == 1
    receiver.status = 200
    receiver.received.clear()

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2

    facts = receiver.facts("payments")
    assert len(facts) == 2 and facts[0].event_id == facts[1].event_id
    assert SandboxFault.objects.get().remaining == 0
    assert sandbox_counts()["webhooks_undelivered"] == 0


def test_it_delivers_each_event_once_however_many_ticks_overlap(sandbox, receiver):
    # Two ticks at once (a slow console, a backlog of ticks drained by a threads-pool
    # worker) read the same undelivered batch; only one of them may send it.
    op = payment()
    PAYMENTS.call(op)
    receiver.delay = 0.5  # within the sandbox fixture's 1 s client timeout

    rounds = [Background(lambda: sandbox_webhooks_deliver(target_base_url=receiver.url))
              for _ in range(2)]

    assert sorted(each.join() for each in rounds) == [0, 1]
    assert [f.operation_id for f in receiver.facts("payments")] == [op.id]
    assert sandbox_counts()["webhooks_undelivered"] == 0


def test_it_holds_a_webhook_back_from_a_tick_that_overlaps_the_holding_round(
    sandbox, receiver
):
    other, late = payment(), payment()
    PAYMENTS.call(other)  # keeps the first round busy on the slow console
    PAYMENTS.call(late)
    sandbox_fault_set(provider="payments", kind="late_webhook", match=late.id)
    receiver.delay = 0.5  # within the sandbox fixture's 1 s client timeout

    rounds = [Background(lambda: sandbox_webhooks_deliver(target_base_url=receiver.url))
              for _ in range(2)]
    for each in rounds:
        each.join()

    assert [f.operation_id for f in receiver.facts("payments")] == [other.id]
    assert sandbox_counts()["webhooks_undelivered"] == 1
    assert SandboxFault.objects.get().remaining == 0
    receiver.delay = 0.0
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 1  # the next round
    assert [f.operation_id for f in receiver.facts("payments")] == [other.id, late.id]


def test_it_reorders_only_the_events_of_the_operation_a_fault_is_aimed_at(
    sandbox, settings, receiver
):
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1_000
    target, bystander = payment(amount_minor=5_000), payment(amount_minor=5_000)
    intents = [PAYMENTS.call(op).external_id for op in (target, bystander)]
    for intent in intents:
        sandbox_payment_settle(payment_intent_id=intent)
    sandbox_fault_set(provider="payments", kind="out_of_order_webhooks", match=target.id)

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 4

    # The target's two events swap places; the bystander asked for no reordering.
    assert [(f.operation_id, f.event_type) for f in receiver.facts("payments")] == [
        (target.id, "payment_intent.succeeded"), (bystander.id, "payment_intent.processing"),
        (target.id, "payment_intent.processing"), (bystander.id, "payment_intent.succeeded"),
    ]
    assert SandboxFault.objects.get().remaining == 0


def test_it_keeps_a_fault_aimed_at_an_operation_for_a_round_with_two_of_its_events(
    sandbox, receiver
):
    first, second = payment(), payment()
    PAYMENTS.call(first)
    PAYMENTS.call(second)
    sandbox_fault_set(provider="payments", kind="out_of_order_webhooks", match=second.id)

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2

    # One event of `second`: nothing of its own to swap, and the round's other operation
    # is no part of what the fault was aimed at.
    assert [f.operation_id for f in receiver.facts("payments")] == [first.id, second.id]
    assert SandboxFault.objects.get().remaining == 1


def test_it_declines_a_processing_payment_as_stripe_does_and_says_so(sandbox, settings,
                                                                     receiver):
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1_000
    op = payment(amount_minor=1_000)  # from the threshold on, the bank takes its time
    accepted = PAYMENTS.call(op)
    assert accepted.result["status"] == "processing"
    with pytest.raises(ValueError):
        sandbox_payment_settle(payment_intent_id=accepted.external_id, status="refunded")

    declined = sandbox_payment_settle(payment_intent_id=accepted.external_id, status="failed")

    # Stripe: a declined attempt sends the intent back to requires_payment_method.
    assert declined.status == "requires_payment_method"
    assert declined.last_payment_error["code"] == "card_declined"
    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2
    assert [(f.event_type, f.status) for f in receiver.facts("payments")] == [
        ("payment_intent.processing", CallOutcome.ACCEPTED),
        ("payment_intent.payment_failed", CallOutcome.FAILED),
    ]
    assert PAYMENTS.lookup(op).status is CallOutcome.FAILED


def test_it_signs_crm_events_and_names_the_operation_behind_each_change(sandbox, receiver):
    create = snapshot("crm.create_deal", {"name": "Acme", "amount_minor": 100,
                                          "currency": "EUR", "owner": "dana"})
    created = adapter_for("crm.create_deal").call(create)
    update = snapshot("crm.update_deal", {"target": created.external_id, "expected_version": 1,
                                          "patch": {"stage": "won"}})
    adapter_for("crm.update_deal").call(update)

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 2

    assert [(f.event_type, f.operation_id, f.external_id) for f in receiver.facts("crm")] == [
        ("deal.created", create.id, created.external_id),
        ("deal.updated", update.id, created.external_id),
    ]


def test_it_bounces_a_queued_message_once_and_tells_the_console(sandbox, receiver):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {}})
    sent = adapter.call(op)
    with pytest.raises(ValueError):
        sandbox_message_deliver(message_id=sent.external_id, status="opened")

    sandbox_message_deliver(message_id=sent.external_id, status="bounced")
    with pytest.raises(SandboxStateError):
        sandbox_message_deliver(message_id=sent.external_id)  # a bounce is final

    assert sandbox_webhooks_deliver(target_base_url=receiver.url) == 1
    assert [(f.event_type, f.operation_id, f.status) for f in receiver.facts("mail")] == [
        ("message.bounced", op.id, CallOutcome.FAILED)
    ]
    assert adapter.lookup(op).status is CallOutcome.FAILED


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "said"),
    [
        # nan and inf: no JSON the database takes (a traceback); -5 was stored, and the
        # sandbox's sleep raised on it (a bare 500, the fault used up).
        (("delay", "--seconds", "nan"), "seconds must be a duration"),
        (("delay", "--seconds", "inf"), "seconds must be a duration"),
        (("delay", "--seconds", "-5"), "seconds must be a duration"),
        (("http_500", "--match", "x" * 256), "at most 255 characters"),
    ],
)
def test_it_refuses_a_fault_it_could_not_carry_out(args, said):
    with pytest.raises(CommandError, match=said):
        call_command("sandbox_fault", "payments", *args, stdout=io.StringIO())
    assert not SandboxFault.objects.exists()
