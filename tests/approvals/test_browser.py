"""The approver's path in a real browser: Playwright driving Debian's Chromium."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from approvals.models import Approval, ApprovalStatus
from operations.models import Operation, OperationStatus
from tests.approvals.conftest import BENEFICIARY
from tests.helpers import browser_sign_in, wait_for

pytestmark = pytest.mark.browser


def test_it_lets_an_approver_approve_in_place_and_the_payment_runs_once(
    live_server, worker_pool, acme, approver, prepare_payment, page
):
    from operations.sandbox.selectors import sandbox_counts

    worker_pool.start(
        extra_env={"PAYMENTS_API_BASE": f"{live_server.url}/sandbox/payments"}
    )
    approval = prepare_payment(acme)

    browser_sign_in(page, live_server, "approver")
    page.click("nav >> text=Approvals")
    page.wait_for_url(f"{live_server.url}/approvals/")
    card = page.locator(f"#card-{approval.id}")
    card.wait_for()
    assert "12,500.00 KZT" in card.inner_text()
    assert "Acme Corp LLP" in card.inner_text()
    assert "••••2345" in card.inner_text()
    assert BENEFICIARY not in page.content()

    counts = page.locator("#approval-counts")
    assert "Pending: 1" in counts.inner_text()
    page.evaluate("window.__notReloaded = true")
    card.locator("textarea[name=comment]").fill("invoice matches the contract")
    with page.expect_response(lambda r: r.url.endswith(f"/{approval.id}/approve")) as answer:
        card.get_by_role("button", name="Approve").click()
    assert answer.value.request.headers.get("hx-request") == "true"
    page.locator(f"#card-{approval.id} [data-status=approved]").wait_for()
    assert page.evaluate("window.__notReloaded === true")
    # The Approve button is gone with the swap: focus goes to the answer, not to <body>.
    expect(page.locator(f"#card-{approval.id} [role=status]")).to_be_focused()
    assert "invoice matches the contract" in page.locator(f"#card-{approval.id}").inner_text()
    # The counts follow the decision at once, not at the next 15-second poll.
    page.locator("#approval-counts", has_text="Approved (24 h): 1").wait_for(timeout=5_000)
    assert "Pending: 0" in page.locator("#approval-counts").inner_text()
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.APPROVED

    def succeeded() -> bool:
        return Operation.objects.get(id=approval.operation_id).status == OperationStatus.SUCCEEDED

    wait_for(succeeded, timeout=60, interval=0.25, what="the approved payment to succeed")
    op = Operation.objects.get(id=approval.operation_id)
    assert op.payload_hash == approval.payload_hash
    assert op.provider_calls == 1
    assert sandbox_counts()["payment_intents"] == 1
    assert page.problems == []


def test_it_shows_a_superseded_intents_diff(
    live_server, transactional_db, acme, approver, prepare_payment, page
):
    old = prepare_payment(acme)
    new = prepare_payment(acme, supersedes=old.operation, amount_minor=1_350_000)

    browser_sign_in(page, live_server, "approver")
    page.goto(f"{live_server.url}/approvals/")
    card = page.locator(f"#card-{new.id}")
    old_amount = card.locator(".diff del.old", has_text="12,500.00 KZT")
    new_amount = card.locator(".diff ins.new", has_text="13,500.00 KZT")
    old_amount.wait_for()
    new_amount.wait_for()
    assert "line-through" in old_amount.evaluate(
        "el => getComputedStyle(el).textDecorationLine"
    )

    page.goto(f"{live_server.url}/approvals/{old.id}/")
    old_card = page.locator(f"#card-{old.id}")
    assert old_card.locator("[data-status=superseded]").count() == 1
    assert old_card.get_by_role("button", name="Approve").count() == 0
    assert new.id in old_card.inner_text()
    assert page.problems == []


def test_it_fits_a_phone_screen_without_sideways_scrolling(
    live_server, transactional_db, acme, approver, prepare_payment, browser
):
    old = prepare_payment(acme, invoice_id="inv_" + "9" * 150)  # a very long id too
    # A changed intent: its card shows a diff table and a link to the approval it replaces.
    approval = prepare_payment(acme, supersedes=old.operation, invoice_id="inv_" + "8" * 150)
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    try:
        browser_sign_in(page, live_server, "approver")
        for path in ("/", "/approvals/", f"/approvals/{approval.id}/", "/operations/",
                     f"/operations/{approval.operation_id}/", "/runs/"):
            page.goto(f"{live_server.url}{path}")
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
            for table in page.locator("table.diff").all():  # the new value is on screen
                box = table.bounding_box()
                assert box is not None and box["x"] + box["width"] <= 390, path
        # Every main link stays on screen, and is tall enough for a thumb (WCAG 2.5.8).
        for link in page.locator("nav[aria-label=Main] a").all():
            box = link.bounding_box()
            assert box is not None and box["x"] + box["width"] <= 390, link.inner_text()
            assert box["height"] >= 24, (link.inner_text(), box["height"])
        sign_out = page.get_by_role("button", name="Sign out").bounding_box()
        assert sign_out is not None and sign_out["height"] >= 24
    finally:
        context.close()


def test_it_holds_the_queue_refresh_while_an_approver_types(
    live_server, transactional_db, acme, approver, prepare_payment, browser
):
    for i in range(6):
        prepare_payment(acme, invoice_id=f"inv_{i}")
    context = browser.new_context(viewport={"width": 1280, "height": 500})
    page = context.new_page()
    try:
        browser_sign_in(page, live_server, "approver")
        page.goto(f"{live_server.url}/approvals/")
        polls: list[str] = []
        page.on("request", lambda r: polls.append(r.url)
                if r.headers.get("hx-request") and "/approvals/" in r.url else None)
        comment = page.locator("textarea[name=comment]").first
        comment.click()
        comment.type("checking the invoice")
        # On to the Approve button, about to press it: the refresh must not take it away.
        page.keyboard.press("Tab")
        approve = page.get_by_role("button", name="Approve").first
        expect(approve).to_be_focused()
        page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
        scrolled = page.evaluate("window.scrollY")
        assert scrolled > 500
        page.wait_for_timeout(16_500)  # past the queue's 15-second refresh
        # Re-rendering around the focused field would have thrown the page back to it.
        assert polls == []
        assert page.evaluate("window.scrollY") == scrolled
        assert comment.input_value() == "checking the invoice"
        expect(approve).to_be_focused()
    finally:
        context.close()


def test_it_shows_the_filter_of_the_page_back_brings_back(
    live_server, transactional_db, acme, operator, page
):
    browser_sign_in(page, live_server, "operator")
    # The first Tab offers a way past the menu, straight to the page.
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("main#content")).to_be_focused()
    page.goto(f"{live_server.url}/operations/")
    status = page.locator("form.filters select[name=status]")
    for value in ("unknown", "succeeded"):
        status.select_option(value)
        with page.expect_response(lambda r, value=value: f"status={value}" in r.url):
            page.get_by_role("button", name="Filter").click()
        page.wait_for_url(f"**/operations/?*status={value}*")
    page.go_back()
    page.wait_for_url("**/operations/?*status=unknown*")
    expect(status).to_have_value("unknown")
    page.go_back()
    page.wait_for_url(f"{live_server.url}/operations/")
    expect(status).to_have_value("")
    assert page.problems == []


def test_it_says_why_an_approve_from_a_page_older_than_the_sign_in_did_nothing(
    live_server, transactional_db, acme, approver, prepare_payment, page
):
    approval = prepare_payment(acme)
    browser_sign_in(page, live_server, "approver")
    page.goto(f"{live_server.url}/approvals/")
    # Another tab: signed out and in again, which renews the token this page still holds.
    other = page.context.new_page()
    other.goto(f"{live_server.url}/")
    other.get_by_role("button", name="Sign out").click()
    browser_sign_in(other, live_server, "approver")
    other.close()

    card = page.locator(f"#card-{approval.id}")
    card.locator("textarea[name=comment]").fill("invoice matches")
    with page.expect_response(lambda r: r.url.endswith(f"/{approval.id}/approve")) as answer:
        card.get_by_role("button", name="Approve").click()
    assert answer.value.status == 403
    # Not a button that silently does nothing: the refusal, in words, where they clicked.
    alert = card.locator("[role=alert]")
    expect(alert).to_contain_text("Nothing was done")
    expect(alert).to_contain_text("loaded before you last signed in")
    expect(alert).to_be_focused()
    assert card.locator("textarea[name=comment]").input_value() == "invoice matches"
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.PENDING
    # The browser and htmx log the 403 themselves; nothing else went wrong on the page.
    assert [p for p in page.problems if "403" not in p] == []
