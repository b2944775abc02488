"""What an operator's action (resolve, dispute, reconcile now) refuses before anything is
recorded: a user without the operate permission on the operation's own tenant, whichever
caller asks (a view, the CLI, a task); a GET, or a post without a CSRF token; a form without
its reason or evidence, or with a card number typed into it. A refused page stays masked."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from operations.engine import operation_dispute, operation_resolve
from operations.models import Attempt, AuditEvent, Evidence, EvidenceKind, OperationStatus
from tests.helpers import signed_in
from tests.operations.engine_helpers import make_unknown, prepared_payment
from tests.operations.operator_helpers import RESOLVE, TEXT_ONLY, audit_count

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
@pytest.mark.parametrize(("form", "said"), [
    ({**RESOLVE, "resolve-reason": " "}, "This field is required."),
    # Evidence is the text or a provider reference: with neither, nothing shows what was
    # verified (a reference alone is proof enough once the provider confirms it).
    ({**TEXT_ONLY, "resolve-evidence": " "},
     "Give evidence text or a provider reference (or both)."),
], ids=["no-reason", "no-evidence-text-nor-reference"])
def test_it_requires_a_reason_and_evidence_to_resolve(acme_unknown, operator, form, said):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/resolve", form)
    assert response.status_code == 400
    assert said in response.content.decode()
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert audit_count(op, "operation.resolve_succeeded") == 0


CARD = "4111 1111 1111 1111"


@pytest.mark.django_db
@pytest.mark.parametrize(("path", "field"), [
    ("resolve", "resolve-evidence"), ("resolve", "resolve-reason"),
    ("resolve", "resolve-provider_reference"), ("dispute", "dispute-reason"),
    ("reconcile", "reconcile-reason"),
])
@pytest.mark.parametrize("htmx", [False, True], ids=["page", "htmx"])
def test_it_keeps_card_numbers_an_operator_types_out_of_the_journal(
    acme_unknown, operator, path, field, htmx
):
    op = acme_unknown
    form = RESOLVE if path == "resolve" else {f"{path}-reason": "checked"}
    response = signed_in(operator).post(
        f"/operations/{op.id}/{path}", {**form, field: f"refunded to card {CARD}"},
        **({"HTTP_HX_REQUEST": "true"} if htmx else {}),
    )
    assert response.status_code == (200 if htmx else 400)
    page = response.content.decode()
    assert "looks like a full card number" in page
    # Given back to correct with the number cut to its last four digits: whole, it would sit
    # in the page htmx keeps in the browser's history store.
    assert "4111111111111111" not in re.sub(r"\D", "", page)
    assert "refunded to card" in page
    op.refresh_from_db()
    assert op.status == "unknown" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, summary__contains="4111").exists()
    assert not AuditEvent.objects.filter(object_id=op.id, reason__contains="4111").exists()
    assert not Attempt.objects.filter(operation=op).exists()  # no lookup was made either


@pytest.mark.django_db
@pytest.mark.parametrize(
    "separator",
    [pytest.param("\u00ad", id="soft-hyphen"), pytest.param("\u200b", id="zero-width-space"),
     pytest.param("_", id="underscore"), pytest.param("/", id="slash")],
)
def test_it_refuses_a_card_number_in_a_reason_whatever_joins_its_groups(
    acme, operator, auditor, separator
):
    # Pasted from a PDF or a chat, the groups are joined by characters no one sees; stored, the
    # number would be shown whole on the timeline and the audit trail every viewer reads.
    op = make_unknown(prepared_payment(acme))
    card = separator.join(["4111", "1111", "1111", "1111"])
    response = signed_in(operator).post(
        reverse("operations:dispute", args=[op.id]),
        {"dispute-reason": f"customer says card {card} was charged twice"},
    )
    assert response.status_code == 400
    assert "looks like a full card number" in response.content.decode()
    op.refresh_from_db()
    assert op.status != OperationStatus.DISPUTED
    stored = [
        *AuditEvent.objects.filter(object_id=op.id).values_list("reason", flat=True),
        *Evidence.objects.filter(operation=op).values_list("summary", flat=True),
    ]
    assert not [text for text in stored if "4111111111111111" in re.sub(r"\D", "", text)]
    timeline = signed_in(auditor).get(reverse("operations:detail", args=[op.id]))
    assert "4111111111111111" not in re.sub(r"\D", "", timeline.content.decode())


@pytest.mark.django_db
def test_it_takes_multi_line_evidence_and_reason_the_browser_allowed(acme_unknown, operator):
    """The textareas' maxlength counts a line break as one character; a browser's form
    submission sends each as CRLF, which the form counted as two: text the browser let
    through (1,919 characters here) was refused as longer than 2000."""
    op = acme_unknown
    lines = [f"line {n:03d} ok" for n in range(160)]
    sent, kept = "\r\n".join(lines), "\n".join(lines)
    assert len(kept) <= 2000 < len(sent)

    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve",
        {**TEXT_ONLY, "resolve-evidence": sent, "resolve-reason": sent},
    )

    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "succeeded" and op.resolved_manually
    event = AuditEvent.objects.get(object_id=op.id, action="operation.resolve_succeeded")
    assert event.reason == kept and event.after["evidence"] == kept
    evidence = Evidence.objects.get(operation=op, kind=EvidenceKind.MANUAL)
    assert evidence.data["evidence"] == kept and evidence.data["reason"] == kept
    assert not Attempt.objects.filter(operation=op).exists()  # words only: nobody was asked


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
    assert op.status == "unknown" and audit_count(op, "operation.dispute") == 0
    # The error is part of the field's label, its accessible name: the field itself is
    # hx-preserve'd, so its own aria-invalid never reaches the page after an htmx post.
    html = response.content.decode()
    assert re.search(
        r'<label for="id_dispute-reason">Reason <span class="error" id="id_dispute-reason_error">',
        html,
    ), html


@pytest.mark.django_db
def test_it_requires_a_reason_to_reconcile_now(acme_unknown, operator):
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/reconcile",
                                        {"reconcile-reason": "   "})
    assert response.status_code == 400
    op.refresh_from_db()
    assert op.status == "unknown" and audit_count(op, "operation.reconcile") == 0
    assert not Attempt.objects.filter(operation=op).exists()  # the provider was not asked


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


@pytest.mark.django_db(transaction=True)
def test_it_refuses_to_resolve_as_failed_on_words_a_payment_the_provider_still_holds(
    acme, approver, operator, sandbox
):
    """An accepted payment still processing was resolved as failed on evidence text: the
    intent could be replaced under a new key while the first payment completed, paid twice.
    Its reference, once the provider reports it failed, settles it; until then it waits."""
    from operations.sandbox.models import PaymentIntent
    from operations.sandbox.services import sandbox_payment_settle
    from tests.operations.engine_helpers import async_payment

    op = async_payment(acme, approver)
    rows = AuditEvent.objects.count()

    response = signed_in(operator).post(f"/operations/{op.id}/resolve",
                                        {**TEXT_ONLY, "resolve-outcome": "failed"})

    assert response.status_code == 409
    assert f"the provider holds {op.external_id} for {op.id}, which may still complete" in (
        re.sub(r"\s+", " ", response.content.decode()))
    op.refresh_from_db()
    assert (op.status, op.resolved_manually) == (OperationStatus.ACCEPTED, False)
    assert AuditEvent.objects.count() == rows
    # Once the provider says it failed, its reference settles it.
    sandbox_payment_settle(payment_intent_id=op.external_id, status="failed")
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed", evidence_text="",
                      reason="the bank declined it", provider_reference=op.external_id)
    op.refresh_from_db()
    assert op.status == OperationStatus.FAILED
    assert PaymentIntent.objects.count() == 1
