"""The dashboard and the operators' queue: numbers that say what their label says, over a
stated window, read from indexes, and no claim about queues a user cannot see."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from kombu.exceptions import OperationalError

from approvals.models import Approval
from approvals.services import approval_approve
from console.roles import role_grant
from operations import tasks
from operations.engine import (
    operation_dispute,
    operation_prepare,
    operation_reconcile,
    operation_resolve,
    webhook_apply,
)
from operations.models import Attempt, Evidence, Operation, OperationStatus
from operations.providers.base import WebhookFacts
from operations.sandbox.models import PaymentIntent
from operations.selectors import dashboard_metrics
from tests.factories import CallAttemptFactory
from tests.helpers import signed_in, updated_past_triggers
from tests.operations.engine_helpers import (
    PAYMENT,
    authorized_payment,
    died_mid_call,
    make_unknown,
    prepared_payment,
)
from tests.operations.operator_helpers import payment_at_provider

pytestmark = pytest.mark.django_db


def _metric(html: str, label: str) -> str:
    """The dashboard's card whose label starts with `label`."""
    match = re.search(
        r'<div class="metric[^"]*"><span class="label">' + re.escape(label) + r".*?</div>",
        html, re.S,
    )
    assert match, f"no metric labelled {label!r}"
    return match.group(0)


def test_it_counts_the_time_to_reconcile_of_an_unknown_a_person_held_then_settled(
    acme, operator
):
    """An operation unknown for two hours, disputed, then resolved: its time from unknown to
    a known outcome is two hours. No sample of it was taken (the dispute's is left out as a
    hold, and the resolution from disputed carried none), so the hardest cases vanished from
    the p95."""
    quick = make_unknown(prepared_payment(acme, invoice_id="inv_quick"),
                         ago=timedelta(minutes=1))
    operation_resolve(operation_id=quick.id, actor=operator, outcome="succeeded",
                      evidence_text="seen at the bank", reason="treasury checked")
    slow = make_unknown(prepared_payment(acme, invoice_id="inv_slow"), ago=timedelta(hours=2))
    operation_dispute(operation_id=slow.id, actor=operator, reason="customer disputes")
    operation_resolve(operation_id=slow.id, actor=operator, outcome="succeeded",
                      evidence_text="the bank confirms one payment", reason="checked")

    metrics = dashboard_metrics(operator)

    # Two operations went unknown and both are settled now: the slower took two hours.
    assert metrics["reconcile_p95"] is not None and metrics["reconcile_p95"] > 3600


def test_it_counts_the_time_to_reconcile_of_a_held_unknown_the_provider_reported_on_meanwhile(
    acme, operator
):
    """Unknown for two hours, disputed, then the provider reports on it (kept on its
    timeline, moving nothing), then resolved: still two hours to a known outcome. The
    event's line on the timeline is no hold, and read as one the sample was dropped, so the
    disputed cases the provider talks about most vanished from the p95."""
    slow = make_unknown(prepared_payment(acme, invoice_id="inv_slow"), ago=timedelta(hours=2))
    operation_dispute(operation_id=slow.id, actor=operator, reason="customer disputes")
    webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_while_held", event_type="payment_intent.updated", operation_id=slow.id,
        external_id="pi_held"))
    assert Evidence.objects.filter(
        operation_id=slow.id, from_status=OperationStatus.DISPUTED,
        to_status=OperationStatus.DISPUTED,
    ).count() == 1
    operation_resolve(operation_id=slow.id, actor=operator, outcome="succeeded",
                      evidence_text="the bank confirms one payment", reason="checked")

    metrics = dashboard_metrics(operator)

    assert metrics["reconcile_p50"] is not None and metrics["reconcile_p50"] > 7000
    resolution = Evidence.objects.get(
        operation_id=slow.id, from_status=OperationStatus.DISPUTED,
        to_status=OperationStatus.SUCCEEDED,
    )
    assert 7000 < resolution.data["unknown_seconds"] < 7300


def test_it_shows_none_waiting_and_no_time_to_reconcile_on_an_empty_journal(acme, operator):
    """No sample is no time at all, not 0 s: an operator would read a zero as instant."""
    metrics = dashboard_metrics(operator)
    assert metrics["reconcile_p50"] is None and metrics["reconcile_p95"] is None
    html = signed_in(operator).get("/").content.decode()
    assert "none waiting" in _metric(html, "Unknown")
    assert '<span class="value">—</span>' in _metric(html, "Time to reconcile")


def test_it_interpolates_the_percentiles_of_the_time_to_reconcile(acme, operator):
    for minutes in (1, 2, 3, 4, 100):
        op = make_unknown(prepared_payment(acme, invoice_id=f"inv_{minutes}"),
                          ago=timedelta(minutes=minutes))
        operation_resolve(operation_id=op.id, actor=operator, outcome="succeeded",
                          evidence_text="seen at the bank", reason="treasury checked")

    metrics = dashboard_metrics(operator)

    # Over 60, 120, 180, 240 and 6000 s: p50 the middle one, p95 most of the way to the last.
    assert 179 < metrics["reconcile_p50"] < 190
    assert 4800 < metrics["reconcile_p95"] < 4900


def test_it_counts_by_status_and_dates_the_oldest_unknown_in_visible_tenants_only(
    acme, globex, operator
):
    older = make_unknown(prepared_payment(acme, invoice_id="inv_o"), ago=timedelta(hours=3))
    make_unknown(prepared_payment(acme, invoice_id="inv_n"), ago=timedelta(minutes=3))
    prepared_payment(acme, invoice_id="inv_ns")
    oldest = make_unknown(prepared_payment(globex, invoice_id="inv_g"), ago=timedelta(days=3))

    metrics = dashboard_metrics(operator)

    by_status = {status: n for status, _label, n in metrics["by_status"]}
    assert by_status["unknown"] == 2 and by_status["not_started"] == 1
    assert metrics["total"] == 3 and metrics["unknown_count"] == 2
    assert metrics["unknown_oldest_since"] == older.unknown_since
    role_grant(user=operator, role="Operator", tenant=globex)
    metrics = dashboard_metrics(operator)
    assert metrics["unknown_count"] == 3
    assert metrics["unknown_oldest_since"] == oldest.unknown_since


def _stuck_for_an_hour(acme) -> Operation:
    """A worker claimed the payment, called and died; its lease ran out an hour ago, and
    the beat has been down since."""
    op = prepared_payment(acme, invoice_id="inv_stuck")
    return died_mid_call(op, claimed=timezone.now() - timedelta(hours=1, seconds=30))


@pytest.mark.django_db(transaction=True)
def test_it_counts_the_time_to_reconcile_of_a_dead_workers_call_from_its_lease_running_out(
    acme, operator, sandbox
):
    op = _stuck_for_an_hour(acme)
    payment_id = payment_at_provider(op)  # the call was carried out; its answer was lost

    # The sweep's reconcile, an hour late: the expired lease becomes unknown, and the lookup
    # finds the payment right away.
    operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert (op.status, op.external_id) == ("succeeded", payment_id)
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 1
    # What the call did was unknown from when the lease ran out, not from the sweep.
    metrics = dashboard_metrics(operator)
    assert metrics["reconcile_p95"] is not None and metrics["reconcile_p95"] >= 3600


@pytest.mark.django_db(transaction=True)
def test_it_counts_the_time_to_reconcile_of_a_stuck_operation_the_provider_reported_on(
    acme, operator, sandbox
):
    """The worker kept the payment's id, as it does the moment it is known, and died before
    the outcome; the provider's event settles it before any sweep came: straight from in
    progress to succeeded, an hour after the lease ran out, and that hour was no sample."""
    op = _stuck_for_an_hour(acme)
    payment_id = payment_at_provider(op)
    Operation.objects.filter(id=op.id).update(external_id=payment_id)
    result, _ = webhook_apply(provider="payments", facts=WebhookFacts(
        event_id="evt_stuck", event_type="payment_intent.succeeded", operation_id=op.id,
        external_id=payment_id, status="succeeded"))

    op.refresh_from_db()
    assert (result, op.status, op.external_id) == ("applied", "succeeded", payment_id)
    assert PaymentIntent.objects.filter(metadata__operation_id=op.id).count() == 1
    assert Attempt.objects.filter(operation=op).count() == 1  # the dead worker's call only
    metrics = dashboard_metrics(operator)
    assert metrics["reconcile_p95"] is not None and metrics["reconcile_p95"] >= 3600


def test_it_counts_the_time_to_reconcile_of_a_stuck_operation_a_person_held_then_settled(
    acme, operator
):
    op = _stuck_for_an_hour(acme)
    operation_dispute(operation_id=op.id, actor=operator, reason="worker died, beat down")
    operation_resolve(operation_id=op.id, actor=operator, outcome="succeeded",
                      evidence_text="seen at the bank", reason="treasury checked")

    metrics = dashboard_metrics(operator)
    assert metrics["manual_resolutions"] == 1
    assert metrics["reconcile_p95"] is not None and metrics["reconcile_p95"] >= 3600
    # One sample: the resolution's, not the hold's as well.
    assert Evidence.objects.filter(operation=op, data__has_key="unknown_seconds").count() == 2
    assert metrics["reconcile_p50"] == metrics["reconcile_p95"]


def _explain_rows_read(sql: str, params, relation: str) -> int:
    """Rows the plan read from `relation` (returned plus filtered out), with sequential
    scans priced out so that any index able to serve the query is used."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]
        cursor.execute("SET LOCAL enable_seqscan = on")
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node) -> int:
        read = 0
        if node.get("Relation Name") == relation:
            loops = node.get("Actual Loops", 1)
            read += int((node.get("Actual Rows", 0)
                         + node.get("Rows Removed by Filter", 0)
                         + node.get("Rows Removed by Index Recheck", 0)) * loops)
        return read + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan[0]["Plan"])


def test_it_reads_only_the_reconcile_samples_and_resolutions_not_all_evidence(acme, operator):
    """Every dashboard visit computes p50/p95 and the manual resolutions. Without the partial
    indexes that read every evidence row of the user's tenants (3+ per operation, growing
    without end): at 1M operations, two parallel scans of the whole table, ~1.7 s a visit."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO operations_operation (id, action, tool_name, payload, canonical_intent,
                payload_hash, policy_version, idempotency_key, command_id, requires_approval,
                created_at, authorized_hash, authorized_policy_version, status,
                status_changed_at, lease_owner, external_id, provider_request_id, error_code,
                error_message, resolved_manually, provider_calls, tenant_id)
            SELECT 'op_review' || lpad(g::text, 21, '0'), 'payments.create', 'pay', '{}',
                   '', 'sha256:x', 'v1', 'review-' || g, '', true, now(), '', '',
                   'succeeded', now(), '', '', '', '', '', false, 1, %s
            FROM generate_series(1, 3000) g
            """,
            [acme.id],
        )
        cursor.execute(
            """
            INSERT INTO operations_evidence (operation_id, kind, from_status, to_status,
                summary, data, created_at)
            SELECT 'op_review' || lpad(g::text, 21, '0'), k.kind, 'in_progress', 'succeeded',
                   'x', CASE WHEN k.kind = 'lookup' AND g % 600 = 0
                        THEN jsonb_build_object('unknown_seconds', g)
                        ELSE '{"attempt": 1}' END, now()
            FROM generate_series(1, 3000) g,
                 (VALUES ('transition'), ('call_result'), ('lookup')) k(kind)
            """
        )
        cursor.execute(
            """
            INSERT INTO operations_evidence (operation_id, kind, from_status, to_status,
                summary, data, created_at)
            SELECT 'op_review' || lpad(g::text, 21, '0'), 'manual', 'unknown', 'succeeded',
                   'resolved', '{"unknown_seconds": 60}', now()
            FROM generate_series(1, 3000, 1000) g
            """
        )
        cursor.execute("ANALYZE operations_operation")
        cursor.execute("ANALYZE operations_evidence")

    seen: list[tuple[str, object]] = []

    def record(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        metrics = dashboard_metrics(operator)
    assert metrics["manual_resolutions"] == 3 and metrics["reconcile_p50"] is not None

    evidence_reads = [(sql, params) for sql, params in seen if "operations_evidence" in sql]
    assert len(evidence_reads) == 2
    for sql, params in evidence_reads:
        read = _explain_rows_read(sql, params, "operations_evidence")
        # 8 rows answer the two questions; 12,000 rows of evidence exist.
        assert read <= 100, f"{read} evidence rows read for: {sql[:120]}"


def test_it_says_over_what_period_conflicts_resolutions_and_reconcile_time_are_counted(
    acme, operator
):
    """All-time totals, unlabelled, left an operator unable to tell "3 version conflicts" of
    this morning from three in a year (the approvals queue labels its decisions "(24 h)")."""
    html = signed_in(operator).get("/").content.decode()
    for label in ("Time to reconcile", "Version conflicts", "Re-approvals", "Manual resolutions"):
        assert "(last 7 days)" in _metric(html, label)


def test_it_counts_what_happened_within_the_window_only(acme, operator):
    old = make_unknown(prepared_payment(acme, invoice_id="inv_old"), ago=timedelta(minutes=5))
    operation_resolve(operation_id=old.id, actor=operator, outcome="failed",
                      evidence_text="no debit at the bank", reason="treasury checked")
    recent = make_unknown(prepared_payment(acme, invoice_id="inv_new"), ago=timedelta(minutes=1))
    operation_resolve(operation_id=recent.id, actor=operator, outcome="succeeded",
                      evidence_text="seen at the bank", reason="treasury checked")
    updated_past_triggers(Evidence.objects.filter(operation=old),
                          created_at=timezone.now() - timedelta(days=8))
    metrics = dashboard_metrics(operator)
    assert metrics["manual_resolutions"] == 1
    assert 59 < metrics["reconcile_p50"] == metrics["reconcile_p95"] < 120


def test_it_does_not_say_an_approval_past_its_time_is_yet_to_expire(acme, operator):
    """A pending approval whose time is up (the expiry sweep has not run yet, or beat is
    down) can no longer be approved: it was counted as waiting, "first expires in 0
    minutes". The approvals queue marks the same card "expired, not yet swept"."""
    prepared_payment(acme, invoice_id="inv_live")
    op = prepared_payment(acme)
    Approval.objects.filter(operation=op).update(
        expires_at=timezone.now() - timedelta(minutes=20))

    card = _metric(signed_in(operator).get("/").content.decode(), "Waiting for approval")

    assert 'aria-label="1 waiting for approval"' in card
    assert "1 expired, not yet closed" in card and 'class="metric alert"' in card


def test_it_shows_an_operation_stuck_on_an_expired_lease_in_the_operators_queue(
    acme, operator
):
    """A worker died mid-call an hour ago and nothing has reconciled it (the beat is down):
    whether the provider acted is unknown, and a person may reconcile or dispute it (the
    issue's "an unknown or stuck operation"). The queue said "Nothing waits for a person"."""
    op = prepared_payment(acme, invoice_id="inv_stuck")
    expired = timezone.now() - timedelta(hours=1)
    Operation.objects.filter(id=op.id).update(
        status="in_progress", lease_owner="w-dead", lease_expires_at=expired,
        status_changed_at=expired - timedelta(minutes=1), provider_calls=1)
    CallAttemptFactory(operation=op, started_at=expired - timedelta(minutes=1))
    assert Attempt.objects.filter(operation=op).count() == 1

    client = signed_in(operator)
    queue = client.get("/operations/unknown/").content.decode()

    assert "Nothing waits for a person." not in queue
    assert 'id="stuck"' in queue and op.id in queue
    card = _metric(client.get("/").content.decode(), "Stuck")
    assert 'aria-label="1 stuck: no worker or sweep has taken them"' in card


def test_it_claims_nothing_waits_only_to_someone_granted_a_tenant(stranger, acme):
    """A user granted on no tenant saw every card at 0 with "nothing waiting", and the queue
    said "Nothing waits for a person", while acme had an unknown: statements about queues
    they cannot see (the audit page refuses rather than show an empty trail)."""
    make_unknown(prepared_payment(acme))
    client = signed_in(stranger)
    html = client.get("/").content.decode()
    assert "You are not granted on any tenant yet" in html
    assert "nothing waiting" not in html and "none waiting" not in html
    # The operators' queue tells them the same of the unknown they cannot see.
    assert "Nothing waits for a person." not in client.get("/operations/unknown/").content.decode()


def _next_check_cell(html: str, op: Operation) -> str:
    """The queue row's "Next automatic check (UTC)" cell."""
    row = re.search(rf'<tr>\s*<td[^>]*><a href="/operations/{op.id}/".*?</tr>', html, re.S)
    assert row, f"{op.id} is not in the queue"
    return re.sub(r"\s+", " ", re.findall(r"<td[^>]*>(.*?)</td>", row.group(0), re.S)[4])


def test_it_shows_a_check_overdue_since_yesterday_with_its_date_and_says_why(acme, operator):
    """The beat had been down since yesterday: the check due 26 hours ago never ran. Shown
    as its time of day alone, it read as a check still to come later today, and nothing said
    it was overdue (the stuck list sees in-progress leases only, not unknowns left waiting)."""
    overdue = make_unknown(prepared_payment(acme, invoice_id="inv_o"), ago=timedelta(hours=27))
    coming = make_unknown(prepared_payment(acme, invoice_id="inv_c"))
    due = timezone.now() - timedelta(hours=26)
    soon = timezone.now() + timedelta(minutes=2)
    Operation.objects.filter(id=overdue.id).update(next_reconcile_at=due)
    Operation.objects.filter(id=coming.id).update(next_reconcile_at=soon)

    html = signed_in(operator).get("/operations/unknown/").content.decode()

    cell = _next_check_cell(html, overdue)
    assert due.strftime("%Y-%m-%d %H:%M:%S") in cell
    assert "overdue" in cell and "celery beat" in cell
    assert "<em>Reconcile now</em> on its page" in cell
    cell = _next_check_cell(html, coming)
    assert soon.strftime("%Y-%m-%d %H:%M:%S") in cell and "overdue" not in cell


def test_it_shows_an_approved_payment_no_worker_has_run_for_an_hour(
    acme, approver, operator, monkeypatch
):
    """The broker refused the execute at the approval's commit, and no sweep has run since
    (the beat, or the workers that run it, are down): the sweep would have queued it again
    60 s after the approval. The queue said "Nothing waits for a person" and the dashboard
    counted nothing stuck, while the approved payment waited to go out."""
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT)
    approval = Approval.objects.get(operation=op, status="pending")

    def broker_down(operation_id: str) -> None:
        raise OperationalError("Error 111 connecting to redis")

    monkeypatch.setattr(tasks.execute_operation, "delay", broker_down)
    approval_approve(approval_id=approval.id, actor=approver)  # logged, the approval stands
    op.refresh_from_db()
    assert op.status == OperationStatus.NOT_STARTED and op.authorized_hash == op.payload_hash
    recheck_due = op.next_reconcile_at
    later = timezone.now() + timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    op.refresh_from_db()
    assert op.status == OperationStatus.NOT_STARTED and op.next_reconcile_at == recheck_due
    assert op.authorization_expires_at > later

    client = signed_in(operator)
    queue = client.get("/operations/unknown/").content.decode()

    assert "Nothing waits for a person." not in queue
    assert 'id="not-run"' in queue and queue.count(f'<a href="/operations/{op.id}/">') == 1
    assert "approved, not run</strong>: is the worker / beat running?" in queue
    assert dashboard_metrics(operator)["stuck_count"] == 1
    card = _metric(client.get("/").content.decode(), "Stuck")
    assert 'aria-label="1 stuck: no worker or sweep has taken them"' in card
    assert 'href="/operations/unknown/#stuck"' in card and 'id="stuck"' in queue


def _accepted_and_due(acme, approver) -> Operation:
    op = authorized_payment(acme, approver)
    then = timezone.now() - timedelta(minutes=2)
    CallAttemptFactory(operation=op, started_at=then, finished_at=then, outcome="accepted")
    Operation.objects.filter(id=op.id).update(
        status=OperationStatus.ACCEPTED, status_changed_at=then, external_id="pi_x",
        provider_calls=1, next_reconcile_at=timezone.now(),
    )
    return op


def test_it_shows_an_accepted_payment_whose_next_lookup_no_sweep_has_run_for_an_hour(
    acme, approver, operator, other_tenant_user, monkeypatch
):
    """Accepted (processing at the bank), its webhook lost: only the sweep's lookups would
    ever settle it. With no sweep for an hour its check is as overdue as an unknown's, which
    the queue flagged; an accepted one was flagged nowhere."""
    op = _accepted_and_due(acme, approver)
    soon = _accepted_and_due(acme, approver)
    later = timezone.now() + timedelta(hours=1)
    Operation.objects.filter(id=soon.id).update(next_reconcile_at=later)  # not due yet
    monkeypatch.setattr(timezone, "now", lambda: later)

    queue = signed_in(operator).get("/operations/unknown/").content.decode()

    assert 'id="not-run"' in queue and soon.id not in queue
    assert queue.count(f'<a href="/operations/{op.id}/">') == 1
    assert "accepted, its next lookup not run</strong>: is the worker / beat running?" in queue
    assert dashboard_metrics(operator)["stuck_count"] == 1
    assert dashboard_metrics(other_tenant_user)["stuck_count"] == 0
    assert op.id not in signed_in(other_tenant_user).get("/operations/unknown/").content.decode()


def test_it_lists_an_accepted_payment_whose_lookups_fail_and_no_sweep_runs_once(
    acme, approver, operator, monkeypatch, settings
):
    """Lookups failing for over an hour, and then no sweep: the failing-lookups list shows it,
    says its next lookup is overdue, and the not-run list and the stuck count leave it to
    that list rather than show one operation twice."""
    settings.ACCEPTED_LOOKUP_FAILING_SECONDS = 3600
    op = _accepted_and_due(acme, approver)
    Operation.objects.filter(id=op.id).update(
        lookups_failing_since=timezone.now() - timedelta(hours=2))
    later = timezone.now() + timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: later)

    queue = signed_in(operator).get("/operations/unknown/").content.decode()

    assert 'id="lookup-failing"' in queue and 'id="not-run"' not in queue
    assert queue.count(f'<a href="/operations/{op.id}/">') == 1
    failing = queue.split('id="lookup-failing"')[1]
    assert "<strong>overdue</strong> by" in failing and "no lookup has run since" in failing
    metrics = dashboard_metrics(operator)
    assert (metrics["lookup_failing_count"], metrics["stuck_count"]) == (1, 0)
