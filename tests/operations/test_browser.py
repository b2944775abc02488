"""The operator's path in a real browser: from the journal to the unknown queue, to an
operation's page, and a resolution the provider confirms, answered in place by htmx."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from console.roles import role_revoke
from operations.models import AuditEvent, Evidence, EvidenceKind
from operations.sandbox.models import PaymentIntent
from operations.sandbox.selectors import sandbox_requests, sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from operations.services import audit_event_record
from tests.helpers import browser_sign_in
from tests.operations.operator_helpers import payment_at_provider

pytestmark = pytest.mark.browser


def _operators_page(page, live_server, op) -> None:
    browser_sign_in(page, live_server, "operator")
    page.goto(f"{live_server.url}/operations/{op.id}/")


def _act_in_place(page, op, *, action: str, button: str, status: str):
    """Press an operator action's button on the operation's page and check that htmx
    answered it in place: no reload, the panel showing `status`, and focus on what the
    answer says (the button went with the swap), not on <body>. Returns the panel."""
    panel = page.locator("#operation-panel")
    page.evaluate("window.__notReloaded = true")
    with page.expect_response(lambda r: r.url.endswith(f"/{op.id}/{action}")) as answer:
        page.get_by_role("button", name=button).click()
    assert answer.value.request.headers.get("hx-request") == "true"
    expect(panel.locator(".status").first).to_have_text(status)
    assert page.evaluate("window.__notReloaded === true")
    expect(panel.locator("[role=status]")).to_be_focused()
    return panel


def test_it_lets_an_operator_resolve_an_unknown_payment_from_its_page(
    live_server, transactional_db, sandbox, acme_unknown, operator, page
):
    op = acme_unknown
    hash_before = op.payload_hash
    # As the operator finds it in the provider's dashboard.
    payment_id = payment_at_provider(op)

    browser_sign_in(page, live_server, "operator")
    page.click("nav >> text=Operations")
    page.get_by_role("link", name="Unknown queue — oldest first").click()
    page.wait_for_url(f"{live_server.url}/operations/unknown/")
    page.get_by_role("link", name=op.id).click()
    page.wait_for_url(f"{live_server.url}/operations/{op.id}/")
    panel = page.locator("#operation-panel")
    assert "Unknown" in panel.locator(".status").first.inner_text()

    page.fill("#id_resolve-evidence", f"{payment_id} succeeded in the provider's dashboard")
    page.fill("#id_resolve-provider_reference", payment_id)
    page.fill("#id_resolve-reason", "the customer confirmed the transfer")
    _act_in_place(page, op, action="resolve", button="Resolve as succeeded", status="Succeeded")

    expect(panel).to_contain_text("set by an operator")
    expect(panel).to_contain_text(payment_id)
    expect(panel.locator("form.operator-action")).to_have_count(1)  # only Mark disputed left

    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually, op.payload_hash) == (
        "succeeded", payment_id, True, hash_before
    )
    # The reference was asked about once, by id; nothing was created or changed at the
    # provider, and the one payment there is the one the person named.
    (lookup,) = sandbox_requests(provider="payments")
    assert (lookup.method, lookup.path.rsplit("/", 1)[-1]) == ("GET", payment_id)
    assert not sandbox_writes(provider="payments").exists()
    assert list(PaymentIntent.objects.values_list("id", flat=True)) == [payment_id]
    (audit,) = AuditEvent.objects.filter(object_id=op.id, action="operation.resolve_succeeded")
    assert (audit.actor, audit.reason) == (operator, "the customer confirmed the transfer")
    assert Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).count() == 1

    page.goto(f"{live_server.url}/operations/unknown/")
    expect(page.get_by_text("No unknown operations. Nothing waits for a person.")).to_be_visible()
    assert page.problems == []


def test_it_lets_an_operator_reconcile_now_and_shows_what_the_lookup_found(
    live_server, transactional_db, sandbox, acme_unknown, operator, page
):
    op = acme_unknown
    payment_id = payment_at_provider(op)

    _operators_page(page, live_server, op)
    page.fill("#id_reconcile-reason", "the customer asks whether it went through")
    panel = _act_in_place(page, op, action="reconcile", button="Reconcile now", status="Succeeded")

    expect(panel.locator("[role=status]")).to_contain_text("Reconcile:")
    expect(panel.locator(".timeline")).to_contain_text("provider lookup")
    expect(panel).to_contain_text(payment_id)

    op.refresh_from_db()
    assert (op.status, op.external_id, op.resolved_manually) == ("succeeded", payment_id, False)
    # A reconcile only reads: the provider saw lookups, no create, and holds one payment.
    assert sandbox_requests(provider="payments").exclude(method="GET").count() == 0
    assert not sandbox_writes(provider="payments").exists()
    assert PaymentIntent.objects.count() == 1
    (audit,) = AuditEvent.objects.filter(object_id=op.id, action="operation.reconcile")
    assert (audit.actor, audit.reason) == (operator, "the customer asks whether it went through")
    assert page.problems == []


def test_it_empties_the_reason_of_a_reconcile_that_went_through_and_keeps_other_drafts(
    live_server, transactional_db, sandbox, acme_unknown, operator, page
):
    op = acme_unknown
    # Every lookup gets a 5xx: the reconcile is recorded and settles nothing, so its button
    # stays on the page.
    sandbox_fault_set(provider="payments", kind="http_500", match="*", times=10)

    _operators_page(page, live_server, op)
    page.fill("#id_resolve-evidence", "half-typed evidence")
    page.fill("#id_reconcile-reason", "the customer asks again")
    panel = _act_in_place(page, op, action="reconcile", button="Reconcile now", status="Unknown")

    expect(panel.locator("[role=status]")).to_contain_text("inconclusive")
    # The reason went to the audit trail; left in the field, the next press would send it
    # again. The draft of another action stays.
    expect(page.locator("#id_reconcile-reason")).to_have_value("")
    expect(page.locator("#id_resolve-evidence")).to_have_value("half-typed evidence")
    (audit,) = AuditEvent.objects.filter(object_id=op.id, action="operation.reconcile")
    assert audit.reason == "the customer asks again"
    assert not sandbox_writes(provider="payments").exists()
    assert page.problems == []


def test_it_records_no_outcome_on_enter_and_asks_before_failed_on_a_persons_word(
    live_server, transactional_db, acme_unknown, operator, page
):
    op = acme_unknown
    _operators_page(page, live_server, op)
    # An operator writing up a failed payment, about to look up the reference.
    page.fill("#id_resolve-evidence", "the bank shows no debit: nothing was paid")
    page.fill("#id_resolve-reason", "treasury checked the statement")
    page.focus("#id_resolve-provider_reference")
    page.keyboard.press("Enter")
    # Then the button they meant. With no provider reference to check, it asks first: a
    # failed payment may be proposed again, and paid twice if this one went through.
    asked: list[str] = []

    def answer(dialog, *, accept: bool) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda dialog: answer(dialog, accept=False))
    page.get_by_role("button", name="Resolve as failed").click()
    page.wait_for_timeout(500)
    op.refresh_from_db()
    assert op.status == "unknown" and "paid twice" in asked[0]
    page.once("dialog", lambda dialog: answer(dialog, accept=True))
    with page.expect_response(lambda r: r.url.endswith(f"/{op.id}/resolve")):
        page.get_by_role("button", name="Resolve as failed").click()
    expect(page.locator("#operation-panel .status").first).to_have_text("Failed")
    assert len(asked) == 2
    op.refresh_from_db()
    assert (op.status, op.resolved_manually) == ("failed", True)
    assert list(AuditEvent.objects.filter(
        action__startswith="operation.resolve", object_id=op.id
    ).values_list("action", flat=True)) == ["operation.resolve_failed"]
    assert page.problems == []


def test_it_keeps_the_page_and_its_draft_when_the_operator_signs_out_in_another_tab(
    live_server, transactional_db, acme_unknown, operator, page
):
    op = acme_unknown
    _operators_page(page, live_server, op)
    page.fill("#id_resolve-evidence", "pi_3 seen in the dashboard; amount and date match")
    page.focus("#id_resolve-evidence")
    other = page.context.new_page()
    other.goto(f"{live_server.url}/")
    other.get_by_role("button", name="Sign out").click()
    other.wait_for_url("**/login/**")
    # The next status poll (every 10 s) says so at the top, and navigates nowhere.
    expect(page.locator("#session-notice [role=alert]")).to_contain_text(
        "You were signed out", timeout=15_000
    )
    assert page.url == f"{live_server.url}/operations/{op.id}/"
    assert page.input_value("#id_resolve-evidence").startswith("pi_3 seen")
    expect(page.locator("#session-notice a")).to_have_attribute(
        "href", f"/login/?next=/operations/{op.id}/"
    )


def test_it_says_in_place_why_older_events_did_not_come(
    live_server, transactional_db, acme, auditor, page
):
    """A person's own click that htmx answers with a GET (Older events, Older operations, a
    filter): when the console refuses it, the person is told, as for an action."""
    for n in range(55):
        audit_event_record(actor=None, action="tenant.update", tenant=acme,
                           object_type="tenant", object_id=acme.slug, reason=f"change {n}")
    browser_sign_in(page, live_server, "auditor")
    page.goto(f"{live_server.url}/audit/")
    older = page.get_by_role("link", name="Older events")
    expect(older).to_be_visible()
    # An admin takes the auditor role away while the page is open.
    role_revoke(user=auditor, role="Auditor", tenant=acme)
    with page.expect_response(lambda r: "before=" in r.url) as answer:
        older.click()
    assert answer.value.status == 403
    # The click must not seem to do nothing: the refusal's words reach the person.
    expect(page.locator("main")).to_contain_text(
        re.compile(r"Not permitted|needs more than your roles|refused", re.I), timeout=5_000)
