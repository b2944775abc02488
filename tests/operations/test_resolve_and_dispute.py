"""Resolving and disputing an operation from its page: the evidence and the audit row each
leaves, the buttons offered only where useful and permitted, the panel answered in place for
htmx, and an open page told that the operation moved on."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from operations import transitions
from operations.engine import TransitionRefused, operation_dispute
from operations.models import AuditEvent, Evidence, EvidenceKind, Operation
from tests.helpers import signed_in
from tests.operations.engine_helpers import make_unknown, prepared_payment
from tests.operations.operator_helpers import RESOLVE, TEXT_ONLY, audit_count


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
    assert (
        'Resolved as succeeded by a person</strong> <code class="muted">'
        "operation.resolve_succeeded</code>" in page
    )


@pytest.mark.django_db
def test_it_resolves_as_failed_with_the_error_recorded(acme_unknown, operator):
    op = acme_unknown
    data = {**TEXT_ONLY, "resolve-outcome": "failed"}
    signed_in(operator).post(f"/operations/{op.id}/resolve", data)
    op.refresh_from_db()
    assert op.status == "failed" and op.error_code == "resolved_failed"
    assert audit_count(op, "operation.resolve_failed") == 1
    # The person's evidence is shown as theirs, not as an error the provider or we made.
    page = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert (
        f"<dt>Failed, by a person's evidence</dt><dd>{RESOLVE['resolve-evidence']}</dd>"
    ) in page
    assert "<dt>Error</dt>" not in page


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
    assert audit_count(op, "operation.dispute") == 1
    assert (
        Evidence.objects.filter(
            operation=op, kind=EvidenceKind.MANUAL, to_status="disputed"
        ).count()
        == 1
    )

    assert client.post(f"/operations/{op.id}/resolve", TEXT_ONLY).status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded"
    second = client.post(f"/operations/{op.id}/resolve", TEXT_ONLY)
    assert second.status_code == 409  # the page again, with why: not a redirect
    assert "Resolve refused" in second.content.decode()
    op.refresh_from_db()
    assert op.status == "succeeded"
    assert audit_count(op, "operation.resolve_succeeded") == 1
    assert Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize("status", [
    "not_started", "accepted", "unknown", "succeeded", "failed", "cancelled", "disputed"])
@pytest.mark.parametrize(("path", "form", "target", "action"), [
    ("resolve", TEXT_ONLY, "succeeded", "operation.resolve_succeeded"),
    ("dispute", {"dispute-reason": "customer says otherwise"}, "disputed", "operation.dispute"),
])
def test_it_resolves_or_disputes_only_from_a_status_the_manual_table_allows(
    acme, operator, status, path, form, target, action
):
    op = prepared_payment(acme)
    if status in ("unknown", "disputed"):
        make_unknown(op)
    if status == "disputed":
        operation_dispute(operation_id=op.id, actor=operator, reason="on hold")
    elif status != "unknown":
        Operation.objects.filter(id=op.id).update(status=status)
    trail_before = AuditEvent.objects.filter(object_id=op.id).count()

    response = signed_in(operator).post(f"/operations/{op.id}/{path}", form)

    op.refresh_from_db()
    if transitions.allowed(status, target, manual=True):
        assert response.status_code == 302 and op.status == target
        assert AuditEvent.objects.filter(object_id=op.id).count() == trail_before + 1
        assert audit_count(op, action) == 1
    else:
        assert response.status_code == 409 and op.status == status
        assert AuditEvent.objects.filter(object_id=op.id).count() == trail_before


@pytest.mark.django_db
def test_it_shows_an_engine_refusal_as_a_message_not_a_500(acme_payment, operator):
    op = acme_payment  # not_started: nothing to dispute
    response = signed_in(operator).post(
        f"/operations/{op.id}/dispute", {"dispute-reason": "just because"}
    )
    assert response.status_code == 409
    assert "Dispute refused" in response.content.decode()
    op.refresh_from_db()
    assert op.status == "not_started" and audit_count(op, "operation.dispute") == 0


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
    assert audit_count(op, "operation.dispute") == 0

    Operation.objects.filter(id=op.id).update(lease_expires_at=timezone.now())
    assert operation_dispute(operation_id=op.id, actor=operator,
                             reason="worker died").status == "disputed"
