"""No way off the site through next=, Referer or HX-Current-URL."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.factories import PASSWORD
from tests.helpers import signed_in

OFFSITE = ["https://evil.example/", "//evil.example/", "/\\evil.example/", "///evil.example/",
           "\\\\evil.example", "javascript:alert(1)", "http:evil.example", "/\t/evil.example"]


@pytest.mark.django_db
@pytest.mark.parametrize("target", OFFSITE)
def test_it_never_sends_a_person_off_site_after_signing_in(approver, target):
    client = Client()
    response = client.post(f"/login/?next={target}",
                           {"username": "approver", "password": PASSWORD, "next": target})
    assert response.status_code == 302
    assert response["Location"] == "/", response["Location"]


@pytest.mark.django_db
@pytest.mark.parametrize("target", OFFSITE)
def test_it_never_sends_a_person_off_site_after_a_decision(acme, approver, target, monkeypatch):
    from approvals.models import Approval
    from operations.engine import operation_prepare
    from tests.operations.engine_helpers import PAYMENT

    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT)
    approval = Approval.objects.get(operation=op)
    response = signed_in(approver).post(f"/approvals/{approval.id}/reject",
                                        {"reason": "no", "next": target})
    assert response.status_code == 302
    assert response["Location"].startswith("/") and not response["Location"].startswith("//")
    assert "evil" not in response["Location"].split("?")[0].lstrip("/").split("/")[0]


@pytest.mark.django_db
@pytest.mark.parametrize("header", ["HTTP_REFERER", "HTTP_HX_CURRENT_URL"])
def test_it_returns_a_signed_out_action_only_to_this_site(acme, header):
    extra = {header: "https://evil.example/steal"}
    if header == "HTTP_HX_CURRENT_URL":
        extra["HTTP_HX_REQUEST"] = "true"
    response = Client().post("/approvals/apr_X/approve", **extra)
    location = response.get("Location") or response.get("HX-Redirect")
    assert location.startswith("/login/?next=/&") or location.startswith("/login/?next=%2F&")
