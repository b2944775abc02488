from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from operations.providers import adapter_for, provider_for, webhook_verifier_for
from operations.providers.base import (
    CallOutcome,
    LookupMethod,
    LookupOutcome,
    WebhookSignatureError,
    request_fingerprint,
)
from operations.providers.signing import hmac_signature_header, stripe_signature_header
from operations.providers.transport import (
    Answer,
    call_failure,
    call_result,
    credentials_marked,
    retry_after_read,
    send,
)
from operations.sandbox.models import Deal, Message, PaymentIntent
from operations.sandbox.selectors import (
    sandbox_requests,
    sandbox_writes,
)
from operations.sandbox.services import (
    sandbox_fault_set,
    sandbox_message_deliver,
)
from tests.operations.providers_support import NotTheProvider, payment, snapshot

PAYMENTS = adapter_for("payments.create")


def test_it_maps_actions_to_adapters_and_providers():
    assert provider_for("payments.create") == "payments"
    assert provider_for("crm.create_deal") == provider_for("crm.update_deal") == "crm"
    assert provider_for("mail.send") == "mail"
    assert PAYMENTS.contract.lookup_methods == (
        LookupMethod.EXTERNAL_ID, LookupMethod.UNIQUE_FIELD
    )
    assert not adapter_for("crm.create_deal").contract.same_key_retry_safe
    with pytest.raises(KeyError):
        adapter_for("payments.refund")
    with pytest.raises(KeyError):
        webhook_verifier_for("sms")


@pytest.mark.parametrize(("action", "prefix"), [
    ("payments.create", "PAYMENTS"), ("crm.create_deal", "CRM"), ("crm.update_deal", "CRM"),
    ("mail.send", "MAIL"),
])
def test_it_tells_provider_accounts_apart_without_keeping_the_key(settings, action, prefix):
    adapter = adapter_for(action)
    setattr(settings, f"{prefix}_API_BASE", "https://provider.example/v1")
    setattr(settings, f"{prefix}_API_KEY", "sk_test_first_account")
    first = adapter.account()
    setattr(settings, f"{prefix}_API_BASE", "https://provider.example/v1/")
    assert adapter.account() == first  # the same endpoint, spelled with a trailing slash

    setattr(settings, f"{prefix}_API_KEY", "sk_live_first_account")
    live = adapter.account()
    setattr(settings, f"{prefix}_API_BASE", "https://other-provider.example/v1")
    elsewhere = adapter.account()
    assert len({first, live, elsewhere}) == 3
    assert all(a.startswith("acct_") and len(a) == 17 for a in (first, live, elsewhere))
    assert "first_account" not in first + live + elsewhere


def test_it_creates_retrieves_and_searches_a_payment(sandbox):
    op = payment()
    result = PAYMENTS.call(op)

    assert result.outcome is CallOutcome.SUCCEEDED
    assert result.external_id.startswith("pi_")
    assert result.http_status == 200
    assert result.provider_request_id.startswith("req_")
    intent = PaymentIntent.objects.get()
    assert intent.amount == 12_500 and intent.currency == "eur"
    assert intent.metadata == {"operation_id": op.id, "tenant": "acme", "invoice_id": "inv_42",
                               "beneficiary_id": "ben_7"}
    # The hash we record is the hash of what the provider received.
    assert sandbox_writes(provider="payments").get().params_hash == result.request_hash

    by_id = PAYMENTS.lookup(replace(op, external_id=result.external_id))
    assert (by_id.outcome, by_id.method, by_id.status) == (
        LookupOutcome.FOUND, LookupMethod.EXTERNAL_ID, CallOutcome.SUCCEEDED
    )
    by_search = PAYMENTS.lookup(op)
    assert (by_search.outcome, by_search.method, by_search.external_id) == (
        LookupOutcome.FOUND, LookupMethod.UNIQUE_FIELD, result.external_id
    )
    assert PAYMENTS.lookup(payment()).outcome is LookupOutcome.ABSENT
    # A reference a person typed may be a typo: "no such payment" proves it names nothing.
    typo = PAYMENTS.retrieve("pi_doesnotexist")
    assert typo.outcome is LookupOutcome.ABSENT and typo.http_status == 404
    assert PaymentIntent.objects.count() == 1


def test_it_takes_only_a_404_that_says_the_object_is_missing_for_proof_of_absence(
    sandbox, settings
):
    made = PAYMENTS.call(payment())
    assert PAYMENTS.retrieve(made.external_id).outcome is LookupOutcome.FOUND
    assert PAYMENTS.retrieve("pi_doesnotexist").outcome is LookupOutcome.ABSENT
    # An API base that ends in /v1 (as Stripe's own URLs read): every path is one the
    # provider does not know, and its 404 says nothing of the payment.
    settings.PAYMENTS_API_BASE = f"{sandbox}/payments/v1"
    for external_id in (made.external_id, "pi_doesnotexist"):
        found = PAYMENTS.retrieve(external_id)
        assert (found.outcome, found.http_status) == (LookupOutcome.INCONCLUSIVE, 404)
        assert "is the API base right?" in found.reason


def test_it_names_the_api_version_it_reads_on_every_payments_request(sandbox, settings):
    made = PAYMENTS.call(payment())
    assert made.outcome is CallOutcome.SUCCEEDED
    # The sandbox, as Stripe, refuses a version it does not know before doing anything: so
    # each of the three requests carries the configured one.
    settings.PAYMENTS_API_VERSION = "2024-13-not-a-version"
    refused = PAYMENTS.call(payment())
    assert (refused.outcome, refused.http_status) == (CallOutcome.FAILED, 400)
    assert "Invalid Stripe API version" in refused.error_message
    op = payment()
    for found in (PAYMENTS.retrieve(made.external_id), PAYMENTS.lookup(op)):
        assert (found.outcome, found.http_status) == (LookupOutcome.INCONCLUSIVE, 400)
    assert PaymentIntent.objects.count() == 1
    settings.PAYMENTS_API_VERSION = ""  # the account's default: no header at all
    assert PAYMENTS.call(payment()).outcome is CallOutcome.SUCCEEDED


def test_it_never_takes_a_payment_it_was_given_and_cannot_find_for_proof_of_absence(sandbox):
    op = payment()
    made = PAYMENTS.call(op)
    # Stripe answers 404 for a payment deleted, or asked of another account or mode (a key
    # swapped in the settings): the payment it named for this operation was made all the same.
    PaymentIntent.objects.filter(id=made.external_id).delete()

    gone = PAYMENTS.lookup(replace(op, external_id=made.external_id))

    assert (gone.outcome, gone.method, gone.http_status, gone.retry_after) == (
        LookupOutcome.INCONCLUSIVE, LookupMethod.EXTERNAL_ID, 404, None
    )
    assert gone.reason == (
        f"the provider no longer has {made.external_id}, which it named for this operation "
        "(deleted since, or asked of another account or mode)"
    )
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 1


def test_it_makes_one_payment_when_the_same_key_is_sent_twice(sandbox):
    op = payment()
    first = PAYMENTS.call(op)
    second = PAYMENTS.call(op)

    assert first.outcome is second.outcome is CallOutcome.SUCCEEDED
    assert second.external_id == first.external_id
    assert second.request_hash == first.request_hash
    assert PaymentIntent.objects.count() == 1
    writes = sandbox_writes(provider="payments").filter(idempotency_key=op.idempotency_key)
    assert writes.count() == 2


def test_it_confirms_with_the_payment_method_the_account_pays_with(sandbox, settings):
    """Stripe refuses a confirm=true create that names no payment method, and one whose
    automatic payment methods may redirect a customer without a return_url to come back to:
    the sandbox charged both, so every test passed on a request Stripe refuses."""
    settings.PAYMENTS_PAYMENT_METHOD = "pm_card_mastercard"
    op = payment()

    made = PAYMENTS.call(op)

    assert made.outcome is CallOutcome.SUCCEEDED
    assert made.request_hash == request_fingerprint(PAYMENTS.params(op))
    assert {name: value for name, value in PAYMENTS.params(op).items()
            if "payment_method" in name} == {
        "payment_method": "pm_card_mastercard", "automatic_payment_methods[enabled]": "true",
        "automatic_payment_methods[allow_redirects]": "never"}
    settings.PAYMENTS_PAYMENT_METHOD = ""
    refused = PAYMENTS.call(payment())
    assert (refused.outcome, refused.http_status) == (CallOutcome.FAILED, 400)
    assert "missing a payment method" in refused.error_message
    assert PaymentIntent.objects.get().id == made.external_id


@pytest.mark.parametrize("change", ["amount", "payment_method"])
def test_it_is_unknown_when_the_same_key_comes_with_other_params(sandbox, settings, change):
    # A payment method changed in the settings while the operation's key is kept is one too:
    # the key is refused, never a second payment made.
    op = payment()
    PAYMENTS.call(op)
    changed = op
    if change == "amount":
        changed = replace(op, payload={**op.payload, "amount_minor": 99_900})
    else:
        settings.PAYMENTS_PAYMENT_METHOD = "pm_card_mastercard"

    result = PAYMENTS.call(changed)

    assert result.outcome is CallOutcome.UNKNOWN
    assert result.error_class == "idempotency_error"
    assert result.http_status == 400
    assert PaymentIntent.objects.count() == 1
    assert PaymentIntent.objects.get().amount == 12_500


def test_it_is_unknown_after_commit_then_drop_yet_one_payment_exists_and_is_found(sandbox):
    sandbox_fault_set(provider="payments", kind="commit_then_drop", seconds=4)
    op = payment()

    started = time.monotonic()
    result = PAYMENTS.call(op)

    assert time.monotonic() - started < 3  # our 1 s timeout, not the provider's 4 s stall
    assert result.outcome is CallOutcome.UNKNOWN
    assert result.error_class == "timeout"
    assert result.external_id == "" and result.http_status is None
    assert PaymentIntent.objects.count() == 1
    found = PAYMENTS.lookup(op)
    assert found.outcome is LookupOutcome.FOUND
    assert found.external_id == PaymentIntent.objects.get().id
    # A same-key retry is answered from the saved response: still one payment.
    retry = PAYMENTS.call(op)
    assert retry.outcome is CallOutcome.SUCCEEDED and retry.external_id == found.external_id
    assert PaymentIntent.objects.count() == 1
    assert sandbox_writes(provider="payments", operation_id=op.id).count() == 2


@pytest.mark.parametrize(
    ("kind", "outcome", "error_class", "payments_made"),
    [
        ("http_500", CallOutcome.UNKNOWN, "http_5xx", 0),
        ("validation_error", CallOutcome.FAILED, "validation", 0),
    ],
)
def test_it_maps_provider_errors(sandbox, kind, outcome, error_class, payments_made):
    op = payment()
    sandbox_fault_set(provider="payments", kind=kind, match=op.id)

    result = PAYMENTS.call(op)

    assert (result.outcome, result.error_class) == (outcome, error_class)
    assert result.provider_request_id.startswith("req_")
    assert PaymentIntent.objects.count() == payments_made
    # The key was not spent by a request that did nothing: the retry makes exactly one.
    assert PAYMENTS.call(op).outcome is CallOutcome.SUCCEEDED
    assert PaymentIntent.objects.count() == 1


def test_it_fails_a_declined_card_with_the_payment_intent_the_decline_left(sandbox):
    op = payment()
    sandbox_fault_set(provider="payments", kind="card_declined", match=op.id)

    first = PAYMENTS.call(op)
    retry = PAYMENTS.call(op)

    # A definite failure, not unknown: but the 402 names the intent Stripe made, which the
    # operation must point at, and the retry gets the same answer, not a second attempt.
    intent = PaymentIntent.objects.get()
    for result in (first, retry):
        assert (result.outcome, result.error_class, result.http_status) == (
            CallOutcome.FAILED, "card_declined", 402)
        assert result.external_id == intent.id
        assert result.result["status"] == "requires_payment_method"
    assert sandbox_writes(provider="payments", operation_id=op.id).count() == 2
    found = PAYMENTS.lookup(replace(op, external_id=first.external_id))
    assert (found.outcome, found.status) == (LookupOutcome.FOUND, CallOutcome.FAILED)
    assert PaymentIntent.objects.count() == 1


@pytest.mark.parametrize(
    ("status", "error_type", "intent_status", "outcome", "error_class", "external_id"),
    [
        # An intent still under way is money that may yet move, whatever the HTTP status:
        # calling it failed would invite a second payment for the same invoice.
        (402, "card_error", "processing", CallOutcome.ACCEPTED, "", "pi_attempted"),
        # A 5xx is no refusal: the intent it names may still move, so a lookup decides.
        (500, "api_error", "requires_payment_method", CallOutcome.UNKNOWN, "http_5xx", ""),
    ],
)
def test_it_takes_the_intent_a_refusal_carries_for_its_status_only_on_a_4xx(
    monkeypatch, status, error_type, intent_status, outcome, error_class, external_id
):
    intent = {"id": "pi_attempted", "object": "payment_intent", "status": intent_status,
              "amount": 12_500, "currency": "eur"}
    answer = Answer(status, {"error": {"type": error_type, "code": "card_declined",
                                       "message": "x", "payment_intent": intent}})
    monkeypatch.setattr("operations.providers.payments.send", lambda *args, **kwargs: answer)

    result = PAYMENTS.call(payment())

    assert (result.outcome, result.error_class, result.external_id) == (
        outcome, error_class, external_id)


@pytest.mark.parametrize(
    ("kind", "payments_made"), [("http_500_after_commit", 1), ("http_500_kept", 0)]
)
def test_it_tells_a_500_the_provider_kept_for_the_key_from_a_fresh_one(
    sandbox, kind, payments_made
):
    op = payment()
    sandbox_fault_set(provider="payments", kind=kind, match=op.id)

    first = PAYMENTS.call(op)
    retry = PAYMENTS.call(op)

    # Both unknown: a payment may exist (after_commit) or not (kept); a lookup tells.
    assert (first.outcome, first.error_class) == (CallOutcome.UNKNOWN, "http_5xx")
    assert (retry.outcome, retry.error_class) == (CallOutcome.UNKNOWN, "replayed_5xx")
    assert retry.http_status == 500 and retry.error_message.startswith("replayed for this key")
    assert PaymentIntent.objects.count() == payments_made
    assert sandbox_writes(provider="payments", operation_id=op.id).count() == 2


@pytest.mark.parametrize(("header", "seconds"), [
    ("120", 120), (" 45 ", 45), ("86400", 900), ("9" * 40, 900), ("", None), ("soon", None),
    ("-5", None),
])
def test_it_reads_a_retry_after_in_seconds_up_to_15_minutes(header, seconds):
    wait = retry_after_read(header)
    assert (wait.total_seconds() if wait is not None else None) == seconds


def test_it_reads_a_retry_after_given_as_an_http_date(monkeypatch):
    now = timezone.now().replace(microsecond=0)
    monkeypatch.setattr(timezone, "now", lambda: now)
    in_five = (now + timedelta(minutes=5)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    past = (now - timedelta(minutes=5)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert retry_after_read(in_five) == timedelta(minutes=5)
    assert retry_after_read(past) == timedelta(0)


def test_it_is_unknown_on_connection_refused(settings):
    settings.PAYMENTS_API_BASE = "http://127.0.0.1:9/sandbox/payments"
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0
    result = PAYMENTS.call(payment())
    assert (result.outcome, result.error_class) == (CallOutcome.UNKNOWN, "connection")
    lookup = PAYMENTS.lookup(payment())
    assert lookup.outcome is LookupOutcome.INCONCLUSIVE
    assert lookup.retry_after == timedelta(seconds=30)


def test_it_never_takes_an_unreachable_provider_for_proof_that_an_object_is_gone(settings):
    # Asked by the id the provider gave us: no answer at all is not "no such object" (404).
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0
    settings.PAYMENTS_API_BASE = "http://127.0.0.1:9/sandbox/payments"
    settings.MAIL_API_BASE = "http://127.0.0.1:9/sandbox/mail"
    settings.CRM_API_BASE = "http://127.0.0.1:9/sandbox/crm"
    asked = [
        PAYMENTS.lookup(replace(payment(), external_id="pi_known")),
        PAYMENTS.retrieve("pi_known"),
        adapter_for("mail.send").retrieve("msg_known"),
        adapter_for("crm.create_deal").retrieve("deal_known"),
    ]
    for found in asked:
        assert found.outcome is LookupOutcome.INCONCLUSIVE, found
        assert found.retry_after == timedelta(seconds=30) and found.http_status is None


DEAL = {"name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"}
MAIL = {"to": "cfo@acme.test", "template": "receipt", "params": {"invoice": "inv_42"}}
# One object of each provider's shape at once (a deal, a message, a PaymentIntent), all of
# them another operation's.
OTHER_OPERATIONS_OBJECT = {
    "id": "obj_1", "object": "payment_intent", "status": "succeeded",
    "metadata": {"operation_id": "op_other"}, "agent_operation_id": "op_other",
    "applied_operation_ids": ["op_other"], "operation_id": "op_other",
    "idempotency_key": "idem-op_other",
}


def _ops_of_every_action() -> dict[str, object]:
    return {
        "payments.create": payment(),
        "crm.create_deal": snapshot("crm.create_deal", DEAL),
        "crm.update_deal": snapshot("crm.update_deal", {
            "target": "obj_1", "expected_version": 1, "patch": {"stage": "won"}}),
        "mail.send": snapshot("mail.send", MAIL),
    }


@pytest.mark.parametrize("action",
                         ["payments.create", "crm.create_deal", "crm.update_deal", "mail.send"])
@pytest.mark.parametrize("answer", ["maintenance_page", "other_operations_object"])
def test_it_takes_a_2xx_without_the_object_its_call_made_for_unknown(settings, action, answer):
    # Anything at the provider's address can answer 200. Read as success, a deal nobody
    # made would close its operation for good; unknown, a lookup finds out.
    stub = (NotTheProvider(b"<html><body>Back soon</body></html>", "text/html")
            if answer == "maintenance_page"
            else NotTheProvider.answering_json(OTHER_OPERATIONS_OBJECT))
    stub.point_adapters_here(settings)
    try:
        result = adapter_for(action).call(_ops_of_every_action()[action])
    finally:
        stub.close()

    assert (result.outcome, result.error_class, result.http_status) == (
        CallOutcome.UNKNOWN, "unexpected_body", 200)
    assert result.error_message.startswith("the provider answered 200 without ")
    assert (result.external_id, result.result) == ("", {})
    assert len(stub.requests) == 1 and stub.requests[0][0] in ("POST", "PATCH")


@pytest.mark.parametrize("action", ["crm.create_deal", "mail.send", "payments.create"])
def test_it_never_takes_a_lookup_answered_200_by_a_maintenance_page_for_proof_of_absence(
    maintenance_page, action
):
    # An HTML page is {} to the client: "no such effect" read from it would let the engine
    # call again, or close an unknown operation as never done.
    op = _ops_of_every_action()[action]

    found = adapter_for(action).lookup(op)

    assert [method for method, _ in maintenance_page.requests] == ["GET"]
    assert (found.outcome, found.retry_after, found.http_status) == (
        LookupOutcome.INCONCLUSIVE, timedelta(seconds=30), 200)
    assert found.reason.startswith("the provider answered 200 without its list of ")


@pytest.mark.parametrize(("action", "asked_by"), [
    ("payments.create", "lookup"), ("mail.send", "lookup"), ("crm.update_deal", "lookup"),
    ("payments.create", "retrieve"), ("mail.send", "retrieve"), ("crm.create_deal", "retrieve"),
])
def test_it_never_takes_a_2xx_that_is_not_the_object_asked_for_by_id_for_what_it_holds(
    maintenance_page, action, asked_by
):
    # Read as the object, a page would be a deal "found" without this update (so absent,
    # and the PATCH goes again), or a payment found in whatever status "" maps to.
    adapter = adapter_for(action)
    op = replace(_ops_of_every_action()[action], external_id="obj_1")

    found = adapter.lookup(op) if asked_by == "lookup" else adapter.retrieve("obj_1")

    assert (found.outcome, found.retry_after, found.method, found.http_status) == (
        LookupOutcome.INCONCLUSIVE, timedelta(seconds=30), LookupMethod.EXTERNAL_ID, 200)
    assert found.reason.startswith("the provider answered 200 without ")
    assert [method for method, _ in maintenance_page.requests] == ["GET"]
    assert maintenance_page.requests[0][1].endswith("/obj_1")


@pytest.mark.parametrize("action", ["crm.create_deal", "mail.send", "payments.create"])
def test_it_finds_nothing_in_a_list_of_objects_it_did_not_ask_for(settings, action):
    # A provider that ignored the filter (another API version, a renamed parameter) lists
    # others' objects: none of them is this operation's, nor proof that it has none.
    stub = NotTheProvider.answering_json(
        {"object": "search_result", "data": [OTHER_OPERATIONS_OBJECT]})
    stub.point_adapters_here(settings)
    try:
        found = adapter_for(action).lookup(_ops_of_every_action()[action])
    finally:
        stub.close()

    assert (found.outcome, found.retry_after, found.matches) == (
        LookupOutcome.INCONCLUSIVE, timedelta(seconds=30), [])
    assert "a list of only the " in found.reason and len(stub.requests) == 1


def test_it_is_inconclusive_inside_the_search_lag_then_found(sandbox, settings):
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 1.5
    # The provider's index trails by less than the engine allows for, as it must in real life.
    sandbox_fault_set(provider="payments", kind="search_lag", seconds=1.0)
    op = payment()
    called_at = timezone.now()
    created = PAYMENTS.call(op)
    op = replace(op, last_call_at=called_at)

    early = PAYMENTS.lookup(op)

    assert early.outcome is LookupOutcome.INCONCLUSIVE
    assert early.reason == "search inside the provider's lag window"
    assert timedelta(0) < early.retry_after <= timedelta(seconds=1.5)
    time.sleep(early.retry_after.total_seconds() + 0.3)
    late = PAYMENTS.lookup(op)
    assert late.outcome is LookupOutcome.FOUND
    assert late.external_id == created.external_id
    assert PaymentIntent.objects.count() == 1


def test_it_never_picks_one_of_several_payments(sandbox):
    op = payment()
    PAYMENTS.call(op)
    PAYMENTS.call(replace(op, idempotency_key="another-key"))

    result = PAYMENTS.lookup(op)

    assert result.outcome is LookupOutcome.INCONCLUSIVE
    assert result.reason == "2 payments carry this operation id"
    assert len(result.matches) == 2 and result.external_id == ""
    assert PaymentIntent.objects.count() == 2


def test_it_makes_one_payment_when_eight_threads_send_the_same_key(sandbox):
    op = payment()
    barrier = threading.Barrier(8)
    results = []

    def send() -> None:
        barrier.wait()
        results.append(PAYMENTS.call(op))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert PaymentIntent.objects.count() == 1
    assert sandbox_writes(provider="payments", operation_id=op.id).count() == 8
    intent_id = PaymentIntent.objects.get().id
    for result in results:
        if result.outcome is CallOutcome.SUCCEEDED:
            assert result.external_id == intent_id
        else:
            assert (result.outcome, result.error_class) == (
                CallOutcome.UNKNOWN, "concurrent_request"
            )
    assert len(results) == 8


def test_it_finds_a_crm_deal_by_agent_operation_id(sandbox):
    adapter = adapter_for("crm.create_deal")
    op = snapshot("crm.create_deal", {"name": "Acme renewal", "amount_minor": 500_000,
                                      "currency": "eur", "owner": "dana"})
    assert adapter.lookup(op).outcome is LookupOutcome.ABSENT

    result = adapter.call(op)

    assert result.outcome is CallOutcome.SUCCEEDED and result.http_status == 201
    found = adapter.lookup(op)
    assert (found.outcome, found.status, found.external_id) == (
        LookupOutcome.FOUND, CallOutcome.SUCCEEDED, result.external_id
    )
    assert Deal.objects.get().agent_operation_id == op.id


def test_it_never_takes_a_deal_it_was_given_and_cannot_find_for_proof_of_absence(sandbox):
    adapter = adapter_for("crm.create_deal")
    op = snapshot("crm.create_deal", {"name": "Acme renewal", "amount_minor": 500_000,
                                      "currency": "EUR", "owner": "dana"})
    made = adapter.call(op)
    # Someone deleted the deal at the CRM: its agent_operation_id is free again, so a
    # "proven absent" create would make a second deal for this operation.
    Deal.objects.filter(id=made.external_id).delete()
    assert adapter.lookup(op).outcome is LookupOutcome.ABSENT  # never named: nothing known

    gone = adapter.lookup(replace(op, external_id=made.external_id))

    assert (gone.outcome, gone.method, gone.retry_after) == (
        LookupOutcome.INCONCLUSIVE, LookupMethod.UNIQUE_FIELD, None
    )
    assert gone.reason.startswith(f"the provider no longer has {made.external_id}, which")


def test_it_refuses_a_second_deal_for_one_operation_at_the_crm(sandbox):
    adapter = adapter_for("crm.create_deal")
    op = snapshot("crm.create_deal", {"name": "Acme renewal", "amount_minor": 500_000,
                                      "currency": "EUR", "owner": "dana"})
    first = adapter.call(op)

    again = adapter.call(op)

    assert (again.outcome, again.error_class, again.http_status) == (
        CallOutcome.UNKNOWN, "already_exists", 409
    )
    assert again.result["error"]["existing_id"] == first.external_id
    # The deal it names is this call's object, so losing it later proves nothing.
    assert again.external_id == first.external_id
    assert Deal.objects.filter(agent_operation_id=op.id).count() == 1
    assert [w.response_status for w in sandbox_writes(provider="crm", operation_id=op.id)] == [
        201, 409
    ]


def test_it_is_inconclusive_without_retry_when_two_deals_carry_the_operation(sandbox):
    adapter = adapter_for("crm.create_deal")
    op = snapshot("crm.create_deal", {"name": "Acme renewal", "amount_minor": 500_000,
                                      "currency": "EUR", "owner": "dana"})
    created = adapter.call(op)
    # A data incident the API would refuse: an import copied the deal, field and all.
    original = Deal.objects.get(pk=created.external_id)
    Deal.objects.create(name=original.name, amount_minor=original.amount_minor,
                        currency=original.currency, owner=original.owner,
                        agent_operation_id=op.id)

    result = adapter.lookup(op)

    assert Deal.objects.filter(agent_operation_id=op.id).count() == 2
    assert result.outcome is LookupOutcome.INCONCLUSIVE
    assert result.reason == "data incident: 2 deals carry agent_operation_id"
    assert result.retry_after is None
    assert len(result.matches) == 2


def test_it_reports_a_crm_version_conflict_with_the_current_record(sandbox):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    adapter = adapter_for("crm.update_deal")
    first = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1,
                                         "patch": {"stage": "won"}})
    stale = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1,
                                         "patch": {"amount_minor": 999}})
    assert adapter.lookup(first).outcome is LookupOutcome.ABSENT

    applied = adapter.call(first)
    conflict = adapter.call(stale)

    assert applied.outcome is CallOutcome.SUCCEEDED and applied.result["version"] == 2
    assert conflict.outcome is CallOutcome.CONFLICT
    assert conflict.http_status == 409
    assert conflict.result["current_version"] == 2
    assert conflict.result["current"]["stage"] == "won"
    # Only the deal's fields a person decides on, not the CRM's whole record.
    assert set(conflict.result["current"]) == {
        "id", "name", "amount_minor", "currency", "owner", "stage", "version"}
    deal.refresh_from_db()
    assert (deal.version, deal.amount_minor, deal.applied_operation_ids) == (2, 100, [first.id])
    assert adapter.lookup(first).status is CallOutcome.SUCCEEDED
    assert adapter.lookup(stale).outcome is LookupOutcome.ABSENT
    assert Deal.objects.count() == 1


@pytest.mark.parametrize("patch", [{"stage": "x" * 41}, {"amount_minor": "ten"},
                                   {"name": ""}, {"currency": "euro"}, {"amount_minor": -1},
                                   {"amount_minor": True}, {},
                                   {"agent_operation_id": "op_other"}])
def test_it_refuses_a_deal_patch_the_deal_cannot_hold_with_a_400(sandbox, patch):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    op = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1, "patch": patch})

    result = adapter_for("crm.update_deal").call(op)

    assert (result.outcome, result.http_status) == (CallOutcome.FAILED, 400)
    deal.refresh_from_db()
    assert (deal.version, deal.applied_operation_ids) == (1, [])


def test_it_sends_a_deal_change_only_to_the_deal_it_names(sandbox):
    # A row journaled before targets were checked: its target is one path segment, never
    # a path that walks to another deal (or another endpoint) with the CRM's key.
    other = Deal.objects.create(name="Other", amount_minor=100, currency="EUR", owner="dana")
    op = snapshot("crm.update_deal", {"target": f"nothing/../{other.id}", "expected_version": 1,
                                      "patch": {"stage": "won"}})

    result = adapter_for("crm.update_deal").call(op)

    assert result.outcome is not CallOutcome.SUCCEEDED
    other.refresh_from_db()
    assert (other.version, other.stage, other.applied_operation_ids) == (1, "open", [])


def test_it_takes_a_conflict_caused_by_its_own_earlier_update_as_success(sandbox):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    adapter = adapter_for("crm.update_deal")
    op = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1,
                                      "patch": {"stage": "won"}})
    adapter.call(op)

    # The same PATCH again, as after a lost answer: the version moved on because of us.
    again = adapter.call(op)

    assert (again.outcome, again.external_id, again.http_status) == (
        CallOutcome.SUCCEEDED, deal.id, 409
    )
    assert again.result["version"] == 2 and again.result["stage"] == "won"
    deal.refresh_from_db()
    assert (deal.version, deal.applied_operation_ids) == (2, [op.id])
    assert len(sandbox_writes(provider="crm", operation_id=op.id)) == 2


def test_it_never_takes_a_deleted_deal_for_proof_that_its_update_never_landed(sandbox):
    deal = Deal.objects.create(name="Acme", amount_minor=100, currency="EUR", owner="dana")
    adapter = adapter_for("crm.update_deal")
    op = snapshot("crm.update_deal", {"target": deal.id, "expected_version": 1,
                                      "patch": {"stage": "won"}})
    assert adapter.lookup(op).outcome is LookupOutcome.ABSENT  # there, and not changed by us
    deal.delete()

    found = adapter.lookup(op)

    # Whether our change landed before the deal went cannot be told: a person decides,
    # and no automatic retry (which would PATCH a deal that is gone) follows.
    assert found.outcome is LookupOutcome.INCONCLUSIVE
    assert found.retry_after is None and found.http_status == 404
    assert not sandbox_writes(provider="crm", operation_id=op.id).exists()


def test_it_sends_mail_once_per_key_and_follows_delivery(sandbox):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {"invoice": "inv_42"}})
    assert adapter.lookup(op).outcome is LookupOutcome.ABSENT

    first = adapter.call(op)
    again = adapter.call(op)

    assert first.outcome is again.outcome is CallOutcome.ACCEPTED
    assert first.http_status == 202 and again.external_id == first.external_id
    assert Message.objects.count() == 1
    assert adapter.lookup(op).status is CallOutcome.ACCEPTED
    sandbox_message_deliver(message_id=first.external_id)
    assert adapter.lookup(op).status is CallOutcome.SUCCEEDED
    other = adapter.call(replace(op, payload={**op.payload, "to": "ceo@acme.test"}))
    assert (other.outcome, other.error_class) == (CallOutcome.UNKNOWN, "idempotency_error")
    assert Message.objects.count() == 1


def test_it_looks_a_known_message_up_by_its_id_after_the_key_is_forgotten(sandbox):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {"invoice": "inv_43"}})
    sent = adapter.call(op)
    # Eight days on, still queued: the provider keeps keys for 7 days, so by key an empty
    # answer would prove nothing; by the id it gave us, the message is found.
    later = replace(op, external_id=sent.external_id,
                    key_first_sent_at=timezone.now() - timedelta(days=8))
    found = adapter.lookup(later)
    assert (found.outcome, found.method, found.external_id, found.status) == (
        LookupOutcome.FOUND, LookupMethod.EXTERNAL_ID, sent.external_id, CallOutcome.ACCEPTED
    )
    assert found.operation_ids == (op.id,)
    assert not sandbox_requests(provider="mail", method="GET",
                                path_endswith="/messages").exists()


def test_it_never_takes_a_message_it_was_given_and_cannot_find_for_proof_of_absence(sandbox):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {"invoice": "inv_45"}})
    sent = adapter.call(op)
    # Mail providers keep their message log for a while only; past it, and past the key's
    # 7 days, a send with this key would be a second email.
    Message.objects.filter(id=sent.external_id).delete()

    gone = adapter.lookup(replace(op, external_id=sent.external_id,
                                  key_first_sent_at=timezone.now() - timedelta(days=8)))

    assert (gone.outcome, gone.method, gone.http_status, gone.retry_after) == (
        LookupOutcome.INCONCLUSIVE, LookupMethod.EXTERNAL_ID, 404, None
    )
    assert gone.reason.startswith(f"the provider no longer has {sent.external_id}, which")
    assert Message.objects.count() == 0


def test_it_proves_a_message_absent_by_its_key_only_while_the_provider_keeps_keys(sandbox):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", {"to": "cfo@acme.test", "template": "invoice_paid",
                                "params": {"invoice": "inv_44"}})
    now = timezone.now()
    recent = adapter.lookup(replace(op, key_first_sent_at=now - timedelta(days=6)))
    assert (recent.outcome, recent.method) == (LookupOutcome.ABSENT, LookupMethod.IDEMPOTENCY_KEY)
    # Past the provider's 7 days an empty answer by key proves nothing: the key is forgotten.
    # Aged from the key's first use: a later call with it does not make the provider keep it
    # longer.
    forgotten = adapter.lookup(replace(op, key_first_sent_at=now - timedelta(days=8),
                                       last_call_at=now - timedelta(days=2)))
    assert forgotten.outcome is LookupOutcome.INCONCLUSIVE
    assert forgotten.reason == "key retention window passed" and forgotten.retry_after is None


def _stripe_event(op_id: str, event_type: str = "payment_intent.succeeded") -> bytes:
    return json.dumps({
        "id": "evt_1", "object": "event", "type": event_type, "created": int(time.time()),
        "data": {"object": {"id": "pi_1", "status": "succeeded", "amount": 100,
                            "currency": "eur", "metadata": {"operation_id": op_id}}},
    }).encode()


def test_it_refuses_payment_webhooks_with_a_bad_or_old_signature(settings):
    verifier = webhook_verifier_for("payments")
    body = _stripe_event("op_1")
    good = stripe_signature_header(secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body)
    for header in (
        stripe_signature_header(secret="whsec_wrong", body=body),
        stripe_signature_header(secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body,
                                timestamp=int(time.time()) - 301),
        "",
    ):
        with pytest.raises(WebhookSignatureError):
            verifier.parse_webhook(headers={"Stripe-Signature": header}, body=body)
    with pytest.raises(WebhookSignatureError):
        verifier.parse_webhook(headers={"Stripe-Signature": good}, body=body + b" ")

    facts = verifier.parse_webhook(headers={"stripe-signature": good}, body=body)

    assert (facts.event_id, facts.event_type, facts.operation_id, facts.external_id,
            facts.status) == ("evt_1", "payment_intent.succeeded", "op_1", "pi_1",
                              CallOutcome.SUCCEEDED)
    assert facts.created_at is not None


@pytest.mark.parametrize(
    ("provider", "header", "event_type", "status"),
    [
        ("crm", "X-CRM-Signature", "deal.updated", CallOutcome.SUCCEEDED),
        ("mail", "X-Mail-Signature", "message.bounced", CallOutcome.FAILED),
    ],
)
def test_it_verifies_hmac_signed_webhooks(settings, provider, header, event_type, status):
    secret = getattr(settings, f"{provider.upper()}_WEBHOOK_SECRET")
    body = json.dumps({
        "id": "evt_2", "type": event_type, "created": 1_700_000_000, "operation_id": "op_2",
        "data": {"object": {"id": "obj_1", "operation_id": "op_2",
                            "agent_operation_id": "op_2"}},
    }).encode()
    verifier = webhook_verifier_for(provider)
    with pytest.raises(WebhookSignatureError):
        verifier.parse_webhook(headers={header: "sha256=" + "0" * 64}, body=body)

    facts = verifier.parse_webhook(
        headers={header: hmac_signature_header(secret=secret, body=body)}, body=body
    )

    assert (facts.event_id, facts.operation_id, facts.external_id, facts.status) == (
        "evt_2", "op_2", "obj_1", status
    )


def test_it_judges_a_payment_by_the_sum_and_currency_the_provider_reports():
    intent = payment(amount_minor=1000).payload

    def judged(**facts) -> str:
        return PAYMENTS.disagreement(payload=intent, facts={"id": "pi_1", **facts})

    assert judged(amount=1000, currency="eur") == ""
    assert judged() == ""  # an event that says nothing of the sum contradicts nothing
    assert judged(amount=1000, currency="usd") == (
        "pi_1 is for 1000 USD, the approved intent for 1000 EUR (minor units)"
    )
    assert judged(amount=100_000, currency="eur").startswith("pi_1 is for 100000 EUR")
    assert judged(amount=999) != ""


def test_it_judges_a_message_by_its_recipient_template_and_parameters_without_keeping_them(
    sandbox,
):
    adapter = adapter_for("mail.send")
    op = snapshot("mail.send", MAIL)
    sent = adapter.call(op)
    assert adapter.disagreement(payload=MAIL, facts=sent.result) == ""
    assert "cfo@acme.test" not in json.dumps(sent.result) and "inv_42" not in json.dumps(
        sent.result)

    def judged(**payload) -> str:
        return adapter.disagreement(payload={**MAIL, **payload}, facts=sent.result)

    msg = sent.external_id
    assert judged(to="CFO@ACME.TEST") == f"{msg} has another recipient than the approved email"
    assert judged(to="cfo@Acme.Test") == ""  # a domain is case-insensitive
    assert judged(template="offer") == f"{msg} has another template than the approved email"
    assert judged(to="ceo@acme.test", params={}) == (
        f"{msg} has another recipient and parameters than the approved email")
    # What the provider does not report contradicts nothing.
    assert adapter.disagreement(payload={**MAIL, "to": "x@y.test"}, facts={"id": msg}) == ""


@pytest.mark.parametrize(("currency", "amount_minor", "sent"), [
    ("EUR", 12_500, 12_500),
    ("JPY", 12_500, 12_500),
    ("KWD", 12_500, 12_500),
    # ISO 4217 minor units, as the approver read them, against Stripe's unit: ISK is
    # zero-decimal in ISO and counted in hundredths at Stripe; MGA two-decimal in ISO and
    # zero-decimal at Stripe; IQD three-decimal in ISO and two at Stripe.
    ("ISK", 500, 50_000),
    ("MGA", 125_000, 1_250),
    ("IQD", 12_500, 1_250),
], ids=["EUR", "JPY", "KWD", "ISK", "MGA", "IQD"])
def test_it_sends_the_approved_sum_in_the_providers_unit_and_judges_it_so(
    sandbox, currency, amount_minor, sent
):
    """500 ISK approved was sent as amount=500, which Stripe reads as 5 ISK."""
    op = snapshot("payments.create", {"amount_minor": amount_minor, "currency": currency,
                                      "invoice_id": "inv_42", "beneficiary_id": "ben_7"})

    result = PAYMENTS.call(op)

    assert result.outcome is CallOutcome.SUCCEEDED
    assert PaymentIntent.objects.get().amount == sent
    # What the provider reports back is the approved sum, not another.
    assert PAYMENTS.disagreement(payload=op.payload, facts=result.result) == ""
    assert PAYMENTS.disagreement(
        payload=op.payload, facts={**result.result, "amount": amount_minor + 1}) != ""


@pytest.mark.parametrize(("currency", "approved", "paid", "said"), [
    ("ISK", 500, 40_000, "pi_x is for 400 ISK, the approved intent for 500 ISK"),
    ("ISK", 500, 40_050, "pi_x is for 400.50 ISK, the approved intent for 500 ISK"),
    ("MGA", 500, 4, "pi_x is for 400 MGA, the approved intent for 500 MGA"),
    ("IQD", 1_000, 200, "pi_x is for 2000 IQD, the approved intent for 1000 IQD"),
    ("EUR", 1_000, 999, "pi_x is for 999 EUR, the approved intent for 1000 EUR"),
], ids=["ISK", "ISK-fraction", "MGA", "IQD", "EUR"])
def test_it_says_a_sum_that_disagrees_in_the_units_the_approval_card_showed(
    currency, approved, paid, said
):
    """Compared in Stripe's unit, the sums were said in it too: 500 ISK approved read as
    "50000 ISK (minor units)" beside a card that said 500."""
    message = PAYMENTS.disagreement(
        payload={"invoice_id": "inv_1", "beneficiary_id": "ben_1", "amount_minor": approved,
                 "currency": currency},
        facts={"id": "pi_x", "amount": paid, "currency": currency.lower()},
    )
    assert message == f"{said} (minor units)"


@pytest.mark.django_db
def test_it_refuses_to_prepare_a_sum_the_payments_provider_has_no_unit_for(acme):
    """Stripe charges MGA in whole ariary: 12.34 MGA could only be refused after approval."""
    from operations.engine import operation_prepare
    from operations.intents import IntentError
    from operations.models import Operation

    with pytest.raises(IntentError, match="takes MGA in whole units only"):
        operation_prepare(tenant=acme, action="payments.create", payload={
            "invoice_id": "inv_1", "beneficiary_id": "ben_7", "amount_minor": 1_234,
            "currency": "MGA"})
    assert not Operation.objects.exists()
    operation_prepare(tenant=acme, action="payments.create", payload={
        "invoice_id": "inv_1", "beneficiary_id": "ben_7", "amount_minor": 1_200,
        "currency": "MGA"})


LONG_DEAL = {"name": "Renewal", "amount_minor": 100, "currency": "EUR",
             "owner": "anna@example.com"}
LONG_DEAL_CHANGE = {"target": "deal_1", "expected_version": 1}
LONG_MAIL = {"to": "anna@example.com", "template": "offer", "params": {}}
LONG_PAYMENT = {"invoice_id": "inv_1", "beneficiary_id": "ben_7", "amount_minor": 1_200,
                "currency": "EUR"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("action", "payload", "said"),
    [
        # Sent as Stripe metadata values, which hold at most 500 characters.
        ("payments.create", {**LONG_PAYMENT, "invoice_id": "inv_" + "1" * 497},
         "invoice_id is longer than 500 characters"),
        ("payments.create", {**LONG_PAYMENT, "beneficiary_id": "vendor_" + "7" * 494},
         "beneficiary_id is longer than 500 characters"),
        # The CRM contract: a deal's name 200, its owner 150, its stage 40.
        ("crm.create_deal", {**LONG_DEAL, "name": "N" * 201},
         "name is longer than 200 characters"),
        ("crm.create_deal", {**LONG_DEAL, "owner": "o" * 139 + "@example.com"},
         "owner is longer than 150 characters"),
        ("crm.update_deal", {**LONG_DEAL_CHANGE, "patch": {"name": "N" * 201}},
         "patch.name is longer than 200 characters"),
        ("crm.update_deal", {**LONG_DEAL_CHANGE, "patch": {"stage": "s" * 41}},
         "patch.stage is longer than 40 characters"),
        # The mail contract (and RFC 5321): an address of at most 254 characters.
        ("mail.send", {**LONG_MAIL, "to": "a" * 243 + "@example.com"},
         "to is longer than 254 characters"),
    ],
    ids=["invoice_id", "beneficiary_id", "deal_name", "deal_owner", "patch_name",
         "patch_stage", "mail_to"],
)
def test_it_refuses_to_prepare_what_the_providers_contract_cannot_hold(acme, action, payload,
                                                                       said):
    """Prepared, a person approved it, and the provider refused it with a 400 only then."""
    from operations.engine import operation_prepare
    from operations.intents import IntentError
    from operations.models import AuditEvent, Operation

    with pytest.raises(IntentError, match=said) as refused:
        operation_prepare(tenant=acme, action=action, payload=payload)
    assert "\n" not in str(refused.value)
    assert not Operation.objects.exists()
    assert not AuditEvent.objects.filter(action="operation.prepare").exists()


@pytest.mark.django_db(transaction=True)
def test_it_prepares_a_reference_as_long_as_the_payments_provider_takes_and_pays_it(
    acme, approver, providers
):
    """The limit checked when prepared is the provider's own: one character more is refused
    before anyone approves it, and one at the limit is paid."""
    from operations.engine import operation_execute, operation_prepare
    from operations.intents import IntentError
    from operations.models import Operation
    from tests.operations.engine_helpers import authorized_payment

    longest = "inv_" + "1" * 496  # Stripe's most for a metadata value: 500 characters
    with pytest.raises(IntentError, match="invoice_id is longer than"):
        operation_prepare(tenant=acme, action="payments.create",
                          payload={**LONG_PAYMENT, "invoice_id": longest + "1"})
    assert not Operation.objects.exists()
    assert not sandbox_requests(provider="payments").exists()

    op = authorized_payment(acme, approver, invoice_id=longest)
    operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert op.status == "succeeded", (op.status, op.error_code)
    assert op.provider_calls == 1
    assert PaymentIntent.objects.get().metadata["invoice_id"] == longest
    assert sandbox_writes(provider="payments").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("currency", "largest"), [
    ("EUR", 99_999_999),
    ("ISK", 999_999),  # hundredths at Stripe: 999999 króna is eight digits there
    ("MGA", 9_999_999_900),  # whole ariary at Stripe
])
def test_it_refuses_to_prepare_a_sum_larger_than_the_payments_provider_takes(
    acme, currency, largest
):
    """Stripe takes at most eight digits in its unit: a larger sum, approved, could only
    fail at the provider."""
    from operations.engine import operation_prepare
    from operations.intents import IntentError
    from operations.models import Operation

    payload = {"invoice_id": "inv_1", "beneficiary_id": "ben_7", "currency": currency}
    too_large = largest + (100 if currency == "MGA" else 1)
    with pytest.raises(IntentError, match="the payments provider takes at most"):
        operation_prepare(tenant=acme, action="payments.create",
                          payload={**payload, "amount_minor": too_large})
    assert not Operation.objects.exists()
    operation_prepare(tenant=acme, action="payments.create",
                      payload={**payload, "amount_minor": largest})
    assert Operation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_calls_no_provider_for_an_approved_intent_prepared_before_its_limit(
    acme, approver, providers, monkeypatch
):
    """An intent approved before the adapter knew a limit (an amount over Stripe's eight
    digits) was called, and could only be refused by the provider."""
    from operations.engine import operation_execute
    from operations.models import Attempt, Evidence
    from operations.providers.payments import PaymentsCreateAdapter
    from tests.operations.engine_helpers import authorized_payment

    with monkeypatch.context() as before:
        before.setattr(PaymentsCreateAdapter, "intent_problem", lambda self, payload: "")
        op = authorized_payment(acme, approver, currency="EUR", amount_minor=100_000_000)

    report = operation_execute(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "cancelled"
    assert "the payments provider takes at most" in report.detail
    assert (op.status, op.error_code, op.provider_calls) == ("cancelled", "intent", 0)
    assert not Attempt.objects.filter(operation=op).exists()
    assert Evidence.objects.filter(operation=op, to_status="cancelled",
                                   summary__contains="takes at most").exists()
    assert not sandbox_requests(provider="payments").exists()
    assert not PaymentIntent.objects.exists()


def test_it_accepts_a_stripe_signature_by_any_secret_in_rotation_and_no_other(settings):
    # While a secret rolls over Stripe signs with both: the header carries one v1= per secret,
    # and the one made with ours may come second.
    verifier = webhook_verifier_for("payments")
    body = _stripe_event("op_1")
    t = int(time.time())
    ours = stripe_signature_header(secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body,
                                   timestamp=t).split(",v1=")[1]
    theirs = stripe_signature_header(secret="whsec_old", body=body, timestamp=t).split(",v1=")[1]
    for header in (f"t={t},v1={theirs},v1={ours}", f"t={t},v1={ours},v1={theirs}"):
        facts = verifier.parse_webhook(headers={"Stripe-Signature": header}, body=body)
        assert facts.event_id == "evt_1"
    for header in (f"t={t},v1={theirs},v1={'0' * 64}", f"t={t},v0={ours}", f"v1={ours}"):
        with pytest.raises(WebhookSignatureError):
            verifier.parse_webhook(headers={"Stripe-Signature": header}, body=body)


def test_it_refuses_an_hmac_signature_header_of_another_scheme(settings):
    body = json.dumps({"id": "evt_3", "type": "deal.updated", "created": 1,
                       "data": {"object": {"id": "deal_1"}}}).encode()
    digest = hmac_signature_header(secret=settings.CRM_WEBHOOK_SECRET, body=body).split("=", 1)[1]
    verifier = webhook_verifier_for("crm")
    for header in (f"md5={digest}", digest, "sha256="):
        with pytest.raises(WebhookSignatureError):
            verifier.parse_webhook(headers={"X-CRM-Signature": header}, body=body)
    assert verifier.parse_webhook(headers={"X-CRM-Signature": f"sha256={digest}"},
                                  body=body).event_id == "evt_3"


def test_it_links_a_deal_update_event_to_the_update_not_to_the_deals_create(settings):
    # The deal keeps the id of the operation that created it; an update names its own.
    body = json.dumps({
        "id": "evt_4", "type": "deal.updated", "created": 1_700_000_000,
        "operation_id": "op_update",
        "data": {"object": {"id": "deal_1", "agent_operation_id": "op_create"}},
    }).encode()
    facts = webhook_verifier_for("crm").parse_webhook(
        headers={"X-CRM-Signature": hmac_signature_header(secret=settings.CRM_WEBHOOK_SECRET,
                                                          body=body)},
        body=body,
    )
    assert (facts.operation_id, facts.external_id) == ("op_update", "deal_1")


@pytest.mark.parametrize(
    ("event_type", "operation_id"),
    [("deal.created", "op_create"), ("deal.deleted", "op_create"), ("deal.updated", "")],
)
def test_it_never_links_someones_deal_update_to_the_deals_create(
    settings, event_type, operation_id
):
    # An update that names no operation is someone's edit in the CRM: the deal still carries
    # the id of the operation that created it, which made none of that edit. Any other
    # event about the deal (made, deleted) is about what that operation made.
    body = json.dumps({
        "id": "evt_6", "type": event_type, "created": 1_700_000_000, "operation_id": "",
        "data": {"object": {"id": "deal_1", "agent_operation_id": "op_create"}},
    }).encode()
    facts = webhook_verifier_for("crm").parse_webhook(
        headers={"X-CRM-Signature": hmac_signature_header(secret=settings.CRM_WEBHOOK_SECRET,
                                                          body=body)},
        body=body,
    )
    # Never by the deal's id either, which the create and every update of the deal carry.
    assert (facts.operation_id, facts.external_id, facts.linked_by_object) == (
        operation_id, "deal_1", False)


def test_it_links_a_mail_event_by_the_operation_its_message_carries(settings):
    body = json.dumps({
        "id": "evt_5", "type": "message.delivered", "created": 1_700_000_000,
        "data": {"object": {"id": "msg_1", "operation_id": "op_mail"}},
    }).encode()
    facts = webhook_verifier_for("mail").parse_webhook(
        headers={"X-Mail-Signature": hmac_signature_header(secret=settings.MAIL_WEBHOOK_SECRET,
                                                           body=body)},
        body=body,
    )
    assert (facts.operation_id, facts.external_id, facts.status) == (
        "op_mail", "msg_1", CallOutcome.SUCCEEDED)


def test_it_marks_the_configured_credentials_in_what_an_answer_or_a_transport_error_says(
    settings
):
    # What a failure says is journaled and shown: a key there would reach every viewer.
    settings.CRM_API_KEY = "crm_live_k3y_0123456789\n"  # as read from a secret file
    settings.MAIL_WEBHOOK_SECRET = "mail-hook-secret-a\x01bcdef"
    echo = NotTheProvider.answering_json({"error": {
        "message": "Invalid API key crm_live_k3y_0123456789",
        "detail": ["signed with mail-hook-secret-a\x01bcdef", 3],
    }})
    try:
        answer = send("GET", echo.url, api_key="crm_sandbox_key")
    finally:
        echo.close()
    assert answer.error == {"message": "Invalid API key [provider key]",
                            "detail": ["signed with [provider key]", 3]}
    # As httpx words a header it refuses: the newline still shows what is wrong.
    assert credentials_marked(
        "Illegal header value b'Bearer crm_live_k3y_0123456789\\n'"
    ) == "Illegal header value b'Bearer [provider key]\\n'"
    assert credentials_marked("a b'mail-hook-secret-a\\x01bcdef' c") == "a b'[provider key]' c"
    # Any other secret the journal refuses from a person, and card data, are not kept either.
    jwt = "eyJhbGciOiJIUzI1.eyJzdWIiOiIx.SflKxwRJSMeK"
    assert credentials_marked(f"token {jwt}") == "token [secret]"
    assert "4242" not in credentials_marked("card 4242 4242 4242 4242 declined")
    # A provider's words are not a person's: held back at the widest card rule, mixed marks
    # between the groups included, where a person's are refused only at a card's shapes.
    assert "1111" not in credentials_marked("card 4111 1111-1111 1111 declined")
    assert credentials_marked("invoice INV-2025-0301-0007-1233 paid") == (
        "invoice INV-2025-0301-0007-1233 paid")


@pytest.mark.parametrize(
    ("answer", "outcome", "error_class"),
    [
        (Answer(None, transport_error="timeout"), CallOutcome.UNKNOWN, "timeout"),
        (Answer(None, transport_error="connection"), CallOutcome.UNKNOWN, "connection"),
        (Answer(503), CallOutcome.UNKNOWN, "http_5xx"),
        (Answer(429), CallOutcome.UNKNOWN, "rate_limited"),
        (Answer(409), CallOutcome.UNKNOWN, "concurrent_request"),
        (Answer(302), CallOutcome.UNKNOWN, "unexpected_status"),
        (Answer(422, {"error": {"type": "invalid_request_error", "code": "parameter_invalid"}}),
         CallOutcome.FAILED, "validation"),
        # Not the provider's refusal: a 4xx without its error body (a proxy's page), a 404
        # naming no code (Stripe's own answer to a path it does not know), a refused key.
        (Answer(422), CallOutcome.UNKNOWN, "http_4xx"),
        (Answer(404), CallOutcome.UNKNOWN, "http_4xx"),
        (Answer(404, {"error": {"type": "invalid_request_error",
                                "message": "Unrecognized request URL (POST: /v1/v1/x)"}}),
         CallOutcome.UNKNOWN, "http_4xx"),
        (Answer(404, {"error": {"type": "invalid_request_error", "code": "resource_missing"}}),
         CallOutcome.FAILED, "validation"),
        (Answer(401, {"error": {"type": "authentication_error", "code": "invalid_api_key"}}),
         CallOutcome.UNKNOWN, "not_authorized"),
        (Answer(403, {"error": {"type": "permission_error"}}),
         CallOutcome.UNKNOWN, "not_authorized"),
        (Answer(402, {"error": {"type": "card_error", "code": "card_declined"}}),
         CallOutcome.FAILED, "validation"),
        # Stripe: a failure "in a dependency external to Stripe", nothing of how far it got.
        (Answer(424), CallOutcome.UNKNOWN, "external_dependency"),
        # Stripe's error type and code outrank the status, as in Stripe's own client: a
        # rate limit coded the old way did nothing, and a misused key is for a person.
        (Answer(400, {"error": {"type": "invalid_request_error", "code": "rate_limit"}}),
         CallOutcome.UNKNOWN, "rate_limited"),
        (Answer(404, {"error": {"type": "idempotency_error"}}),
         CallOutcome.UNKNOWN, "idempotency_error"),
        (Answer(400, {"error": {"type": "invalid_request_error", "code": "amount_too_small"}}),
         CallOutcome.FAILED, "validation"),
    ],
)
def test_it_calls_only_a_4xx_refusal_a_definite_failure(answer, outcome, error_class):
    # Anything but a provider's plain refusal may have landed: unknown, to be looked up.
    assert not answer.ok
    assert call_failure(answer)[:2] == (outcome, error_class)
    result = call_result(answer, sent={"amount": 1}, outcome=lambda body: CallOutcome.SUCCEEDED,
                         facts=dict, lacks=lambda body: "")
    assert (result.outcome, result.error_class, result.external_id) == (
        outcome, error_class, "")
