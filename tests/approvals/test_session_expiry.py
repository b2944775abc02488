"""An approver whose session ran out while the queue or a card was still on screen."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from django.test import Client
from django.urls import reverse

from approvals.models import Approval, ApprovalStatus
from tests.helpers import signed_in

pytestmark = pytest.mark.django_db


def test_it_sends_the_browser_to_sign_in_and_back_when_an_htmx_approve_finds_no_session(
    acme, approver, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    detail = reverse("approvals:detail", args=[approval.id])
    client = Client()  # the session is gone; the card is still on screen
    response = client.post(
        reverse("approvals:approve", args=[approval.id]), {"comment": "ok"},
        HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL=f"http://testserver{detail}",
    )
    # htmx follows a 302 itself and would swap the whole sign-in page into the card; the
    # browser must be sent to sign in instead, and come back to the page it was on.
    assert response.status_code != 302, response.get("Location")
    target = response["HX-Redirect"]
    assert target.startswith(reverse("login"))
    # The sign-in page says the approval was not made (the comment typed is gone with it).
    sign_in = client.get(target).content.decode()
    assert "You were signed out, so what you just sent was not done." in sign_in
    # Back from signing in: the page the approver was on, never a GET of the POST-only URL.
    client.force_login(approver)  # signs in again
    assert "/approve" not in target
    assert client.get(target, follow=True).status_code == 200
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_never_swaps_the_sign_in_page_into_the_queue_when_its_poll_finds_no_session(
    acme, approver, prepare_payment
):
    prepare_payment(acme)
    response = Client().get(reverse("approvals:queue"), {"tenant": "acme"},
                            HTTP_HX_REQUEST="true",
                            HTTP_HX_CURRENT_URL="http://testserver/approvals/?tenant=acme")
    assert response.status_code != 302, response.get("Location")
    # A poll sent nothing that was refused: no "not done" on the sign-in page.
    assert response["HX-Redirect"] == "/login/?next=/approvals/%3Ftenant%3Dacme"


def test_it_returns_a_plain_approve_without_a_session_to_its_page_not_to_a_405(
    acme, approver, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    detail = reverse("approvals:detail", args=[approval.id])
    client = Client()
    response = client.post(reverse("approvals:approve", args=[approval.id]), {"comment": "ok"},
                           HTTP_REFERER=f"http://testserver{detail}")
    assert response.status_code == 302
    client.force_login(approver)  # signs in again
    assert response["Location"].endswith("&not_done=1")
    next_url = response["Location"].split("next=", 1)[1].removesuffix("&not_done=1")
    back = client.get(unquote(next_url))
    assert back.status_code == 200, back.status_code  # not 405 on the POST-only URL
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_returns_a_signed_out_resubmit_of_a_refused_rejection_to_a_page(
    acme, approver, prepare_payment
):
    """Without JavaScript a refused rejection comes back rendered at /reject; the session
    then ends before the approver sends it again."""
    approval = prepare_payment(acme)
    reject = reverse("approvals:reject", args=[approval.id])
    # A reason of blanks passes the browser's `required`; the card comes back to correct.
    refused = signed_in(approver).post(reject, {"reason": "   ", "next": "/approvals/"})
    assert refused.status_code == 400
    anonymous = Client()  # the session ends before the corrected form is sent
    answer = anonymous.post(reject, {"reason": "wrong beneficiary", "next": "/approvals/"},
                            HTTP_REFERER=f"http://testserver{reject}")
    assert answer.status_code == 302
    anonymous.force_login(approver)
    next_url = unquote(answer["Location"].split("next=", 1)[1].removesuffix("&not_done=1"))
    back = anonymous.get(next_url)
    assert back.status_code == 200, (next_url, back.status_code, back.content[:80])
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
