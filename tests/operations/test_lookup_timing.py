"""The failure cases of the design brief where an empty lookup proves nothing yet, broken on
purpose against PostgreSQL and the sandbox providers over real HTTP: the provider's search
lags behind its writes, a call the client gave up on (or a stalled worker's) may still land,
and a key is kept only so long. An operation is called again, or closed as never done, only
once nothing can land any more.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

import time
from datetime import timedelta
from itertools import pairwise

import pytest
from django.utils import timezone

from operations import engine
from operations.models import Attempt, AttemptKind, Operation, OperationStatus
from operations.sandbox.models import Deal, PaymentIntent
from operations.sandbox.selectors import sandbox_writes
from operations.sandbox.services import sandbox_fault_set
from tests.factories import CallAttemptFactory
from tests.helpers import Background, signed_in, updated_past_triggers, wait_for
from tests.operations.engine_helpers import authorized_payment, died_mid_call
from tests.operations.failure_helpers import (
    executed_into_a_fault,
    lookups_inconclusive,
    lose_the_answer,
    payment_posts,
)

S = OperationStatus


@pytest.mark.django_db(transaction=True)
def test_it_does_not_create_again_on_an_empty_search_inside_the_lag_window(
    acme, approver, providers, settings
):
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 3
    sandbox_fault_set(provider="payments", kind="search_lag", match="*", seconds=3, times=50)
    op = lose_the_answer(authorized_payment(acme, approver))
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "reconciled" and op.status == S.UNKNOWN
    assert "lag" in op.evidence.filter(kind="lookup").last().data["reason"]
    assert op.next_reconcile_at is not None  # checked again, automatically
    assert len(payment_posts(op)) == 1

    time.sleep(3.2)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    posts = list(payment_posts(op))
    assert len(posts) == 1 and posts[0].idempotency_key == op.idempotency_key
    assert PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_makes_one_deal_when_a_timed_out_create_lands_after_the_retry(acme, providers):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    # The first POST stalls at the CRM before it creates anything, past our 1 s timeout.
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=2.5)
    engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and Deal.objects.count() == 0

    # The lookup truly finds nothing yet, so the engine calls again; then the stalled
    # request wakes up and tries to create the same deal.
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "called" and op.status == S.SUCCEEDED
    wait_for(lambda: all(w.response_status for w in sandbox_writes(
        provider="crm", operation_id=op.id)), what="the stalled create to finish")

    deal = Deal.objects.get(agent_operation_id=op.id)
    assert Deal.objects.count() == 1 and op.external_id == deal.id
    writes = sandbox_writes(provider="crm", operation_id=op.id).order_by("id")
    assert sorted(w.response_status for w in writes) == [201, 409]
    kinds = list(op.attempts.order_by("number").values_list("kind", "outcome"))
    assert kinds == [("call", "unknown"), ("lookup", "absent"), ("call", "succeeded")]


@pytest.mark.django_db(transaction=True)
def test_it_does_not_apply_an_absence_looked_up_before_a_newer_call(
    acme, approver, providers, settings
):
    from operations.sandbox.models import SandboxFault

    settings.PROVIDER_TIMEOUT_SECONDS = 5  # the slow lookup is answered, only late
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    engine.operation_execute(operation_id=op.id)  # call 1: refused before any write
    # A slow reconcile: its lookup is held at the provider while everything below happens.
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    slow = Background(lambda: engine.operation_reconcile(operation_id=op.id))
    wait_for(lambda: not SandboxFault.objects.filter(match=op.id, kind="delay",
                                                     remaining__gt=0).exists(),
             what="the slow lookup to take the delay fault")
    # A second reconcile proves absence; the execute after it makes call 2, whose answer
    # is lost too, so the operation is unknown again.
    assert engine.operation_reconcile(operation_id=op.id).may_call_again
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    assert engine.operation_execute(operation_id=op.id).outcome == "called"
    report = slow.join()

    op.refresh_from_db()
    assert report.outcome == "stale" and not report.may_call_again
    assert op.status == S.UNKNOWN and op.provider_calls == 2
    assert len(payment_posts(op)) == 2 and PaymentIntent.objects.count() == 0
    assert op.evidence.filter(to_status=S.NOT_STARTED).count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_lands_a_slow_crm_answer_instead_of_cancelling_after_an_early_absence(
    acme, providers, settings
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 5
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    assert not op.requires_approval  # authorized by the policy
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=1.2))
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=3)  # the POST is slow
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    wait_for(lambda: Operation.objects.filter(
        id=op.id, status=S.IN_PROGRESS, lease_expires_at__lte=timezone.now()).exists(),
        what="the lease to run out while the POST is in flight")
    # The sweep's reconcile: no deal yet, but the unanswered call may still land.
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.outcome == "inconclusive" and not report.may_call_again
    call.join()

    op.refresh_from_db()
    deal = Deal.objects.get(agent_operation_id=op.id)
    assert op.status == S.SUCCEEDED and op.external_id == deal.id  # not cancelled
    assert op.provider_calls == 1 and Deal.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_measures_the_search_lag_from_the_newest_call_a_concurrent_reconcile_allowed(
    acme, approver, providers, settings, monkeypatch
):
    import threading

    from operations.engine import reconcile as reconcile_module

    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    # Call 1: refused before any write, three minutes ago.
    op = executed_into_a_fault(acme, approver, "http_500")
    long_ago = timezone.now() - timedelta(minutes=3)
    updated_past_triggers(Attempt.objects.filter(operation=op),
                          started_at=long_ago, finished_at=long_ago)
    # Reconcile R stalls as it reads what it will tell the provider's search...
    stalled_once, go = threading.Event(), threading.Event()
    real_snapshot, main = reconcile_module.snapshot, threading.get_ident()

    def stalled_snapshot(op_, **kwargs):
        taken = real_snapshot(op_, **kwargs)
        if threading.get_ident() != main and not stalled_once.is_set():
            stalled_once.set()
            go.wait(3)
        return taken

    monkeypatch.setattr(reconcile_module, "snapshot", stalled_snapshot)
    stalled = Background(lambda: engine.operation_reconcile(operation_id=op.id))
    assert stalled_once.wait(10)
    # ...while another reconcile runs (it waits for R's row lock, or proves absence) and
    # call 2 commits a payment whose answer is lost, hidden from the search by its lag.
    engine.operation_reconcile(operation_id=op.id)
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=2)
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)
    engine.operation_execute(operation_id=op.id)
    go.set()
    stalled.join()
    wait_for(lambda: not payment_posts(op).filter(response_status__isnull=True).exists(),
             what="the dropped answer's request to end at the sandbox")

    op.refresh_from_db()
    assert PaymentIntent.objects.count() == 1 and op.provider_calls == 2
    assert op.status == S.UNKNOWN
    # Absence was proven once, before call 2; never again with call 1's age as the lag.
    assert op.evidence.filter(to_status=S.NOT_STARTED).count() == 1


@pytest.mark.django_db
def test_it_keeps_looking_up_an_accepted_payment_past_the_keys_retention(
    acme, approver, monkeypatch
):
    op = authorized_payment(acme, approver)
    then = timezone.now() - timedelta(hours=25)  # "processing" at the bank for a day
    CallAttemptFactory(operation=op, started_at=then, finished_at=then, outcome="accepted")
    Operation.objects.filter(id=op.id).update(status=S.ACCEPTED, external_id="pi_x",
                                              provider_calls=1, next_reconcile_at=timezone.now())
    lookups_inconclusive(monkeypatch)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.ACCEPTED and op.next_reconcile_at is not None

    # A lookup that can never answer again (a mail key past its retention): a person's.
    lookups_inconclusive(monkeypatch, reason="key retention window passed", retry_after=None)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.next_reconcile_at is None


@pytest.mark.django_db
def test_it_shows_a_person_an_accepted_payment_whose_lookups_fail_for_long_and_keeps_looking(
    acme, approver, operator, other_tenant_user, maintenance_page, settings, monkeypatch
):
    """A wrong PAYMENTS_API_BASE after a deploy: every lookup of an accepted payment's final
    answer gets a page that is not the provider. The sweep looked it up every 30 s for ever,
    and no list showed it to anyone (not unknown, not disputed, not stuck)."""
    from operations.engine import core
    from operations.providers.base import CallOutcome, LookupMethod, LookupOutcome, LookupResult
    from operations.selectors import (
        dashboard_metrics,
        operations_lookup_failing_queue,
        operations_unknown_queue,
    )

    settings.ACCEPTED_LOOKUP_FAILING_SECONDS = 3600
    op = authorized_payment(acme, approver)
    then = timezone.now() - timedelta(days=3)
    CallAttemptFactory(operation=op, started_at=then, finished_at=then, outcome="accepted")
    Operation.objects.filter(id=op.id).update(
        status=S.ACCEPTED, status_changed_at=then, external_id="pi_x", provider_calls=1,
        next_reconcile_at=timezone.now(),
    )
    clock = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    def sweep_round() -> None:
        assert op.id in engine.operations_claim_due_for_reconcile()
        engine.operation_reconcile(operation_id=op.id)
        op.refresh_from_db()

    def listed(user) -> bool:
        return op.id in {o.id for o in operations_lookup_failing_queue(user)}

    sweep_round()
    first_failure = clock[0]
    assert op.lookups_failing_since == first_failure
    # Three days of sweeps, each lookup answered by a page that is not the provider.
    for _ in range(3 * 24):
        clock[0] += timedelta(hours=1)
        Operation.objects.filter(id=op.id).update(next_reconcile_at=clock[0])
        sweep_round()
        # Still looked up on its own (the effect was accepted), and dated from the first.
        assert op.status == S.ACCEPTED and op.next_reconcile_at > clock[0]
        assert op.lookups_failing_since == first_failure
    # Every round asked the provider, and only asked: lookups, never another payment.
    lookups = op.attempts.filter(kind=AttemptKind.LOOKUP)
    assert lookups.count() == 1 + 3 * 24 and op.provider_calls == 1
    assert len(maintenance_page.requests) == 1 + 3 * 24
    assert {method for method, _ in maintenance_page.requests} == {"GET"}
    assert op.evidence.filter(kind="lookup", to_status=S.ACCEPTED).count() == 1 + 3 * 24

    # A person sees it, within their tenants only, in the operators' queue and the dashboard.
    assert listed(operator) and not listed(other_tenant_user)
    assert op.id not in {o.id for o in operations_unknown_queue(operator)}
    assert dashboard_metrics(operator)["lookup_failing_count"] == 1
    assert dashboard_metrics(other_tenant_user)["lookup_failing_count"] == 0
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert 'id="lookup-failing"' in html and op.id in html
    assert first_failure.strftime("%Y-%m-%d %H:%M:%S") in html
    assert "PAYMENTS_API_BASE" in html and "Nothing waits for a person." not in html
    assert op.id not in signed_in(other_tenant_user).get("/operations/unknown/").content.decode()
    dashboard = signed_in(operator).get("/").content.decode()
    assert 'href="/operations/unknown/#lookup-failing"' in dashboard

    # The base is put right: the provider answers that it is still processing. Off the list.
    real = core.adapter("payments.create")

    class ProviderAnswers:
        contract = real.contract
        account = real.account
        disagreement = real.disagreement

        def lookup(self, op_):
            return LookupResult(outcome=LookupOutcome.FOUND, method=LookupMethod.EXTERNAL_ID,
                                status=CallOutcome.ACCEPTED, external_id="pi_x")

    monkeypatch.setattr(core, "adapter", lambda action: ProviderAnswers())
    clock[0] += timedelta(hours=1)
    Operation.objects.filter(id=op.id).update(next_reconcile_at=clock[0])
    sweep_round()
    assert op.status == S.ACCEPTED and op.lookups_failing_since is None
    assert not listed(operator) and dashboard_metrics(operator)["lookup_failing_count"] == 0


@pytest.mark.django_db
def test_it_lists_an_accepted_payment_only_once_its_lookups_fail_past_the_limit(
    acme, approver, operator, monkeypatch, settings
):
    from operations.selectors import operations_lookup_failing_queue

    settings.ACCEPTED_LOOKUP_FAILING_SECONDS = 3600
    op = authorized_payment(acme, approver)
    CallAttemptFactory(operation=op, outcome="accepted")
    Operation.objects.filter(id=op.id).update(status=S.ACCEPTED, external_id="pi_x",
                                              provider_calls=1, next_reconcile_at=timezone.now())
    lookups_inconclusive(monkeypatch)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    failing_since = op.lookups_failing_since
    assert failing_since is not None and op.next_reconcile_at is not None
    engine.operation_reconcile(operation_id=op.id)  # a second failure keeps the first's date
    op.refresh_from_db()
    assert op.lookups_failing_since == failing_since
    assert op.id not in {o.id for o in operations_lookup_failing_queue(operator)}

    Operation.objects.filter(id=op.id).update(
        lookups_failing_since=timezone.now() - timedelta(seconds=3601))
    assert op.id in {o.id for o in operations_lookup_failing_queue(operator)}

    # Handed to a person as unknown (the provider can no longer tell): the unknown queue's.
    lookups_inconclusive(monkeypatch, reason="key retention window passed", retry_after=None)
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.lookups_failing_since is None
    assert op.id not in {o.id for o in operations_lookup_failing_queue(operator)}


@pytest.mark.django_db(transaction=True)
def test_it_confirms_a_given_up_call_did_not_land_before_closing_it_as_never_done(
    acme, providers, settings
):
    op = engine.operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100000, "currency": "EUR", "owner": "dana"})
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=2))
    # The CRM takes 3 s; our client gives up after 1 s, and the deal lands later anyway.
    sandbox_fault_set(provider="crm", kind="delay", match=op.id, seconds=3)
    engine.operation_execute(operation_id=op.id)
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # no deal yet
    wait_for(lambda: Operation.objects.get(id=op.id).authorization_expires_at < timezone.now(),
             what="the authorization to run out")
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    # Not cancelled while the given-up call may still land: a lookup confirms first.
    assert report.outcome == "confirming_absence" and op.status == S.UNKNOWN
    wait_for(lambda: Deal.objects.filter(agent_operation_id=op.id).exists(),
             what="the slow create to land")
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    deal = Deal.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == deal.id and op.provider_calls == 1


@pytest.mark.django_db(transaction=True)
def test_it_closes_as_never_done_once_no_call_can_land_and_the_approval_ran_out(
    acme, approver, providers
):
    op = executed_into_a_fault(acme, approver, "http_500")  # nothing written
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() - timedelta(seconds=1))
    report = engine.operation_reconcile(operation_id=op.id)
    assert report.outcome == "inconclusive" and not report.may_call_again  # may still land
    # The provider's late-landing window after the call has passed.
    earlier = timezone.now() - timedelta(minutes=5)
    updated_past_triggers(Attempt.objects.filter(operation=op, kind=AttemptKind.CALL),
                          started_at=earlier, finished_at=earlier)
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == S.CANCELLED and op.error_code == "authorization"
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 0


@pytest.mark.parametrize(("claimed_ago", "timeout", "reach"), [
    # This release's client timeout (1 s, the sandbox fixture's).
    (70, None, 31),
    # An earlier release's 60 s one, shortened since (a rolling deploy): by today's settings
    # the call could have landed only until 69 s ago, and the search's lag would be over.
    (100, 60, 90),
])
@pytest.mark.django_db(transaction=True)
def test_it_measures_the_search_lag_from_the_last_moment_an_unanswered_call_could_land(
    acme, approver, providers, settings, claimed_ago, timeout, reach
):
    from operations.engine.core import adapter, snapshot

    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    op = authorized_payment(acme, approver)
    # A worker claimed a while ago and died without an answer; its call may have reached the
    # provider as late as its lease's end plus its client's timeout (`reach` seconds after
    # the claim), and did commit.
    claimed = timezone.now() - timedelta(seconds=claimed_ago)
    op = died_mid_call(op, claimed=claimed, timeout=timeout)
    assert adapter(op.action).call(snapshot(op)).external_id
    # The provider's search does not show it yet (its lag, from when the call could land).
    sandbox_fault_set(provider="payments", kind="search_lag", match=op.id, seconds=60)

    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "inconclusive" and not report.may_call_again
    assert op.status == S.UNKNOWN
    assert "lag" in op.evidence.filter(kind="lookup").last().data["reason"]
    # Checked again once the lag has passed after the call's reach, not before.
    lag_ends = claimed + timedelta(seconds=reach + 60)
    assert abs((op.next_reconcile_at - lag_ends).total_seconds()) < 5
    assert engine.operation_execute(operation_id=op.id).outcome == "reconciled"
    # Nothing was sent again: only the call that landed reached the provider.
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("retry_in", "scheduled"), [(5, True), (30, False)])
@pytest.mark.parametrize("sent_again_an_hour_ago", [False, True])
def test_it_hands_an_unknown_to_a_person_when_the_next_lookup_would_pass_the_keys_retention(
    acme, approver, monkeypatch, retry_in, scheduled, sent_again_an_hour_ago
):
    op = authorized_payment(acme, approver)
    # The lost call was made 24 hours less 15 seconds ago: the provider keeps its key for
    # 24 hours, so a lookup later than 15 seconds from now proves nothing about it.
    then = timezone.now() - timedelta(hours=24) + timedelta(seconds=15)
    calls = [then]
    if sent_again_an_hour_ago:
        # Sent again with the same key after a proven absence: Stripe ages a key from its
        # first use, so this call does not make it keep the key any longer.
        calls.append(timezone.now() - timedelta(hours=1))
    for number, sent in enumerate(calls, start=1):
        CallAttemptFactory(operation=op, number=number, started_at=sent, finished_at=sent,
                           outcome="unknown")
    Operation.objects.filter(id=op.id).update(status=S.UNKNOWN, provider_calls=len(calls),
                                              unknown_since=calls[-1])
    lookups_inconclusive(monkeypatch, retry_after=timedelta(seconds=retry_in))
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "inconclusive" and op.status == S.UNKNOWN
    assert (op.next_reconcile_at is not None) is scheduled
    summary = op.evidence.filter(kind="lookup").last().summary
    assert ("waiting for a person" in summary) is not scheduled
    assert op.provider_calls == len(calls)


def _accepted_and_due(acme, approver) -> Operation:
    op = authorized_payment(acme, approver, amount_minor=15_000_000)
    then = timezone.now() - timedelta(minutes=3)
    CallAttemptFactory(operation=op, started_at=then, finished_at=then, outcome="accepted")
    Operation.objects.filter(id=op.id).update(
        status=S.ACCEPTED, status_changed_at=then, external_id="pi_x", provider_calls=1,
        next_reconcile_at=timezone.now(),
    )
    return op


def _looked_up_for(op: Operation, clock: list, *, hours: int) -> list[float]:
    """The sweep's rounds over `hours` of the clock, each whenever the operation is due: the
    seconds between its lookups."""
    looked_at: list = []
    end = clock[0] + timedelta(hours=hours)
    while clock[0] < end:
        assert op.id in engine.operations_claim_due_for_reconcile()
        looked_at.append(clock[0])
        engine.operation_reconcile(operation_id=op.id)
        op.refresh_from_db()
        assert op.next_reconcile_at is not None, "handed to a person"
        clock[0] = op.next_reconcile_at
    assert op.attempts.filter(kind=AttemptKind.LOOKUP).count() == len(looked_at)
    return [(b - a).total_seconds() for a, b in pairwise(looked_at)]


@pytest.mark.django_db
def test_it_looks_up_an_accepted_payment_no_more_often_while_the_provider_fails(
    acme, approver, rate_limited, settings
):
    """Rate-limited (429, Retry-After 600), an accepted payment was looked up again in 30 s:
    four times as often as while the provider answered "still processing" (every
    ACCEPTED_RECONCILE_SECONDS), and ten times as often as the provider asked."""
    settings.ACCEPTED_RECONCILE_SECONDS = 120
    op = _accepted_and_due(acme, approver)

    before = timezone.now()
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()

    assert op.status == S.ACCEPTED and rate_limited.requests  # asked, and rate-limited
    wait = (op.next_reconcile_at - before).total_seconds()
    assert 600 <= wait < 600 + 5  # as long as the provider asked, and no longer


@pytest.mark.django_db(transaction=True)
def test_it_looks_up_a_payment_processing_for_long_less_often_up_to_15_minutes_apart(
    acme, approver, providers, settings, monkeypatch
):
    """A bank debit stays `processing` for days, and no webhook came: it was looked up every
    ACCEPTED_RECONCILE_SECONDS for as long (two thousand lookups over three days, each an
    attempt and an evidence row on its page). The wait now grows with the time accepted, up
    to 15 minutes, so its settling is still found within a quarter of an hour."""
    settings.ACCEPTED_RECONCILE_SECONDS = 120
    op = authorized_payment(acme, approver)
    settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR = op.payload["amount_minor"]
    assert engine.operation_execute(operation_id=op.id).status == S.ACCEPTED
    op.refresh_from_db()
    clock = [op.next_reconcile_at]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    gaps = _looked_up_for(op, clock, hours=3)

    assert gaps[:4] == [120, 240, 480, 900] and set(gaps[3:]) == {900}
    assert len(gaps) + 1 == 15  # every two minutes: 90
    assert op.status == S.ACCEPTED and op.provider_calls == 1
    assert PaymentIntent.objects.get().status == "processing"
    assert len(payment_posts(op)) == 1
    lookups = op.evidence.filter(kind="lookup")
    assert lookups.count() == 15
    assert all(lookup.summary.startswith("provider still reports accepted") for lookup in lookups)


@pytest.mark.django_db
def test_it_doubles_the_wait_between_an_accepted_payments_failing_lookups_up_to_15_minutes(
    acme, approver, maintenance_page, settings, monkeypatch
):
    """A wrong API base after a deploy fails every lookup, with no Retry-After: the wait
    is never shorter than the accepted schedule (which grows with the time accepted, here
    three minutes at the first lookup) and grows with the time failing, up to 15 minutes, so
    hours of it cost a few lookups an hour (and a person is shown it after the first)."""
    settings.ACCEPTED_RECONCILE_SECONDS = 120
    op = _accepted_and_due(acme, approver)
    clock = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    gaps = _looked_up_for(op, clock, hours=3)

    assert [round(gap) for gap in gaps[:6]] == [180, 360, 720, 900, 900, 900]
    assert set(gaps[4:]) == {900} and len(maintenance_page.requests) == len(gaps) + 1
    assert op.status == S.ACCEPTED and op.provider_calls == 1


@pytest.mark.django_db
def test_it_backs_off_looking_up_an_unknown_deal_while_the_crm_keeps_failing(
    acme, rate_limited, monkeypatch
):
    """A small deal (authorized by policy) whose create's answer was lost, and a CRM that
    rate-limits every request: it was looked up every 30 s, and with no key retention to end
    it, for ever. The wait now grows with the time unknown, from the CRM's Retry-After to at
    most 15 minutes."""
    op = engine.operation_prepare(
        tenant=acme, action="crm.create_deal",
        payload={"name": "Renewal 2027", "amount_minor": 100_000, "currency": "EUR",
                 "owner": "anna"},
    )
    assert op.authorized_hash
    then = timezone.now() - timedelta(minutes=5)
    CallAttemptFactory(operation=op, started_at=then, finished_at=then, outcome="unknown",
                       error_class="timeout")
    Operation.objects.filter(id=op.id).update(
        status=S.UNKNOWN, unknown_since=then, status_changed_at=then, error_code="timeout",
        provider_calls=1, next_reconcile_at=timezone.now(),
    )
    clock = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    gaps = _looked_up_for(op, clock, hours=1)

    # Unknown for 5 minutes at the first lookup: the CRM's 600 s, then the time unknown.
    assert gaps == [600, 900, 900, 900][: len(gaps)] and len(gaps) == 4
    assert op.status == S.UNKNOWN and op.provider_calls == 1
    assert {method for method, _ in rate_limited.requests} == {"GET"}


@pytest.mark.django_db
def test_it_backs_off_no_further_than_the_last_lookup_the_payments_key_still_allows(
    acme, approver, monkeypatch
):
    """Unknown for 23 hours of failing lookups, the wait is 15 minutes; but the key the lost
    call went with is kept 10 minutes more, and a lookup after that proves nothing. The
    backoff does not skip the last lookup that still can: it is not handed to a person
    sooner than it was before the backoff."""
    op = authorized_payment(acme, approver)
    sent = timezone.now() - timedelta(hours=24) + timedelta(minutes=10)
    CallAttemptFactory(operation=op, started_at=sent, finished_at=sent, outcome="unknown")
    Operation.objects.filter(id=op.id).update(
        status=S.UNKNOWN, provider_calls=1, unknown_since=sent + timedelta(minutes=1))
    lookups_inconclusive(monkeypatch, backoff=True)

    engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.next_reconcile_at == sent + timedelta(hours=24)
