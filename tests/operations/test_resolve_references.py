"""Resolving with a provider reference: the provider confirms the reference before anything is
recorded. One it does not confirm (unknown, not an id, another operation's or tenant's, a
status or a sum that contradicts the resolution, or a provider that cannot be asked) leaves
the operation as it was, with the question asked and the refusal on record; so does a
second object carrying the operation's id, when it records another."""

from __future__ import annotations

import pytest
from django.utils import timezone

from operations.engine import ReferenceRefused, TransitionRefused, operation_prepare
from operations.models import Attempt, AttemptKind, AuditEvent, Evidence, EvidenceKind, Operation
from operations.sandbox.models import PaymentIntent
from operations.sandbox.selectors import sandbox_requests, sandbox_writes
from operations.sandbox.services import (
    sandbox_deal_create,
    sandbox_fault_set,
    sandbox_message_create,
    sandbox_message_deliver,
    sandbox_payment_create,
    sandbox_payment_settle,
)
from operations.selectors import operation_timeline
from tests.helpers import signed_in
from tests.operations.engine_helpers import make_unknown, prepared_payment
from tests.operations.operator_helpers import (
    RESOLVE,
    TEXT_ONLY,
    payment_at_provider,
    resolved_by_reference,
    sandbox_request_count,
)


def _nothing_recorded(op: Operation) -> None:
    """A resolution refused before the provider was asked leaves the operation as it was,
    and no row about it."""
    before = (op.status, op.external_id, op.resolved_manually)
    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == before
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert not AuditEvent.objects.filter(
        object_id=op.id, action__startswith="operation.resolve"
    ).exists()
    assert not Attempt.objects.filter(operation=op).exists()


def _refusal_recorded(op: Operation, *, actor, reference: str, outcome: str = "succeeded",
                      evidence: str = "seen in the dashboard",
                      reason: str = "customer asked") -> str:
    """A reference the provider did not confirm leaves the operation as it was: what it
    records is the question asked (a lookup attempt), what came of it (lookup evidence) and
    the refused action (an audit row). Returns the refusal as recorded."""
    before = (op.status, op.external_id, op.resolved_manually, op.next_reconcile_at)
    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually, op.next_reconcile_at) == before
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert not AuditEvent.objects.filter(
        object_id=op.id, action=f"operation.resolve_{outcome}").exists()
    (attempt,) = Attempt.objects.filter(operation=op)
    assert (attempt.kind, attempt.number) == (AttemptKind.LOOKUP, 1)
    (audit,) = AuditEvent.objects.filter(object_id=op.id, action__endswith="_refused")
    assert (audit.action, audit.actor) == (f"operation.resolve_{outcome}_refused", actor)
    facts = {"outcome": outcome, "provider_reference": reference, "evidence": evidence,
             "reason": reason}
    assert audit.after == facts
    (noted,) = Evidence.objects.filter(operation=op)
    assert (noted.kind, noted.from_status, noted.to_status, noted.actor) == (
        EvidenceKind.LOOKUP, op.status, op.status, actor)
    assert noted.summary == (
        f"{actor.username}'s reference {reference} was not accepted: {audit.reason}")
    assert noted.data == {"attempt": 1, "method": "external_id",
                          "provider_request_id": attempt.provider_request_id,
                          "problem": audit.reason, **facts}
    return audit.reason


@pytest.mark.django_db(transaction=True)
def test_it_resolves_with_a_payment_reference_the_provider_confirms(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    payment_id = payment_at_provider(op)
    hash_before = op.payload_hash

    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve", {**RESOLVE, "resolve-provider_reference": payment_id}
    )

    assert response.status_code == 302
    op.refresh_from_db()
    assert (op.status, op.external_id, op.payload_hash) == ("succeeded", payment_id, hash_before)
    lookups = sandbox_requests(provider="payments", method="GET")
    assert sandbox_request_count() == lookups.count() == 1
    assert lookups.get().path.endswith(f"/v1/payment_intents/{payment_id}")
    evidence = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL)
    assert evidence.data["evidence"] == RESOLVE["resolve-evidence"]
    assert evidence.data["provider_reference"] == payment_id
    verified = evidence.data["verified"]
    assert (verified["external_id"], verified["status"], verified["operation_ids"]) == (
        payment_id, "succeeded", [op.id]
    )
    assert verified["provider_request_id"] == lookups.get().request_id
    assert verified["matches"][0]["status"] == "succeeded"
    attempt = Attempt.objects.get(operation=op)
    assert (attempt.kind, attempt.outcome, attempt.external_id, attempt.number) == (
        AttemptKind.LOOKUP, "found", payment_id, verified["attempt"]
    )
    assert attempt.provider_request_id == verified["provider_request_id"]
    assert attempt.started_at <= attempt.finished_at
    titles = [entry.title for entry in operation_timeline(op)]
    assert f"Attempt 1: lookup of the reference {payment_id} → found" in titles
    event = AuditEvent.objects.get(object_id=op.id, action="operation.resolve_succeeded")
    assert event.after == {"status": "succeeded", "external_id": payment_id,
                           "evidence": RESOLVE["resolve-evidence"],
                           "provider_reference": payment_id}
    assert not sandbox_writes(provider="payments").exists()


@pytest.mark.django_db(transaction=True)
def test_it_resolves_from_the_page_with_a_provider_reference_alone(
    acme_unknown, operator, sandbox
):
    """The engine takes evidence text or a reference the provider confirms; the page's form
    demanded the text even when the reference was given."""
    op = acme_unknown
    payment_id = payment_at_provider(op)

    response = signed_in(operator).post(f"/operations/{op.id}/resolve", {
        **RESOLVE, "resolve-evidence": "", "resolve-provider_reference": payment_id,
    })

    assert response.status_code == 302
    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == ("succeeded", payment_id, True)
    assert sandbox_request_count() == 1
    # The confirmed reference is the evidence on record.
    evidence = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL)
    assert (evidence.data["evidence"], evidence.data["provider_reference"]) == ("", payment_id)
    assert evidence.data["verified"]["external_id"] == payment_id
    assert evidence.summary == (f"resolved as succeeded by operator: the provider's "
                                f"{payment_id} ({payment_id} confirmed by payments)")
    event = AuditEvent.objects.get(object_id=op.id, action="operation.resolve_succeeded")
    assert event.after["provider_reference"] == payment_id


@pytest.mark.django_db(transaction=True)
def test_it_resolves_with_a_crm_deal_reference_the_provider_confirms(acme, operator, sandbox):
    op = make_unknown(operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"}))
    deal = sandbox_deal_create(name="Renewal", amount_minor=100000, currency="EUR",
                               owner="dana", agent_operation_id=op.id)

    op = resolved_by_reference(op, operator, deal.id)

    assert (op.status, op.external_id) == ("succeeded", deal.id)
    verified = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL).data["verified"]
    assert (verified["status"], verified["operation_ids"]) == ("succeeded", [op.id])
    assert sandbox_requests(provider="crm", method="GET").count() == sandbox_request_count() == 1
    assert Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("delivery", "outcome"), [("delivered", "succeeded"),
                                                   ("bounced", "failed")])
def test_it_resolves_with_a_mail_message_reference_the_provider_confirms(
    acme, operator, sandbox, delivery, outcome
):
    op = make_unknown(operation_prepare(tenant=acme, action="mail.send", payload={
        "to": "anna@example.com", "template": "receipt", "params": {"invoice": "inv_1"}}))
    message = sandbox_message_create(
        to="anna@example.com", template="receipt", params={"invoice": "inv_1"},
        operation_id=op.id, idempotency_key=op.idempotency_key, fingerprint="",
    )
    sandbox_message_deliver(message_id=message.id, status=delivery)

    op = resolved_by_reference(op, operator, message.id, outcome=outcome)

    assert (op.status, op.external_id) == (outcome, message.id)
    verified = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL).data["verified"]
    assert (verified["status"], verified["operation_ids"]) == (outcome, [op.id])
    [kept] = verified["matches"]
    # Digests of the recipient and parameters, never the address or the values themselves.
    assert sorted(kept) == ["id", "params_digest", "status", "template", "to_digest"]
    assert (kept["id"], kept["status"], kept["template"]) == (message.id, delivery, "receipt")
    assert "anna@" not in str(verified) and "inv_1" not in str(verified)
    assert sandbox_requests(provider="mail", method="GET").count() == sandbox_request_count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_the_provider_does_not_know(acme_unknown, operator, sandbox):
    op = acme_unknown
    typed = {**RESOLVE, "resolve-provider_reference": "pi_01TYPO"}

    response = signed_in(operator).post(f"/operations/{op.id}/resolve", typed)

    assert response.status_code == 400
    page = response.content.decode()
    assert ("Resolve refused: The payments provider says payment pi_01TYPO does not exist; "
            "check the reference.") in page
    # The draft stays on the page to be corrected, the refusal at the field it is about.
    assert 'value="pi_01TYPO"' in page and RESOLVE["resolve-evidence"] in page
    assert 'id="id_resolve-provider_reference_error"' in page
    assert sandbox_request_count() == 1
    assert _refusal_recorded(
        op, actor=operator, reference="pi_01TYPO", evidence=RESOLVE["resolve-evidence"],
        reason=RESOLVE["resolve-reason"],
    ) == "The payments provider says payment pi_01TYPO does not exist; check the reference."
    # On the timeline the lookup is about the reference, not proof that no payment exists.
    assert "Attempt 1: lookup of the reference pi_01TYPO → not found at the provider" in page
    assert "proven absent" not in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("typed", ["DE89370400440532013000", "79991234567"],
                         ids=["an-iban", "a-phone-number"])
def test_it_masks_a_typed_reference_in_the_timeline_as_everywhere_else(
    acme_unknown, operator, auditor, admin_user, sandbox, typed
):
    """The evidence line masked what a person typed as a reference, and the title of the
    lookup made to check it showed it whole beside it."""
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/resolve",
                                        {**RESOLVE, "resolve-provider_reference": typed})
    assert response.status_code == 400

    page = signed_in(auditor).get(f"/operations/{op.id}/").content.decode()
    assert f"Attempt 1: lookup of the reference ••••{typed[-4:]} → not found" in page
    assert typed not in page
    # The audited unmasked page shows it as typed.
    page = signed_in(admin_user).get(f"/operations/{op.id}/?unmasked=1").content.decode()
    assert f"Attempt 1: lookup of the reference {typed} → not found" in page


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_that_is_not_an_id_without_asking(
    acme_unknown, operator, sandbox
):
    with pytest.raises(ReferenceRefused, match="is not a provider id"):
        resolved_by_reference(acme_unknown, operator, "../search")
    assert sandbox_request_count() == 0
    _nothing_recorded(acme_unknown)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_another_operations_payment_id(acme, operator, sandbox):
    paid = make_unknown(prepared_payment(acme, invoice_id="inv_paid"))
    other = make_unknown(prepared_payment(acme, invoice_id="inv_other"))
    payment_id = payment_at_provider(paid)
    resolved_by_reference(paid, operator, payment_id)

    with pytest.raises(ReferenceRefused) as refused:
        resolved_by_reference(other, operator, payment_id)

    assert str(refused.value) == (
        f"{payment_id} at the payments provider belongs to {paid.id}, not to {other.id}; "
        "check the reference."
    )
    assert _refusal_recorded(other, actor=operator, reference=payment_id) == str(refused.value)
    paid.refresh_from_db()
    assert (paid.status, paid.external_id) == ("succeeded", payment_id)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_another_tenants_payment_id_without_naming_its_operation(
    acme, globex, operator, sandbox
):
    theirs = make_unknown(prepared_payment(globex, invoice_id="inv_theirs"))
    ours = make_unknown(prepared_payment(acme, invoice_id="inv_ours"))
    payment_id = payment_at_provider(theirs)

    with pytest.raises(ReferenceRefused) as refused:
        resolved_by_reference(ours, operator, payment_id)

    # The operator of one tenant never learns another tenant's operation ids.
    assert theirs.id not in str(refused.value)
    assert str(refused.value) == (
        f"{payment_id} at the payments provider belongs to an operation of another tenant, "
        f"not to {ours.id}; check the reference."
    )
    assert _refusal_recorded(ours, actor=operator, reference=payment_id) == str(refused.value)
    # Nor from what the refusal recorded: not their operation's id, nor their payment's sum.
    recorded = str([*Evidence.objects.filter(operation=ours).values(),
                    *AuditEvent.objects.filter(object_id=ours.id).values(),
                    *Attempt.objects.filter(operation=ours).values()])
    assert theirs.id not in recorded
    assert str(theirs.payload["amount_minor"]) not in recorded


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_payment_that_names_no_operation(acme_unknown, operator, sandbox):
    payment_id = sandbox_payment_create(amount=100, currency="kzt", metadata={},
                                        confirm=True)["id"]
    with pytest.raises(ReferenceRefused, match="names no operation") as refused:
        resolved_by_reference(acme_unknown, operator, payment_id)
    assert _refusal_recorded(acme_unknown, actor=operator, reference=payment_id) == str(
        refused.value)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("settle", "outcome", "said"), [
    ("failed", "succeeded", "requires_payment_method, which contradicts resolving as succeeded"),
    ("succeeded", "failed", "succeeded, which contradicts resolving as failed"),
    ("", "failed", "processing, not final yet"),
])
def test_it_refuses_a_reference_whose_status_contradicts_the_outcome(
    acme_unknown, operator, sandbox, settings, settle, outcome, said
):
    op = acme_unknown
    # From the sandbox's async threshold on, a payment stays processing until settled.
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = op.payload["amount_minor"]
    payment_id = payment_at_provider(op)
    if settle:
        sandbox_payment_settle(payment_intent_id=payment_id, status=settle)

    with pytest.raises(ReferenceRefused) as refused:
        resolved_by_reference(op, operator, payment_id, outcome=outcome)

    assert f"The payments provider reports {payment_id} as {said}" in str(refused.value)
    assert sandbox_request_count() == 1
    assert _refusal_recorded(op, actor=operator, reference=payment_id, outcome=outcome) == str(
        refused.value)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_when_the_provider_cannot_be_asked_and_records_only_the_question(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    payment_id = payment_at_provider(op)
    sandbox_fault_set(provider="payments", kind="http_500")
    client = signed_in(operator)

    body = client.post(
        f"/operations/{op.id}/resolve", {**RESOLVE, "resolve-provider_reference": payment_id},
        HTTP_HX_REQUEST="true",
    ).content.decode()

    assert f"The payments provider could not be asked about {payment_id}" in body
    assert "try again, or resolve with the evidence text alone." in body
    assert sandbox_requests(provider="payments").get().response_status == 500
    assert _refusal_recorded(
        op, actor=operator, reference=payment_id, evidence=RESOLVE["resolve-evidence"],
        reason=RESOLVE["resolve-reason"],
    ).startswith(f"The payments provider could not be asked about {payment_id}")

    # Words alone still settle it, without asking the provider again.
    assert client.post(f"/operations/{op.id}/resolve", TEXT_ONLY).status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded" and op.external_id == ""
    assert sandbox_request_count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_provider_request_for_a_text_only_resolution(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/resolve", TEXT_ONLY)
    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded"
    assert sandbox_request_count() == 0
    assert not Attempt.objects.filter(operation=op).exists()


@pytest.mark.django_db(transaction=True)
def test_it_asks_the_provider_only_about_an_operation_that_can_be_resolved(
    acme, operator, sandbox
):
    op = prepared_payment(acme, invoice_id="inv_fresh")  # not_started: nothing to resolve
    with pytest.raises(TransitionRefused, match="cannot be resolved as succeeded"):
        resolved_by_reference(op, operator, payment_at_provider(op))
    assert sandbox_request_count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_to_a_payment_for_another_sum(acme_unknown, operator, sandbox):
    op = acme_unknown
    payment_id = payment_at_provider(op, amount=99_900)

    with pytest.raises(ReferenceRefused) as refused:
        resolved_by_reference(op, operator, payment_id)

    assert str(refused.value) == (
        f"{payment_id} is for 99900 KZT, the approved intent for 1250000 KZT (minor units), so "
        "it is not this operation's approved effect; check the reference, or mark the "
        "operation disputed."
    )
    assert sandbox_request_count() == 1
    assert _refusal_recorded(op, actor=operator, reference=payment_id) == str(refused.value)


def _accepted_with(op: Operation, external_id: str) -> Operation:
    """The provider took the call as `external_id`, still processing, and its answer was
    recorded."""
    Operation.objects.filter(id=op.id).update(
        status="accepted", external_id=external_id, provider_calls=1,
        status_changed_at=timezone.now())
    op.refresh_from_db()
    return op


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_to_a_second_payment_of_an_operation_that_records_one(
    acme, operator, sandbox, settings
):
    op = prepared_payment(acme)
    # From the sandbox's async threshold on, a payment stays processing until settled.
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = op.payload["amount_minor"]
    first = payment_at_provider(op)
    second = payment_at_provider(op)
    sandbox_payment_settle(payment_intent_id=second, status="succeeded")
    op = _accepted_with(op, first)

    with pytest.raises(ReferenceRefused) as refused:
        resolved_by_reference(op, operator, second)

    assert str(refused.value) == (
        f"{op.id} records {first} at the payments provider, and {second} is another object "
        "carrying its id: a second effect, which no resolution settles; mark the operation "
        "disputed while it is looked into."
    )
    assert _refusal_recorded(op, actor=operator, reference=second) == str(refused.value)
    op.refresh_from_db()
    assert (op.status, op.external_id) == ("accepted", first)
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 2


@pytest.mark.django_db(transaction=True)
def test_it_resolves_with_the_reference_of_the_payment_the_operation_records(
    acme, operator, sandbox, settings
):
    op = prepared_payment(acme)
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = op.payload["amount_minor"]
    payment_id = payment_at_provider(op)
    sandbox_payment_settle(payment_intent_id=payment_id, status="succeeded")
    op = _accepted_with(op, payment_id)

    resolved_by_reference(op, operator, payment_id)

    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == (
        "succeeded", payment_id, True)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_resolution_when_another_object_is_recorded_while_the_provider_is_asked(
    acme_unknown, operator, sandbox, monkeypatch
):
    from operations.engine import people

    op = acme_unknown
    ours, another = payment_at_provider(op), payment_at_provider(op)
    real_verify = people._reference_verify

    def another_recorded_meanwhile(op_, **kwargs):
        verified = real_verify(op_, **kwargs)
        # A lookup of the engine's records the other payment while the operator's reference
        # is being confirmed; the status stays unknown.
        Operation.objects.filter(id=op.id).update(external_id=another)
        return verified

    monkeypatch.setattr(people, "_reference_verify", another_recorded_meanwhile)
    with pytest.raises(TransitionRefused, match="not what the page showed"):
        resolved_by_reference(op, operator, ours)

    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == ("unknown", another, False)
    assert not AuditEvent.objects.filter(
        object_id=op.id, action="operation.resolve_succeeded").exists()
