"""Celery tasks: each takes an id, calls one service, and is safe to receive twice.

Execute and reconcile use acks_late: a worker that dies mid-task leaves its message
unacknowledged, and the broker hands it out again after the visibility timeout (at once,
under the prefork pool, when only a child process died: reject_on_worker_lost). The engine's
claim and lease make the second delivery harmless.

Their return values are not stored: what happened is in the journal, and nothing reads a
result, which would otherwise sit in Redis for CELERY_RESULT_EXPIRES per operation. A caller
that wants the outcome (a test) asks for it with apply_async(ignore_result=False).
"""

from __future__ import annotations

from celery import shared_task
from django.db import transaction

from operations import engine


@shared_task(
    name="operations.execute_operation", acks_late=True, reject_on_worker_lost=True,
    ignore_result=True,
)
def execute_operation(operation_id: str) -> str:
    return engine.operation_execute(operation_id=operation_id).outcome


@shared_task(
    name="operations.reconcile_operation", acks_late=True, reject_on_worker_lost=True,
    ignore_result=True,
)
def reconcile_operation(operation_id: str) -> str:
    report = engine.operation_reconcile(operation_id=operation_id)
    if report.may_call_again:
        # Proven absent: the execute path claims it afresh and calls with the same key.
        execute_on_commit(operation_id)
    return report.outcome


@shared_task(name="operations.sweep_operations", ignore_result=True)
def sweep_operations() -> int:
    """Beat: expired leases and due re-checks each get one reconcile task; operations that
    should be running but were never claimed get their execute again."""
    ids = engine.operations_claim_due_for_reconcile()
    for operation_id in ids:
        reconcile_on_commit(operation_id)
    waiting = engine.operations_claim_waiting_for_execute()
    for operation_id in waiting:
        execute_on_commit(operation_id)
    return len(ids) + len(waiting)


def execute_on_commit(operation_id: str) -> None:
    """Enqueue execution once the transaction that authorized it has committed. Robust: a
    broker that is down then must not turn a committed approval into an error page; the
    failure is logged and the sweep queues the execute at its recheck time."""
    transaction.on_commit(lambda: execute_operation.delay(operation_id), robust=True)


def reconcile_on_commit(operation_id: str) -> None:
    """Enqueue a reconcile once the transaction that claimed it has committed; robust for
    the same reason as execute_on_commit (the claim runs out and the sweep queues it again).

    The message lives as long as the claim: once that runs out the sweep queues another, so
    with the workers behind (an outage) an hour left one live lookup per operation, not one
    per claim, each a provider lookup when the backlog drained."""
    expires = engine.reconcile_claim_seconds()
    transaction.on_commit(
        lambda: reconcile_operation.apply_async((operation_id,), expires=expires), robust=True
    )
