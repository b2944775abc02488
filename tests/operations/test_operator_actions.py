from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from operations.engine import (
    ReferenceRefused,
    TransitionRefused,
    operation_dispute,
    operation_prepare,
    operation_resolve,
)
from operations.forms import ResolveForm
from operations.models import (
    Attempt,
    AttemptKind,
    AuditEvent,
    Evidence,
    EvidenceKind,
    Operation,
    WebhookEvent,
)
from operations.sandbox.selectors import (
    sandbox_counts,
    sandbox_requests,
    sandbox_writes,
)
from operations.sandbox.services import (
    sandbox_deal_create,
    sandbox_fault_set,
    sandbox_message_create,
    sandbox_message_deliver,
    sandbox_payment_create,
    sandbox_payment_settle,
)
from tests.helpers import signed_in
from tests.operations.engine_helpers import make_unknown, prepared_payment

RESOLVE = {
    "resolve-outcome": "succeeded",
    "resolve-evidence": "pi_123 seen as succeeded in the provider dashboard",
    "resolve-provider_reference": "pi_123",
    "resolve-reason": "customer confirmed the transfer",
}
# Evidence in words only: nothing to ask the provider.
TEXT_ONLY = {**RESOLVE, "resolve-provider_reference": ""}


def _audits(op, action: str) -> int:
    return AuditEvent.objects.filter(
        object_type="operation", object_id=op.id, action=action
    ).count()


@pytest.mark.django_db
def test_it_resolves_an_unknown_operation_with_evidence_and_audit(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    response = client.post(f"/operations/{op.id}/resolve", TEXT_ONLY)
    assert response.status_code == 302 and response["Location"] == f"/operations/{op.id}/"
    op.refresh_from_db()
    assert op.status == "succeeded" and op.resolved_manually and op.external_id == ""
    event = AuditEvent.objects.get(object_id=op.id, action="operation.resolve_succeeded")
    assert event.actor_username == "operator"
    assert event.reason == "customer confirmed the transfer"
    # What the person went by is on the trail itself: an auditor reads it there and in the
    # CSV, without opening each operation's timeline.
    assert event.before == {"status": "unknown"} and event.after == {
        "status": "succeeded", "evidence": RESOLVE["resolve-evidence"], "provider_reference": "",
    }
    evidence = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL)
    assert (evidence.from_status, evidence.to_status, evidence.actor) == (
        "unknown",
        "succeeded",
        operator,
    )
    assert evidence.data["evidence"] == RESOLVE["resolve-evidence"]
    assert "verified" not in evidence.data
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "Resolved as succeeded." in page
    assert "Audit operation.resolve_succeeded" in page


@pytest.mark.django_db
def test_it_resolves_as_failed_with_the_error_recorded(acme_unknown, operator):
    op = acme_unknown
    data = {**TEXT_ONLY, "resolve-outcome": "failed"}
    signed_in(operator).post(f"/operations/{op.id}/resolve", data)
    op.refresh_from_db()
    assert op.status == "failed" and op.error_code == "resolved_failed"
    assert _audits(op, "operation.resolve_failed") == 1


ACTION_FORMS = {**RESOLVE, "dispute-reason": "x", "reconcile-reason": "x"}


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["resolve", "dispute", "reconcile"])
@pytest.mark.parametrize(("users", "code"), [
    (("approver", "auditor"), 403),  # they see the tenant, but may not operate
    (("other_tenant_user", "stranger"), 404),  # the operation is not theirs to see at all
])
def test_it_refuses_operator_actions_to_those_without_the_operate_permission(
    acme_unknown, path, users, code, request
):
    op = acme_unknown
    for who in users:
        response = signed_in(request.getfixturevalue(who)).post(
            f"/operations/{op.id}/{path}", ACTION_FORMS
        )
        assert response.status_code == code, who
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert (
        AuditEvent.objects.filter(object_id=op.id).exclude(action="operation.prepare").count() == 0
    )


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["resolve", "dispute", "reconcile"])
def test_it_refuses_get_on_action_urls(acme_unknown, operator, path):
    assert signed_in(operator).get(f"/operations/{acme_unknown.id}/{path}").status_code == 405


@pytest.mark.django_db
def test_it_refuses_a_post_without_csrf_token(acme_unknown, operator):
    client = signed_in(operator, enforce_csrf_checks=True)
    response = client.post(f"/operations/{acme_unknown.id}/resolve", RESOLVE)
    assert response.status_code == 403
    acme_unknown.refresh_from_db()
    assert acme_unknown.status == "unknown"


@pytest.mark.django_db
@pytest.mark.parametrize("missing", ["resolve-reason", "resolve-evidence"])
def test_it_requires_a_reason_and_evidence_to_resolve(acme_unknown, operator, missing):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/resolve", {**RESOLVE, missing: " "})
    assert response.status_code == 400
    assert "This field is required." in response.content.decode()
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert _audits(op, "operation.resolve_succeeded") == 0


CARD = "4111 1111 1111 1111"


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "field"), [
    ("resolve", "resolve-evidence"), ("resolve", "resolve-reason"),
    ("resolve", "resolve-provider_reference"), ("dispute", "dispute-reason"),
    ("reconcile", "reconcile-reason"),
])
def test_it_keeps_card_numbers_an_operator_types_out_of_the_journal(
    acme_unknown, operator, path, field
):
    op = acme_unknown
    form = RESOLVE if path == "resolve" else {f"{path}-reason": "checked"}
    response = signed_in(operator).post(
        f"/operations/{op.id}/{path}", {**form, field: f"refunded to card {CARD}"}
    )
    assert response.status_code == 400
    assert "looks like a full card number" in response.content.decode()
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, summary__contains="4111").exists()
    assert not AuditEvent.objects.filter(object_id=op.id, reason__contains="4111").exists()
    assert not Attempt.objects.filter(operation=op).exists()  # no lookup was made either


@pytest.mark.django_db
def test_it_refuses_card_numbers_from_any_caller_of_the_services(acme_unknown, operator):
    from operations.engine import TransitionRefused, operation_reconcile, operation_resolve

    op = acme_unknown
    with pytest.raises(TransitionRefused, match="evidence: looks like a full card number"):
        operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                          evidence_text=f"card {CARD}", reason="checked")
    with pytest.raises(TransitionRefused, match="reason: looks like a full card number"):
        operation_dispute(operation_id=op.id, actor=operator, reason=f"card {CARD}")
    with pytest.raises(TransitionRefused, match="reason: looks like"):
        operation_reconcile(operation_id=op.id, actor=operator,
                            reason="key sk_live_abcdefgh12345678")
    op.refresh_from_db()
    assert op.status == "unknown" and not Evidence.objects.filter(operation=op).exists()


@pytest.mark.django_db
def test_it_requires_a_reason_to_dispute(acme_unknown, operator):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/dispute", {"dispute-reason": ""})
    assert response.status_code == 400
    op.refresh_from_db()
    assert op.status == "unknown" and _audits(op, "operation.dispute") == 0
    # The error is part of the field's label, its accessible name: the field itself is
    # hx-preserve'd, so its own aria-invalid never reaches the page after an htmx post.
    html = response.content.decode()
    assert re.search(
        r'<label for="id_dispute-reason">Reason <span class="error" id="id_dispute-reason_error">',
        html,
    ), html


@pytest.mark.django_db
def test_it_disputes_then_resolves_once_and_refuses_a_second_resolution(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    response = client.post(
        f"/operations/{op.id}/dispute", {"dispute-reason": "customer says they were charged twice"}
    )
    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "disputed" and op.resolved_manually
    assert _audits(op, "operation.dispute") == 1
    assert (
        Evidence.objects.filter(
            operation=op, kind=EvidenceKind.MANUAL, to_status="disputed"
        ).count()
        == 1
    )

    assert client.post(f"/operations/{op.id}/resolve", TEXT_ONLY).status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded"
    second = client.post(f"/operations/{op.id}/resolve", TEXT_ONLY, follow=True)
    assert second.status_code == 200
    assert "Resolve refused" in second.content.decode()
    op.refresh_from_db()
    assert op.status == "succeeded"
    assert _audits(op, "operation.resolve_succeeded") == 1
    assert Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).count() == 2


@pytest.mark.django_db
def test_it_shows_an_engine_refusal_as_a_message_not_a_500(acme_payment, operator):
    op = acme_payment  # not_started: nothing to dispute
    response = signed_in(operator).post(
        f"/operations/{op.id}/dispute", {"dispute-reason": "just because"}, follow=True
    )
    assert response.status_code == 200
    assert "Dispute refused" in response.content.decode()
    op.refresh_from_db()
    assert op.status == "not_started" and _audits(op, "operation.dispute") == 0


@pytest.mark.django_db
def test_it_re_renders_the_panel_in_place_for_htmx(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    response = client.post(
        f"/operations/{op.id}/dispute",
        {"dispute-reason": "on hold for review"},
        HTTP_HX_REQUEST="true",
    )
    body = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in body
    assert "Marked disputed" in body and "status-disputed" in body
    assert "Resolve as succeeded" in body and "Mark disputed</button>" not in body
    refused = client.post(
        f"/operations/{op.id}/dispute", {"dispute-reason": "again"}, HTTP_HX_REQUEST="true"
    )
    assert refused.status_code == 200 and "Dispute refused" in refused.content.decode()
    invalid = client.post(
        f"/operations/{op.id}/resolve", {**RESOLVE, "resolve-reason": ""}, HTTP_HX_REQUEST="true"
    )
    assert invalid.status_code == 200 and "This field is required." in invalid.content.decode()


@pytest.mark.django_db
def test_it_shows_the_buttons_only_when_useful_and_permitted(
    acme_unknown, acme_payment, operator, approver
):
    unknown_page = signed_in(operator).get(f"/operations/{acme_unknown.id}/").content.decode()
    assert "Reconcile now</button>" in unknown_page
    assert "Resolve as succeeded" in unknown_page and "Mark disputed</button>" in unknown_page
    fresh_page = signed_in(operator).get(f"/operations/{acme_payment.id}/").content.decode()
    assert "Reconcile now" not in fresh_page and "Resolve as" not in fresh_page
    approver_page = signed_in(approver).get(f"/operations/{acme_unknown.id}/").content.decode()
    assert "Reconcile now" not in approver_page and "Resolve as" not in approver_page


@pytest.mark.django_db
def test_it_offers_only_dispute_on_a_finished_operation(acme, operator, approver):
    op = prepared_payment(acme, invoice_id="inv_done")
    Operation.objects.filter(id=op.id).update(status="succeeded", external_id="pi_done")
    page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "Mark disputed</button>" in page
    assert "Reconcile now" not in page and "Resolve as" not in page
    assert "Mark disputed" not in signed_in(approver).get(f"/operations/{op.id}/").content.decode()

    signed_in(operator).post(f"/operations/{op.id}/dispute",
                             {"dispute-reason": "beneficiary says no money arrived"})

    op.refresh_from_db()
    assert op.status == "disputed" and op.resolved_manually
    event = AuditEvent.objects.get(object_id=op.id, action="operation.dispute")
    assert event.reason == "beneficiary says no money arrived"
    page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "Resolve as succeeded" in page and "Mark disputed</button>" not in page


@pytest.mark.django_db
def test_it_offers_dispute_for_an_expired_lease_only(acme, operator):
    op = prepared_payment(acme, invoice_id="inv_stuck")
    Operation.objects.filter(id=op.id).update(
        status="in_progress",
        lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "Mark disputed</button>" not in page
    Operation.objects.filter(id=op.id).update(
        lease_expires_at=timezone.now() - timedelta(minutes=5)
    )
    page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "Mark disputed</button>" in page and "expired" in page
    signed_in(operator).post(f"/operations/{op.id}/dispute", {"dispute-reason": "worker died"})
    op.refresh_from_db()
    assert op.status == "disputed" and op.lease_expires_at is None


@pytest.mark.django_db(transaction=True)
def test_it_reconciles_now_with_a_lookup_attempt_and_audit(acme_unknown, operator, sandbox):
    # The sandbox's search answers 500: a real lookup that proves nothing either way.
    sandbox_fault_set(provider="payments", kind="http_500", times=3)
    op = acme_unknown
    hash_before = op.payload_hash
    response = signed_in(operator).post(
        f"/operations/{op.id}/reconcile",
        {"reconcile-reason": "customer is asking"},
        HTTP_HX_REQUEST="true",
    )
    body = response.content.decode()
    assert response.status_code == 200 and "Reconcile: inconclusive" in body
    op.refresh_from_db()
    assert op.status == "unknown" and op.payload_hash == hash_before
    assert Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).count() == 1
    assert not Attempt.objects.filter(operation=op, kind=AttemptKind.CALL).exists()
    event = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert event.reason == "customer is asking" and event.actor_username == "operator"
    assert Evidence.objects.filter(operation=op, kind=EvidenceKind.LOOKUP).count() == 1
    assert "Attempt 1: provider lookup" in body
    assert not sandbox_writes(provider="payments").exists()


@pytest.mark.django_db(transaction=True)
def test_it_hands_a_proven_absent_operation_back_to_a_worker_after_reconcile_now(
    acme, approver, operator, sandbox, monkeypatch
):
    from operations import tasks
    from operations.engine import operation_execute
    from tests.operations.engine_helpers import authorized_payment

    queued: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", queued.append)
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    operation_execute(operation_id=op.id)  # refused before any write: unknown

    body = signed_in(operator).post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "customer is asking"},
        HTTP_HX_REQUEST="true").content.decode()

    op.refresh_from_db()
    assert op.status == "not_started" and queued == [op.id]
    assert "queued to run again with the same key" in body
    assert not sandbox_writes(provider="payments").filter(response_status=200).exists()


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_disputed_operation_alone_on_the_engine_side_too(
    acme_unknown, operator, approver, sandbox
):
    op = operation_dispute(operation_id=acme_unknown.id, actor=operator, reason="hold")
    response = signed_in(approver).post(f"/operations/{op.id}/resolve", RESOLVE)
    assert response.status_code == 403
    # An operator may ask for a reconcile, but nothing reads the provider or moves a hold.
    requests_before = sandbox_requests(provider="payments").count()
    response = signed_in(operator).post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "check again"})
    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "disputed"
    assert not Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).exists()
    assert sandbox_requests(provider="payments").count() == requests_before
    # The request itself is on the trail, with its reason, though nothing was looked up.
    event = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert (event.reason, event.actor_username) == ("check again", "operator")
    assert event.before == {"status": "disputed"}
    assert event.after == {"status": "disputed", "lookup": "none",
                           "detail": "nothing to do: disputed"}


@pytest.mark.django_db
def test_it_puts_the_status_a_reconcile_now_moved_on_the_trail(acme_unknown, operator, sandbox):
    # The trail is where an auditor reads what people did: a reconcile that settled an
    # operation said only what the lookup found, never from which status to which.
    op = acme_unknown
    _payment_at_provider(op)  # the call whose answer was lost did land
    response = signed_in(operator).post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "customer is asking"})
    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded"
    event = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert (event.actor_username, event.reason) == ("operator", "customer is asking")
    assert event.before == {"status": "unknown"}
    assert (event.after["status"], event.after["lookup"]) == ("succeeded", "found")


@pytest.mark.django_db
def test_it_tells_an_open_page_that_the_operation_moved_on(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/")
    seen = page.context["seen"]
    assert 'id="status-watch"' in page.content.decode()

    def watch() -> str:
        response = client.get(f"/operations/{op.id}/", {"seen": seen}, HTTP_HX_REQUEST="true")
        # The same URL without htmx is the whole page: no cache may hand out one for the other.
        assert "HX-Request" in response["Vary"]
        return response.content.decode()

    assert "HX-Request" in page["Vary"]
    quiet = watch()
    assert "<html" not in quiet and "This operation is now" not in quiet
    operation_dispute(operation_id=op.id, actor=operator, reason="customer disputes it")
    moved = watch()
    assert "This operation is now <strong>Disputed (on hold)</strong>" in moved
    assert f'href="/operations/{op.id}/">Reload</a>' in moved
    # Said once: the watch stops polling, so its live region does not repeat it every 10 s.
    assert "hx-trigger" not in moved


@pytest.mark.django_db
def test_it_keeps_drafts_and_tells_a_lookup_that_settled_nothing_from_success(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    # The sandbox answers every lookup with a 5xx: the reconcile settles nothing.
    sandbox_fault_set(provider="payments", kind="http_500", match="*", times=10)
    body = signed_in(operator).post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "customer is asking"},
        HTTP_HX_REQUEST="true",
    ).content.decode()
    assert '<li class="info">Reconcile: inconclusive; status unknown' in body
    # Drafts typed in the other actions survive the panel's re-render (htmx keeps them).
    fields = {name: attrs for attrs, name in
              re.findall(r'<(?:textarea|input)([^>]*name="([^"]+)"[^>]*)>', body)}
    for field in ("resolve-evidence", "resolve-reason", "resolve-provider_reference",
                  "dispute-reason"):
        assert "hx-preserve" in fields[field], field


# --- a provider reference is confirmed at the provider before anything is recorded ---------


def _payment_at_provider(op: Operation, *, amount: int | None = None, **metadata: str) -> str:
    """A payment the sandbox holds (made there directly, so no request is logged); for the
    intent's own sum unless told otherwise."""
    return sandbox_payment_create(
        amount=op.payload["amount_minor"] if amount is None else amount,
        currency=op.payload["currency"].lower(), metadata={"operation_id": op.id, **metadata},
        confirm=True,
    )["id"]


def _resolve(op: Operation, actor, reference: str, *, outcome: str = "succeeded") -> Operation:
    return operation_resolve(
        operation_id=op.id, actor=actor, outcome=outcome, evidence_text="seen in the dashboard",
        reason="customer asked", provider_reference=reference,
    )


def _requests() -> int:
    return sandbox_counts()["requests"]


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
    payment_id = _payment_at_provider(op)
    hash_before = op.payload_hash

    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve", {**RESOLVE, "resolve-provider_reference": payment_id}
    )

    assert response.status_code == 302
    op.refresh_from_db()
    assert (op.status, op.external_id, op.payload_hash) == ("succeeded", payment_id, hash_before)
    lookups = sandbox_requests(provider="payments", method="GET")
    assert _requests() == lookups.count() == 1
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
    event = AuditEvent.objects.get(object_id=op.id, action="operation.resolve_succeeded")
    assert event.after == {"status": "succeeded", "external_id": payment_id,
                           "evidence": RESOLVE["resolve-evidence"],
                           "provider_reference": payment_id}
    assert not sandbox_writes(provider="payments").exists()


@pytest.mark.django_db(transaction=True)
def test_it_resolves_with_a_crm_deal_reference_the_provider_confirms(acme, operator, sandbox):
    op = make_unknown(operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"}))
    deal = sandbox_deal_create(name="Renewal", amount_minor=100000, currency="EUR",
                               owner="dana", agent_operation_id=op.id)

    op = _resolve(op, operator, deal.id)

    assert (op.status, op.external_id) == ("succeeded", deal.id)
    verified = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL).data["verified"]
    assert (verified["status"], verified["operation_ids"]) == ("succeeded", [op.id])
    assert sandbox_requests(provider="crm", method="GET").count() == _requests() == 1
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

    op = _resolve(op, operator, message.id, outcome=outcome)

    assert (op.status, op.external_id) == (outcome, message.id)
    verified = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL).data["verified"]
    assert (verified["status"], verified["operation_ids"]) == (outcome, [op.id])
    assert verified["matches"] == [{"id": message.id, "status": delivery}]
    assert sandbox_requests(provider="mail", method="GET").count() == _requests() == 1


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
    assert _requests() == 1
    assert _refusal_recorded(
        op, actor=operator, reference="pi_01TYPO", evidence=RESOLVE["resolve-evidence"],
        reason=RESOLVE["resolve-reason"],
    ) == "The payments provider says payment pi_01TYPO does not exist; check the reference."


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_that_is_not_an_id_without_asking(
    acme_unknown, operator, sandbox
):
    with pytest.raises(ReferenceRefused, match="is not a provider id"):
        _resolve(acme_unknown, operator, "../search")
    assert _requests() == 0
    _nothing_recorded(acme_unknown)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_another_operations_payment_id(acme, operator, sandbox):
    paid = make_unknown(prepared_payment(acme, invoice_id="inv_paid"))
    other = make_unknown(prepared_payment(acme, invoice_id="inv_other"))
    payment_id = _payment_at_provider(paid)
    _resolve(paid, operator, payment_id)

    with pytest.raises(ReferenceRefused) as refused:
        _resolve(other, operator, payment_id)

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
    payment_id = _payment_at_provider(theirs)

    with pytest.raises(ReferenceRefused) as refused:
        _resolve(ours, operator, payment_id)

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
        _resolve(acme_unknown, operator, payment_id)
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
    payment_id = _payment_at_provider(op)
    if settle:
        sandbox_payment_settle(payment_intent_id=payment_id, status=settle)

    with pytest.raises(ReferenceRefused) as refused:
        _resolve(op, operator, payment_id, outcome=outcome)

    assert f"The payments provider reports {payment_id} as {said}" in str(refused.value)
    assert _requests() == 1
    assert _refusal_recorded(op, actor=operator, reference=payment_id, outcome=outcome) == str(
        refused.value)


@pytest.mark.django_db(transaction=True)
def test_it_refuses_when_the_provider_cannot_be_asked_and_records_only_the_question(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    payment_id = _payment_at_provider(op)
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
    assert _requests() == 1


@pytest.mark.django_db(transaction=True)
def test_it_makes_no_provider_request_for_a_text_only_resolution(
    acme_unknown, operator, sandbox
):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/resolve", TEXT_ONLY)
    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded"
    assert _requests() == 0
    assert not Attempt.objects.filter(operation=op).exists()


@pytest.mark.django_db(transaction=True)
def test_it_asks_the_provider_only_about_an_operation_that_can_be_resolved(
    acme, operator, sandbox
):
    op = prepared_payment(acme, invoice_id="inv_fresh")  # not_started: nothing to resolve
    with pytest.raises(TransitionRefused, match="cannot be resolved as succeeded"):
        _resolve(op, operator, _payment_at_provider(op))
    assert _requests() == 0


@pytest.mark.django_db
def test_it_holds_a_provider_event_that_contradicts_a_person_for_review(
    acme_unknown, operator, other_tenant_user
):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import dashboard_metrics

    op = acme_unknown
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                      evidence_text="bank statement shows no debit", reason="checked")

    def event(event_id: str, status: CallOutcome, kind: str) -> tuple[str, str]:
        return webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type=f"payment_intent.{kind}", operation_id=op.id,
            external_id="pi_late", status=status))

    assert event("evt_agrees", CallOutcome.FAILED, "payment_failed")[0] == "ignored"
    assert dashboard_metrics(operator)["held_for_review"] == 0
    result, message = event("evt_contradicts", CallOutcome.SUCCEEDED, "succeeded")
    op.refresh_from_db()
    assert result == "held" and "provider reports succeeded" in message
    assert op.status == "failed" and op.external_id == ""  # the person's decision stands
    assert WebhookEvent.objects.get(event_id="evt_contradicts").needs_review

    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in page and "pi_late" in page
    assert "by a person's decision" in page
    queue = client.get("/operations/unknown/").content.decode()
    assert 'id="held"' in queue and op.id in queue
    assert dashboard_metrics(operator)["held_for_review"] == 1
    assert "#held" in client.get("/").content.decode()
    assert dashboard_metrics(other_tenant_user)["held_for_review"] == 0
    assert op.id not in signed_in(other_tenant_user).get("/operations/unknown/").content.decode()

    # A person looks again: the notice has done its job.
    operation_dispute(operation_id=op.id, actor=operator, reason="treasury checks the late debit")
    assert dashboard_metrics(operator)["held_for_review"] == 0
    assert "The provider disagrees" not in client.get(f"/operations/{op.id}/").content.decode()
    assert 'id="held"' not in client.get("/operations/unknown/").content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("action", ["dispute", "resolve"])
def test_it_answers_only_the_held_events_the_page_showed(acme_unknown, operator, action):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import webhooks_held_for_review

    op = acme_unknown
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                      evidence_text="bank statement shows no debit", reason="checked")

    def contradiction(event_id: str) -> None:
        assert webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type="payment_intent.succeeded", operation_id=op.id,
            external_id=f"pi_{event_id}", status=CallOutcome.SUCCEEDED))[0] == "held"

    if action == "resolve":
        # Resolvable again once disputed (nothing held yet, so nothing answered).
        operation_dispute(operation_id=op.id, actor=operator, reason="treasury re-checks")
    contradiction("evt_shown")
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    field = re.search(rf'name="{action}-held_shown" value="([^"]*)"', page)
    assert field, page
    # Held while the person was deciding: their decision is not about it.
    contradiction("evt_later")
    op.refresh_from_db()
    data = {f"{action}-reason": "treasury checked the debit",
            f"{action}-held_shown": field.group(1)}
    if action == "resolve":
        data.update({"resolve-outcome": "succeeded", "resolve-evidence": "debit on statement",
                     "resolve-seen": op.status_changed_at.isoformat()})
    assert client.post(f"/operations/{op.id}/{action}", data).status_code == 302

    op.refresh_from_db()
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_later"]
    decision = op.evidence.filter(kind="manual").last()
    assert decision.data["reviewed_events"] == ["evt_shown"]
    assert "pi_evt_later" in client.get(f"/operations/{op.id}/").content.decode()


@pytest.mark.django_db
def test_it_refuses_a_decision_from_a_page_whose_held_events_do_not_parse(
    acme_unknown, operator
):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/dispute", {
        "dispute-reason": "on hold", "dispute-held_shown": "12 evt_x"})
    op.refresh_from_db()
    assert response.status_code == 400 and "reload it" in response.content.decode()
    assert op.status == "unknown" and not op.evidence.filter(kind="manual").exists()


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_reported_after_the_console_closed_the_operation_as_never_done(
    acme, approver, operator, sandbox
):
    from operations.engine import operation_execute, webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from tests.operations.engine_helpers import authorized_payment

    # The approval ran out before any call: the console closes it as never done.
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == "cancelled" and _requests() == 0
    # Yet the provider holds a payment for it (one its search did not show in time).
    payment_id = _payment_at_provider(op)

    def event(event_id: str, status: CallOutcome) -> tuple[str, str]:
        return webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type=f"payment_intent.{status.value}", operation_id=op.id,
            external_id=payment_id, status=status))

    result, message = event("evt_paid_after_all", CallOutcome.SUCCEEDED)

    op.refresh_from_db()
    assert result == "held" and "provider reports succeeded" in message
    assert (op.status, op.external_id) == ("cancelled", "")
    # The timeline says why it still reads cancelled while the provider reports a payment.
    held = op.evidence.filter(kind="webhook").get()
    assert "held for review" in held.summary and held.to_status == "cancelled"
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in page and payment_id in page
    assert "by a person's decision" not in page and "Mark disputed" in page
    assert 'id="held"' in client.get("/operations/unknown/").content.decode()

    # Not settled straight from cancelled: a person first holds it, with a reason on record.
    with pytest.raises(TransitionRefused, match="cannot be resolved as succeeded"):
        _resolve(op, operator, payment_id)
    # A person holds it, checks the payment at the provider, and settles it with it.
    operation_dispute(operation_id=op.id, actor=operator, reason="treasury sees the debit")
    op = _resolve(op, operator, payment_id)
    assert (op.status, op.external_id, op.resolved_manually) == ("succeeded", payment_id, True)
    assert 'id="held"' not in client.get("/operations/unknown/").content.decode()
    assert not sandbox_writes(provider="payments").exists()
    assert sandbox_counts()["payment_intents"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("closed", "reported", "result"),
    [
        ("failed", "succeeded", "held"),  # retried at the provider: the money moved
        ("failed", "accepted", "ignored"),  # an earlier "processing", only out of order
        ("cancelled", "accepted", "held"),  # under way, though closed as never done
        ("cancelled", "failed", "ignored"),  # no money moved: nothing for a person to do
        ("succeeded", "accepted", "ignored"),
    ],
)
def test_it_tells_a_contradicted_outcome_from_a_late_event(acme, closed, reported, result):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = prepared_payment(acme)
    Operation.objects.filter(id=op.id).update(status=closed, external_id="pi_1")

    outcome, _ = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id=f"evt_{closed}_{reported}", event_type="payment_intent.x", operation_id=op.id,
        external_id="pi_1", status=CallOutcome(reported)))

    op.refresh_from_db()
    assert (outcome, op.status) == (result, closed)
    assert WebhookEvent.objects.get().needs_review == (result == "held")


# --- a person's decision applies to what they saw, never to what the engine did since ------


def _page_hidden_fields(client, op: Operation) -> dict[str, str]:
    """What the page's resolve form sends along unseen, as a browser would."""
    page = client.get(f"/operations/{op.id}/").content.decode()
    return dict(re.findall(r'<input type="hidden" name="(resolve-[^"]+)" value="([^"]*)"', page))


@pytest.mark.django_db
def test_it_resolves_the_status_the_page_showed(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    form = _page_hidden_fields(client, op)
    assert set(form) == {"resolve-seen"}
    # Exactly the stored moment, to the microsecond: an empty or rounded value would skip the
    # check or refuse every resolution.
    seen = ResolveForm(prefix="resolve", data=form).fields["seen"].clean(form["resolve-seen"])
    assert seen == op.status_changed_at
    client.post(f"/operations/{op.id}/resolve", {**form, **TEXT_ONLY})
    op.refresh_from_db()
    assert op.status == "succeeded" and op.resolved_manually
    assert _audits(op, "operation.resolve_succeeded") == 1


@pytest.mark.django_db
def test_it_resolves_the_status_the_page_showed_whatever_offset_the_moment_came_in(
    acme_unknown, operator
):
    from datetime import timezone as dt_timezone

    # The same moment, in an offset Python reads and PostgreSQL cannot hold (±15:59 at
    # most): the conditional update raised (a 500).
    op = acme_unknown
    moment = op.status_changed_at.astimezone(dt_timezone(timedelta(hours=23, minutes=59)))
    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve", {**TEXT_ONLY, "resolve-seen": moment.isoformat()},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200
    op.refresh_from_db()
    assert op.status == "succeeded" and _audits(op, "operation.resolve_succeeded") == 1


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_resolution_of_a_status_the_operator_never_saw(
    acme, approver, operator, sandbox
):
    from operations import engine
    from operations.sandbox.models import PaymentIntent
    from tests.operations.engine_helpers import authorized_payment

    # Large enough that the sandbox leaves the payment processing: accepted, not final.
    op = authorized_payment(acme, approver, amount_minor=150_000_000)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)  # nothing written
    engine.operation_execute(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == "unknown"
    client = signed_in(operator)
    form = _page_hidden_fields(client, op)

    # While the operator checks with the bank (nothing there), the sweep's lookup proves
    # absence and the call goes again: the provider now holds a processing payment.
    assert engine.operation_reconcile(operation_id=op.id).may_call_again
    assert engine.operation_execute(operation_id=op.id).status == "accepted"
    body = client.post(f"/operations/{op.id}/resolve", {
        **form, **TEXT_ONLY, "resolve-outcome": "failed",
        "resolve-evidence": "the bank shows no such payment",
    }, HTTP_HX_REQUEST="true").content.decode()

    op.refresh_from_db()
    assert "Resolve refused" in body and "reload" in body.lower()
    assert op.status == "accepted" and not op.resolved_manually and op.error_code == ""
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert _audits(op, "operation.resolve_failed") == 0
    intent = PaymentIntent.objects.get()
    assert intent.status == "processing" and op.external_id == intent.id
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 2


@pytest.mark.django_db
def test_it_says_the_time_zone_of_a_lease_and_of_a_status_that_moved_on(acme, operator):
    op = prepared_payment(acme, invoice_id="inv_leased")
    Operation.objects.filter(id=op.id).update(
        status="in_progress", lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
    )
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/")
    lease = timezone.localtime(Operation.objects.get(id=op.id).lease_expires_at)
    assert f"w1 until {lease:%H:%M:%S} UTC" in page.content.decode()
    Operation.objects.filter(id=op.id).update(status="disputed", lease_owner="",
                                              lease_expires_at=None,
                                              status_changed_at=timezone.now())
    moved = client.get(f"/operations/{op.id}/", {"seen": page.context["seen"]},
                       HTTP_HX_REQUEST="true").content.decode()
    changed = timezone.localtime(Operation.objects.get(id=op.id).status_changed_at)
    assert f"(since {changed:%H:%M:%S} UTC)" in moved


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "form", "wrong"), [
    ("reconcile", {"reconcile-reason": f"card {CARD}"}, "Give a reason to reconcile."),
    ("dispute", {"dispute-reason": f"card {CARD}"}, "Give a reason to dispute."),
    ("resolve", {**RESOLVE, "resolve-provider_reference": CARD},
     "The resolution is incomplete."),
])
def test_it_says_what_is_wrong_with_a_filled_in_form_not_that_it_is_missing(
    acme_unknown, operator, path, form, wrong
):
    """A reason was given; the banner asking for one sent the operator looking for a blank."""
    response = signed_in(operator).post(
        f"/operations/{acme_unknown.id}/{path}", form, HTTP_HX_REQUEST="true"
    )
    alert = re.search(r'<div role="alert">(.*?)</div>', response.content.decode(), re.S)
    assert alert is not None
    assert wrong not in alert.group(1)
    assert "looks like a full card number" in alert.group(1)
    # An empty form still says what is missing.
    empty = signed_in(operator).post(
        f"/operations/{acme_unknown.id}/{path}", {}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert wrong in empty


@pytest.mark.django_db
def test_it_refuses_to_dispute_a_call_in_flight_while_its_lease_runs(acme, operator):
    op = prepared_payment(acme, invoice_id="inv_in_flight")
    Operation.objects.filter(id=op.id).update(
        status="in_progress", lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(minutes=5), provider_calls=1,
    )
    with pytest.raises(TransitionRefused, match="still leased"):
        operation_dispute(operation_id=op.id, actor=operator, reason="looks stuck")
    op.refresh_from_db()
    # The worker's answer, due any moment, lands on its own claim, not on a person's hold.
    assert (op.status, op.lease_owner, op.resolved_manually) == ("in_progress", "w1", False)
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert _audits(op, "operation.dispute") == 0

    Operation.objects.filter(id=op.id).update(lease_expires_at=timezone.now())
    assert operation_dispute(operation_id=op.id, actor=operator,
                             reason="worker died").status == "disputed"


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_resolution_when_the_engine_moves_on_while_the_provider_is_asked(
    acme_unknown, operator, sandbox, monkeypatch
):
    from operations.engine import people, webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = acme_unknown
    payment_id = _payment_at_provider(op)
    seen = op.status_changed_at
    real_verify = people._reference_verify

    def engine_moves_on_meanwhile(op_, **kwargs):
        verified = real_verify(op_, **kwargs)
        # While the operator's reference is looked up, a webhook moves the operation on.
        assert webhook_apply(provider="payments", facts=WebhookFacts(
            event_id="evt_meanwhile", event_type="payment_intent.processing",
            operation_id=op.id, status=CallOutcome.ACCEPTED))[0] == "applied"
        return verified

    monkeypatch.setattr(people, "_reference_verify", engine_moves_on_meanwhile)
    with pytest.raises(TransitionRefused, match="not what the page showed"):
        operation_resolve(
            operation_id=op.id, actor=operator, outcome="succeeded",
            evidence_text="seen in the dashboard", reason="customer asked",
            provider_reference=payment_id, seen_status_changed_at=seen,
        )
    op.refresh_from_db()
    assert op.status == "accepted" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert not Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).exists()
    assert _audits(op, "operation.resolve_succeeded") == 0


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_reference_to_a_payment_for_another_sum(acme_unknown, operator, sandbox):
    op = acme_unknown
    payment_id = _payment_at_provider(op, amount=99_900)

    with pytest.raises(ReferenceRefused) as refused:
        _resolve(op, operator, payment_id)

    assert str(refused.value) == (
        f"{payment_id} is for 99900 KZT, the approved intent for 1250000 KZT (minor units), so "
        "it is not this operation's approved effect; check the reference, or mark the "
        "operation disputed."
    )
    assert _requests() == 1
    assert _refusal_recorded(op, actor=operator, reference=payment_id) == str(refused.value)


# --- a permission counts on the operation's own tenant only ------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["resolve", "dispute", "reconcile"])
def test_it_refuses_an_action_the_user_may_take_only_on_another_tenant(
    acme_unknown, globex, approver, path
):
    from console.roles import role_grant

    # Sees acme (approver there) and operates globex: neither makes them acme's operator.
    role_grant(user=approver, role="Operator", tenant=globex)
    op = acme_unknown
    response = signed_in(approver).post(f"/operations/{op.id}/{path}", ACTION_FORMS)
    assert response.status_code == 403
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op).exists()
    assert not Attempt.objects.filter(operation=op).exists()
    assert not AuditEvent.objects.filter(object_id=op.id).exclude(
        action="operation.prepare").exists()


@pytest.mark.django_db
def test_it_refuses_operators_work_to_any_caller_of_the_services_without_the_permission(
    acme_unknown, approver, other_tenant_user
):
    from django.core.exceptions import PermissionDenied

    from operations.engine import operation_reconcile

    op = acme_unknown
    # The views check first; the engine checks again, for every other caller (the CLI, tasks).
    for actor in (approver, other_tenant_user):
        with pytest.raises(PermissionDenied, match="operate_operations on acme"):
            operation_resolve(operation_id=op.id, actor=actor, outcome="failed",
                              evidence_text="bank statement", reason="checked")
        with pytest.raises(PermissionDenied, match="operate_operations on acme"):
            operation_dispute(operation_id=op.id, actor=actor, reason="customer disputes")
        with pytest.raises(PermissionDenied, match="operate_operations on acme"):
            operation_reconcile(operation_id=op.id, actor=actor, reason="look again")
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op).exists()
    assert not Attempt.objects.filter(operation=op).exists()  # the provider was not asked
    assert not AuditEvent.objects.filter(object_id=op.id).exclude(
        action="operation.prepare").exists()


@pytest.mark.django_db
def test_it_keeps_the_page_masked_when_it_refuses_a_form(acme, operator):
    op = make_unknown(prepared_payment(acme, beneficiary_id="acct_40817810099910004312"))
    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve", {**TEXT_ONLY, "resolve-reason": ""}
    )
    html = response.content.decode()
    assert response.status_code == 400 and "This field is required." in html
    # The whole page again, as masked as the one the operator posted from.
    assert "40817810099910004312" not in html and "••••4312" in html
    assert not AuditEvent.objects.filter(action="operation.view_unmasked").exists()
