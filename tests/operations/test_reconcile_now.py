"""An operator's "Reconcile now": one lookup at the provider and never a call, its reason on
the audit trail and what it found said in place. An operation it proves absent goes back to a
worker; a disputed one is left alone."""

from __future__ import annotations

import re

import pytest

from operations.engine import operation_dispute
from operations.models import Attempt, AttemptKind, AuditEvent, Evidence, EvidenceKind
from operations.sandbox.selectors import sandbox_requests, sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import signed_in
from tests.operations.operator_helpers import RESOLVE, payment_at_provider


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
    payment_at_provider(op)  # the call whose answer was lost did land
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
    # The reason of the reconcile that went through comes back empty (test_browser).
    assert "hx-preserve" not in fields["reconcile-reason"]


def reconciled_now_overtaken_by_an_event(op, operator, monkeypatch, *, payment_id: str,
                                         status: str):
    """The operator's "Reconcile now" (a plain POST), whose lookup the provider's event that
    `payment_id` is `status` overtakes: applied while the lookup is out."""
    from operations import engine
    from operations.engine import core
    from operations.providers.base import CallOutcome, WebhookFacts

    adapter = core.adapter(op.action)
    real_lookup = adapter.lookup

    def lookup_overtaken_by_the_event(snapshot):
        result, message = engine.webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=f"evt_{status}", event_type=f"payment_intent.{status}",
            operation_id=op.id, external_id=payment_id,
            status=CallOutcome.SUCCEEDED if status == "succeeded" else CallOutcome.ACCEPTED,
            data={"id": payment_id, "status": status, "amount": op.payload["amount_minor"],
                  "currency": op.payload["currency"].lower()}))
        assert result == "applied", message
        return real_lookup(snapshot)

    monkeypatch.setattr(adapter, "lookup", lookup_overtaken_by_the_event)
    return signed_in(operator).post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "customer is asking"})


@pytest.mark.django_db(transaction=True)
def test_it_says_on_the_trail_that_a_reconcile_overtaken_by_an_event_moved_nothing(
    acme_unknown, operator, sandbox, monkeypatch
):
    """The provider's event settled the operation while the operator's lookup was out. The
    reconcile's audit row said before unknown, after succeeded, found: beside the event, as
    if the operator's lookup had made the move. It says it moved nothing."""
    op = acme_unknown
    payment_id = payment_at_provider(op)

    response = reconciled_now_overtaken_by_an_event(op, operator, monkeypatch,
                                                    payment_id=payment_id, status="succeeded")

    assert response.status_code == 302
    op.refresh_from_db()
    assert (op.status, op.external_id) == ("succeeded", payment_id)
    moves = Evidence.objects.filter(operation=op, to_status="succeeded").exclude(
        from_status="succeeded")
    assert [move.kind for move in moves] == [EvidenceKind.WEBHOOK]
    event = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert event.before == {"status": "unknown"}
    assert event.after == {"status": "succeeded", "lookup": "found", "detail": "",
                           "moved": "nothing: settled meanwhile"}
    assert not sandbox_writes(provider="payments").exists()


@pytest.mark.django_db(transaction=True)
def test_it_says_on_the_trail_that_a_reconcile_an_event_moved_to_accepted_first_moved_nothing(
    acme_unknown, operator, sandbox, monkeypatch, settings
):
    """The provider's event moved the operation to accepted while the operator's lookup was
    out, and the lookup found the payment still processing: the operation left open, the
    lookup only noted it. Its audit row said before unknown, after accepted, found, beside
    the event's, as if the operator's lookup had made the move."""
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = 1  # the payment stays processing
    op = acme_unknown
    payment_id = payment_at_provider(op)

    response = reconciled_now_overtaken_by_an_event(op, operator, monkeypatch,
                                                    payment_id=payment_id, status="processing")

    assert response.status_code == 302
    op.refresh_from_db()
    assert (op.status, op.external_id) == ("accepted", payment_id)
    moves = Evidence.objects.filter(operation=op, to_status="accepted").exclude(
        from_status="accepted")
    assert [move.kind for move in moves] == [EvidenceKind.WEBHOOK]
    event = AuditEvent.objects.get(object_id=op.id, action="operation.reconcile")
    assert event.before == {"status": "unknown"}
    assert event.after["status"] == "accepted" and event.after["lookup"] == "found"
    assert event.after["moved"].startswith("nothing: ")
    assert not sandbox_writes(provider="payments").exists()
