"""A person's decision, and what moves on around it: a provider event that contradicts it (or
the console's own closing as never done) is held for review until a person looks again, a
decision answers only the held events its page showed, and a resolution applies to the
status the page showed, never to what the engine did since."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from operations.engine import TransitionRefused, operation_dispute, operation_resolve
from operations.forms import ResolveForm
from operations.models import Attempt, AttemptKind, Evidence, EvidenceKind, Operation, WebhookEvent
from operations.sandbox.selectors import sandbox_counts, sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.helpers import signed_in
from tests.operations.engine_helpers import prepared_payment
from tests.operations.operator_helpers import (
    TEXT_ONLY,
    audit_count,
    payment_at_provider,
    resolved_by_reference,
    sandbox_request_count,
)


@pytest.mark.django_db
def test_it_holds_a_provider_event_that_contradicts_a_person_for_review(
    acme_unknown, operator, other_tenant_user
):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import dashboard_metrics

    op = acme_unknown
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                      evidence_text="bank statement shows no debit", reason="checked")

    def event(event_id: str, status: CallOutcome, kind: str) -> tuple[str, str]:
        return webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type=f"payment_intent.{kind}", operation_id=op.id,
            external_id="pi_late", status=status))

    assert event("evt_agrees", CallOutcome.FAILED, "payment_failed")[0] == "ignored"
    assert dashboard_metrics(operator)["held_for_review"] == 0
    result, message = event("evt_contradicts", CallOutcome.SUCCEEDED, "succeeded")
    op.refresh_from_db()
    assert result == "held" and "provider reports succeeded" in message
    assert op.status == "failed" and op.external_id == ""  # the person's decision stands
    assert WebhookEvent.objects.get(event_id="evt_contradicts").needs_review

    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in page and "pi_late" in page
    assert "by a person's decision" in page
    queue = client.get("/operations/unknown/").content.decode()
    assert 'id="held"' in queue and op.id in queue
    assert dashboard_metrics(operator)["held_for_review"] == 1
    assert "#held" in client.get("/").content.decode()
    assert dashboard_metrics(other_tenant_user)["held_for_review"] == 0
    assert op.id not in signed_in(other_tenant_user).get("/operations/unknown/").content.decode()

    # A person looks again: the notice has done its job.
    operation_dispute(operation_id=op.id, actor=operator, reason="treasury checks the late debit")
    assert dashboard_metrics(operator)["held_for_review"] == 0
    assert "The provider disagrees" not in client.get(f"/operations/{op.id}/").content.decode()
    assert 'id="held"' not in client.get("/operations/unknown/").content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("action", ["dispute", "resolve"])
def test_it_answers_only_the_held_events_the_page_showed(acme_unknown, operator, action):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from operations.selectors import webhooks_held_for_review

    op = acme_unknown
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                      evidence_text="bank statement shows no debit", reason="checked")

    def contradiction(event_id: str) -> None:
        assert webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type="payment_intent.succeeded", operation_id=op.id,
            external_id=f"pi_{event_id}", status=CallOutcome.SUCCEEDED))[0] == "held"

    if action == "resolve":
        # Resolvable again once disputed (nothing held yet, so nothing answered).
        operation_dispute(operation_id=op.id, actor=operator, reason="treasury re-checks")
    contradiction("evt_shown")
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    field = re.search(rf'name="{action}-held_shown" value="([^"]*)"', page)
    assert field, page
    # Held while the person was deciding: their decision is not about it.
    contradiction("evt_later")
    op.refresh_from_db()
    data = {f"{action}-reason": "treasury checked the debit",
            f"{action}-held_shown": field.group(1)}
    if action == "resolve":
        data.update({"resolve-outcome": "succeeded", "resolve-evidence": "debit on statement",
                     "resolve-seen": op.status_changed_at.isoformat()})
    assert client.post(f"/operations/{op.id}/{action}", data).status_code == 302

    op.refresh_from_db()
    assert [e.event_id for e in webhooks_held_for_review(operation=op)] == ["evt_later"]
    decision = op.evidence.filter(kind="manual").last()
    assert decision.data["reviewed_events"] == ["evt_shown"]
    assert "pi_evt_later" in client.get(f"/operations/{op.id}/").content.decode()


@pytest.mark.django_db
def test_it_takes_a_decision_from_a_page_showing_hundreds_of_held_events(
    acme_unknown, operator
):
    """The page names every held event it showed, by id, in a hidden field the form capped
    at 2,000 characters: with two hundred events of a busy install's ten-digit ids, every
    dispute and resolution from the page was refused, and no one could answer them."""
    op = acme_unknown
    operation_resolve(operation_id=op.id, actor=operator, outcome="failed",
                      evidence_text="bank statement shows no debit", reason="checked")
    WebhookEvent.objects.bulk_create(
        WebhookEvent(id=10**10 + n, provider="payments", event_id=f"evt_{n}",
                     event_type="payment_intent.succeeded", operation=op,
                     external_id=f"pi_{n}", reported_status="succeeded", needs_review=True)
        for n in range(200)
    )
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    shown = re.search(r'name="dispute-held_shown" value="([^"]*)"', page).group(1)
    assert len(shown.split()) == 200

    response = client.post(f"/operations/{op.id}/dispute", {
        "dispute-reason": "treasury checks the debits", "dispute-held_shown": shown})

    assert response.status_code == 302
    op.refresh_from_db()
    assert op.status == "disputed"
    assert not WebhookEvent.objects.held_for_review().filter(operation=op).exists()
    decision = op.evidence.filter(kind="manual").last()
    assert len(decision.data["reviewed_events"]) == 200


@pytest.mark.django_db
@pytest.mark.parametrize("shown", [
    "12 evt_x", "12 \u00b2", "\u0661\u0662",
    " ".join(str(n) for n in range(1, 10_002)),  # more than any page names
], ids=["not-a-number", "superscript", "arabic-digits", "ten-thousand-and-one"])
def test_it_refuses_a_decision_from_a_page_whose_held_events_do_not_parse(
    acme_unknown, operator, shown
):
    # A superscript two is a digit to str.isdigit() and no number to int(): it was a 500.
    # Each id is a parameter of the decision's queries: 300,000 fit in a request.
    op = acme_unknown
    response = signed_in(operator).post(f"/operations/{op.id}/dispute", {
        "dispute-reason": "on hold", "dispute-held_shown": shown})
    op.refresh_from_db()
    assert response.status_code == 400 and "reload it" in response.content.decode()
    assert op.status == "unknown" and not op.evidence.filter(kind="manual").exists()


@pytest.mark.django_db(transaction=True)
def test_it_holds_a_payment_reported_after_the_console_closed_the_operation_as_never_done(
    acme, approver, operator, sandbox
):
    from operations.engine import operation_execute, webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts
    from tests.operations.engine_helpers import authorized_payment

    # The approval ran out before any call: the console closes it as never done.
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == "cancelled" and sandbox_request_count() == 0
    # Yet the provider holds a payment for it (one its search did not show in time).
    payment_id = payment_at_provider(op)

    def event(event_id: str, status: CallOutcome) -> tuple[str, str]:
        return webhook_apply(provider="payments", facts=WebhookFacts(
            event_id=event_id, event_type=f"payment_intent.{status.value}", operation_id=op.id,
            external_id=payment_id, status=status))

    result, message = event("evt_paid_after_all", CallOutcome.SUCCEEDED)

    op.refresh_from_db()
    assert result == "held" and "provider reports succeeded" in message
    assert (op.status, op.external_id) == ("cancelled", "")
    # The timeline says why it still reads cancelled while the provider reports a payment.
    held = op.evidence.filter(kind="webhook").get()
    assert "held for review" in held.summary and held.to_status == "cancelled"
    client = signed_in(operator)
    page = client.get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in page and payment_id in page
    assert "by a person's decision" not in page and "Mark disputed" in page
    assert 'id="held"' in client.get("/operations/unknown/").content.decode()

    # Not settled straight from cancelled: a person first holds it, with a reason on record.
    with pytest.raises(TransitionRefused, match="cannot be resolved as succeeded"):
        resolved_by_reference(op, operator, payment_id)
    # A person holds it, checks the payment at the provider, and settles it with it.
    operation_dispute(operation_id=op.id, actor=operator, reason="treasury sees the debit")
    op = resolved_by_reference(op, operator, payment_id)
    assert (op.status, op.external_id, op.resolved_manually) == ("succeeded", payment_id, True)
    assert 'id="held"' not in client.get("/operations/unknown/").content.decode()
    assert not sandbox_writes(provider="payments").exists()
    assert sandbox_counts()["payment_intents"] == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("closed", "reported", "result"),
    [
        ("failed", "succeeded", "held"),  # retried at the provider: the money moved
        ("failed", "accepted", "ignored"),  # an earlier "processing", only out of order
        ("cancelled", "accepted", "held"),  # under way, though closed as never done
        ("cancelled", "failed", "ignored"),  # no money moved: nothing for a person to do
        ("succeeded", "accepted", "ignored"),
    ],
)
def test_it_tells_a_contradicted_outcome_from_a_late_event(acme, closed, reported, result):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = prepared_payment(acme)
    Operation.objects.filter(id=op.id).update(status=closed, external_id="pi_1")

    # Each event made by the provider before the journal closed the operation.
    outcome, _ = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id=f"evt_{closed}_{reported}", event_type="payment_intent.x", operation_id=op.id,
        external_id="pi_1", status=CallOutcome(reported),
        created_at=op.status_changed_at - timedelta(minutes=1)))

    op.refresh_from_db()
    assert (outcome, op.status) == (result, closed)
    assert WebhookEvent.objects.get().needs_review == (result == "held")


def _page_hidden_fields(client, op: Operation, prefix: str = "resolve") -> dict[str, str]:
    """What the page's resolve (or dispute) form sends along unseen, as a browser would."""
    page = client.get(f"/operations/{op.id}/").content.decode()
    return dict(re.findall(rf'<input type="hidden" name="({prefix}-[^"]+)" value="([^"]*)"', page))


@pytest.mark.django_db
def test_it_resolves_the_status_the_page_showed(acme_unknown, operator):
    op = acme_unknown
    client = signed_in(operator)
    form = _page_hidden_fields(client, op)
    assert set(form) == {"resolve-seen"}
    # Exactly the stored moment, to the microsecond: an empty or rounded value would skip the
    # check or refuse every resolution.
    seen = ResolveForm(prefix="resolve", data=form).fields["seen"].clean(form["resolve-seen"])
    assert seen == op.status_changed_at
    client.post(f"/operations/{op.id}/resolve", {**form, **TEXT_ONLY})
    op.refresh_from_db()
    assert op.status == "succeeded" and op.resolved_manually
    assert audit_count(op, "operation.resolve_succeeded") == 1


@pytest.mark.django_db
def test_it_resolves_the_status_the_page_showed_whatever_offset_the_moment_came_in(
    acme_unknown, operator
):
    from datetime import timezone as dt_timezone

    # The same moment, in an offset Python reads and PostgreSQL cannot hold (±15:59 at
    # most): the conditional update raised (a 500).
    op = acme_unknown
    moment = op.status_changed_at.astimezone(dt_timezone(timedelta(hours=23, minutes=59)))
    response = signed_in(operator).post(
        f"/operations/{op.id}/resolve", {**TEXT_ONLY, "resolve-seen": moment.isoformat()},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200
    op.refresh_from_db()
    assert op.status == "succeeded" and audit_count(op, "operation.resolve_succeeded") == 1


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_resolution_of_a_status_the_operator_never_saw(
    acme, approver, operator, sandbox
):
    from operations import engine
    from operations.sandbox.models import PaymentIntent
    from tests.operations.engine_helpers import authorized_payment

    # Large enough that the sandbox leaves the payment processing: accepted, not final.
    op = authorized_payment(acme, approver, amount_minor=15_000_000)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)  # nothing written
    engine.operation_execute(operation_id=op.id)
    assert Operation.objects.get(id=op.id).status == "unknown"
    client = signed_in(operator)
    form = _page_hidden_fields(client, op)

    # While the operator checks with the bank (nothing there), the sweep's lookup proves
    # absence and the call goes again: the provider now holds a processing payment.
    assert engine.operation_reconcile(operation_id=op.id).may_call_again
    assert engine.operation_execute(operation_id=op.id).status == "accepted"
    body = client.post(f"/operations/{op.id}/resolve", {
        **form, **TEXT_ONLY, "resolve-outcome": "failed",
        "resolve-evidence": "the bank shows no such payment",
    }, HTTP_HX_REQUEST="true").content.decode()

    op.refresh_from_db()
    assert "Resolve refused" in body and "reload" in body.lower()
    assert op.status == "accepted" and not op.resolved_manually and op.error_code == ""
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert audit_count(op, "operation.resolve_failed") == 0
    intent = PaymentIntent.objects.get()
    assert intent.status == "processing" and op.external_id == intent.id
    assert len(sandbox_writes(provider="payments", operation_id=op.id)) == 2


@pytest.mark.django_db(transaction=True)
def test_it_refuses_a_resolution_when_the_engine_moves_on_while_the_provider_is_asked(
    acme_unknown, operator, sandbox, monkeypatch
):
    from operations.engine import people, webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = acme_unknown
    payment_id = payment_at_provider(op)
    seen = op.status_changed_at
    real_verify = people._reference_verify

    def engine_moves_on_meanwhile(op_, **kwargs):
        verified = real_verify(op_, **kwargs)
        # While the operator's reference is looked up, a webhook moves the operation on.
        assert webhook_apply(provider="payments", facts=WebhookFacts(
            event_id="evt_meanwhile", event_type="payment_intent.processing",
            operation_id=op.id, status=CallOutcome.ACCEPTED))[0] == "applied"
        return verified

    monkeypatch.setattr(people, "_reference_verify", engine_moves_on_meanwhile)
    with pytest.raises(TransitionRefused, match="not what the page showed"):
        operation_resolve(
            operation_id=op.id, actor=operator, outcome="succeeded",
            evidence_text="seen in the dashboard", reason="customer asked",
            provider_reference=payment_id, seen_status_changed_at=seen,
        )
    op.refresh_from_db()
    assert op.status == "accepted" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert not Attempt.objects.filter(operation=op, kind=AttemptKind.LOOKUP).exists()
    assert audit_count(op, "operation.resolve_succeeded") == 0


@pytest.mark.django_db
def test_it_refuses_a_dispute_of_a_status_the_operator_never_saw(acme_unknown, operator):
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = acme_unknown
    client = signed_in(operator)
    form = _page_hidden_fields(client, op, "dispute")
    assert set(form) == {"dispute-seen"}
    # The page showed unknown; while the operator types, the provider's webhook settles it.
    # Disputing applies to settled effects too: from that page it would put on hold a
    # payment that went through, on a decision taken about an unknown one.
    assert webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_settled", event_type="payment_intent.succeeded", operation_id=op.id,
        status=CallOutcome.SUCCEEDED))[0] == "applied"
    response = client.post(f"/operations/{op.id}/dispute",
                           {**form, "dispute-reason": "nobody knows if it went through"})

    assert response.status_code == 409
    body = response.content.decode()
    assert "Dispute refused" in body and "now succeeded" in body and "reload" in body.lower()
    op.refresh_from_db()
    assert op.status == "succeeded" and not op.resolved_manually
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    assert audit_count(op, "operation.dispute") == 0
    # Reloaded, the page's dispute applies to the status it now shows.
    client.post(f"/operations/{op.id}/dispute", {
        **_page_hidden_fields(client, op, "dispute"), "dispute-reason": "the customer contests it",
    })
    op.refresh_from_db()
    assert op.status == "disputed" and audit_count(op, "operation.dispute") == 1


@pytest.mark.django_db
@pytest.mark.parametrize("htmx", [True, False], ids=["htmx", "plain"])
@pytest.mark.parametrize("action", ["dispute", "resolve"])
def test_it_sends_a_form_back_after_an_error_with_the_status_its_page_now_shows(
    acme_unknown, operator, action, htmx
):
    """A form error re-renders the panel with the status as it is now, but the form kept the
    moment its first page showed: when the engine had moved the operation on meanwhile, the
    next press was refused once as stale, though the person was looking at the new status.
    It now carries the moment shown, and says the status moved on before anything is
    decided on it."""
    from operations.engine import webhook_apply
    from operations.providers.base import CallOutcome, WebhookFacts

    op = acme_unknown
    client = signed_in(operator)
    headers = {"HTTP_HX_REQUEST": "true"} if htmx else {}
    url = f"/operations/{op.id}/{action}"
    words = {"dispute-reason": "the customer contests it"} if action == "dispute" else {
        **TEXT_ONLY, "resolve-outcome": "succeeded"}
    blank = f"{action}-reason"
    decided = "operation.dispute" if action == "dispute" else "operation.resolve_succeeded"

    def sent_back(response) -> dict[str, str]:
        return dict(re.findall(
            rf'<input type="hidden" name="({action}-[^"]+)" value="([^"]*)"',
            response.content.decode()))

    # Nothing moved: the error alone, and the form applies to the same status.
    first = client.post(url, {**_page_hidden_fields(client, op, action), **words, blank: ""},
                        **headers)
    assert "not what your page showed" not in first.content.decode()
    seen = ResolveForm(prefix=action, data=sent_back(first)).fields["seen"].clean(
        sent_back(first)[f"{action}-seen"])
    assert seen == op.status_changed_at

    # While the operator types, the provider's event moves it on: a payment processing.
    assert webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_meanwhile", event_type="payment_intent.processing",
        operation_id=op.id, external_id="pi_meanwhile", status=CallOutcome.ACCEPTED),
    )[0] == "applied"
    op.refresh_from_db()
    assert op.status == "accepted"
    second = client.post(url, {**sent_back(first), **words, blank: ""}, **headers)

    body = second.content.decode()
    assert "is now accepted, final result pending" in body and "not what your page showed" in body
    assert audit_count(op, decided) == 0
    assert not Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).exists()
    # The person saw the new status and sends again: it applies to that one, not refused.
    third = client.post(url, {**sent_back(second), **words}, **headers)

    assert "refused" not in third.content.decode()
    op.refresh_from_db()
    assert op.status == ("disputed" if action == "dispute" else "succeeded")
    assert op.resolved_manually
    assert Evidence.objects.filter(operation=op, kind=EvidenceKind.MANUAL).count() == 1
    assert audit_count(op, decided) == 1
