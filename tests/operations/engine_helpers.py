"""Shared builders for engine tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from unittest import mock

from django.utils import timezone
from ulid import ULID

from operations.engine import operation_authorize, operation_execute, operation_prepare
from operations.engine.core import adapter, call_reach_until
from operations.intents import IntentError
from operations.models import Attempt, AttemptKind, Operation, OperationStatus

PAYMENT = {"invoice_id": "inv_9182", "beneficiary_id": "vendor_77", "amount_minor": 1250000,
           "currency": "KZT"}


def prepared_payment(tenant, **overrides) -> Operation:
    return operation_prepare(tenant=tenant, action="payments.create",
                             payload={**PAYMENT, **overrides})


@contextmanager
def ids_made_at(moment: datetime) -> Iterator[None]:
    """Ids made in the block are those of `moment`, as if the clock read it then: a row a
    test dates in the past (its created_at) gets the id it would have had, as the journal
    orders and bounds by id."""
    with mock.patch("operations.ids._monotonic_ulid", lambda: ULID.from_datetime(moment)):
        yield


def authorized_payment(tenant, approver=None, **overrides) -> Operation:
    op = prepared_payment(tenant, **overrides)
    return operation_authorize(
        operation_id=op.id, approved_hash=op.payload_hash, policy_version=op.policy_version,
        approved_by=approver, expires_at=timezone.now() + timedelta(minutes=30),
    )


def make_unknown(op: Operation, *, ago: timedelta = timedelta(minutes=5)) -> Operation:
    """Test-only: put an operation in `unknown` as a lost provider answer would."""
    since = timezone.now() - ago
    Operation.objects.filter(id=op.id).update(
        status="unknown",
        unknown_since=since,
        status_changed_at=since,
        error_code="timeout",
        provider_calls=1,
    )
    op.refresh_from_db()
    return op


def async_payment(tenant, approver=None) -> Operation:
    """Executed against the sandbox: at or above its async threshold a payment stays
    `processing` (accepted) until settled."""
    op = authorized_payment(tenant, approver, amount_minor=15_000_000)
    operation_execute(operation_id=op.id)
    op.refresh_from_db()
    assert op.status == "accepted"
    return op


def replaced_and_run(op: Operation, approver) -> Operation | None:
    """What an agent does with an intent that looks failed: supersedes it with a changed one
    (a new operation, a new key), approved and executed at once. None when the engine
    refuses the supersede."""
    try:
        replacement = operation_prepare(
            tenant=op.tenant, action=op.action, supersedes=op,
            payload={**op.payload, "amount_minor": op.payload["amount_minor"] + 1},
        )
    except IntentError:
        return None
    operation_authorize(
        operation_id=replacement.id, approved_hash=replacement.payload_hash,
        policy_version=replacement.policy_version, approved_by=approver,
        expires_at=op.authorization_expires_at,
    )
    operation_execute(operation_id=replacement.id)
    return replacement


def died_mid_call(op: Operation, *, claimed, timeout: float | None = None) -> Operation:
    """What a worker killed mid-call leaves: its claim, with a 30 s lease from `claimed`,
    and a call attempt with no answer, made with a client timeout of `timeout` seconds
    (the settings' when None)."""
    lease_expires_at = claimed + timedelta(seconds=30)
    Operation.objects.filter(id=op.id).update(
        status=OperationStatus.IN_PROGRESS, status_changed_at=claimed, lease_owner="dead:1",
        lease_expires_at=lease_expires_at, provider_calls=1, next_reconcile_at=None)
    reach_until = (
        call_reach_until(lease_expires_at) if timeout is None
        else lease_expires_at + timedelta(seconds=timeout)
    )
    Attempt.objects.create(operation=op, number=1, kind=AttemptKind.CALL, worker="dead:1",
                           idempotency_key=op.idempotency_key, started_at=claimed,
                           reach_until=reach_until,
                           provider_account=adapter(op.action).account())
    op.refresh_from_db()
    return op


def executing_in_flight(op: Operation, settings, *, fault: str, seconds: float,
                        timeout: float = 5):
    """Execute `op` in a background thread (returned, to `join()`) while the sandbox holds
    its answer back: `delay` before the payment is made, `commit_then_drop` after. Returns
    once the call is out (`delay`) or the payment committed (`commit_then_drop`)."""
    from operations.sandbox.models import PaymentIntent
    from operations.sandbox.services import sandbox_fault_set
    from tests.helpers import Background, wait_for

    sandbox_fault_set(provider="payments", kind=fault, match=op.id, seconds=seconds)
    settings.PROVIDER_TIMEOUT_SECONDS = timeout
    call = Background(lambda: operation_execute(operation_id=op.id))
    if fault == "commit_then_drop":
        wait_for(lambda: PaymentIntent.objects.filter(metadata__operation_id=op.id).exists(),
                 what="the provider to commit the payment")
    else:
        wait_for(lambda: Operation.objects.get(id=op.id).status == OperationStatus.IN_PROGRESS,
                 what="the call to start")
    return call


def stalled_before_recording(op: Operation, monkeypatch, *, worker: str = "A"):
    """`worker` executes `op` in a background thread, has its call's answer, then freezes
    before writing it down, until past its lease and the reach of its call (the test's
    settings give a 1 s lease and timeout). Returns the thread (to `join()`) and the event
    that lets it go on."""
    from operations.engine import execute as execute_module
    from tests.helpers import Background

    stalls_as = worker
    stalled, go = threading.Event(), threading.Event()
    real_record = execute_module._record_call_result

    def stalls_before_recording(op_, attempt, result, *, worker: str, adapter):
        if worker == stalls_as:
            stalled.set()
            go.wait(15)
        return real_record(op_, attempt, result, worker=worker, adapter=adapter)

    monkeypatch.setattr(execute_module, "_record_call_result", stalls_before_recording)
    call = Background(lambda: operation_execute(operation_id=op.id, worker=stalls_as))
    assert stalled.wait(10)
    time.sleep(2.3)  # past the lease and the reach of its call
    return call, go
