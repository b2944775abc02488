"""A POST from a page loaded before the person last signed in (here or in another tab)."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from approvals.models import Approval, ApprovalStatus
from tests.factories import PASSWORD

pytestmark = pytest.mark.django_db


def _stale_client(user) -> tuple[Client, str]:
    """A signed-in client holding the token its page had before the user signed in again."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    client.get("/")
    stale = client.cookies["csrftoken"].value
    # Signing in again (in another tab, after signing out there) rotates the token.
    client.get("/login/")
    response = client.post("/login/", {
        "username": user.username, "password": PASSWORD,
        "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
    })
    assert response.status_code == 302 and client.cookies["csrftoken"].value != stale
    return client, stale


def test_it_says_in_words_that_a_stale_pages_approve_did_nothing(
    acme, approver, prepare_payment
):
    approval = prepare_payment(acme)
    client, stale = _stale_client(approver)
    queue = "http://testserver" + reverse("approvals:queue")
    response = client.post(
        reverse("approvals:approve", args=[approval.id]), {"comment": "ok"},
        HTTP_X_CSRFTOKEN=stale, HTTP_REFERER=queue,
    )
    html = response.content.decode()
    assert response.status_code == 403
    assert "CSRF verification failed" not in html
    assert "loaded before you last signed in" in html and "Reload the page" in html
    # The words app.js shows in place of an htmx action, and the way back for a plain form.
    assert "data-refusal" in html
    assert f'href="{queue}"' in html
    assert '<nav aria-label="Main"' in html
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING


def test_it_never_links_back_to_another_site_from_the_stale_page_answer(approver):
    client, stale = _stale_client(approver)
    response = client.post("/logout/", HTTP_X_CSRFTOKEN=stale,
                           HTTP_REFERER="https://evil.example.com/")
    assert response.status_code == 403
    assert "evil.example.com" not in response.content.decode()
    assert 'href="/">Back to the dashboard' in response.content.decode()
