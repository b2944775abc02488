from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from approvals.models import Approval, ApprovalStatus
from approvals.services import ApprovalRefused, approval_approve
from operations.engine import operation_authorize
from operations.models import AuditEvent, Operation
from tests.helpers import Background, a_statement_waits_on_a_lock


@pytest.mark.django_db(transaction=True)
def test_it_lets_exactly_one_of_two_simultaneous_approvals_win(
    acme, approver, admin_user, prepare_payment, no_execute
):
    approval = prepare_payment(acme)
    barrier = threading.Barrier(2)
    results: dict[str, str] = {}

    def decide(user) -> None:
        try:
            barrier.wait(timeout=10)
            approval_approve(approval_id=approval.id, actor=user, comment=user.username)
            results[user.username] = "approved"
        except ApprovalRefused as refusal:
            results[user.username] = refusal.message
        finally:
            connection.close()  # each thread has its own connection

    threads = [threading.Thread(target=decide, args=(u,)) for u in (approver, admin_user)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    winners = [name for name, outcome in results.items() if outcome == "approved"]
    assert len(winners) == 1, results
    (loser,) = {"approver", "admin"} - set(winners)
    assert results[loser].startswith(f"Already approved by {winners[0]} at ")
    stored = Approval.objects.get(id=approval.id)
    assert stored.status == ApprovalStatus.APPROVED
    assert stored.decided_by.username == winners[0]
    op = Operation.objects.get(id=approval.operation_id)
    assert op.authorized_by.username == winners[0]
    assert no_execute == [op.id]
    assert AuditEvent.objects.filter(action="approval.approve", object_id=approval.id).count() == 1
    refused = AuditEvent.objects.get(action="approval.approve_refused", object_id=approval.id)
    assert refused.actor_username == loser


@pytest.mark.django_db(transaction=True)
def test_it_locks_the_operation_before_the_approval_as_a_supersede_does(
    acme, approver, prepare_payment, no_execute
):
    """A decision and a changed intent's supersede must take the two rows in one order, or
    each could hold what the other waits for (PostgreSQL would then kill one of them)."""
    from django.db import DatabaseError, transaction

    from tests.helpers import Background, wait_for

    approval = prepare_payment(acme)
    holding, release = threading.Event(), threading.Event()

    def hold_the_operation() -> None:  # as prepare does while it supersedes this intent
        with transaction.atomic():
            Operation.objects.select_for_update().get(id=approval.operation_id)
            holding.set()
            release.wait(timeout=20)

    holder = Background(hold_the_operation)
    assert holding.wait(timeout=10)
    decision = Background(lambda: approval_approve(approval_id=approval.id, actor=approver))

    wait_for(a_statement_waits_on_a_lock, what="the decision to wait for a lock")
    # It waits on the operation, so the approval is still free for the supersede to take.
    try:
        with transaction.atomic():
            Approval.objects.select_for_update(nowait=True).get(id=approval.id)
    except DatabaseError:
        pytest.fail("the decision locked the approval before the operation")
    finally:
        release.set()
    holder.join()
    assert decision.join().status == ApprovalStatus.APPROVED
    assert no_execute == [approval.operation_id]


@pytest.mark.django_db(transaction=True)
def test_it_leaves_the_tenant_free_for_other_intents_while_an_approval_commits(
    acme, approver, prepare_payment
):
    approval = prepare_payment(acme)
    authorized, release = threading.Event(), threading.Event()

    def approve_and_hold() -> None:  # an approval's transaction, not yet committed
        with transaction.atomic():
            operation_authorize(
                operation_id=approval.operation_id, approved_hash=approval.payload_hash,
                policy_version=approval.policy_version, approved_by=approver,
                expires_at=approval.expires_at,
            )
            authorized.set()
            release.wait(timeout=20)

    holder = Background(approve_and_hold)
    assert authorized.wait(timeout=10)
    try:
        # The agent prepares another payment of the same tenant meanwhile: its insert takes
        # KEY SHARE on the tenant row, which a FOR UPDATE of that row blocks.
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '1s'")
            other = prepare_payment(acme, invoice_id="inv_other")
        assert isinstance(other, Approval)
    finally:
        release.set()
        holder.join()
