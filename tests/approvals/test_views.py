from __future__ import annotations

import html as html_lib
import re
from urllib.parse import urlencode

import pytest
from django.test import Client
from django.urls import reverse

from approvals.models import Approval, ApprovalStatus
from approvals.services import approval_approve
from operations.engine import operation_prepare, operation_resolve
from operations.intents import payload_fingerprint
from operations.models import AuditEvent, Operation
from tests.approvals.conftest import BENEFICIARY, EMAIL
from tests.helpers import page_and_query_count, signed_in, updated_past_triggers
from tests.operations.engine_helpers import make_unknown

pytestmark = pytest.mark.django_db


def _approve_url(approval: Approval) -> str:
    return reverse("approvals:approve", args=[approval.id])


def test_it_lists_pending_cards_masked_with_money_and_legal_entity(
    acme, approver, prepare_payment
):
    approval = prepare_payment(acme)
    response = signed_in(approver).get(reverse("approvals:queue"))
    html = response.content.decode()
    assert response.status_code == 200
    assert approval.id in html
    assert "12,500.00 KZT" in html
    assert "Acme Corp LLP" in html
    assert "payments-v3" in html
    assert "inv_9182" in html
    assert "••••2345" in html
    assert BENEFICIARY not in html
    assert 'hx-trigger="every 15s"' in html
    assert 'hx-trigger="approvals-changed from:body"' in html
    assert "{#" not in html and "Refreshed on its own" not in html  # comments stay comments
    assert not AuditEvent.objects.filter(action="approval.view_unmasked").exists()


def test_it_shows_a_masked_card_the_keyed_fingerprint_its_operation_page_shows(
    acme, admin_user, approver, prepare_payment
):
    # The unkeyed hash of the intent beside its masked values would give those back to a
    # brute force; its keyed fingerprint still lets a person match the card to the operation.
    approval = prepare_payment(acme)
    fingerprint = payload_fingerprint(approval.payload_hash)
    operation_page = signed_in(approver).get(
        reverse("operations:detail", args=[approval.operation_id])).content.decode()
    assert fingerprint in operation_page
    for user in (approver, admin_user):
        for url in (reverse("approvals:queue"), reverse("approvals:detail", args=[approval.id])):
            html = signed_in(user).get(url).content.decode()
            assert approval.payload_hash[7:30] not in html
            assert f'title="Keyed fingerprint of the payload hash, equal for equal intents; ' \
                f'the hash itself is on the unmasked view: {fingerprint}"' in html
            assert fingerprint[:20] in html


def test_it_limits_a_comment_or_reason_in_the_browser_as_the_forms_do(
    acme, approver, prepare_payment
):
    from approvals.forms import ApproveForm, RejectForm

    approval = prepare_payment(acme)
    html = signed_in(approver).get(reverse("approvals:queue")).content.decode()
    # Typed past the limit, a comment was refused only after Approve was pressed.
    comment = ApproveForm.base_fields["comment"].max_length
    reason = RejectForm.base_fields["reason"].max_length
    assert f'id="comment-{approval.id}" maxlength="{comment}"' in html
    assert f'id="reason-{approval.id}" required maxlength="{reason}"' in html


def test_it_names_each_cards_link_by_its_intent_not_only_its_action(
    acme, approver, prepare_payment
):
    first = prepare_payment(acme)
    second = prepare_payment(acme, invoice_id="inv_second")
    html = signed_in(approver).get(reverse("approvals:queue")).content.decode()
    names = re.findall(r'<a href="/approvals/(\w+)/">(.*?)</a>', html)
    named = {approval_id: re.sub(r"<[^>]+>", "", name) for approval_id, name in names}
    # Twenty cards of one action must not read as twenty identical links or headings.
    assert named[first.id].startswith("Create a payment: Pay ")
    assert "inv_second" in named[second.id] and named[first.id] != named[second.id]


def test_it_shows_unmasked_values_only_with_the_permission_and_audits_it(
    acme, admin_user, approver, prepare_payment
):
    approval = prepare_payment(acme)
    client = signed_in(admin_user)
    url = reverse("approvals:detail", args=[approval.id])
    # Masked by default, even for those who may unmask; the queue never unmasks.
    for page in (url, reverse("approvals:queue")):
        assert BENEFICIARY not in client.get(page).content.decode()
    htmx = client.get(url + "?unmasked=1", HTTP_HX_REQUEST="true")
    assert BENEFICIARY not in htmx.content.decode()
    # The card and the page share one URL: no cache may hand out one for the other.
    assert "HX-Request" in htmx["Vary"] and "HX-Request" in client.get(url)["Vary"]
    assert not AuditEvent.objects.filter(action="approval.view_unmasked").exists()
    masked = client.get(url)
    assert "no-store" not in masked.get("Cache-Control", "")
    response = client.get(url + "?unmasked=1")
    html = response.content
    assert BENEFICIARY in html.decode()
    assert approval.payload_hash in html.decode()  # the hash itself, on the audited view only
    assert f"to {BENEFICIARY} for invoice" in html.decode()  # the summary line too
    assert "no-store" in response["Cache-Control"] and "private" in response["Cache-Control"]
    event = AuditEvent.objects.get(action="approval.view_unmasked")
    assert event.actor == admin_user
    assert event.after["approvals"] == [approval.id]
    # Without the permission, asking changes nothing and records nothing.
    html = signed_in(approver).get(url + "?unmasked=1").content.decode()
    assert BENEFICIARY not in html and "Show unmasked" not in html
    assert AuditEvent.objects.filter(action="approval.view_unmasked").count() == 1


def test_it_never_shows_unmasked_values_on_any_approver_page(
    acme, approver, admin_user, prepare_payment, prepare_mail
):
    payment = prepare_payment(acme)
    mail = prepare_mail(acme)
    changed = prepare_payment(acme, supersedes=payment.operation, amount_minor=999_00,
                              beneficiary_id="vendor_778800000")
    decided = prepare_payment(acme, invoice_id="inv_2")
    client = signed_in(approver)
    client.post(reverse("approvals:reject", args=[decided.id]), {"reason": "dup"})
    pages = [
        reverse("approvals:queue"),
        reverse("approvals:queue") + "?tenant=acme&action=payments.create",
        reverse("approvals:queue") + "?action=mail.send",
    ] + [reverse("approvals:detail", args=[a.id]) for a in (payment, mail, changed, decided)]
    for page in pages:
        for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
            response = client.get(page, **headers)
            assert response.status_code == 200, page
            html = response.content.decode()
            assert BENEFICIARY not in html, page
            assert "vendor_778800000" not in html, page
            assert EMAIL not in html, page
            assert "anna.smith" not in html, page
    htmx = client.post(_approve_url(mail), {"comment": "ok"}, HTTP_HX_REQUEST="true")
    assert EMAIL not in htmx.content.decode()


def _masked_pages_as_read(client: Client, approval: Approval) -> list[str]:
    """Every masked page showing the intent, as a person reads it: tags gone, entities
    decoded, invisible characters (soft hyphen, zero-width space) dropped as a screen does."""
    op = approval.operation
    pages = [
        reverse("approvals:queue"),
        reverse("approvals:detail", args=[approval.id]),
        reverse("operations:detail", args=[op.id]),
        reverse("operations:list"),
    ]
    texts = []
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
        text = html_lib.unescape(re.sub(r"<[^>]+>", " ", response.content.decode()))
        texts.append(re.sub("[\u00ad\u200b\u2060\ufeff]", "", text))
    return texts


def test_it_never_shows_a_beneficiarys_email_address_on_a_masked_page(
    acme, approver, prepare_payment
):
    # A payee named by email (as payouts to a person often are) is personal data, masked as
    # a mail's recipient or a deal's owner is.
    approval = prepare_payment(acme, beneficiary_id="jane.doe@example.com")
    for page in _masked_pages_as_read(signed_in(approver), approval):
        assert "jane.doe@example.com" not in page
        assert "j***@example.com" in page


def test_it_masks_an_email_address_with_a_national_top_level_domain_in_a_deal_name(
    acme, approver
):
    op = operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal for ivan.petrov@пример.рф", "amount_minor": 1_000_000_00,
        "currency": "KZT", "owner": "anna@example.com",
    })
    approval = Approval.objects.get(operation=op)
    for page in _masked_pages_as_read(signed_in(approver), approval):
        assert "ivan.petrov@" not in page
        assert "i***@пример.рф" in page


def test_it_shows_only_tenants_the_user_may_see(acme, globex, approver, prepare_payment):
    mine = prepare_payment(acme)
    theirs = prepare_payment(globex)
    html = signed_in(approver).get(reverse("approvals:queue")).content.decode()
    assert mine.id in html
    assert theirs.id not in html


def test_it_filters_by_tenant_and_action(acme, admin_user, prepare_payment, prepare_mail):
    payment = prepare_payment(acme)
    mail = prepare_mail(acme)
    client = signed_in(admin_user)
    html = client.get(reverse("approvals:queue") + "?action=mail.send").content.decode()
    assert mail.id in html and payment.id not in html
    html = client.get(reverse("approvals:queue") + "?tenant=globex").content.decode()
    assert mail.id not in html
    # Says why nothing is shown, rather than a queue that looks empty ("Pending: 0").
    assert "Nothing is shown: Tenant — Select a valid choice" in html
    assert "No approvals match" not in html and "Pending: 0" not in html
    html = client.get(reverse("approvals:queue") + "?action=bogus").content.decode()
    assert "Nothing is shown: Action — Select a valid choice" in html


def test_it_pages_by_keyset_pending_soonest_first_then_decisions(
    acme, approver, prepare_payment, monkeypatch
):
    from datetime import timedelta

    from django.utils import timezone

    monkeypatch.setattr("approvals.views.QUEUE_PAGE_SIZE", 2)
    approvals = [prepare_payment(acme, invoice_id=f"inv_{i}") for i in range(4)]
    now = timezone.now()
    for i, approval in enumerate(approvals):
        Approval.objects.filter(id=approval.id).update(
            expires_at=now + timedelta(hours=4 - i)
        )
    client = signed_in(approver)
    client.post(reverse("approvals:reject", args=[approvals[0].id]), {"reason": "dup"})
    seen: list[str] = []
    url = reverse("approvals:queue")
    for _ in range(3):
        response = client.get(url)
        page = [c["approval"].id for c in response.context["cards"]]
        seen += page
        if not response.context["next_cursor"]:
            break
        assert f"cursor={response.context['next_cursor']}".split("|")[0] in (
            response.content.decode()
        )
        url = reverse("approvals:queue") + "?" + urlencode(
            {"cursor": response.context["next_cursor"]}
        )
    assert seen == [approvals[3].id, approvals[2].id, approvals[1].id, approvals[0].id]


def test_it_keeps_filters_and_cursor_in_the_poll_url(acme, approver, prepare_payment,
                                                     monkeypatch):
    monkeypatch.setattr("approvals.views.QUEUE_PAGE_SIZE", 1)
    for i in range(3):
        prepare_payment(acme, invoice_id=f"inv_{i}")
    client = signed_in(approver)
    first = client.get(reverse("approvals:queue") + "?tenant=acme")
    cursor = first.context["next_cursor"]
    second = client.get(
        reverse("approvals:queue"), {"tenant": "acme", "cursor": cursor},
        HTTP_HX_REQUEST="true",
    )
    html = second.content.decode()
    assert "<html" not in html
    assert 'id="approval-rows"' in html
    assert "tenant=acme" in html
    from urllib.parse import quote

    assert f"cursor={quote(cursor)}" in html


def test_it_approves_in_place_with_htmx(acme, approver, prepare_payment, no_execute):
    approval = prepare_payment(acme)
    response = signed_in(approver).post(
        _approve_url(approval), {"comment": "looks right"}, HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in html
    assert f'id="card-{approval.id}"' in html
    assert 'data-status="approved"' in html
    assert "looks right" in html
    # The card holds still while it has focus (the queue pauses its refresh): the answer
    # says where the operation's live status is.
    op_id = approval.operation_id
    assert (f'<a href="/operations/{op_id}/">Follow it on the operation page</a>: this card '
            "shows its status as it was when you decided.") in html
    assert response["HX-Trigger"] == "approvals-changed"  # the queue's counts follow
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.APPROVED


def test_it_approves_with_a_plain_post_and_redirects(acme, approver, prepare_payment,
                                                     no_execute):
    approval = prepare_payment(acme)
    client = signed_in(approver)
    response = client.post(_approve_url(approval), {"comment": "", "next": "/approvals/"})
    assert response.status_code == 302
    assert response["Location"] == "/approvals/"
    page = client.get(response["Location"]).content.decode()
    assert "Approved; the operation is queued to run." in page


def test_it_returns_masked_after_a_decision_taken_on_the_unmasked_page(
    acme, admin_user, prepare_payment, no_execute
):
    """The unmasked page is shown once, when asked for, and audited so. Deciding on it
    without JavaScript redirected back to ?unmasked=1: the values shown again and a second
    view_unmasked event the person never asked for."""
    approval = prepare_payment(acme)
    client = signed_in(admin_user)
    here = reverse("approvals:detail", args=[approval.id]) + "?unmasked=1&tab=history"
    assert BENEFICIARY in client.get(here).content.decode()
    assert AuditEvent.objects.filter(action="approval.view_unmasked").count() == 1

    response = client.post(_approve_url(approval), {"comment": "", "next": here})

    assert response.status_code == 302
    assert response["Location"] == reverse("approvals:detail", args=[approval.id]) + "?tab=history"
    page = client.get(response["Location"]).content.decode()
    assert "Approved; the operation is queued to run." in page
    assert BENEFICIARY not in page
    assert AuditEvent.objects.filter(action="approval.view_unmasked").count() == 1
    assert AuditEvent.objects.filter(action="approval.approve").count() == 1


def test_it_ignores_an_offsite_next(acme, approver, prepare_payment, no_execute):
    approval = prepare_payment(acme)
    response = signed_in(approver).post(_approve_url(approval), {"next": "https://evil.test/"})
    assert response["Location"] == reverse("approvals:detail", args=[approval.id])


def test_it_returns_to_the_approval_for_a_next_that_is_not_a_path(
    acme, approver, prepare_payment, no_execute
):
    # redirect() reads a bare word as a view name: "queue" raised NoReverseMatch (a 500)
    # after the decision had been taken, and the approver saw an error, not that it was.
    approve, reject = prepare_payment(acme), prepare_payment(acme, invoice_id="inv_2")
    client = signed_in(approver)
    for approval, url, data in (
        (approve, _approve_url(approve), {"next": "queue"}),
        (reject, reverse("approvals:reject", args=[reject.id]),
         {"next": "approvals:queue", "reason": "duplicate"}),
    ):
        response = client.post(url, data)
        assert response.status_code == 302
        assert response["Location"] == reverse("approvals:detail", args=[approval.id])
    assert Approval.objects.get(id=approve.id).status == ApprovalStatus.APPROVED
    assert Approval.objects.get(id=reject.id).status == ApprovalStatus.REJECTED


def test_it_shows_the_refusal_in_the_card(acme, approver, admin_user, prepare_payment,
                                          no_execute):
    approval = prepare_payment(acme)
    signed_in(admin_user).post(_approve_url(approval))
    response = signed_in(approver).post(_approve_url(approval), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200
    assert "Already approved by admin at" in html
    assert 'role="alert"' in html


def test_it_rejects_in_place_and_requires_a_reason(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    client = signed_in(approver)
    empty = client.post(reverse("approvals:reject", args=[approval.id]), {"reason": ""},
                        HTTP_HX_REQUEST="true")
    assert "needs a reason" in empty.content.decode()
    done = client.post(reverse("approvals:reject", args=[approval.id]),
                       {"reason": "wrong vendor"}, HTTP_HX_REQUEST="true")
    assert 'data-status="rejected"' in done.content.decode()


def test_it_refuses_a_decision_whose_text_is_too_long_and_says_why(acme, approver,
                                                                   prepare_payment, no_execute):
    approval = prepare_payment(acme)
    client = signed_in(approver)
    audit_rows = AuditEvent.objects.count()

    approve = client.post(_approve_url(approval), {"comment": "x" * 2001},
                          HTTP_HX_REQUEST="true").content.decode()
    reject = client.post(reverse("approvals:reject", args=[approval.id]),
                         {"reason": "y" * 2001}, HTTP_HX_REQUEST="true").content.decode()

    assert "Comment: Ensure this value has at most 2000 characters" in approve
    assert "Reason: Ensure this value has at most 2000 characters" in reject
    assert "needs a reason" not in reject
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert AuditEvent.objects.count() == audit_rows


# 160 lines as a textarea holds them: 1,919 characters with LF line ends, inside its
# maxlength of 2000. A browser's form submission sends each line end as CRLF: 2,079.
BROWSER_LINES = [f"line {n:03d} ok" for n in range(160)]


def test_it_takes_a_multi_line_comment_or_reason_the_browser_allowed(
    acme, approver, prepare_payment, no_execute
):
    """The textarea's maxlength counts a line break as one character, the form counted the
    CRLF a browser sends as two: a text the browser let through was refused as too long."""
    approve, reject = prepare_payment(acme), prepare_payment(acme, invoice_id="inv_2")
    sent, kept = "\r\n".join(BROWSER_LINES), "\n".join(BROWSER_LINES)
    assert len(kept) <= 2000 < len(sent)
    client = signed_in(approver)

    approved = client.post(_approve_url(approve), {"comment": sent}, follow=True)
    rejected = client.post(reverse("approvals:reject", args=[reject.id]), {"reason": sent},
                           follow=True)

    for response in (approved, rejected):
        assert "at most 2000 characters" not in response.content.decode()
    assert Approval.objects.get(id=approve.id).status == ApprovalStatus.APPROVED
    assert Approval.objects.get(id=reject.id).status == ApprovalStatus.REJECTED
    assert no_execute == [approve.operation_id]
    assert Operation.objects.get(id=reject.operation_id).status == "cancelled"
    # Stored as the approver saw it in the browser, line ends and all.
    for approval, action in ((approve, "approval.approve"), (reject, "approval.reject")):
        assert Approval.objects.get(id=approval.id).comment == kept
        (audit,) = AuditEvent.objects.filter(action=action, object_id=approval.id)
        assert audit.reason == kept


@pytest.mark.parametrize(("url", "words"), [
    ("approvals:reject", {"reason": ""}),
    ("approvals:reject", {"reason": "y" * 2001}),
    ("approvals:approve", {"comment": "card 4111 1111 1111 1111"}),
], ids=["reject-without-reason", "reject-too-long", "approve-with-a-card-number"])
def test_it_records_a_late_decision_whose_words_the_form_refuses(
    acme, approver, prepare_payment, no_execute, url, words
):
    """An approval after expiry does nothing but record the attempt, whatever its words:
    the approver was told their reason was missing, the approval stayed pending and the
    trail never saw the attempt."""
    from datetime import timedelta

    from django.utils import timezone

    approval = prepare_payment(acme)
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=1))

    page = signed_in(approver).post(reverse(url, args=[approval.id]), words,
                                    HTTP_HX_REQUEST="true").content.decode()

    assert "This approval expired at" in page
    assert "needs a reason" not in page and "at most 2000" not in page
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.EXPIRED
    verb = url.split(":")[1]
    (attempt,) = AuditEvent.objects.filter(action=f"approval.{verb}_refused",
                                           object_id=approval.id)
    assert attempt.actor == approver and attempt.after["refusal"] == "expired"
    # The words the form refused are not on the trail.
    assert "4111" not in str(attempt.after) and "yyyy" not in str(attempt.after)
    assert Operation.objects.get(id=approval.operation_id).status == "cancelled"
    assert no_execute == []


def test_it_keeps_a_card_number_in_a_decision_out_of_the_trail(acme, approver,
                                                              prepare_payment, no_execute):
    from approvals.services import ApprovalRefused, approval_reject

    approval = prepare_payment(acme)
    client = signed_in(approver)
    approve = client.post(_approve_url(approval), {"comment": "card 4111 1111 1111 1111"},
                          HTTP_HX_REQUEST="true").content.decode()
    reject = client.post(reverse("approvals:reject", args=[approval.id]),
                         {"reason": "paid by 4111-1111-1111-1111"},
                         HTTP_HX_REQUEST="true").content.decode()
    assert "Comment: This looks like a full card number" in approve
    assert "Reason: This looks like a full card number" in reject
    # Any other caller of the service is refused the same way.
    with pytest.raises(ApprovalRefused, match="looks like a full card number"):
        approval_reject(approval_id=approval.id, actor=approver,
                        reason="4111111111111111")
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert not AuditEvent.objects.filter(reason__contains="4111").exists()
    assert "4111" not in str(list(AuditEvent.objects.values_list("after", flat=True)))


def test_it_gives_words_it_refuses_back_to_fix_without_javascript(
    acme, approver, admin_user, prepare_payment, no_execute
):
    """With htmx the textarea keeps what was typed (hx-preserve); without JavaScript the
    refusal redirected (PRG) and the form came back empty, the whole reason to type again.
    The approval's page comes back with the refusal and the words, never the card number."""
    approval = prepare_payment(acme)
    client = signed_in(approver)
    reason = ("Refund to card 4111 1111 1111 1111 was already made by phone on 2 Dec, "
              "see ticket SUP-5521; paying this invoice again would pay twice")
    audit_rows = AuditEvent.objects.count()

    response = client.post(reverse("approvals:reject", args=[approval.id]),
                           {"reason": reason, "next": reverse("approvals:queue")})

    assert response.status_code == 400
    html = html_lib.unescape(response.content.decode())
    assert "Reason: This looks like a full card number; write only its last four digits" in html
    textarea = re.search(rf'<textarea name="reason" id="reason-{approval.id}"[^>]*>(.*?)'
                         "</textarea>", html, re.S).group(1)
    assert textarea == reason.replace("4111 1111 1111 1111", "••••1111")
    assert "4111111111111111" not in re.sub(r"\D", "", html)
    # The page is the masked one, and sends the next decision back where the first came from.
    assert BENEFICIARY not in html
    assert f'name="next" value="{reverse("approvals:queue")}"' in html
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    assert Operation.objects.get(id=approval.operation_id).status == "not_started"
    assert AuditEvent.objects.count() == audit_rows
    # A comment too long for the form comes back whole, on the page, to shorten.
    comment = "checked with treasury " + "x" * 2000
    response = client.post(_approve_url(approval), {"comment": comment})
    assert response.status_code == 400
    html = html_lib.unescape(response.content.decode())
    assert "Comment: Ensure this value has at most 2000 characters" in html
    assert f'hx-preserve="true">{comment}</textarea>' in html
    assert no_execute == []
    # An approval no words can decide any more still answers with a redirect and a message.
    signed_in(admin_user).post(reverse("approvals:reject", args=[approval.id]),
                               {"reason": "duplicate"})
    response = client.post(_approve_url(approval), {"comment": "fine"})
    assert response.status_code == 302
    assert no_execute == []


def test_it_answers_403_to_an_auditor_posting_a_decision(acme, auditor, prepare_payment):
    approval = prepare_payment(acme)
    client = signed_in(auditor)
    assert client.get(reverse("approvals:detail", args=[approval.id])).status_code == 200
    assert approval.id in client.get(reverse("approvals:queue")).content.decode()
    assert client.post(_approve_url(approval)).status_code == 403
    assert client.post(reverse("approvals:reject", args=[approval.id]),
                       {"reason": "x"}).status_code == 403
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_answers_404_for_a_tenant_the_user_cannot_see(acme, other_tenant_user, stranger,
                                                         prepare_payment):
    approval = prepare_payment(acme)
    for user in (other_tenant_user, stranger):
        client = signed_in(user)
        assert client.get(reverse("approvals:detail", args=[approval.id])).status_code == 404
        assert client.post(_approve_url(approval)).status_code == 404
    assert signed_in(stranger).get(reverse("approvals:detail", args=["apr_nope"])).status_code \
        == 404


def test_it_answers_405_to_wrong_methods(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    client = signed_in(approver)
    assert client.get(_approve_url(approval)).status_code == 405
    assert client.get(reverse("approvals:reject", args=[approval.id])).status_code == 405
    assert client.post(reverse("approvals:queue")).status_code == 405
    assert client.post(reverse("approvals:detail", args=[approval.id])).status_code == 405


def test_it_refuses_a_post_without_csrf(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    client = Client(enforce_csrf_checks=True)
    client.force_login(approver)
    assert client.post(_approve_url(approval)).status_code == 403
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_shows_the_diff_of_a_superseded_intent_and_refuses_the_old_one(
    acme, approver, prepare_payment, no_execute
):
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_350_000)
    client = signed_in(approver)
    html = client.get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert '<del class="old">12,500.00 KZT</del>' in html
    assert '<ins class="new">13,500.00 KZT</ins>' in html
    old_html = client.get(reverse("approvals:detail", args=[old.id])).content.decode()
    assert 'data-status="superseded"' in old_html
    assert "approvals:approve" not in old_html and _approve_url(old) not in old_html
    response = client.post(_approve_url(old), HTTP_HX_REQUEST="true")
    assert f"superseded by a changed one ({new.id})" in response.content.decode()
    assert Approval.objects.get(id=old.id).status == ApprovalStatus.SUPERSEDED
    assert no_execute == []


@pytest.mark.parametrize("changes", [{"amount_minor": 1_350_000}, {}],
                         ids=["changed", "asked-again-unchanged"])
def test_it_says_a_replaced_request_was_changed_only_when_its_intent_was(
    acme, approver, prepare_payment, no_execute, changes
):
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, **changes)
    assert (new.payload_hash != old.payload_hash) == bool(changes)
    client = signed_in(approver)

    old_html = client.get(reverse("approvals:detail", args=[old.id])).content.decode()
    assert ("This intent was changed" in old_html) == bool(changes)
    assert ("This intent was asked again, unchanged" in old_html) == (not changes)
    assert f'href="{reverse("approvals:detail", args=[new.id])}"' in old_html
    refusal = client.post(_approve_url(old), HTTP_HX_REQUEST="true").content.decode()
    assert ("superseded by a changed one" in refusal) == bool(changes)
    assert (f"asked again unchanged ({new.id})" in refusal) == (not changes)


def test_it_answers_a_history_restore_of_an_approvals_page_with_the_whole_page(
    acme, approver, prepare_payment
):
    """Back to an approval's page that htmx no longer caches asks for it with HX-Request and
    HX-History-Restore-Request, and htmx puts the answer in place of the whole body. The page
    tested HX-Request alone, so it gave back a bare card with no layout, and varied on
    HX-Request only, so a cache could hand the card to the restore, or the page to a swap."""
    from django.utils.cache import cc_delim_re

    approval = prepare_payment(acme)
    client = signed_in(approver)
    url = reverse("approvals:detail", args=[approval.id])

    swap = client.get(url, HTTP_HX_REQUEST="true")
    restore = client.get(url, HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")

    assert approval.id in swap.content.decode() and "<html" not in swap.content.decode()
    assert approval.id in restore.content.decode() and "<html" in restore.content.decode()
    for response in (swap, restore):
        vary = {h.strip().lower() for h in cc_delim_re.split(response["Vary"])}
        assert {"hx-request", "hx-history-restore-request"} <= vary


def test_it_shows_approvals_in_navigation(approver):
    html = signed_in(approver).get("/").content.decode()
    assert 'href="/approvals/"' in html


def test_it_counts_the_pending_queue_and_the_last_days_decisions(
    acme, approver, admin_user, prepare_payment, no_execute
):
    from datetime import timedelta

    from django.utils import timezone

    prepare_payment(acme)
    old, recent = prepare_payment(acme), prepare_payment(acme)
    for approval in (old, recent):
        signed_in(admin_user).post(_approve_url(approval))
    updated_past_triggers(Approval.objects.filter(id=old.id),
                          decided_at=timezone.now() - timedelta(days=2))

    response = signed_in(approver).get(reverse("approvals:queue"))

    counts = {status: (label, n) for status, label, n in response.context["counts"]}
    assert counts["pending"] == ("Pending", 1)
    assert counts["approved"] == ("Approved (24 h)", 1)  # the two-day-old one is not counted
    assert "Approved (24 h): 1" in response.content.decode()


def test_it_counts_an_approval_that_ran_out_apart_from_the_pending_until_it_is_swept(
    acme, approver, prepare_payment, no_execute
):
    """The beat is behind: one approval ran out a minute ago and is not closed yet. Its
    card says so and any decision on it is refused, but the queue's counts read "Pending:
    2", two intents waiting for a decision, where the dashboard counted it apart."""
    from datetime import timedelta

    from django.utils import timezone

    from approvals.services import approvals_expire_overdue

    waiting = prepare_payment(acme)
    ran_out = prepare_payment(acme, invoice_id="inv_ran_out")
    Approval.objects.filter(id=ran_out.id).update(
        expires_at=timezone.now() - timedelta(minutes=1))
    client = signed_in(approver)

    response = client.get(reverse("approvals:queue"))

    html = response.content.decode()
    assert waiting.id in html and "expired, not yet swept" in html
    counts = {status: (label, n) for status, label, n in response.context["counts"]}
    assert counts["pending"] == ("Pending", 1)
    assert counts["overdue"] == ("Expired, not yet closed", 1)
    assert '<span class="status status-pending">Pending: 1</span>' in html
    assert '<span class="status status-overdue">Expired, not yet closed: 1</span>' in html
    # The dashboard, by the same rule, says the same.
    dashboard = client.get("/").context["waiting"]
    assert (dashboard["count"], dashboard["overdue"]) == (1, 1)
    # Swept, it is an expiry of the last 24 hours, and nothing is counted as overdue.
    assert approvals_expire_overdue() == 1
    counts = {status: n for status, _, n in client.get(reverse("approvals:queue"))
              .context["counts"]}
    assert (counts["pending"], counts["expired"]) == (1, 1) and "overdue" not in counts
    assert no_execute == []


def test_it_tells_an_approver_the_approval_expired_and_records_the_attempt(
    acme, approver, prepare_payment, no_execute
):
    from datetime import timedelta

    from django.utils import timezone

    approval = prepare_payment(acme)
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=5)
    )
    response = signed_in(approver).post(_approve_url(approval), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert "This approval expired at" in html
    assert 'data-status="expired"' in html
    assert AuditEvent.objects.filter(
        action="approval.approve_refused", object_id=approval.id
    ).exists()
    assert no_execute == []


def test_it_starts_over_on_a_cursor_that_is_not_a_real_time(acme, approver, prepare_payment):
    approval = prepare_payment(acme)
    client = signed_in(approver)
    for cursor in ("p|2024-02-30T00:00:00+00:00|x", "p|2024-01-01T25:00:00|x",
                   "p|2024-01-01T10:00:00|naive", "d|garbage|x"):
        response = client.get(reverse("approvals:queue"), {"cursor": cursor})
        assert response.status_code == 200, cursor
        assert approval.id in response.content.decode()  # the first page


def test_it_starts_over_on_a_cursor_whose_time_the_database_cannot_hold(
    acme, approver, prepare_payment
):
    # Python reads offsets up to ±23:59; PostgreSQL holds ±15:59 only: it raised (a 500).
    approval = prepare_payment(acme)
    client = signed_in(approver)
    shown = {
        "p|2024-01-01T00:00:00+23:59|x": True,  # pending, expiring after that moment
        "d|2024-01-01T00:00:00-16:00|x": False,  # a page of decisions only
        "p|0001-01-01T00:00:00+05:00|x": True,  # before year 1 in UTC: the first page
        "d|9999-12-31T23:59:59-05:00|x": True,  # after 9999 in UTC: the first page
    }
    for cursor, pending_shown in shown.items():
        for htmx in ({}, {"HTTP_HX_REQUEST": "true"}):
            response = client.get(reverse("approvals:queue"), {"cursor": cursor}, **htmx)
            assert response.status_code == 200, cursor
            assert (approval.id in response.content.decode()) == pending_shown, cursor


def test_it_keeps_its_place_on_a_cursor_written_in_another_offset(
    acme, approver, prepare_payment
):
    from datetime import timedelta, timezone

    first, second = prepare_payment(acme), prepare_payment(acme, invoice_id="inv_2")
    Approval.objects.filter(id=second.id).update(expires_at=first.expires_at)
    moment = first.expires_at.astimezone(timezone(timedelta(hours=5)))
    response = signed_in(approver).get(
        reverse("approvals:queue"), {"cursor": f"p|{moment.isoformat()}|{first.id}"}
    )
    assert [card["approval"].id for card in response.context["cards"]] == [second.id]


def test_it_counts_the_intents_waiting_on_the_dashboard(acme, approver, other_tenant_user,
                                                       prepare_payment, no_execute):
    waiting = prepare_payment(acme)
    decided = prepare_payment(acme, invoice_id="inv_decided")
    signed_in(approver).post(_approve_url(decided))
    page = signed_in(approver).get("/")
    assert page.context["waiting"]["count"] == 1
    assert page.context["waiting"]["soonest"] == waiting.expires_at
    html = page.content.decode()
    assert 'href="/approvals/">1</a>' in html and "first expires in" in html
    # Another tenant's user: nothing of acme's queue.
    assert signed_in(other_tenant_user).get("/").context["waiting"]["count"] == 0


def test_it_links_an_operation_page_to_its_approval_requests(
    acme, approver, operator, prepare_payment
):

    first = prepare_payment(acme)
    second = prepare_payment(acme, supersedes=first.operation, amount_minor=1_300_000)
    approval_approve(approval_id=second.id, actor=approver, comment="checked the invoice")
    url = reverse("operations:detail", args=[second.operation_id])
    html = signed_in(operator).get(url).content.decode()
    assert reverse("approvals:detail", args=[second.id]) in html
    assert f"Approval {second.id}" in html and f"approved by {approver.username}" in html
    # Only this intent's requests: the replaced intent's approval is on its own page.
    assert reverse("approvals:detail", args=[first.id]) not in html
    old = signed_in(operator).get(reverse("operations:detail", args=[first.operation_id]))
    assert reverse("approvals:detail", args=[first.id]) in old.content.decode()
    assert "superseded" in old.content.decode()


def test_it_shows_the_amount_a_currency_change_makes(acme, approver, prepare_payment):
    old = prepare_payment(acme)  # 1,250,000 minor units of KZT: 12,500.00 KZT
    # Same minor units, in a currency without minor units: a hundred times the money.
    new = prepare_payment(acme, supersedes=old.operation, currency="JPY")
    html = signed_in(approver).get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert '<del class="old">KZT</del>' in html
    assert '<del class="old">12,500.00 KZT</del>' in html
    assert '<ins class="new">1,250,000 JPY</ins>' in html


def test_it_says_the_time_zone_of_the_replaced_intents_decisions(
    acme, approver, prepare_payment, no_execute
):
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_350_000)
    html = signed_in(approver).get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert "Approvals of the intent it replaces" in html
    assert "<th>Decided (UTC)</th>" in html and "<th>Decided</th>" not in html


@pytest.mark.parametrize("changes", [{"amount_minor": 1_150_000}, {}],
                         ids=["changed", "asked-again-unchanged"])
def test_it_shows_why_the_replaced_intent_was_rejected_on_the_new_ones_card(
    acme, approver, prepare_payment, no_execute, changes
):
    from approvals.services import approval_reject

    old = prepare_payment(acme)
    approval_reject(approval_id=old.id, actor=approver, reason="wrong amount, see contract")
    # The agent fixes the amount, or asks again unchanged: a new intent replacing the
    # rejected (cancelled) one. Unchanged, the card must still say what befell the first.
    new = prepare_payment(acme, supersedes=old.operation, **changes)
    client = signed_in(approver)

    queue = client.get(reverse("approvals:queue")).content.decode()
    card = queue[queue.index(f'id="card-{new.id}"'):]
    card = card[:card.index("</article>")]
    assert f'href="{reverse("approvals:detail", args=[old.id])}"' in card
    assert "rejected" in card and "wrong amount, see contract" in card
    assert ("Asked again, unchanged" in card) == (not changes)

    detail = client.get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert "<th>Reason or comment</th>" in detail
    assert "<td>wrong amount, see contract</td>" in detail


def test_it_masks_an_address_or_account_in_a_rejection_reason_where_it_is_shown(
    acme, approver, auditor, admin_user, prepare_payment, no_execute
):
    email, account = "anna.smith@example.com", "40817810099910004312"
    old = prepare_payment(acme)
    assert signed_in(approver).post(reverse("approvals:reject", args=[old.id]), {
        "reason": f"beneficiary {email} gave account {account}, not this one",
    }).status_code == 302
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_150_000)
    for url in (reverse("approvals:detail", args=[old.id]),
                reverse("approvals:detail", args=[new.id]),  # why the one it replaces went
                reverse("approvals:queue"), "/audit/"):
        html = signed_in(auditor).get(url).content.decode()
        assert email not in html and account not in html, url
    html = signed_in(auditor).get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert "a***@example.com" in html and "••••4312" in html
    unmasked = signed_in(admin_user).get(
        reverse("approvals:detail", args=[new.id]) + "?unmasked=1").content.decode()
    assert email in unmasked and account in unmasked


def test_it_names_the_expired_request_an_unchanged_intent_asks_again_for(
    acme, approver, prepare_payment, no_execute
):
    from datetime import timedelta

    from django.utils import timezone

    from approvals.services import approvals_expire_overdue

    # As the expiry refusal tells the agent: prepare the intent anew, superseding this one.
    old = prepare_payment(acme)
    Approval.objects.filter(id=old.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert approvals_expire_overdue() == 1
    again = prepare_payment(acme, supersedes=old.operation)
    assert again.payload_hash == old.payload_hash

    queue = signed_in(approver).get(reverse("approvals:queue")).content.decode()
    card = queue[queue.index(f'id="card-{again.id}"'):]
    card = card[:card.index("</article>")]
    assert f'href="{reverse("approvals:detail", args=[old.id])}"' in card and "expired" in card


def test_it_counts_and_offers_nothing_of_another_tenant_in_the_queue(
    acme, globex, approver, prepare_payment, no_execute
):
    from django.utils import timezone

    mine = prepare_payment(acme)
    prepare_payment(globex)
    decided = prepare_payment(globex, invoice_id="inv_decided")
    Approval.objects.filter(id=decided.id).update(
        status=ApprovalStatus.APPROVED, decided_at=timezone.now())

    response = signed_in(approver).get(reverse("approvals:queue"))

    counts = {status: n for status, _label, n in response.context["counts"]}
    assert counts["pending"] == 1 and counts["approved"] == 0
    html = response.content.decode()
    assert mine.id in html
    # The tenant filter names the user's own tenants only.
    assert 'value="acme"' in html and "globex" not in html.lower()


def test_it_offers_the_decision_buttons_only_to_those_who_may_decide(
    acme, approver, auditor, prepare_payment
):
    approval = prepare_payment(acme)
    pages = [reverse("approvals:queue"), reverse("approvals:detail", args=[approval.id])]
    for page in pages:
        html = signed_in(approver).get(page).content.decode()
        assert _approve_url(approval) in html, page
        # The auditor reads the same card, without the buttons the server would refuse.
        html = signed_in(auditor).get(page).content.decode()
        assert approval.id in html and _approve_url(approval) not in html, page
        assert reverse("approvals:reject", args=[approval.id]) not in html, page


def test_it_offers_no_approve_on_an_intent_of_an_outdated_policy_but_lets_it_be_rejected(
    acme, approver, prepare_payment, settings, no_execute
):
    outdated = prepare_payment(acme)
    settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
    current = prepare_payment(acme, invoice_id="inv_2")
    client = signed_in(approver)
    for page in (reverse("approvals:queue"), reverse("approvals:detail", args=[outdated.id])):
        html = client.get(page).content.decode()
        # The server would refuse it: the button is not offered, and the card says why.
        assert _approve_url(outdated) not in html, page
        assert reverse("approvals:reject", args=[outdated.id]) in html, page
        assert ("prepared under policy <code>payments-v3</code>, and "
                "<code>payments-v4</code> is now in force") in html, page
    html = client.get(reverse("approvals:queue")).content.decode()
    assert _approve_url(current) in html
    assert html.count("is now in force: it can no longer be approved") == 1

    client.post(reverse("approvals:reject", args=[outdated.id]), {"reason": "old policy"})
    outdated.refresh_from_db()
    assert outdated.status == ApprovalStatus.REJECTED
    assert outdated.operation.status == "cancelled"
    assert no_execute == []
    assert "is now in force" not in client.get(
        reverse("approvals:detail", args=[outdated.id])).content.decode()


def test_it_offers_no_approve_for_a_live_replay_effect_its_launcher_may_no_longer_make(
    acme, approver, admin_user, no_execute
):
    """The engine calls an irreversible effect of a live replay only while whoever launched
    the replay holds replay_live_irreversible (run_mode_problem): once that is taken away,
    an approval could only be followed by a cancellation without a call."""
    from console.roles import role_revoke
    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory
    from tests.operations.engine_helpers import PAYMENT

    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
    live = RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launched_by=admin_user)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=live,
                           command_id="cmd_pay_01")
    approval = Approval.objects.get(operation=op)
    role_revoke(user=admin_user, role="Admin", tenant=acme, reason="left the team")

    client = signed_in(approver)
    for page in (reverse("approvals:queue"), reverse("approvals:detail", args=[approval.id])):
        html = client.get(page).content.decode()
        assert _approve_url(approval) not in html, page
        assert "It runs as soon as you approve" not in html, page
        assert reverse("approvals:reject", args=[approval.id]) in html, page
        assert (f"run {live.id} is a live replay launched by admin, who may not make an "
                "irreversible effect") in html, page
    # The rule is the server's: a press from a page read before the revocation is refused,
    # and recorded.
    client.post(_approve_url(approval), {"comment": "ok"})
    approval.refresh_from_db()
    op.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING and not op.authorized_hash
    (refused,) = AuditEvent.objects.filter(action="approval.approve_refused",
                                           object_id=approval.id)
    assert refused.after["refusal"] == "run_mode" and live.id in refused.reason
    assert no_execute == []
    client.post(reverse("approvals:reject", args=[approval.id]), {"reason": "no longer allowed"})
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.REJECTED


def test_it_offers_approve_to_anyone_but_the_person_who_made_the_intent(
    acme, approver, admin_user, prepare_payment, no_execute
):
    """Four eyes: the server refuses whoever created the intent (or launched its run); the
    card says so in place of an Approve button that could only be refused, and keeps Reject.
    Another approver on the tenant gets the button."""
    approval = prepare_payment(acme, actor=approver)
    approve_url = reverse("approvals:approve", args=[approval.id])
    reject_url = reverse("approvals:reject", args=[approval.id])
    pages = (reverse("approvals:queue"), reverse("approvals:detail", args=[approval.id]))
    for page in pages:
        html = signed_in(approver).get(page).content.decode()
        assert f'action="{approve_url}"' not in html
        assert f'action="{reject_url}"' in html
        assert "someone else must approve it" in html
        html = signed_in(admin_user).get(page).content.decode()
        assert f'action="{approve_url}"' in html
        assert "someone else must approve it" not in html
    # The rule itself is the server's: a press from an old page is still refused.
    signed_in(approver).post(approve_url, {"comment": "ok"})
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING
    assert AuditEvent.objects.filter(action="approval.approve_refused").count() == 1


def _heading(html: str, approval: Approval) -> str:
    card = html[html.index(f'id="card-{approval.id}"'):]
    return re.sub(r"\s+", " ", card[:card.index("</h2>")])


def test_it_says_in_a_decided_cards_heading_what_became_of_the_operation(
    acme, approver, operator, prepare_payment, no_execute
):
    """A green "approved" beside "Pay 12,500.00 KZT to …" read as money sent, while the
    payment had failed: that was a small pill on the ninth row of facts."""
    approval = prepare_payment(acme)
    approval_approve(approval_id=approval.id, actor=approver, comment="invoice matches")
    make_unknown(Operation.objects.get(id=approval.operation_id))
    heading = _heading(signed_in(approver).get("/approvals/").content.decode(), approval)
    assert "approved" in heading and "operation unknown" in heading
    operation_resolve(operation_id=approval.operation_id, actor=operator, outcome="failed",
                      evidence_text="no debit at the bank", reason="treasury checked")
    heading = _heading(signed_in(approver).get("/approvals/").content.decode(), approval)
    assert "operation failed" in heading


def test_it_names_what_changed_in_a_changed_intents_heading(acme, approver, prepare_payment):
    """On a phone the diff came after thirteen rows of facts, below the fold: the heading
    says the intent changed, and what."""
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_400_000,
                          beneficiary_id="vendor_990012399")
    html = signed_in(approver).get(reverse("approvals:detail", args=[new.id])).content.decode()
    assert "changed: beneficiary, amount" in _heading(html, new)
    unchanged = prepare_payment(acme, invoice_id="inv_other")
    html = signed_in(approver).get(
        reverse("approvals:detail", args=[unchanged.id])).content.decode()
    assert "changed:" not in _heading(html, unchanged)
    # A deal change names the fields it moves, each a row of the diff.
    deal = {"target": "deal_1", "expected_version": 3,
            "patch": {"stage": "won", "owner": "anna@example.com"}}
    first = operation_prepare(tenant=acme, action="crm.update_deal", payload=deal)
    second = operation_prepare(tenant=acme, action="crm.update_deal", supersedes=first,
                               payload={**deal, "patch": {"stage": "lost",
                                                          "owner": "alex@example.com"}})
    changed = Approval.objects.get(operation=second)
    html = signed_in(approver).get(
        reverse("approvals:detail", args=[changed.id])).content.decode()
    assert "changed: owner, stage" in _heading(html, changed)
    assert "<td>Change: owner</td>" in html and "changed in the masked part" in html


@pytest.mark.parametrize("who", ["operator", "auditor"])
def test_it_tells_a_person_who_may_not_decide_who_does(acme, request, who, prepare_payment):
    """A pending card with its buttons simply missing left an operator covering for an
    approver unsure whether the page was broken, and whom to ask."""
    approval = prepare_payment(acme)
    user = request.getfixturevalue(who)
    html = signed_in(user).get(reverse("approvals:detail", args=[approval.id])).content.decode()
    assert "Only an approver on Acme Corp can approve or reject this" in html
    assert 'action="' + reverse("approvals:reject", args=[approval.id]) not in html


def test_it_says_when_an_expired_approval_ran_out_not_when_it_was_swept(
    acme, approver, prepare_payment
):
    from datetime import timedelta

    from django.utils import timezone

    from approvals.services import approvals_expire_overdue

    approval = prepare_payment(acme)
    # The beat was an hour behind: the approval ran out an hour before it was closed.
    ran_out = timezone.now() - timedelta(hours=1)
    Approval.objects.filter(id=approval.id).update(expires_at=ran_out)
    assert approvals_expire_overdue() == 1
    html = signed_in(approver).get(reverse("approvals:detail", args=[approval.id])).content
    html = html.decode()
    assert f"<dt>Expired</dt><dd>at <time datetime=\"{ran_out.isoformat()}\">" \
        f"{ran_out:%Y-%m-%d %H:%M:%S} UTC</time>" in html
    assert "closed by the system at" in html


def test_it_says_a_replays_intent_repeats_a_command_its_parent_run_carried_out(
    acme, approver, admin_user
):
    """A replay prepares its nodes' commands again under new keys: the card was the one
    already paid, naming only a run id."""
    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory
    from tests.operations.engine_helpers import PAYMENT

    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
    paid = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                             run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_pay_01")
    Operation.objects.filter(id=paid.id).update(status="succeeded", external_id="pi_1")
    live = RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launched_by=admin_user,
                      launch_reason="reproduce the timeout for anna@acme.test")
    again = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=live, command_id="cmd_pay_01")
    other = operation_prepare(tenant=acme, action="payments.create",
                              payload={**PAYMENT, "invoice_id": "inv_other"}, run=live,
                              command_id="cmd_pay_02")
    client = signed_in(approver)

    for url in (f"/approvals/{Approval.objects.get(operation=again).id}/", "/approvals/"):
        page = client.get(url).content.decode()
        text = re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", "", page)))
        assert (f"Live (real calls) of {checkpoint.run_id}, launched by admin: reproduce "
                "the timeout for a***@acme.test") in text
        assert (f"This command is also in a run this one derives from: "
                f"{paid.id} is succeeded (run {checkpoint.run_id}). This intent has its own "
                "idempotency key") in text
        assert f'href="/operations/{paid.id}/"' in page
    # Another command of the replay repeats nothing: its card warns of nothing.
    page = client.get(f"/approvals/{Approval.objects.get(operation=other).id}/").content.decode()
    assert "also in a run" not in page and "Live (real calls)</span> of" in page
    # Nor does the original run's own card.
    page = client.get(f"/approvals/{Approval.objects.get(operation=paid).id}/").content.decode()
    assert "also in a run" not in page and "Derived" not in page


@pytest.mark.parametrize(("earlier", "said"), [
    ({}, "waiting for its approval"),
    ({"authorized_hash": "same"}, "approved, not yet carried out"),
    ({"provider_calls": 1}, "to be called again (a lookup found its last call left nothing)"),
    ({"status": "cancelled"}, None),
    ({"status": "failed"}, None),
], ids=["waiting", "approved-and-queued", "called-before", "cancelled", "refused"])
def test_it_warns_of_a_replayed_command_its_parent_run_may_yet_carry_out(
    acme, approver, admin_user, earlier, said
):
    """The parent run's copy of the command has not made its effect yet, but may: approving
    both pays twice under two keys. Only one closed with no effect needs no warning."""
    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory
    from tests.operations.engine_helpers import PAYMENT

    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
    first = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_pay_01")
    if earlier.get("authorized_hash"):
        earlier = {**earlier, "authorized_hash": first.payload_hash}
    Operation.objects.filter(id=first.id).update(**earlier)
    replay = RunFactory(derived_from=checkpoint, mode=RunMode.LIVE, launched_by=admin_user,
                        launch_reason="reproduce the timeout")
    again = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=replay, command_id="cmd_pay_01")

    page = signed_in(approver).get(
        f"/approvals/{Approval.objects.get(operation=again).id}/").content.decode()
    text = re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", "", page)))
    if said is None:
        assert "also in a run" not in text and first.id not in text
    else:
        assert (f"This command is also in a run this one derives from: {first.id} is {said} "
                f"(run {checkpoint.run_id}).") in text


def _replayed_after(acme, admin_user, first):
    """A live replay of `first`'s run asking its command again: its approval."""
    from operations.models import RunMode
    from tests.factories import RunFactory
    from tests.operations.engine_helpers import PAYMENT

    replay = RunFactory(derived_from=first.checkpoint, mode=RunMode.LIVE,
                        launched_by=admin_user, launch_reason="reproduce the timeout")
    again = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=replay, command_id=first.command_id)
    return Approval.objects.get(operation=again)


def _failed_by_a_person(acme, approver, operator):
    """A payment of a run whose answer was lost and that a person resolved as failed."""
    from datetime import timedelta

    from django.utils import timezone

    from operations.engine import operation_authorize
    from tests.factories import CheckpointFactory, RunFactory
    from tests.operations.engine_helpers import PAYMENT

    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
    first = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_pay_01")
    operation_authorize(operation_id=first.id, approved_hash=first.payload_hash,
                        policy_version=first.policy_version, approved_by=approver,
                        expires_at=timezone.now() + timedelta(minutes=30))
    make_unknown(first)
    operation_resolve(operation_id=first.id, actor=operator, outcome="failed",
                      evidence_text="no such payment in the dashboard",
                      reason="checked by phone with the bank")
    first.refresh_from_db()
    assert first.status == "failed"
    return first


@pytest.mark.parametrize("reported_by", ["event", "late answer"])
def test_it_warns_of_a_replayed_command_its_parent_run_failed_but_the_provider_carried_out(
    acme, approver, operator, admin_user, reported_by
):
    """A person failed the parent run's payment; then the provider reported it succeeded
    (a webhook, or the answer to the call that came too late), held for review. Prepare
    refuses to replace such an intent for that reason; a replay's intent under a new key
    would pay the invoice a second time just the same, so its card warns."""
    from operations import engine
    from operations.engine.core import held_reports
    from operations.providers.base import CallOutcome, WebhookFacts
    from tests.factories import CallAttemptFactory
    from tests.operations.engine_helpers import PAYMENT

    first = _failed_by_a_person(acme, approver, operator)
    if reported_by == "event":
        result, _ = engine.webhook_apply(provider="payments", facts=WebhookFacts(
            event_id="evt_late_success", event_type="payment_intent.succeeded",
            operation_id=first.id, external_id="pi_LATE", status=CallOutcome.SUCCEEDED,
            data={"id": "pi_LATE", "status": "succeeded", "amount": PAYMENT["amount_minor"],
                  "currency": PAYMENT["currency"].lower()}))
        assert result == "held"
    else:
        CallAttemptFactory(operation=first, number=first.attempts.count() + 1,
                           outcome="succeeded", external_id="pi_LATE", needs_review=True,
                           review_note="the provider reports succeeded (pi_LATE)")
    first.refresh_from_db()
    assert first.status == "failed" and held_reports(first.id).names()
    approval = _replayed_after(acme, admin_user, first)

    page = signed_in(approver).get(f"/approvals/{approval.id}/").content.decode()

    text = re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", "", page)))
    assert (f"This command is also in a run this one derives from: {first.id} is failed, "
            "but the provider has since reported an effect of it, held for review "
            f"(run {first.run_id}).") in text
    assert f'href="/operations/{first.id}/"' in page


def test_it_does_not_warn_of_a_failed_command_whose_late_report_a_person_has_answered(
    acme, approver, operator, admin_user
):
    """Once a person has answered the provider's late report and left the operation failed,
    it is closed with no effect again, as any failed one."""
    from django.utils import timezone

    from tests.factories import CallAttemptFactory

    first = _failed_by_a_person(acme, approver, operator)
    CallAttemptFactory(operation=first, number=first.attempts.count() + 1,
                       outcome="succeeded", external_id="pi_LATE", needs_review=True,
                       reviewed_at=timezone.now(),
                       review_note="the provider reports succeeded (pi_LATE)")
    approval = _replayed_after(acme, admin_user, first)

    page = signed_in(approver).get(f"/approvals/{approval.id}/").content.decode()

    assert "also in a run" not in page and first.id not in page


def test_it_reads_the_lineage_of_derived_intents_in_the_same_queries_for_any_page(
    acme, approver, admin_user, prepare_payment
):
    """Each card of a replay's or a branch's intent names the run it derives from and the
    same command's effects in earlier runs: read per card and per generation, a page of
    twenty cards two generations deep made hundreds of queries."""
    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory

    client = signed_in(approver)

    def queue() -> tuple[int, str]:
        return page_and_query_count(client, reverse("approvals:queue"))

    queue()  # per-process caches
    counts, earlier_ids = [], []
    for n in range(3):
        original = RunFactory(tenant=acme)
        first = prepare_payment(acme, run=original, command_id="cmd_pay", invoice_id=f"inv_{n}")
        # Two generations, as a branch of a replay is.
        replay = RunFactory(derived_from=CheckpointFactory(run=original), mode=RunMode.LIVE,
                            launched_by=admin_user)
        branch = RunFactory(derived_from=CheckpointFactory(run=replay), launched_by=admin_user)
        prepare_payment(acme, run=branch, command_id="cmd_pay", invoice_id=f"inv_{n}_again")
        earlier_ids.append(first.operation_id)
        count, html = queue()
        counts.append(count)
        # Each derived card still names its parent run and warns of its own earlier effect.
        assert f'href="/runs/{replay.id}/"' in html
        for earlier_id in earlier_ids:
            assert f'href="/operations/{earlier_id}/"' in html
    assert counts[0] == counts[1] == counts[2], counts
    assert html.count("This command is also in a run this one derives from") == 3


def test_it_checks_a_live_replays_launcher_once_for_a_page_of_its_cards(
    acme, approver, admin_user, prepare_payment
):
    """A live replay asks again every payment of the run it repeats, each a pending card
    whose run's mode is checked (may its launcher still make an irreversible effect?): the
    check read the launcher's grants once per card, a query more for every card."""
    from operations.models import RunMode
    from tests.factories import CheckpointFactory, RunFactory

    original = RunFactory(tenant=acme)
    replay = RunFactory(derived_from=CheckpointFactory(run=original), mode=RunMode.LIVE,
                        launched_by=admin_user)
    client = signed_in(approver)

    def queue() -> tuple[int, str]:
        return page_and_query_count(client, reverse("approvals:queue"))

    prepare_payment(acme, run=replay, command_id="cmd_pay_0", invoice_id="inv_0")
    queue()  # per-process caches
    counts = []
    for n in range(1, 4):
        prepare_payment(acme, run=replay, command_id=f"cmd_pay_{n}", invoice_id=f"inv_{n}")
        count, html = queue()
        counts.append(count)
    assert counts[0] == counts[1] == counts[2], counts
    # Every card is still one an approver may approve: its launcher may make the payment.
    assert html.count("may not make an irreversible effect") == 0
    assert html.count(f'href="/runs/{replay.id}/"') >= 4

    # Once the launcher may not, every card says so, read as anew for every page.
    from console.roles import role_revoke

    role_revoke(user=admin_user, role="Admin", tenant=acme, reason="left the company")
    count, html = queue()
    assert html.count("may not make an irreversible effect") == 4
