"""The sandbox providers' HTTP contracts, asked directly: what a real client of Stripe, the CRM
and the mail API relies on, so an engine test cannot pass only because the sandbox is lenient."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.utils import timezone

from operations.providers import adapter_for
from operations.providers.base import CallOutcome, LookupOutcome, request_fingerprint
from operations.sandbox import services
from operations.sandbox.models import (
    Deal,
    IdempotencyRecord,
    Message,
    PaymentIntent,
    SandboxWebhook,
)
from operations.sandbox.selectors import sandbox_counts, sandbox_requests
from operations.sandbox.services import (
    SandboxStateError,
    sandbox_deal_update,
    sandbox_fault_set,
    sandbox_payment_create,
    sandbox_payment_settle,
    sandbox_settle_due,
)
from tests.operations.providers_support import payment, snapshot

PAYMENTS = adapter_for("payments.create")
# What a confirm Stripe accepts carries: a payment method, and automatic payment methods (on
# by default since API version 2023-08-16) that never redirect, or else a return_url.
VALID_PAYMENT = {"amount": "1000", "currency": "eur", "confirm": "true",
                 "payment_method": "pm_card_visa", "automatic_payment_methods[enabled]": "true",
                 "automatic_payment_methods[allow_redirects]": "never",
                 "metadata[operation_id]": "op_contract"}
DEAL = {"name": "Acme renewal", "amount_minor": 500_000, "currency": "EUR", "owner": "dana"}
MAIL = {"to": "cfo@acme.test", "template": "invoice_paid", "params": {"invoice": "inv_42"}}


def ask(method: str, url: str, *, provider: str, headers: dict[str, str] | None = None,
        **kwargs: Any) -> httpx.Response:
    key = getattr(settings, f"{provider.upper()}_API_KEY")
    return httpx.request(method, url, headers={"Authorization": f"Bearer {key}", **(headers or {})},
                         **kwargs)


def create_payment(sandbox: str, data: dict[str, str], key: str = "") -> httpx.Response:
    return ask("POST", f"{sandbox}/payments/v1/payment_intents", provider="payments",
               headers={"Idempotency-Key": key} if key else {}, data=data)


# --- payments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"coupon": "FREE"}, "parameter_unknown", "coupon"),
        ({"amount": "0"}, "amount_too_small", "amount"),
        # Stripe: up to eight digits in its unit, and a minimum charge (0.50 USD).
        ({"amount": "100000000", "currency": "usd"}, "amount_too_large", "amount"),
        ({"amount": "49", "currency": "usd"}, "amount_too_small", "amount"),
        ({"amount": "29", "currency": "gbp"}, "amount_too_small", "amount"),
        ({"amount": "49", "currency": "jpy"}, "amount_too_small", "amount"),
        ({"amount": "12.50"}, "parameter_invalid_integer", "amount"),
        ({"currency": "euro"}, "parameter_invalid", "currency"),
        ({"confirm": "yes"}, "parameter_invalid", "confirm"),
    ],
)
def test_it_refuses_payment_params_stripe_refuses_and_leaves_the_key_unspent(
    sandbox, change, code, param
):
    refused = [create_payment(sandbox, {**VALID_PAYMENT, **change}, key=key)
               for key in ("", "key-1")]

    for answer in refused:
        assert answer.status_code == 400
        assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == (code, param)
    assert PaymentIntent.objects.count() == 0 and IdempotencyRecord.objects.count() == 0
    # Stripe saves no result for a request that failed validation: the key is still free.
    fixed = create_payment(sandbox, VALID_PAYMENT, key="key-1")
    assert fixed.status_code == 200
    assert PaymentIntent.objects.count() == 1


@pytest.mark.parametrize(("amount", "currency", "status"), [
    ("99999999", "usd", "processing"), ("50", "usd", "succeeded"), ("30", "gbp", "succeeded"),
    # Outside Stripe's table of minimums the sandbox converts nothing: any positive amount.
    ("1", "kzt", "succeeded"),
])
def test_it_takes_amounts_within_stripes_limits(sandbox, amount, currency, status):
    made = create_payment(sandbox, {**VALID_PAYMENT, "amount": amount, "currency": currency},
                          key="key-limits")

    assert made.status_code == 200, made.json()
    assert (made.json()["amount"], made.json()["status"]) == (int(amount), status)
    assert PaymentIntent.objects.count() == 1


def without(params: dict[str, str], *names: str) -> dict[str, str]:
    return {name: value for name, value in params.items() if name not in names}


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (without(VALID_PAYMENT, "payment_method"), "payment_method"),
        # Automatic payment methods by default, which may redirect the customer.
        (without(VALID_PAYMENT, "automatic_payment_methods[enabled]",
                 "automatic_payment_methods[allow_redirects]"), "return_url"),
        ({**VALID_PAYMENT, "automatic_payment_methods[allow_redirects]": "always"},
         "return_url"),
        ({**VALID_PAYMENT, "payment_method": "visa"}, "payment_method"),
    ],
    ids=["no-payment-method", "default-redirects", "redirects", "not-a-payment-method"],
)
def test_it_refuses_to_confirm_a_payment_stripe_cannot_confirm_and_leaves_the_key_unspent(
    sandbox, params, param
):
    refused = create_payment(sandbox, params, key="key-confirm")

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert PaymentIntent.objects.count() == SandboxWebhook.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0
    assert sandbox_requests(provider="payments").get().response_status == 400


@pytest.mark.parametrize(
    ("params", "version", "status"),
    [
        (VALID_PAYMENT, "2024-06-20", "succeeded"),
        ({**without(VALID_PAYMENT, "automatic_payment_methods[allow_redirects]"),
          "return_url": "https://console.example.com/back"}, "2024-06-20", "succeeded"),
        ({**without(VALID_PAYMENT, "automatic_payment_methods[enabled]",
                    "automatic_payment_methods[allow_redirects]"),
          "payment_method_types[0]": "card"}, "2024-06-20", "succeeded"),
        # Before 2023-08-16 an intent took only cards unless told otherwise.
        (without(VALID_PAYMENT, "automatic_payment_methods[enabled]",
                 "automatic_payment_methods[allow_redirects]"), "2023-08-15", "succeeded"),
        # Not confirmed: the payment method may come later.
        ({**without(VALID_PAYMENT, "payment_method"), "confirm": "false"}, "2024-06-20",
         "requires_confirmation"),
    ],
    ids=["never-redirects", "return-url", "cards", "old-version", "unconfirmed"],
)
def test_it_takes_the_payment_method_parameters_of_a_confirm_stripe_accepts(
    sandbox, params, version, status
):
    made = ask("POST", f"{sandbox}/payments/v1/payment_intents", provider="payments",
               headers={"Idempotency-Key": "key-pm", "Stripe-Version": version}, data=params)

    assert made.status_code == 200, made.json()
    assert made.json()["status"] == status
    assert PaymentIntent.objects.get().id == made.json()["id"]


def test_it_replays_a_keyed_create_with_stripes_status_body_and_header(sandbox):
    first = create_payment(sandbox, {**VALID_PAYMENT, "currency": "EUR"}, key="key-2")
    again = create_payment(sandbox, {**VALID_PAYMENT, "currency": "EUR"}, key="key-2")
    keyless = create_payment(sandbox, VALID_PAYMENT)

    assert first.status_code == again.status_code == keyless.status_code == 200
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert first.json()["currency"] == "eur"  # Stripe answers with currencies in lower case
    assert keyless.json()["id"] != first.json()["id"]
    counts = sandbox_counts()
    assert (counts["payment_intents"], counts["webhooks"], counts["webhooks_undelivered"],
            counts["requests"]) == (2, 2, 2, 3)


@pytest.mark.parametrize(("kind", "payments_made"),
                         [("http_500_after_commit", 1), ("http_500_kept", 0)])
def test_it_keeps_a_500_for_the_key_and_replays_it_as_stripe_does(sandbox, kind, payments_made):
    sandbox_fault_set(provider="payments", kind=kind, match="op_contract")

    first = create_payment(sandbox, VALID_PAYMENT, key="key-500")
    again = create_payment(sandbox, VALID_PAYMENT, key="key-500")
    other_params = create_payment(sandbox, {**VALID_PAYMENT, "amount": "2000"}, key="key-500")

    assert first.status_code == again.status_code == 500
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    assert other_params.status_code == 400
    assert other_params.json()["error"]["type"] == "idempotency_error"
    assert PaymentIntent.objects.count() == payments_made
    assert IdempotencyRecord.objects.get(key="key-500").response_status == 500


def test_it_declines_a_card_with_a_402_that_carries_the_intent_and_keeps_it_for_the_key(
    sandbox,
):
    sandbox_fault_set(provider="payments", kind="card_declined", match="op_contract")
    with pytest.raises(ValueError):
        sandbox_fault_set(provider="crm", kind="card_declined")

    first = create_payment(sandbox, VALID_PAYMENT, key="key-402")
    again = create_payment(sandbox, VALID_PAYMENT, key="key-402")

    # Stripe: the request ran and made the intent, which the failed attempt left in
    # requires_payment_method; the 402 is the key's answer from then on.
    assert first.status_code == again.status_code == 402
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    error = first.json()["error"]
    assert (error["type"], error["code"]) == ("card_error", "card_declined")
    intent = PaymentIntent.objects.get()
    assert error["payment_intent"]["id"] == intent.id
    assert intent.status == error["payment_intent"]["status"] == "requires_payment_method"
    assert intent.last_payment_error["code"] == "card_declined"
    assert list(SandboxWebhook.objects.values_list("type", flat=True)) == [
        "payment_intent.payment_failed"]
    assert IdempotencyRecord.objects.get(key="key-402").response_status == 402


def test_it_asks_for_3d_secure_and_waits_until_the_customer_answers(sandbox):
    sandbox_fault_set(provider="payments", kind="requires_action", match="op_contract")
    with pytest.raises(ValueError):
        sandbox_fault_set(provider="mail", kind="requires_action")

    first = create_payment(sandbox, VALID_PAYMENT, key="key-3ds")
    again = create_payment(sandbox, VALID_PAYMENT, key="key-3ds")

    # Stripe answers 200 with the intent in requires_action, and keeps that answer for the
    # key; the intent waits there until its customer authenticates (or never does).
    assert first.status_code == again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == first.json()
    intent = PaymentIntent.objects.get()
    assert first.json()["id"] == intent.id and intent.status == "requires_action"
    assert sandbox_settle_due(older_than=timedelta(0))["payments_settled"] == 0
    assert sandbox_payment_settle(payment_intent_id=intent.id).status == "succeeded"
    assert list(SandboxWebhook.objects.order_by("id").values_list("type", flat=True)) == [
        "payment_intent.requires_action", "payment_intent.succeeded"]


def test_it_keeps_no_500_where_there_is_no_key_to_keep_it_under(sandbox):
    sandbox_fault_set(provider="payments", kind="http_500_kept", match="op_contract")
    sandbox_fault_set(provider="payments", kind="http_500_after_commit", match="op_contract")

    kept = create_payment(sandbox, VALID_PAYMENT)
    after_commit = create_payment(sandbox, VALID_PAYMENT)
    plain = create_payment(sandbox, VALID_PAYMENT)

    assert (kept.status_code, after_commit.status_code, plain.status_code) == (500, 500, 200)
    assert PaymentIntent.objects.count() == 2 and IdempotencyRecord.objects.count() == 0


def test_it_leaves_a_key_that_already_holds_an_answer_as_it_is(sandbox):
    first = create_payment(sandbox, VALID_PAYMENT, key="key-held")
    sandbox_fault_set(provider="payments", kind="http_500_kept", match="op_contract")
    sandbox_fault_set(provider="payments", kind="http_500_after_commit", match="op_contract")

    # The kept-500 fault finds the key taken: the saved success is replayed. The fault after
    # commit turns a replay's answer into a 500 but nothing ran, so the key keeps its 200.
    replayed = create_payment(sandbox, VALID_PAYMENT, key="key-held")
    failed = create_payment(sandbox, VALID_PAYMENT, key="key-held")
    later = create_payment(sandbox, VALID_PAYMENT, key="key-held")

    assert (replayed.status_code, failed.status_code, later.status_code) == (200, 500, 200)
    assert replayed.json() == later.json() == first.json()
    assert PaymentIntent.objects.count() == 1


def test_it_takes_over_a_key_whose_first_request_died_but_only_with_the_same_params(sandbox):
    long_ago = timezone.now() - timedelta(seconds=61)
    op, other = payment(), payment()
    IdempotencyRecord.objects.create(key=op.idempotency_key, created_at=long_ago,
                                     fingerprint=request_fingerprint(PAYMENTS.params(op)))
    IdempotencyRecord.objects.create(key=other.idempotency_key, created_at=long_ago,
                                     fingerprint=request_fingerprint({"amount": "1"}))

    taken_over = PAYMENTS.call(op)
    refused = PAYMENTS.call(other)

    assert taken_over.outcome is CallOutcome.SUCCEEDED
    assert (refused.outcome, refused.error_class, refused.http_status) == (
        CallOutcome.UNKNOWN, "idempotency_error", 400
    )
    assert list(PaymentIntent.objects.values_list("metadata__operation_id", flat=True)) == [op.id]


def test_it_creates_nothing_when_its_idempotency_claim_was_lost(db):
    # Another request took the stale claim over and saved its answer first.
    claim = IdempotencyRecord.objects.create(
        key="key-3", fingerprint="sha256:x", created_at=timezone.now(), response_status=200,
        response_body={"id": "pi_other"},
    )

    with pytest.raises(SandboxStateError):
        sandbox_payment_create(amount=1000, currency="eur", metadata={"operation_id": "op_1"},
                               confirm=True, claim=claim)

    assert PaymentIntent.objects.count() == 0 and SandboxWebhook.objects.count() == 0


def test_it_hides_new_payments_from_search_for_a_minute_unless_told_otherwise(sandbox):
    sandbox_fault_set(provider="payments", kind="search_lag")
    op = payment()
    PAYMENTS.call(op)

    def searched() -> list:
        return ask("GET", f"{sandbox}/payments/v1/payment_intents/search", provider="payments",
                   params={"query": f"metadata['operation_id']:'{op.id}'"}).json()["data"]

    assert searched() == []
    PaymentIntent.objects.update(created_at=timezone.now() - timedelta(seconds=61))
    assert [intent["metadata"]["operation_id"] for intent in searched()] == [op.id]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/payments/v1/payment_intents",
         {"data": {**VALID_PAYMENT, "metadata[invoice_id]": "i" * 501}}, "metadata"),
        ("/crm/deals", {"json": {**DEAL, "agent_operation_id": "o" * 121}}, "agent_operation_id"),
        ("/mail/messages", {"json": {**MAIL, "operation_id": "o" * 121}}, "operation_id"),
    ],
)
def test_it_refuses_a_value_longer_than_the_provider_keeps_with_a_400(sandbox, path, body, param):
    provider = path.split("/")[1]

    answer = ask("POST", f"{sandbox}{path}", provider=provider, **body)

    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert PaymentIntent.objects.count() == Deal.objects.count() == Message.objects.count() == 0
    assert sandbox_requests(provider=provider).get().response_status == 400


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/payments/v1/payment_intents/pi_%00", {}),
        ("GET", "/payments/v1/payment_intents/search", {
            "params": {"query": "metadata['operation_id']:'op_\x00'"}}),
        ("POST", "/payments/v1/payment_intents", {
            "data": {**VALID_PAYMENT, "metadata[operation_id]": "op_\x00"}}),
        ("GET", "/crm/deals/deal_%00", {}),
        ("POST", "/crm/deals", {"json": {**DEAL, "name": "Acme\x00renewal"}}),
        ("GET", "/mail/messages/msg_%00", {}),
        ("POST", "/mail/messages", {"json": {**MAIL, "params": {"invoice": "inv_\x00"}}}),
    ],
)
def test_it_refuses_a_nul_byte_with_a_400_not_500(sandbox, method, path, body):
    # PostgreSQL refuses NUL in text: the request log (written before the key is even
    # checked) and the provider's own reads raised, a 500 for anyone who reached it.
    provider = path.split("/")[1]

    anonymous = httpx.request(method, f"{sandbox}{path}", **body)
    answer = ask(method, f"{sandbox}{path}", provider=provider, **body)

    assert anonymous.status_code == 401
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "parameter_invalid"
    assert PaymentIntent.objects.count() == Deal.objects.count() == Message.objects.count() == 0
    logged = sandbox_requests(provider=provider)
    assert [r.response_status for r in logged] == [401, 400]
    assert all("\x00" not in r.path + r.operation_id for r in logged)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/payments/v1/payment_intents", {"data": {**VALID_PAYMENT, "amount": str(2**63)}},
         "amount"),
        ("/crm/deals", {"json": {**DEAL, "amount_minor": 2**63}}, "amount_minor"),
    ],
)
def test_it_refuses_an_amount_larger_than_the_provider_keeps_with_a_400(
    sandbox, path, body, param
):
    # Past a bigint the insert raised (a 500), as an overlong text did before it was refused.
    provider = path.split("/")[1]

    answer = ask("POST", f"{sandbox}{path}", provider=provider, **body)

    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert PaymentIntent.objects.count() == Deal.objects.count() == 0
    assert sandbox_requests(provider=provider).get().response_status == 400


# --- CRM ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "payload", "unknown_id"), [
    ("crm.create_deal", DEAL, "deal_nope"),
    ("mail.send", MAIL, "msg_nope"),
])
def test_it_finds_only_the_effect_that_carries_the_operation(sandbox, action, payload,
                                                             unknown_id):
    # Deals by their agent_operation_id, messages by their own idempotency key.
    adapter = adapter_for(action)
    mine, other = snapshot(action, payload), snapshot(action, payload)
    adapter.call(other)

    assert adapter.lookup(mine).outcome is LookupOutcome.ABSENT
    created = adapter.call(mine)
    found = adapter.lookup(mine)

    assert (found.outcome, found.external_id, len(found.matches)) == (
        LookupOutcome.FOUND, created.external_id, 1
    )
    gone = adapter.retrieve(unknown_id)
    assert (gone.outcome, gone.http_status) == (LookupOutcome.ABSENT, 404)


def test_it_lets_deals_without_an_operation_id_repeat(sandbox):
    answers = [ask("POST", f"{sandbox}/crm/deals", provider="crm", json=DEAL) for _ in range(2)]

    assert [answer.status_code for answer in answers] == [201, 201]
    assert Deal.objects.filter(agent_operation_id="").count() == 2


def test_it_refuses_a_second_deal_for_an_operation_whose_first_create_is_still_committing(
    sandbox, monkeypatch
):
    adapter = adapter_for("crm.create_deal")
    op = snapshot("crm.create_deal", DEAL)
    inside, record = threading.Event(), services.sandbox_webhook_record

    def slow_record(**kwargs: Any) -> Any:
        # The first create has inserted its deal and not yet committed.
        inside.set()
        time.sleep(0.3)
        return record(**kwargs)

    monkeypatch.setattr(services, "sandbox_webhook_record", slow_record)
    first: list = []
    thread = threading.Thread(target=lambda: first.append(adapter.call(op)))
    thread.start()
    assert inside.wait(5)
    second = adapter.call(op)
    thread.join()

    assert (first[0].http_status, second.http_status) == (201, 409)
    assert second.result["error"]["existing_id"] == first[0].external_id
    assert Deal.objects.filter(agent_operation_id=op.id).count() == 1


def test_it_never_applies_a_patch_over_a_version_that_moved_meanwhile(db):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    as_read = Deal.objects.get(pk=deal.pk)
    # Another PATCH lands between this request's read and its write.
    Deal.objects.filter(pk=deal.pk).update(version=2, applied_operation_ids=["op_first"])

    current, applied = sandbox_deal_update(deal=as_read, expected_version=1,
                                           patch={"stage": "won"}, operation_id="op_late")

    assert not applied
    assert (current.version, current.stage, current.applied_operation_ids) == (
        2, "open", ["op_first"]
    )
    assert SandboxWebhook.objects.count() == 0


@pytest.mark.parametrize("body", [
    b"{not json", b"[1, 2]",
    # Nested past the parser's own limit, and within it but past what the answer walks.
    b'{"a": ' * 5000 + b"1" + b"}" * 5000, b'{"a": ' * 900 + b"1" + b"}" * 900,
], ids=["malformed", "array", "deeper than the parser", "deeper than the answer"])
def test_it_refuses_a_body_that_is_not_a_json_object_with_a_400(sandbox, body):
    answer = ask("POST", f"{sandbox}/crm/deals", provider="crm", content=body,
                 headers={"Content-Type": "application/json"})

    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "parameter_invalid_json"
    assert Deal.objects.count() == 0
    assert sandbox_requests(provider="crm").get().response_status == 400


# --- mail ---------------------------------------------------------------------------------


def test_it_sends_every_message_that_carries_no_key(sandbox):
    answers = [ask("POST", f"{sandbox}/mail/messages", provider="mail", json=MAIL)
               for _ in range(2)]

    assert [answer.status_code for answer in answers] == [202, 202]
    assert answers[0].json()["id"] != answers[1].json()["id"]
    assert Message.objects.count() == 2


@pytest.mark.parametrize(
    ("change", "param"),
    [({"to": "cfo at acme"}, "to"), ({"template": ""}, "template"), ({"params": ["x"]}, "params")],
)
def test_it_refuses_a_message_it_cannot_send_with_a_400(sandbox, change, param):
    answer = ask("POST", f"{sandbox}/mail/messages", provider="mail", json={**MAIL, **change},
                 headers={"Idempotency-Key": "key-4"})

    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert Message.objects.count() == 0
