"""The operation page never acts on a keystroke nobody meant, and never throws away what an
operator typed: a refused action, or a session that ended elsewhere, leaves the draft."""

from __future__ import annotations

import re
from urllib.parse import unquote

import pytest
from django.test import Client
from django.urls import reverse

from operations.models import AuditEvent, OperationStatus
from tests.factories import CallAttemptFactory
from tests.helpers import signed_in

pytestmark = pytest.mark.django_db

S = OperationStatus


def test_it_gives_the_resolve_form_a_default_button_that_records_nothing(acme_unknown, operator):
    """Enter in the form's one single-line field (the provider reference) submits it with its
    default button, the first submit button in tree order; htmx follows, as the browser fires
    a click at that button. That button must be disabled and carry no outcome."""
    html = signed_in(operator).get(f"/operations/{acme_unknown.id}/").content.decode()
    action = reverse("operations:resolve", args=[acme_unknown.id])
    form = re.search(rf'<form[^>]*action="{re.escape(action)}".*?</form>', html, re.S).group(0)
    assert 'type="text"' in form  # the provider reference: Enter there submits
    first_button = re.search(r"<button[^>]*>", form).group(0)
    assert "disabled" in first_button and "name=" not in first_button


def test_it_answers_a_poll_without_a_session_in_place_and_never_navigates(acme_unknown):
    """Signed out in another tab while typing evidence: the page's own status poll must not
    send the page to sign in (HX-Redirect), which would drop the draft."""
    op = acme_unknown
    seen = f"{op.status}@{op.status_changed_at.timestamp():.6f}"
    response = Client().get(
        f"/operations/{op.id}/", {"seen": seen}, HTTP_HX_REQUEST="true",
        HTTP_HX_CURRENT_URL=f"http://testserver/operations/{op.id}/", HTTP_X_CONSOLE_POLL="true",
    )
    assert response.status_code == 286  # htmx stops polling
    assert "HX-Redirect" not in response
    assert response["HX-Retarget"] == "#session-notice"
    body = response.content.decode()
    assert "You were signed out" in body
    assert f"/login/?next=/operations/{op.id}/" in body
    # Something the person sent is still answered by sending them to sign in.
    action = Client().post(
        f"/operations/{op.id}/reconcile", {"reconcile-reason": "x"}, HTTP_HX_REQUEST="true",
        HTTP_HX_CURRENT_URL=f"http://testserver/operations/{op.id}/", HTTP_X_CONSOLE_POLL="true",
    )
    assert action.status_code == 204 and "not_done=1" in action["HX-Redirect"]


def test_it_keeps_the_typed_resolution_when_the_engine_refuses_it_without_javascript(
    acme_unknown, operator
):
    """Without JavaScript a refused resolution used to redirect (PRG), and the evidence and
    reason typed were gone, while the refusal tells the operator to come back a little later
    with the same evidence. The page comes back with them."""
    op = acme_unknown
    CallAttemptFactory(operation=op)  # a call with no answer yet: it may still land
    evidence = "no debit on the statement of 2 December, account ending 0042"
    response = signed_in(operator).post(f"/operations/{op.id}/resolve", {
        "resolve-outcome": "failed", "resolve-evidence": evidence,
        "resolve-provider_reference": "", "resolve-reason": "treasury checked",
    })
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and not op.resolved_manually
    assert not AuditEvent.objects.filter(
        action__in=["operation.resolve_failed", "operation.resolve_succeeded"], object_id=op.id
    ).exists()
    assert response.status_code == 409
    html = response.content.decode()
    assert evidence in html and "treasury checked" in html
    assert "Resolve refused" in html


def _next_of(location: str) -> str:
    assert location.startswith("/login/?next="), location
    return unquote(location.split("next=", 1)[1].removesuffix("&not_done=1"))


def test_it_returns_a_signed_out_resubmit_of_a_refused_form_to_the_operation_page(
    acme_unknown, operator
):
    op = acme_unknown
    resolve = reverse("operations:resolve", args=[op.id])
    # Without JavaScript: the reason left out, the form comes back to correct, rendered at
    # the action's own URL (the address bar now shows /resolve).
    refused = signed_in(operator).post(resolve, {
        "resolve-outcome": "failed",
        "resolve-evidence": "no debit on the statement of 2 December",
        "resolve-provider_reference": "", "resolve-reason": "",
    })
    assert refused.status_code == 400
    # The session ends (signed out in another tab) while the operator checks the bank; they
    # add the reason and send the form again from that page.
    anonymous = Client()
    answer = anonymous.post(resolve, {
        "resolve-outcome": "failed",
        "resolve-evidence": "no debit on the statement of 2 December",
        "resolve-provider_reference": "", "resolve-reason": "treasury checked",
    }, HTTP_REFERER=f"http://testserver{resolve}")
    assert answer.status_code == 302
    anonymous.force_login(operator)  # signs in again
    back = anonymous.get(_next_of(answer["Location"]))
    # Back to a page, as for any other signed-out action: not a GET of the POST-only URL,
    # which answers 405 with an empty body.
    assert back.status_code == 200, (back.status_code, back.content[:80])
    op.refresh_from_db()
    assert op.status == OperationStatus.UNKNOWN


def test_it_sends_a_stale_pages_back_link_from_a_refused_form_to_a_page(acme_unknown, operator):
    op = acme_unknown
    dispute = reverse("operations:dispute", args=[op.id])
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    # The form came back at /dispute; the person then signed in again in another tab, so
    # this page's token is stale, and the refusal offers the way "back to the page you were on".
    answer = client.post(dispute, {"dispute-reason": "beneficiary says it never came"},
                         HTTP_REFERER=f"http://testserver{dispute}")
    assert answer.status_code == 403
    back = answer.context["back"] or "/"
    assert client.get(back).status_code == 200, back
