"""The effect engine: prepare, authorize, execute, reconcile, resolve.

This module is the only code that changes `Operation.status`. Every change is a conditional
UPDATE (`WHERE id = … AND status IN (…)`) checked for one row, written together with its
evidence / attempt / audit row in one transaction, and allowed by `transitions`. No network
I/O happens inside a transaction: a provider is called only between two short ones.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from operations import transitions
from operations.ids import new_id
from operations.intents import (
    IntentError,
    idempotency_key_for,
    intent_canonical,
    intent_validate,
)
from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    Checkpoint,
    Evidence,
    EvidenceKind,
    Operation,
    OperationStatus,
    Run,
    Tenant,
)
from operations.policy import policy_for, policy_version_current
from operations.providers.base import (
    CallOutcome,
    CallResult,
    EffectClass,
    LookupOutcome,
    LookupResult,
    OperationSnapshot,
    ProviderAdapter,
)
from operations.services import audit_event_record
from operations.signals import operation_prepared

S = OperationStatus
logger = logging.getLogger(__name__)


class EngineError(Exception):
    pass


class AuthorizationRefused(EngineError):
    pass


class TransitionRefused(EngineError):
    pass


def _lease() -> timedelta:
    return timedelta(seconds=getattr(settings, "OPERATION_LEASE_SECONDS", 30))


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _adapter(action: str) -> ProviderAdapter:
    from operations.providers import adapter_for

    return adapter_for(action)


def _snapshot(op: Operation) -> OperationSnapshot:
    call = (
        op.attempts.filter(kind=AttemptKind.CALL)
        .order_by("-number")
        .values("started_at", "finished_at")
        .first()
    )
    last_call = None
    if call is not None:
        # The provider may act at any moment until the answer arrives; an unanswered call
        # may have acted until at least the client's timeout.
        last_call = call["finished_at"] or call["started_at"] + timedelta(
            seconds=float(getattr(settings, "PROVIDER_TIMEOUT_SECONDS", 10))
        )
    return OperationSnapshot(
        id=op.id,
        action=op.action,
        tenant=op.tenant.slug,
        payload=op.payload,
        idempotency_key=op.idempotency_key,
        external_id=op.external_id,
        last_call_at=last_call,
    )


def _next_attempt_number(operation_id: str) -> int:
    # Called inside the transaction that owns the operation row (claim or lookup start),
    # so two attempts can never draw the same number; the unique constraint backs it up.
    last = (
        Attempt.objects.filter(operation_id=operation_id)
        .order_by("-number")
        .values_list("number", flat=True)
        .first()
    )
    return (last or 0) + 1


def _transition(
    op: Operation,
    *,
    to: str,
    sources: set[str] | frozenset[str],
    evidence_kind: str,
    summary: str,
    data: dict[str, Any] | None = None,
    extra: Q | None = None,
    fields: dict[str, Any] | None = None,
    actor=None,
    manual: bool = False,
    audit_action: str = "",
    reason: str = "",
) -> bool:
    """One conditional UPDATE plus its evidence (and audit) row; True when this call won."""
    for source in sources:
        if not transitions.allowed(source, to, manual=manual):
            raise TransitionRefused(f"{source} → {to} is not in the transition table")
    now = timezone.now()
    values: dict[str, Any] = {"status": to, "status_changed_at": now}
    if to != S.IN_PROGRESS:
        values.update(lease_owner="", lease_expires_at=None)
    if to == S.UNKNOWN:
        values["unknown_since"] = now
    else:
        values["unknown_since"] = None
        values["next_reconcile_at"] = (
            now + timedelta(seconds=getattr(settings, "ACCEPTED_RECONCILE_SECONDS", 120))
            if to == S.ACCEPTED
            else None
        )
    values.update(fields or {})
    condition = Q(id=op.id, status__in=list(sources))
    if extra is not None:
        condition &= extra
    with transaction.atomic():
        before = Operation.objects.filter(id=op.id).values("status", "unknown_since").first()
        won = Operation.objects.filter(condition).update(**values) == 1
        if not won:
            return False
        payload = dict(data or {})
        if before and before["unknown_since"] is not None and to != S.UNKNOWN:
            payload["unknown_seconds"] = round((now - before["unknown_since"]).total_seconds(), 3)
        Evidence.objects.create(
            operation_id=op.id,
            kind=evidence_kind,
            from_status=before["status"] if before else "",
            to_status=to,
            summary=summary,
            data=payload,
            actor=actor,
        )
        if audit_action:
            audit_event_record(
                actor=actor,
                action=audit_action,
                tenant=op.tenant,
                object_type="operation",
                object_id=op.id,
                reason=reason,
                before={"status": before["status"] if before else ""},
                after={
                    "status": to,
                    **{
                        k: v
                        for k, v in (fields or {}).items()
                        if k in {"external_id", "error_code"}
                    },
                },
            )
    return True


# --- prepare and authorize ---------------------------------------------------------------


def operation_prepare(
    *,
    tenant: Tenant,
    action: str,
    payload: dict[str, Any],
    run: Run | None = None,
    checkpoint: Checkpoint | None = None,
    command_id: str = "",
    supersedes: Operation | None = None,
    actor=None,
) -> Operation:
    """Record the canonical intent before anything is called. Validates; never calls out.

    Preparing the same command of the same run again with the same intent returns the
    existing operation (a resumed node re-runs its code); a different intent for it must
    say which operation it supersedes.
    """
    payload = intent_validate(action=action, payload=payload)
    policy = policy_for(action)
    canonical, payload_hash = intent_canonical(
        action=action, tenant=tenant.slug, payload=payload, policy_version=policy.version
    )
    with transaction.atomic():
        if run is not None and command_id:
            live = (
                Operation.objects.select_for_update(of=("self",))
                .filter(run=run, command_id=command_id, superseded_by__isnull=True)
                .exclude(status=S.CANCELLED)
                .order_by("-id")
                .first()
            )
            if live is not None and supersedes is None:
                if live.payload_hash == payload_hash:
                    return live
                raise IntentError(
                    f"command {command_id} of {run.id} already has intent {live.id} with "
                    "another payload; a changed intent must supersede it"
                )
        if supersedes is not None:
            supersedes = Operation.objects.select_for_update().get(id=supersedes.id)
            if supersedes.tenant_id != tenant.id or supersedes.action != action:
                raise IntentError("a superseding intent keeps the tenant and the action")
            if hasattr(supersedes, "superseded_by"):
                raise IntentError(f"{supersedes.id} is already superseded")
            if supersedes.status not in (S.NOT_STARTED, S.FAILED, S.CANCELLED):
                raise IntentError(
                    f"{supersedes.id} is {supersedes.status}; only an intent that has not run, "
                    "or failed, can be superseded"
                )
        operation_id = new_id("op")
        run_id = run.id if run else (supersedes.run_id if supersedes else "")
        requires = policy.requires_approval(payload)
        op = Operation.objects.create(
            id=operation_id,
            tenant=tenant,
            action=action,
            tool_name=action,
            payload=payload,
            canonical_intent=canonical,
            payload_hash=payload_hash,
            policy_version=policy.version,
            idempotency_key=idempotency_key_for(
                operation_id=operation_id,
                action=action,
                run_id=run_id or "",
                command_id=command_id or (supersedes.command_id if supersedes else ""),
            ),
            run=run or (supersedes.run if supersedes else None),
            checkpoint=checkpoint or (supersedes.checkpoint if supersedes else None),
            command_id=command_id or (supersedes.command_id if supersedes else ""),
            supersedes=supersedes,
            requires_approval=requires,
            created_by=actor,
        )
        audit_event_record(
            actor=actor,
            action="operation.prepare",
            tenant=tenant,
            object_type="operation",
            object_id=op.id,
            after={
                "action": action,
                "payload_hash": payload_hash,
                "policy_version": policy.version,
                "supersedes": supersedes.id if supersedes else None,
            },
        )
        if supersedes is not None and supersedes.status == S.NOT_STARTED:
            _transition(
                supersedes,
                to=S.CANCELLED,
                sources={S.NOT_STARTED},
                evidence_kind=EvidenceKind.TRANSITION,
                summary=f"superseded by {op.id}",
                data={"superseded_by": op.id},
                actor=actor,
            )
        if requires:
            operation_prepared.send(sender=Operation, operation=op, supersedes=supersedes)
        else:
            # The policy itself authorizes; recorded like any other authorization.
            Operation.objects.filter(id=op.id).update(
                authorized_hash=payload_hash,
                authorized_policy_version=policy.version,
                authorized_at=timezone.now(),
                authorization_expires_at=timezone.now() + policy.approval_ttl,
            )
            Evidence.objects.create(
                operation=op,
                kind=EvidenceKind.AUTHORIZATION,
                summary=f"authorized by policy {policy.version}: {policy.rule}",
                data={"policy_version": policy.version},
            )
        op.refresh_from_db()
        return op


def operation_authorize(
    *,
    operation_id: str,
    approved_hash: str,
    policy_version: str,
    approved_by,
    expires_at,
    reason: str = "",
) -> Operation:
    """Record that a person approved exactly this intent (hash) until `expires_at`."""
    with transaction.atomic():
        op = Operation.objects.select_for_update().select_related("tenant").get(id=operation_id)
        if op.payload_hash != approved_hash:
            raise AuthorizationRefused(
                f"the approved hash {approved_hash[:19]}… is not this intent's "
                f"{op.payload_hash[:19]}…"
            )
        current = policy_version_current(op.action)
        if policy_version != op.policy_version or policy_version != current:
            raise AuthorizationRefused(
                f"policy {policy_version} is not current ({current}); "
                "the intent needs a new approval"
            )
        if expires_at <= timezone.now():
            raise AuthorizationRefused("the approval has expired")
        updated = Operation.objects.filter(
            id=op.id, status=S.NOT_STARTED, payload_hash=approved_hash, authorized_hash=""
        ).update(
            authorized_hash=approved_hash,
            authorized_policy_version=policy_version,
            authorized_by=approved_by,
            authorized_at=timezone.now(),
            authorization_expires_at=expires_at,
        )
        if updated != 1:
            raise AuthorizationRefused(
                f"{op.id} is {op.status}{' and already authorized' if op.authorized_hash else ''}"
            )
        Evidence.objects.create(
            operation=op,
            kind=EvidenceKind.AUTHORIZATION,
            actor=approved_by,
            summary=f"approved by {getattr(approved_by, 'username', 'system')} "
            f"until {expires_at:%Y-%m-%d %H:%M} UTC",
            data={"approved_hash": approved_hash, "policy_version": policy_version},
        )
        audit_event_record(
            actor=approved_by,
            action="operation.authorize",
            tenant=op.tenant,
            object_type="operation",
            object_id=op.id,
            reason=reason,
            after={"approved_hash": approved_hash, "expires_at": expires_at.isoformat()},
        )
    op.refresh_from_db()
    return op


def _authorization_problem(op: Operation) -> str:
    if not op.authorized_hash:
        return "missing"
    if op.authorized_hash != op.payload_hash:
        return "the authorization is for another intent (hash mismatch)"
    current = policy_version_current(op.action)
    if op.authorized_policy_version != op.policy_version or op.policy_version != current:
        return f"policy {op.policy_version} is no longer current ({current})"
    if op.authorization_expires_at is None or op.authorization_expires_at <= timezone.now():
        return "the authorization has expired"
    return ""


# --- execute ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecuteReport:
    operation_id: str
    outcome: str  # called / already_succeeded / held_elsewhere / awaiting_authorization / …
    status: str
    detail: str = ""


def operation_execute(*, operation_id: str, worker: str = "") -> ExecuteReport:
    """Run the approved intent at most once, in the resume order of the design brief."""
    worker = worker or _worker_name()
    op = Operation.objects.select_related("tenant").get(id=operation_id)

    if op.status == S.SUCCEEDED:
        return ExecuteReport(op.id, "already_succeeded", op.status, "stored result returned")
    if op.status in (S.FAILED, S.CANCELLED, S.DISPUTED, S.ACCEPTED):
        return ExecuteReport(op.id, "nothing_to_do", op.status)

    lease_expired = (
        op.status == S.IN_PROGRESS
        and op.lease_expires_at is not None
        and op.lease_expires_at <= timezone.now()
    )
    if op.status == S.UNKNOWN or lease_expired:
        # Never call after an unknown outcome without asking the provider first.
        report = operation_reconcile(operation_id=op.id)
        op.refresh_from_db()
        if op.status != S.NOT_STARTED:
            return ExecuteReport(op.id, "reconciled", op.status, report.detail)
    elif op.status == S.IN_PROGRESS:
        return ExecuteReport(op.id, "held_elsewhere", op.status, f"leased by {op.lease_owner}")

    problem = _authorization_problem(op)
    if problem == "missing":
        return ExecuteReport(op.id, "awaiting_authorization", op.status)
    if problem:
        _transition(
            op,
            to=S.CANCELLED,
            sources={S.NOT_STARTED},
            evidence_kind=EvidenceKind.AUTHORIZATION,
            summary=f"not executed: {problem}",
            data={"problem": problem},
            fields={"error_code": "authorization", "error_message": problem},
        )
        op.refresh_from_db()
        return ExecuteReport(op.id, "cancelled", op.status, problem)

    adapter = _adapter(op.action)
    now = timezone.now()
    with transaction.atomic():
        # The claim re-checks the authorization in the same statement, so an approval that
        # expires between the read above and here cannot slip through.
        claimed = Operation.objects.filter(
            id=op.id,
            status=S.NOT_STARTED,
            authorized_hash=F("payload_hash"),
            authorization_expires_at__gt=now,
            authorized_policy_version=policy_version_current(op.action),
        ).update(
            status=S.IN_PROGRESS,
            status_changed_at=now,
            lease_owner=worker,
            lease_expires_at=now + _lease(),
            attempt_count=F("attempt_count") + 1,
            provider_calls=F("provider_calls") + 1,
            unknown_since=None,
            next_reconcile_at=None,
        )
        if claimed != 1:
            op.refresh_from_db()
            return ExecuteReport(op.id, "lost_claim", op.status, "another worker claimed it first")
        attempt = Attempt.objects.create(
            operation_id=op.id,
            number=_next_attempt_number(op.id),
            kind=AttemptKind.CALL,
            worker=worker,
            idempotency_key=op.idempotency_key,
        )
        Evidence.objects.create(
            operation_id=op.id,
            kind=EvidenceKind.TRANSITION,
            from_status=S.NOT_STARTED,
            to_status=S.IN_PROGRESS,
            summary=f"claimed by {worker}; calling the provider",
            data={"attempt": attempt.number, "idempotency_key": op.idempotency_key},
        )

    snapshot = _snapshot(op)
    try:
        result = adapter.call(snapshot)
    except Exception as exc:
        logger.exception("adapter call failed for %s", op.id)
        result = CallResult(
            outcome=CallOutcome.UNKNOWN, error_class=type(exc).__name__, error_message=str(exc)
        )
    return _record_call_result(op, attempt, result, worker=worker, adapter=adapter)


_ATTEMPT_OUTCOME = {
    CallOutcome.SUCCEEDED: AttemptOutcome.SUCCEEDED,
    CallOutcome.ACCEPTED: AttemptOutcome.ACCEPTED,
    CallOutcome.FAILED: AttemptOutcome.FAILED,
    CallOutcome.CONFLICT: AttemptOutcome.FAILED,
    CallOutcome.UNKNOWN: AttemptOutcome.UNKNOWN,
}


def _record_call_result(
    op: Operation,
    attempt: Attempt,
    result: CallResult,
    *,
    worker: str,
    adapter: ProviderAdapter,
) -> ExecuteReport:
    now = timezone.now()
    # First, alone and short: the provider's ids, the moment we have them.
    with transaction.atomic():
        Attempt.objects.filter(id=attempt.id).update(
            finished_at=now,
            outcome=_ATTEMPT_OUTCOME[result.outcome],
            http_status=result.http_status,
            provider_request_id=result.provider_request_id,
            external_id=result.external_id,
            request_hash=result.request_hash,
            error_class=result.error_class,
            error_message=result.error_message[:2000],
        )
        if result.external_id or result.provider_request_id:
            ids: dict[str, str] = {}
            if result.external_id:
                ids["external_id"] = result.external_id
            if result.provider_request_id:
                ids["provider_request_id"] = result.provider_request_id
            Operation.objects.filter(id=op.id).update(**ids)

    data = {
        "attempt": attempt.number,
        "http_status": result.http_status,
        "provider_request_id": result.provider_request_id,
        "external_id": result.external_id,
        "error_class": result.error_class,
    }
    fields: dict[str, Any] = {}
    if result.outcome == CallOutcome.SUCCEEDED:
        to, fields = S.SUCCEEDED, {"result": result.result}
        summary = f"provider confirmed {result.external_id}"
    elif result.outcome == CallOutcome.ACCEPTED:
        to, fields = S.ACCEPTED, {"result": result.result}
        summary = f"provider accepted {result.external_id}; final result pending"
    elif result.outcome == CallOutcome.FAILED:
        to = S.FAILED
        fields = {
            "error_code": result.error_class or "rejected",
            "error_message": result.error_message,
        }
        summary = f"provider refused the intent: {result.error_message or result.error_class}"
    elif result.outcome == CallOutcome.CONFLICT:
        to = S.FAILED
        fields = {
            "error_code": "version_conflict",
            "error_message": result.error_message,
            "result": result.result,
        }
        summary = "the record changed since the intent; a person decides on a new intent"
    else:
        to = S.UNKNOWN
        # A lost answer is checked again soon; a key reused with other parameters is not
        # something a lookup can settle, so it waits for a person.
        retry = result.error_class != "idempotency_error" and adapter.contract.autonomous
        fields = {
            "error_code": result.error_class or "unknown",
            "error_message": result.error_message,
            "next_reconcile_at": now
            + timedelta(seconds=getattr(settings, "RECONCILE_DELAY_SECONDS", 5))
            if retry
            else None,
        }
        summary = (
            f"no reliable answer ({result.error_class or 'unknown'}); reconcile before any new call"
        )

    won = _transition(
        op,
        to=to,
        sources={S.IN_PROGRESS},
        extra=Q(lease_owner=worker),
        evidence_kind=EvidenceKind.CALL_RESULT,
        summary=summary,
        data=data,
        fields=fields,
    )
    if not won and to != S.UNKNOWN:
        # Our lease ran out while the call was in flight and the sweep marked it unknown:
        # the answer we now hold is still the best evidence there is.
        won = _transition(
            op,
            to=to,
            sources={S.UNKNOWN},
            extra=Q(resolved_manually=False),
            evidence_kind=EvidenceKind.CALL_RESULT,
            summary=summary + " (answer arrived late)",
            data=data,
            fields=fields,
        )
    op.refresh_from_db()
    return ExecuteReport(op.id, "called", op.status, summary)


# --- reconcile ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReconcileReport:
    operation_id: str
    outcome: str  # found / absent / inconclusive / nothing_to_do
    status: str
    detail: str = ""
    may_call_again: bool = False


def _expire_lease(op: Operation) -> None:
    _transition(
        op,
        to=S.UNKNOWN,
        sources={S.IN_PROGRESS},
        extra=Q(lease_expires_at__lte=timezone.now()),
        evidence_kind=EvidenceKind.TRANSITION,
        summary=f"lease of {op.lease_owner or 'a worker'} expired with no recorded answer",
        data={"lease_owner": op.lease_owner},
        fields={"error_code": "lease_expired", "next_reconcile_at": timezone.now()},
    )


def operation_reconcile(*, operation_id: str, actor=None, reason: str = "") -> ReconcileReport:
    """Ask the provider what really happened and move the journal toward that fact.

    Reads only: never creates anything at the provider. Proven absence returns the operation
    to not_started (only where the contract makes a new call safe); anything ambiguous stays
    unknown, with what was found, for a person.
    """
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    if actor is not None:
        _require(actor, "operate_operations", op)
    if (
        op.status == S.IN_PROGRESS
        and op.lease_expires_at is not None
        and op.lease_expires_at <= timezone.now()
    ):
        _expire_lease(op)
        op.refresh_from_db()
    if op.status not in (S.UNKNOWN, S.ACCEPTED) or op.resolved_manually:
        return ReconcileReport(op.id, "nothing_to_do", op.status)

    adapter = _adapter(op.action)
    snapshot = _snapshot(op)
    with transaction.atomic():
        Operation.objects.select_for_update().filter(id=op.id).first()
        attempt = Attempt.objects.create(
            operation_id=op.id,
            number=_next_attempt_number(op.id),
            kind=AttemptKind.LOOKUP,
            worker=_worker_name(),
            idempotency_key=op.idempotency_key,
        )
    try:
        found = adapter.lookup(snapshot)
    except Exception as exc:
        logger.exception("adapter lookup failed for %s", op.id)
        found = LookupResult(
            outcome=LookupOutcome.INCONCLUSIVE,
            reason=f"lookup raised {type(exc).__name__}",
            retry_after=timedelta(seconds=30),
        )
    if actor is not None:
        audit_event_record(
            actor=actor,
            action="operation.reconcile",
            tenant=op.tenant,
            object_type="operation",
            object_id=op.id,
            reason=reason,
            after={"lookup": found.outcome, "detail": found.reason},
        )
    return _record_lookup(op, attempt, found, adapter=adapter, actor=actor)


_LOOKUP_STATUS = {
    CallOutcome.SUCCEEDED: S.SUCCEEDED,
    CallOutcome.ACCEPTED: S.ACCEPTED,
    CallOutcome.FAILED: S.FAILED,
}


def _record_lookup(
    op: Operation,
    attempt: Attempt,
    found: LookupResult,
    *,
    adapter: ProviderAdapter,
    actor,
) -> ReconcileReport:
    now = timezone.now()
    outcome = {
        LookupOutcome.FOUND: AttemptOutcome.FOUND,
        LookupOutcome.ABSENT: AttemptOutcome.ABSENT,
        LookupOutcome.INCONCLUSIVE: AttemptOutcome.INCONCLUSIVE,
    }[found.outcome]
    Attempt.objects.filter(id=attempt.id).update(
        finished_at=now,
        outcome=outcome,
        http_status=found.http_status,
        provider_request_id=found.provider_request_id,
        external_id=found.external_id,
        error_message=found.reason[:2000],
    )
    data = {
        "attempt": attempt.number,
        "method": found.method or "",
        "reason": found.reason,
        "matches": found.matches[:10],
        "external_id": found.external_id,
    }
    contract = adapter.contract
    op.refresh_from_db()
    if op.status not in (S.UNKNOWN, S.ACCEPTED) or op.resolved_manually:
        return ReconcileReport(op.id, "nothing_to_do", op.status, "settled meanwhile")

    if found.outcome == LookupOutcome.FOUND and found.status in _LOOKUP_STATUS:
        to = _LOOKUP_STATUS[found.status]
        if to == op.status:
            Evidence.objects.create(
                operation=op,
                kind=EvidenceKind.LOOKUP,
                from_status=op.status,
                to_status=to,
                summary=f"provider still reports {found.status} for {found.external_id}",
                data=data,
                actor=actor,
            )
            return ReconcileReport(op.id, "found", op.status, "unchanged")
        fields: dict[str, Any] = {
            "external_id": found.external_id or op.external_id,
            "result": found.result or None,
        }
        if to == S.FAILED:
            fields.update(error_code="provider_failed", error_message=found.reason)
        _transition(
            op,
            to=to,
            sources={op.status},
            evidence_kind=EvidenceKind.LOOKUP,
            summary=f"provider lookup ({found.method}) found {found.external_id}: {found.status}",
            data=data,
            fields=fields,
            actor=actor,
        )
        op.refresh_from_db()
        return ReconcileReport(op.id, "found", op.status, f"found {found.external_id}")

    if found.outcome == LookupOutcome.ABSENT and op.status == S.UNKNOWN:
        # Absence proven by an authoritative lookup makes a new call safe where the provider
        # dedups by key, or where a natural key / expected version turns a duplicate into a
        # refusal instead of a second effect.
        may_call = contract.same_key_retry_safe or contract.effect_class in (
            EffectClass.CREATE_WITH_NATURAL_KEY,
            EffectClass.VERSIONED_UPDATE,
        )
        if may_call:
            _transition(
                op,
                to=S.NOT_STARTED,
                sources={S.UNKNOWN},
                evidence_kind=EvidenceKind.LOOKUP,
                summary=f"provider lookup ({found.method}) proved no effect exists; "
                "may call again with the same key",
                data=data,
                fields={"error_code": "", "error_message": ""},
                actor=actor,
            )
            op.refresh_from_db()
            return ReconcileReport(op.id, "absent", op.status, "proven absent", may_call_again=True)
        Operation.objects.filter(id=op.id, status=S.UNKNOWN).update(next_reconcile_at=None)
        Evidence.objects.create(
            operation=op,
            kind=EvidenceKind.LOOKUP,
            from_status=op.status,
            to_status=op.status,
            summary="proven absent, but the provider's contract does not make a new call "
            "safe; a person decides",
            data=data,
            actor=actor,
        )
        return ReconcileReport(op.id, "absent", op.status, "a person decides")

    # Inconclusive (or absent while accepted): stay where we are, with everything found.
    retry_at = now + found.retry_after if found.retry_after else None
    if contract.key_retention is not None and retry_at is not None:
        last_call = _snapshot(op).last_call_at
        if last_call is not None and retry_at - last_call > contract.key_retention:
            retry_at = None  # past the key's retention a retry proves nothing: a person
    Operation.objects.filter(id=op.id, status=op.status).update(next_reconcile_at=retry_at)
    Evidence.objects.create(
        operation=op,
        kind=EvidenceKind.LOOKUP,
        from_status=op.status,
        to_status=op.status,
        summary=f"lookup inconclusive: {found.reason or found.outcome}"
        + (f"; next check {retry_at:%H:%M:%S}" if retry_at else "; waiting for a person"),
        data=data,
        actor=actor,
    )
    return ReconcileReport(op.id, "inconclusive", op.status, found.reason)


# --- people -------------------------------------------------------------------------------


def _require(actor, perm: str, op: Operation) -> None:
    if actor is None or not actor.has_perm(f"operations.{perm}", op.tenant):
        raise PermissionDenied(f"{perm} on {op.tenant.slug} is required")


def operation_resolve(
    *,
    operation_id: str,
    actor,
    outcome: str,
    evidence_text: str,
    reason: str,
    provider_reference: str = "",
) -> Operation:
    """An operator settles an unknown (or disputed) operation by what they verified."""
    if outcome not in (S.SUCCEEDED, S.FAILED):
        raise TransitionRefused("resolve as succeeded or failed")
    if not reason.strip() or not (evidence_text.strip() or provider_reference.strip()):
        raise TransitionRefused("a reason and evidence (text or provider reference) are required")
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    _require(actor, "operate_operations", op)
    fields: dict[str, Any] = {"resolved_manually": True}
    if provider_reference:
        fields["external_id"] = provider_reference
    if outcome == S.FAILED:
        fields.update(error_code="resolved_failed", error_message=evidence_text[:500])
    won = _transition(
        op,
        to=outcome,
        sources=transitions.sources(outcome, manual=True) - {S.IN_PROGRESS},
        evidence_kind=EvidenceKind.MANUAL,
        manual=True,
        actor=actor,
        summary=f"resolved as {outcome} by {actor.username}: {evidence_text}",
        data={
            "evidence": evidence_text,
            "provider_reference": provider_reference,
            "reason": reason,
        },
        fields=fields,
        audit_action=f"operation.resolve_{outcome}",
        reason=reason,
    )
    if not won:
        op.refresh_from_db()
        raise TransitionRefused(f"{op.id} is {op.status}; it cannot be resolved as {outcome}")
    op.refresh_from_db()
    return op


def operation_dispute(*, operation_id: str, actor, reason: str) -> Operation:
    """Put an operation on hold: no webhook or lookup moves it until a person resolves it."""
    if not reason.strip():
        raise TransitionRefused("a reason is required")
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    _require(actor, "operate_operations", op)
    sources = transitions.sources(S.DISPUTED, manual=True)
    extra = ~Q(status=S.IN_PROGRESS) | Q(lease_expires_at__lte=timezone.now())
    won = _transition(
        op,
        to=S.DISPUTED,
        sources=sources,
        extra=extra,
        evidence_kind=EvidenceKind.MANUAL,
        manual=True,
        actor=actor,
        summary=f"marked disputed by {actor.username}: {reason}",
        data={"reason": reason},
        fields={"resolved_manually": True},
        audit_action="operation.dispute",
        reason=reason,
    )
    if not won:
        op.refresh_from_db()
        raise TransitionRefused(f"{op.id} is {op.status} (or still leased); it cannot be disputed")
    op.refresh_from_db()
    return op


def operation_cancel(*, operation_id: str, actor, reason: str) -> bool:
    """Cancel an intent that never ran (a rejected or superseded approval)."""
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    return _transition(
        op,
        to=S.CANCELLED,
        sources={S.NOT_STARTED},
        evidence_kind=EvidenceKind.TRANSITION,
        actor=actor,
        summary=f"cancelled: {reason}",
        data={"reason": reason},
        fields={"error_code": "cancelled", "error_message": reason},
        audit_action="operation.cancel" if actor is not None else "",
        reason=reason,
    )


# --- the sweep ----------------------------------------------------------------------------


def operations_due_for_reconcile(*, limit: int = 200) -> list[str]:
    """Expired leases and unknowns whose next check is due, oldest first (partial indexes)."""
    now = timezone.now()
    expired = (
        Operation.objects.filter(status=S.IN_PROGRESS, lease_expires_at__lte=now)
        .order_by("lease_expires_at")
        .values_list("id", flat=True)[:limit]
    )
    due = (
        Operation.objects.filter(next_reconcile_at__lte=now, status__in=[S.UNKNOWN, S.ACCEPTED])
        .order_by("next_reconcile_at")
        .values_list("id", flat=True)[:limit]
    )
    return list(dict.fromkeys([*expired, *due]))


def webhook_apply(*, provider: str, facts) -> tuple[str, str]:
    """Store a verified provider event once and apply it only as an allowed transition.

    Returns (result, message): result is "duplicate", "applied", "ignored" or "unlinked".
    """
    from operations.models import WebhookEvent

    try:
        with transaction.atomic():
            event = WebhookEvent.objects.create(
                provider=provider,
                event_id=facts.event_id,
                event_type=facts.event_type,
                external_id=facts.external_id,
                data=facts.data,
                provider_created_at=facts.created_at,
            )
    except IntegrityError:
        return "duplicate", f"event {facts.event_id} already received"

    op = None
    if facts.operation_id:
        op = Operation.objects.select_related("tenant").filter(id=facts.operation_id).first()
    if op is None and facts.external_id:
        op = (
            Operation.objects.select_related("tenant").filter(external_id=facts.external_id).first()
        )
    if op is None:
        WebhookEvent.objects.filter(id=event.id).update(outcome="no matching operation")
        return "unlinked", "no matching operation"

    target = _LOOKUP_STATUS.get(facts.status) if facts.status else None
    data = {
        "event_id": facts.event_id,
        "event_type": facts.event_type,
        "external_id": facts.external_id,
    }
    if op.resolved_manually or op.status == S.DISPUTED:
        message = f"ignored: {op.id} is {op.status} by an operator's decision"
    elif target is None:
        message = f"ignored: {facts.event_type} carries no status"
    elif target == op.status:
        message = f"ignored: {op.id} is already {op.status}"
    elif not transitions.allowed(op.status, target):
        message = f"ignored: {op.status} → {target} is not allowed (late or out of order)"
    else:
        fields: dict[str, Any] = {}
        if facts.external_id and not op.external_id:
            fields["external_id"] = facts.external_id
        if target == S.FAILED:
            fields.update(error_code="provider_failed", error_message=facts.event_type)
        won = _transition(
            op,
            to=target,
            sources={op.status},
            extra=Q(resolved_manually=False),
            evidence_kind=EvidenceKind.WEBHOOK,
            summary=f"webhook {facts.event_type}",
            data=data,
            fields=fields,
        )
        message = f"applied: {op.status} → {target}" if won else "ignored: status moved meanwhile"
        WebhookEvent.objects.filter(id=event.id).update(
            operation=op, applied=won, outcome=message[:200]
        )
        return ("applied" if won else "ignored"), message
    with transaction.atomic():
        WebhookEvent.objects.filter(id=event.id).update(operation=op, outcome=message[:200])
        Evidence.objects.create(
            operation=op,
            kind=EvidenceKind.WEBHOOK,
            from_status=op.status,
            to_status=op.status,
            summary=f"webhook {facts.event_type} {message}",
            data=data,
        )
    return "ignored", message
