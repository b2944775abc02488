"""Closing an operation as never done (cancelled, or replaced by a new intent) while a call it
made may still land at the provider, broken on purpose against the sandbox over real HTTP.

A call our client gave up on (a timeout) may still be carried out: a lookup that comes back
empty only lets the *same* call go again (the provider dedups it by key), never closes the
operation or lets another one take its place, until nothing can land any more.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.intents import IntentError
from operations.models import Attempt, AttemptKind, Operation, OperationStatus
from operations.sandbox.models import PaymentIntent
from operations.sandbox.services import sandbox_fault_clear, sandbox_fault_set
from tests.helpers import updated_past_triggers, wait_for
from tests.operations.engine_helpers import authorized_payment
from tests.operations.failure_helpers import payment_posts

S = OperationStatus


def given_up_then_proven_absent(op: Operation) -> Operation:
    """The provider takes 4 s over the POST; our client gives up after 1 s, and the search
    (no lag) finds nothing yet: absence proven, the same call may go again."""
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=4)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    assert Operation.objects.get(id=op.id).status == S.UNKNOWN
    assert engine.operation_reconcile(operation_id=op.id).may_call_again
    op.refresh_from_db()
    assert op.status == S.NOT_STARTED and op.provider_calls == 1
    assert PaymentIntent.objects.count() == 0  # not yet
    return op


def slow_post_landed(op: Operation) -> None:
    wait_for(lambda: not payment_posts(op).filter(response_status__isnull=True).exists(),
             timeout=15, what="the slow POST to end at the sandbox")


@pytest.mark.django_db(transaction=True)
def test_it_refuses_to_supersede_an_intent_whose_given_up_call_may_still_land(
    acme, approver, providers_drained
):
    old = given_up_then_proven_absent(authorized_payment(acme, approver))
    # The agent changes the amount: a new intent would replace this one, with its own
    # operation id and key, while the first POST is still on its way.
    with pytest.raises(IntentError, match="call"):
        engine.operation_prepare(
            tenant=acme, action="payments.create", supersedes=old,
            payload={**old.payload, "amount_minor": old.payload["amount_minor"] + 100},
        )
    old.refresh_from_db()
    assert old.status == S.NOT_STARTED and not hasattr(old, "superseded_by")
    assert Operation.objects.count() == 1

    # The old intent runs again with its own key; the late POST dedups against it.
    assert engine.operation_execute(operation_id=old.id).outcome == "called"
    slow_post_landed(old)
    old.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert old.status == S.SUCCEEDED and old.external_id == intent.id
    posts = list(payment_posts(old))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {old.idempotency_key}
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_does_not_cancel_on_a_stale_read_after_another_worker_called(
    acme, approver, providers_drained, monkeypatch
):
    from operations.engine import execute as execute_module

    op = authorized_payment(acme, approver)
    runs_out_at = timezone.now() + timedelta(seconds=2)
    Operation.objects.filter(id=op.id).update(authorization_expires_at=runs_out_at)
    real_check = execute_module.call_problem
    other: dict = {}

    def another_worker_goes_first(op_):
        # Worker A read not_started with no calls made. Before its check, worker B claims,
        # calls (the provider is slow, B's client gives up), and a lookup proves absence
        # for now; then the approval runs out.
        if not other:
            other["b"] = True
            given_up_then_proven_absent(op)
            wait_for(lambda: timezone.now() > runs_out_at, what="the approval to run out")
        return real_check(op_)

    monkeypatch.setattr(execute_module, "call_problem", another_worker_goes_first)
    report = engine.operation_execute(operation_id=op.id, worker="A")
    monkeypatch.setattr(execute_module, "call_problem", real_check)
    op.refresh_from_db()
    # A must not close as never done what B's call may still carry out.
    assert report.outcome == "lost_claim" and op.status == S.NOT_STARTED, report
    assert engine.operation_execute(operation_id=op.id).outcome == "confirming_absence"

    slow_post_landed(op)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert len(payment_posts(op)) == 1 and op.provider_calls == 1


def _landed_late_unseen(
    tenant, approver, settings, *, gave_up_ago: float, landed_after: float
) -> tuple[Operation, PaymentIntent, datetime]:
    """A payment our client gave up on `gave_up_ago` seconds ago, which the provider carried
    out `landed_after` seconds after that and its search (60 s behind) does not show yet; the
    approval has run out meanwhile. (operation, payment, when the client gave up)."""
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    op = authorized_payment(tenant, approver)
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    engine.operation_execute(operation_id=op.id)
    slow_post_landed(op)
    intent = PaymentIntent.objects.get()
    now = timezone.now()
    gave_up = now - timedelta(seconds=gave_up_ago)
    updated_past_triggers(Attempt.objects.filter(operation=op, kind=AttemptKind.CALL),
                          started_at=gave_up - timedelta(seconds=1), finished_at=gave_up)
    PaymentIntent.objects.filter(id=intent.id).update(
        created_at=gave_up + timedelta(seconds=landed_after))
    Operation.objects.filter(id=op.id).update(authorization_expires_at=now - timedelta(minutes=1))
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)
    return op, intent, gave_up


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("gave_up_ago", "landed_after", "index_behind", "outage_lag", "wait"),
    [
        # 65 s after our client gave up: the provider carried the POST out 50 s after that
        # (inside the contract's 60 s late-landing window), and its search shows a payment
        # only 60 s after it is made. Wait: late landing plus the lag.
        (65, 50, 60, 0, 60 + 60),
        # Stripe: searchable "in less than a minute" normally, "up to an hour behind during
        # outages". 5 minutes on, its index is 10 minutes behind; only closing could follow
        # (the approval has run out), so the wait is for the lag an outage may have.
        (300, 1, 600, 3600, 60 + 3600),
    ],
    ids=["usual_lag", "outage_lag"],
)
def test_it_waits_out_the_search_lag_after_the_last_moment_a_call_could_land(
    acme, approver, providers_drained, settings, gave_up_ago, landed_after, index_behind,
    outage_lag, wait,
):
    op, intent, gave_up = _landed_late_unseen(
        acme, approver, settings, gave_up_ago=gave_up_ago, landed_after=landed_after)
    settings.PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS = outage_lag
    sandbox_fault_clear(provider="payments", kind="search_lag")
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=index_behind)

    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    # The empty search proves nothing yet: not cancelled, looked at again once it can.
    assert op.status == S.UNKNOWN and report.outcome == "inconclusive", report
    assert op.next_reconcile_at >= gave_up + timedelta(seconds=wait)
    assert len(payment_posts(op)) == 1  # and nothing was called again meanwhile

    sandbox_fault_clear(provider="payments", kind="search_lag")  # the index caught up
    time.sleep(0.1)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_takes_an_empty_search_for_the_moment_it_was_sent_not_answered(
    acme, approver, providers_drained, settings, monkeypatch
):
    from operations.engine import core

    # The POST landed at the end of the late-landing window; the search shows it 60 s later,
    # a second from now.
    op, intent, _ = _landed_late_unseen(
        acme, approver, settings, gave_up_ago=118.5, landed_after=59.5)
    real = core.adapter(op.action)

    class SlowAnswer:
        contract = real.contract
        account = real.account

        def lookup(self, op_):
            found = real.lookup(op_)  # searched now: the payment is not visible yet
            time.sleep(2)  # the answer takes its time to come back
            return found

    monkeypatch.setattr(core, "adapter", lambda action: SlowAnswer())
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and report.outcome == "inconclusive", report
    assert op.next_reconcile_at is not None

    monkeypatch.setattr(core, "adapter", lambda action: real)
    engine.operation_reconcile(operation_id=op.id)  # the search has caught up
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_closes_an_unknown_payment_as_never_done_on_a_maintenance_page(
    acme, approver, maintenance_page, settings
):
    from operations.providers.transport import account_fingerprint
    from tests.factories import CallAttemptFactory
    from tests.operations.engine_helpers import make_unknown

    settings.PAYMENTS_SEARCH_LAG_SECONDS = 0
    settings.PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS = 0
    op = make_unknown(authorized_payment(acme, approver), ago=timedelta(minutes=10))
    # Its one call gave up long ago, and its approval has run out since: a proven absence
    # would close it as cancelled, for good (a replacing intent gets a new key).
    long_ago = timezone.now() - timedelta(minutes=10)
    CallAttemptFactory(operation=op, started_at=long_ago, finished_at=long_ago,
                       outcome="unknown", error_class="timeout",
                       provider_account=account_fingerprint(
                           settings.PAYMENTS_API_BASE, settings.PAYMENTS_API_KEY))
    Operation.objects.filter(id=op.id).update(authorization_expires_at=long_ago)

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    # A 200 page that is not Stripe's search result proves nothing absent.
    assert op.status == S.UNKNOWN and report.outcome == "inconclusive", report
    assert op.next_reconcile_at is not None
    assert [method for method, _ in maintenance_page.requests] == ["GET"]  # no call
