"""The failure cases of the design brief about who holds an operation, broken on purpose
against the real stack: PostgreSQL, Redis, Celery worker processes (killed mid-call, or eight
of them handed the same execute), and the sandbox providers over real HTTP. The claim and the
lease are broken at the moments between a read and a write: a worker that stalls past its
lease, a late answer, a claim taken over after the read.

Every test counts what reached the provider (POSTs, their keys and parameters) and how many
external objects exist, not only the final status.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
from celery.app.task import Task
from django.db import transaction
from django.utils import timezone

from operations import engine, tasks
from operations.models import AttemptKind, Operation, OperationStatus
from operations.sandbox.models import PaymentIntent
from operations.sandbox.selectors import sandbox_counts
from operations.sandbox.services import sandbox_fault_set
from operations.tasks import execute_operation, sweep_operations
from tests.helpers import Background, a_statement_waits_on_a_lock, wait_for
from tests.operations.engine_helpers import (
    authorized_payment,
    died_mid_call,
    make_unknown,
    prepared_payment,
    stalled_before_recording,
)
from tests.operations.failure_helpers import payment_posts

S = OperationStatus


WORKER_POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])


def worker_a_stalled_past_its_lease(op, monkeypatch) -> tuple[Background, threading.Event]:
    """Worker A calls and has its answer, then freezes before writing it down, until past
    its lease and the reach of its call; a lookup then proves the call absent (the settings
    give a 1 s lease and timeout). Returns A's thread and the event that lets it go on."""
    a, go = stalled_before_recording(op, monkeypatch, worker="A")
    assert engine.operation_reconcile(operation_id=op.id).may_call_again  # proven absent
    return a, go


@pytest.mark.worker
@WORKER_POOLS
def test_it_finds_the_payment_after_the_worker_dies_between_commit_and_answer(
    acme, approver, providers, worker_pool, pool
):
    op = authorized_payment(acme, approver)
    # The sandbox commits the payment, then holds its answer far past any timeout.
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=8)
    worker_pool.start(concurrency=1, pool=pool, extra_env={
        **providers, "PROVIDER_TIMEOUT_SECONDS": "30", "OPERATION_LEASE_SECONDS": "2",
        "CELERY_VISIBILITY_TIMEOUT": "4",
    })
    first = execute_operation.apply_async(
        args=[op.id], queue=worker_pool.queue, ignore_result=False
    )
    wait_for(lambda: PaymentIntent.objects.filter(
        metadata__operation_id=op.id).exists(), what="the sandbox to commit the payment")
    # The provider has committed; the worker is waiting for an answer. Kill it outright.
    for proc in worker_pool.procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    worker_pool.procs.clear()
    op.refresh_from_db()
    assert op.status == S.IN_PROGRESS and op.external_id == ""

    # A new worker: the sweep turns the expired lease into `unknown` and reconciles; the
    # redelivered execute (acks_late) finds nothing left to do.
    worker_pool.start(concurrency=2, pool=pool, extra_env={
        **providers, "PROVIDER_TIMEOUT_SECONDS": "2", "OPERATION_LEASE_SECONDS": "2",
        "CELERY_VISIBILITY_TIMEOUT": "4", "CELERY_UNACKED_RESTORE_SECONDS": "1",
    })
    time.sleep(2.5)  # past the lease
    sweep_operations.apply_async(queue=worker_pool.queue, ignore_result=False).get(timeout=20)
    wait_for(lambda: Operation.objects.get(id=op.id).status == S.SUCCEEDED, timeout=40,
             what="reconciliation to find the payment")
    # The killed worker's message comes back (acks_late) and runs: it must call nobody.
    assert first.get(timeout=40) in {"reconciled", "already_succeeded"}

    op.refresh_from_db()
    intent = PaymentIntent.objects.get(metadata__operation_id=op.id)
    assert PaymentIntent.objects.count() == 1
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    posts = list(payment_posts(op))
    assert len(posts) == 1, "no POST may follow a lookup that found the payment"
    assert {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == 1
    assert op.attempts.filter(kind=AttemptKind.LOOKUP, outcome="found").exists()
    assert op.evidence.filter(kind="lookup", to_status=S.SUCCEEDED).exists()


@pytest.mark.worker
@WORKER_POOLS
def test_it_makes_one_call_when_eight_workers_receive_the_same_execute(
    acme, approver, providers, worker_pool, pool
):
    op = authorized_payment(acme, approver)
    # Slow the provider so all eight deliveries arrive while the first call is in flight.
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=1.5)
    worker_pool.start(concurrency=8, pool=pool,
                      extra_env={**providers, "PROVIDER_TIMEOUT_SECONDS": "10"})
    results = [execute_operation.apply_async(args=[op.id], queue=worker_pool.queue,
                                           ignore_result=False)
               for _ in range(8)]
    outcomes = sorted(r.get(timeout=60) for r in results)
    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert outcomes.count("called") == 1, outcomes
    # They overlapped: some delivery met the call in flight, not only its stored result.
    assert {"held_elsewhere", "lost_claim"} & set(outcomes), outcomes
    assert len(payment_posts(op)) == 1
    assert PaymentIntent.objects.count() == 1
    assert op.provider_calls == 1
    assert op.attempts.filter(kind=AttemptKind.CALL).count() == 1


@pytest.mark.worker
def test_it_looks_up_and_calls_once_per_operation_when_sweeps_run_at_once(
    acme, approver, providers, worker_pool
):
    """A backlog of beat messages drained by a pool of threads, or two beats in a deploy's
    overlap: lost answers due now and leases a dead worker held are each claimed by one
    sweep, looked up once and paid once."""
    ops = []
    for i in range(6):
        op = make_unknown(authorized_payment(acme, approver, invoice_id=f"inv_u{i}"))
        Operation.objects.filter(id=op.id).update(
            next_reconcile_at=timezone.now() - timedelta(seconds=1))
        ops.append(op)
    for i in range(6):
        ops.append(died_mid_call(authorized_payment(acme, approver, invoice_id=f"inv_d{i}"),
                                 claimed=timezone.now() - timedelta(minutes=5)))
    worker_pool.start(concurrency=8, extra_env={**providers, "PROVIDER_TIMEOUT_SECONDS": "2"})

    sweeps = [sweep_operations.apply_async(queue=worker_pool.queue, ignore_result=False)
              for _ in range(8)]

    assert sum(sweep.get(timeout=60) for sweep in sweeps) == len(ops)
    wait_for(lambda: all(o.status == S.SUCCEEDED
                         for o in Operation.objects.filter(id__in=[o.id for o in ops])),
             timeout=60, what="every operation to be found absent and paid once")
    for op in ops:
        assert op.attempts.filter(kind=AttemptKind.LOOKUP).count() == 1
        assert len(payment_posts(op)) == 1
    assert sorted(PaymentIntent.objects.values_list("metadata__operation_id", flat=True)) == (
        sorted(op.id for op in ops))


@pytest.mark.django_db(transaction=True)
def test_it_keeps_an_operators_settlement_when_a_late_answer_arrives(
    acme, approver, operator, providers, settings
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 8
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=4)

    call = Background(lambda: engine.operation_execute(operation_id=op.id))
    wait_for(lambda: Operation.objects.filter(
        id=op.id, status=S.IN_PROGRESS, lease_expires_at__lte=timezone.now()).exists(),
        what="the lease to run out while the call is in flight")
    engine.operation_dispute(operation_id=op.id, actor=operator,
                             reason="the worker looks stuck; treasury checks by hand")
    call.join()

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.DISPUTED and op.resolved_manually
    assert op.external_id == ""  # the late answer did not write over the operator's case
    call = op.attempts.get(kind=AttemptKind.CALL)
    assert call.external_id == intent.id  # but is kept, and held for the person who holds it
    assert call.needs_review and call.reviewed_at is None
    assert len(payment_posts(op)) == 1


def stalled_after_the_claim(monkeypatch, *, seconds: float) -> None:
    """Execute, run in a thread other than the test's, stalls `seconds` between its claim
    and its call."""
    from operations.engine import execute as execute_module

    real_snapshot = execute_module.snapshot
    main = threading.get_ident()

    def stalled(op_, **kwargs):
        if threading.get_ident() != main:
            time.sleep(seconds)
        return real_snapshot(op_, **kwargs)

    monkeypatch.setattr(execute_module, "snapshot", stalled)


@pytest.mark.django_db(transaction=True)
def test_it_never_sends_a_call_after_its_lease_ran_out(
    acme, approver, providers, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 2
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=2.2))
    stalled_after_the_claim(monkeypatch, seconds=3.5)  # a long GC pause, a frozen container
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    time.sleep(2.5)
    # The lease ran out: the sweep's reconcile finds nothing, which proves nothing yet.
    assert not engine.operation_reconcile(operation_id=op.id).may_call_again
    call.join()

    attempt = op.attempts.get(kind=AttemptKind.CALL)
    assert attempt.error_class == "lease_lost" and PaymentIntent.objects.count() == 0
    assert len(payment_posts(op)) == 0  # the stalled worker sent nothing
    # Nothing was sent, and the approval has run out meanwhile: closed as never done.
    report = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "absent" and not report.may_call_again
    assert op.status == S.CANCELLED and PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_it_never_sends_a_call_after_its_authorization_ran_out(
    acme, approver, providers, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 30  # the lease would still allow the call
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    Operation.objects.filter(id=op.id).update(
        authorization_expires_at=timezone.now() + timedelta(seconds=1.5))
    stalled_after_the_claim(monkeypatch, seconds=2.5)  # valid at the claim, gone by the send
    report = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A")).join()

    assert report.status == S.UNKNOWN
    attempt = op.attempts.get(kind=AttemptKind.CALL)
    assert attempt.error_class == "lease_lost"
    assert "authorization ran out" in attempt.error_message
    assert len(payment_posts(op)) == 0 and PaymentIntent.objects.count() == 0
    # Nothing was sent and the approval is gone: a lookup closes it as never done at once,
    # without waiting out a call that never left.
    reconciled = engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    assert reconciled.outcome == "absent" and not reconciled.may_call_again
    assert op.status == S.CANCELLED and op.provider_calls == 1
    assert len(payment_posts(op)) == 0 and PaymentIntent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("meanwhile", ["answer_lost", "call_in_flight"])
def test_it_does_not_claim_what_another_worker_moved_on_after_its_read(
    acme, approver, providers, settings, monkeypatch, meanwhile
):
    from operations.engine import execute as execute_module

    if meanwhile == "call_in_flight":
        settings.PROVIDER_TIMEOUT_SECONDS = 5  # B waits for its slow answer
    op = authorized_payment(acme, approver)
    real_check = execute_module.call_problem
    other: dict = {}

    def another_worker_goes_first(op_):
        # Worker A has read not_started; before its claim, worker B claims and calls.
        problem = real_check(op_)
        if not other:
            other["started"] = True
            if meanwhile == "answer_lost":  # B's call committed, its answer was lost
                sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id,
                                  seconds=3)
                other["report"] = engine.operation_execute(operation_id=op.id, worker="B")
                assert Operation.objects.get(id=op.id).status == S.UNKNOWN
            else:  # B's call is still in flight, under B's live lease
                sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
                other["call"] = Background(
                    lambda: engine.operation_execute(operation_id=op.id, worker="B"))
                wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS)
                         .exists(), what="worker B's claim")
        return problem

    monkeypatch.setattr(execute_module, "call_problem", another_worker_goes_first)
    report = engine.operation_execute(operation_id=op.id, worker="A")
    assert report.outcome == "lost_claim", report
    if "call" in other:
        assert other["call"].join().outcome == "called"

    op.refresh_from_db()
    assert len(payment_posts(op)) == 1, "A must not call what B claimed (or left unknown)"
    assert op.provider_calls == 1 and PaymentIntent.objects.count() == 1
    assert list(op.attempts.filter(kind=AttemptKind.CALL).values_list("worker", flat=True)) \
        == ["B"]
    if meanwhile == "answer_lost":  # unknown stays unknown until a lookup, never a call
        assert op.status == S.UNKNOWN and not op.attempts.filter(kind=AttemptKind.LOOKUP)


@pytest.mark.django_db(transaction=True)
def test_it_leaves_a_call_in_flight_to_its_worker_while_the_lease_runs(
    acme, approver, providers, settings
):
    settings.PROVIDER_TIMEOUT_SECONDS = 5  # the slow answer arrives; the lease is 30 s
    op = authorized_payment(acme, approver)
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))
    wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS).exists(),
             what="worker A's claim")
    # A second delivery and an operator's reconcile, both while A's lease runs: hands off.
    assert engine.operation_execute(operation_id=op.id, worker="B").outcome == "held_elsewhere"
    assert engine.operation_reconcile(operation_id=op.id).outcome == "nothing_to_do"
    assert op.id not in engine.operations_due_for_reconcile()
    assert call.join().outcome == "called"

    op.refresh_from_db()
    assert op.status == S.SUCCEEDED
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert not op.evidence.filter(to_status=S.UNKNOWN).exists()
    assert len(payment_posts(op)) == 1 and PaymentIntent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("lapse", ["expired", "policy_moved_on"])
def test_it_does_not_call_when_the_authorization_lapses_between_its_check_and_the_claim(
    acme, approver, providers, settings, monkeypatch, lapse
):
    from operations.engine import execute as execute_module

    op = authorized_payment(acme, approver)
    hash_before = op.payload_hash
    real_check = execute_module.call_problem

    def lapses_right_after_the_check(op_):
        problem = real_check(op_)
        if lapse == "expired":
            Operation.objects.filter(id=op.id).update(authorization_expires_at=timezone.now())
        else:
            settings.POLICY_VERSION_OVERRIDES = {"payments.create": "payments-v4"}
        return problem

    monkeypatch.setattr(execute_module, "call_problem", lapses_right_after_the_check)
    report = engine.operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert report.outcome == "lost_claim" and op.status == S.NOT_STARTED
    assert op.provider_calls == 0 and not op.attempts.exists()
    assert sandbox_counts()["requests"] == 0 and PaymentIntent.objects.count() == 0
    # The next delivery sees the lapse at its check and closes it, still without a call.
    monkeypatch.setattr(execute_module, "call_problem", real_check)
    assert engine.operation_execute(operation_id=op.id).outcome == "cancelled"
    op.refresh_from_db()
    assert sandbox_counts()["requests"] == 0 and op.payload_hash == hash_before


@pytest.mark.django_db(transaction=True)
def test_it_does_not_claim_on_an_authorization_that_ran_out_while_it_waited_for_the_row(
    acme, approver, providers
):
    """Another transaction (a provider event's delivery) holds the operation's row while its
    approval runs out: the claim, which waits for that lock, checks the authorization at its
    own moment, not at the moment it began to wait. Checked on the older moment, it claimed:
    an intent never called was counted as called and left unknown (a call that never went
    out, a lookup, the operators' queue while the provider is down), not closed."""
    op = authorized_payment(acme, approver)
    expires_at = timezone.now() + timedelta(seconds=2)
    Operation.objects.filter(id=op.id).update(authorization_expires_at=expires_at)
    holding, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        with transaction.atomic():
            Operation.objects.select_for_update().filter(id=op.id).values_list("id").first()
            holding.set()
            release.wait(timeout=20)

    holder = Background(hold_the_row)
    assert holding.wait(timeout=10)
    call = Background(lambda: engine.operation_execute(operation_id=op.id, worker="A"))

    wait_for(a_statement_waits_on_a_lock, what="the claim to wait for the row")
    time.sleep(max((expires_at - timezone.now()).total_seconds(), 0) + 0.2)
    release.set()
    holder.join()
    report = call.join()

    op.refresh_from_db()
    assert report.outcome == "lost_claim" and op.status == S.NOT_STARTED
    assert op.provider_calls == 0 and not op.attempts.exists()
    assert len(payment_posts(op)) == 0 and PaymentIntent.objects.count() == 0
    # The next delivery sees the lapse and closes it as never done.
    assert engine.operation_execute(operation_id=op.id).outcome == "cancelled"
    assert len(payment_posts(op)) == 0 and sandbox_counts()["requests"] == 0


@pytest.mark.django_db(transaction=True)
def test_it_never_records_a_stalled_workers_answer_over_the_next_workers_claim(
    acme, approver, providers, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    # A has its (5xx) answer, nothing written, then freezes before writing it down.
    sandbox_fault_set(provider="payments", kind="http_500", match=op.id)
    a, go = worker_a_stalled_past_its_lease(op, monkeypatch)
    settings.PROVIDER_TIMEOUT_SECONDS = 5
    sandbox_fault_set(provider="payments", kind="delay", match=op.id, seconds=2)
    b = Background(lambda: engine.operation_execute(operation_id=op.id, worker="B"))
    wait_for(lambda: Operation.objects.filter(id=op.id, status=S.IN_PROGRESS,
                                              lease_owner="B").exists(), what="B's claim")
    go.set()
    a.join()
    # A's late "unknown" must not land on B's claim while B's call is in flight.
    held = Operation.objects.get(id=op.id)
    assert (held.status, held.lease_owner) == (S.IN_PROGRESS, "B")
    assert b.join().outcome == "called"

    op.refresh_from_db()
    assert op.status == S.SUCCEEDED and op.external_id == PaymentIntent.objects.get().id
    posts = list(payment_posts(op))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert not op.evidence.filter(from_status=S.IN_PROGRESS, to_status=S.UNKNOWN,
                                  kind="call_result").exists()


@pytest.mark.django_db(transaction=True)
def test_it_finds_the_payment_by_the_sweep_alone_when_a_worker_died_holding_the_lease(
    acme, approver, providers, monkeypatch
):
    from operations.engine.core import adapter, snapshot

    op = authorized_payment(acme, approver)
    # What a worker killed mid-call leaves: its claim with a lease that ran out, a call
    # attempt with no answer, and a payment the provider committed. No message redelivered.
    op = died_mid_call(op, claimed=timezone.now() - timedelta(minutes=2))
    assert adapter(op.action).call(snapshot(op)).external_id  # committed at the provider

    outcomes: list[str] = []
    monkeypatch.setattr(tasks.execute_operation, "delay", outcomes.append)
    monkeypatch.setattr(
        tasks.reconcile_operation, "apply_async",
        lambda args, **options: outcomes.append(tasks.reconcile_operation(*args)),
    )
    assert tasks.sweep_operations() == 1
    assert outcomes == ["found"]

    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    assert len(payment_posts(op)) == 1 and op.provider_calls == 1
    assert op.attempts.filter(kind=AttemptKind.LOOKUP, outcome="found").count() == 1


@pytest.mark.django_db(transaction=True)
def test_it_never_records_a_stalled_workers_refusal_over_a_newer_calls_payment(
    acme, approver, providers, settings, monkeypatch
):
    settings.OPERATION_LEASE_SECONDS = 1
    settings.PROVIDER_TIMEOUT_SECONDS = 1
    op = authorized_payment(acme, approver)
    # A's call is refused (a 400, nothing written), but A freezes before writing that down.
    sandbox_fault_set(provider="payments", kind="validation_error", match=op.id)
    a, go = worker_a_stalled_past_its_lease(op, monkeypatch)
    # B's call commits the payment, and its answer is lost.
    sandbox_fault_set(provider="payments", kind="commit_then_drop", match=op.id, seconds=3)
    assert engine.operation_execute(operation_id=op.id, worker="B").outcome == "called"
    assert Operation.objects.get(id=op.id).status == S.UNKNOWN
    go.set()
    a.join()

    # A's refusal is older than B's call: it must not close as failed what B may have done.
    op.refresh_from_db()
    assert op.status == S.UNKNOWN and op.error_code != "validation"
    assert not op.evidence.filter(to_status=S.FAILED).exists()
    engine.operation_reconcile(operation_id=op.id)
    op.refresh_from_db()
    intent = PaymentIntent.objects.get()
    assert op.status == S.SUCCEEDED and op.external_id == intent.id
    posts = list(payment_posts(op))
    assert len(posts) == 2 and {p.idempotency_key for p in posts} == {op.idempotency_key}
    assert op.provider_calls == 2


@pytest.mark.django_db(transaction=True)
def test_it_never_expires_a_lease_that_a_new_claim_replaced_after_the_read(
    acme, approver, providers, monkeypatch
):
    from django.db.models import F

    from operations.engine import reconcile as reconcile_module

    op = authorized_payment(acme, approver)
    claimed = timezone.now() - timedelta(minutes=2)
    Operation.objects.filter(id=op.id).update(
        status=S.IN_PROGRESS, status_changed_at=claimed, lease_owner="A",
        lease_expires_at=claimed + timedelta(seconds=30), provider_calls=1)
    real_expired = reconcile_module.lease_expired

    def b_claims_after_the_read(op_):
        expired = real_expired(op_)  # A's lease, as this reconcile read it: expired
        if expired and op_.lease_owner == "A":
            # Before its UPDATE: A's answer was recorded, a lookup proved absence, and B
            # claimed the operation again, with a live lease and its call in flight.
            Operation.objects.filter(id=op.id).update(
                lease_owner="B", lease_expires_at=timezone.now() + timedelta(seconds=30),
                provider_calls=F("provider_calls") + 1)
        return expired

    monkeypatch.setattr(reconcile_module, "lease_expired", b_claims_after_the_read)
    report = engine.operation_reconcile(operation_id=op.id)

    op.refresh_from_db()
    assert report.outcome == "nothing_to_do"
    assert (op.status, op.lease_owner, op.provider_calls) == (S.IN_PROGRESS, "B", 2)
    assert not op.evidence.filter(to_status=S.UNKNOWN).exists()
    assert not op.attempts.filter(kind=AttemptKind.LOOKUP).exists()
    assert sandbox_counts()["requests"] == 0


@pytest.mark.django_db
def test_it_queues_a_handful_of_lookups_per_operation_while_workers_are_behind(
    acme, monkeypatch, django_capture_on_commit_callbacks
):
    # A provider outage (or a worker outage) for an hour: no reconcile message is consumed.
    # The reconcile claim runs out every 3 x PROVIDER_TIMEOUT_SECONDS (30 s) and the beat
    # queues another message each time; each must die with its claim, or every one is a
    # provider lookup when the backlog drains, and new approvals' executes wait behind them.
    op = make_unknown(prepared_payment(acme))
    Operation.objects.filter(id=op.id).update(
        next_reconcile_at=timezone.now() - timedelta(seconds=1))
    sent: list[tuple] = []

    def publish(self, args=None, kwargs=None, **options):
        sent.append((self.name, tuple(args or ()), clock[0], options.get("expires")))

    monkeypatch.setattr(Task, "apply_async", publish)
    clock = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])

    for _ in range(720):  # the beat every 5 s for an hour
        with django_capture_on_commit_callbacks(execute=True):
            tasks.sweep_operations()
        clock[0] += timedelta(seconds=5)

    def live(sent_at, expires) -> bool:
        if expires is None:
            return True
        ends = expires if hasattr(expires, "tzinfo") else sent_at + timedelta(seconds=expires)
        return ends > clock[0]

    lookups = [s for s in sent if s[0] == "operations.reconcile_operation" and s[1] == (op.id,)]
    waiting = [s for s in lookups if live(s[2], s[3])]
    assert len(waiting) <= 10, (
        f"{len(waiting)} reconcile messages (each a provider lookup) queued for one "
        "operation during an hour nobody consumed them")
