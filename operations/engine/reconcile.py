"""Reconcile: read the provider and move the journal toward the fact. Never creates."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from operations.engine import core
from operations.engine.core import (
    S,
    lease_expired,
    lookup_against_intent,
    lookup_guarded,
    lookup_in_calls_account,
    next_attempt_number,
    outcome_open,
    person_text_check,
    require_perm,
    snapshot,
    transition,
    worker_name,
)
from operations.engine.findings import ReconcileReport, lookup_record
from operations.models import (
    Attempt,
    AttemptKind,
    EvidenceKind,
    Operation,
)
from operations.providers.base import LookupResult
from operations.services import audit_event_record


def _expire_lease(op: Operation) -> None:
    transition(
        op,
        to=S.UNKNOWN,
        sources={S.IN_PROGRESS},
        extra=Q(lease_expires_at__lte=timezone.now()),
        evidence_kind=EvidenceKind.TRANSITION,
        summary=f"lease of {op.lease_owner or 'a worker'} expired with no recorded answer",
        data={"lease_owner": op.lease_owner},
        # This reconcile looks right away; the sweep may pick it up only if it never does.
        fields={
            # What the call did has been unknown since the lease ran out, however late a
            # sweep (or a person) came: the dashboard's time to reconcile runs from then.
            "unknown_since": F("lease_expires_at"),
            "error_code": core.LEASE_EXPIRED,
            "next_reconcile_at": timezone.now() + timedelta(seconds=reconcile_claim_seconds()),
        },
    )


def operation_reconcile(
    *, operation_id: str, actor: AbstractUser | None = None, reason: str = ""
) -> ReconcileReport:
    """Ask the provider what really happened and move the journal toward that fact.

    Reads only: never creates anything at the provider. Proven absence returns the operation
    to not_started (only where the contract makes a new call safe); anything ambiguous stays
    unknown, with what was found, for a person.

    A person asks with a reason: signed in (`actor`), or from a shell (a reason alone; the
    audit trail names the shell's user). The sweep asks with neither.
    """
    asked_by_person = actor is not None or bool(reason)
    if asked_by_person:
        person_text_check(reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    if actor is not None:
        require_perm(actor, "operate_operations", op)
    # What the person asked about (an expired lease is still in_progress to them).
    asked_at = {"status": op.status}
    if lease_expired(op):
        _expire_lease(op)
        op.refresh_from_db()
    if not outcome_open(op):
        if asked_by_person:
            # The operator asked, with a reason: the trail shows the request even when the
            # status had moved on and there was nothing to look up.
            audit_event_record(
                actor=actor, action="operation.reconcile", tenant=op.tenant,
                object_type="operation", object_id=op.id, reason=reason, before=asked_at,
                after={"status": op.status, "lookup": "none",
                       "detail": f"nothing to do: {op.status}"},
            )
        return ReconcileReport(op.id, "nothing_to_do", op.status)

    adapter = core.adapter(op.action)
    attempt_account = adapter.account()
    with transaction.atomic():
        # The calls made so far, read under the row lock: an absence this lookup proves says
        # nothing about a call that starts after it (a concurrent reconcile may allow one).
        # The snapshot too, so the last call it tells the adapter about (the search lag is
        # measured from it) is the newest of those calls, not one from before a concurrent
        # reconcile let another go.
        op = Operation.objects.select_for_update(of=("self",)).select_related("tenant").get(
            id=op.id
        )
        calls_before = op.provider_calls
        looked_up_status = op.status
        op_snapshot = snapshot(op)
        attempt = Attempt.objects.create(
            operation_id=op.id,
            number=next_attempt_number(op.id),
            kind=AttemptKind.LOOKUP,
            worker=worker_name(),
            idempotency_key=op.idempotency_key,
            provider_account=attempt_account,
        )
    found = lookup_guarded(
        op.id,
        lambda: lookup_in_calls_account(
            op_snapshot, lookup_against_intent(adapter, op_snapshot, adapter.lookup(op_snapshot)),
            account=attempt_account,
        ),
    )
    report = lookup_record(
        op, op_snapshot, attempt, found, adapter=adapter, actor=actor,
        calls_before=calls_before, looked_up_status=looked_up_status,
    )
    if asked_by_person:
        # After the lookup is recorded: the trail says what the person's reconcile moved,
        # from the status they asked about to the one it left, not only what was found.
        audit_event_record(
            actor=actor,
            action="operation.reconcile",
            tenant=op.tenant,
            object_type="operation",
            object_id=op.id,
            reason=reason,
            before=asked_at,
            after=_reconcile_audited(report, found, looked_up_status=looked_up_status),
        )
    return report


def _reconcile_audited(
    report: ReconcileReport, found: LookupResult, *, looked_up_status: str
) -> dict[str, str]:
    """A person's reconcile as its audit row says it: the status it left and what was found.
    A lookup another fact overtook (a person's resolution, an event, a late answer landed
    while it was out) moved nothing: said so, or beside that fact's own row the trail would
    read as if this lookup had made the move."""
    after = {"status": report.status, "lookup": found.outcome, "detail": found.reason}
    if report.outcome in ("nothing_to_do", "stale") or not report.moved:
        after["moved"] = f"nothing: {report.detail}"
    elif report.detail == "unchanged" and report.status != looked_up_status:
        # Found as the journal already held it (still processing: accepted), where an event
        # moved it while the lookup was out; the lookup only noted it.
        after["moved"] = "nothing: overtaken by a newer fact"
    return after


def reconcile_claim_seconds() -> float:
    """How long a queued reconcile owns its operation's next check: a lookup may take the
    provider's whole timeout, and the queue may be behind."""
    return 3 * settings.PROVIDER_TIMEOUT_SECONDS
