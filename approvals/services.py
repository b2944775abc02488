"""Writes on approvals. Every status change is a conditional UPDATE from `pending`, checked
for one row, and commits together with its audit row. Refusals raise `ApprovalRefused` and
are audited in their own transaction, so the attempt is on record though nothing changed.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.selectors import (
    approval_is_own_intent,
    approval_policy_moved_to,
    approval_replaced_by,
    approval_replacement_changed,
    approval_run_mode_problem,
    intent_authors,
)
from operations.engine import AuthorizationRefused, operation_authorize, operation_cancel
from operations.intents import secret_in_text
from operations.models import Operation, Tenant
from operations.policy import policy_for
from operations.selectors import tenants_for_user
from operations.services import audit_event_record
from operations.tasks import execute_on_commit

logger = logging.getLogger(__name__)

P = ApprovalStatus
# The least time an approval gives the engine to start the operation.
AUTHORIZATION_MIN_WINDOW = timedelta(minutes=15)


class ApprovalRefused(Exception):
    """A decision that was not taken; the message is meant for the person who tried."""

    def __init__(self, message: str, *, code: str = "refused"):
        super().__init__(message)
        self.message = message
        self.code = code


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "an unknown time"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _decided_message(approval: Approval) -> str:
    who = approval.decided_by.username if approval.decided_by_id else "the system"
    if approval.status == P.SUPERSEDED:
        request, successor = approval_replaced_by(approval)
        changed = approval_replacement_changed(
            approval, request=request, successor=successor
        )
        by = {
            True: "a changed one",
            False: "the same intent asked again",
            None: "a newer intent",
        }[changed]
        when = _when(approval.decided_at)
        if approval.superseded_by_id is None:
            return (
                f"This intent was superseded at {when} by {by}, which needs no approval; "
                "there is nothing to decide."
            )
        if changed is False:
            return (
                f"This intent was asked again unchanged ({approval.superseded_by_id}) at "
                f"{when}; decide the new request instead."
            )
        return (
            f"This intent was superseded by {by} ({approval.superseded_by_id}) at "
            f"{when}; review and approve the new intent instead."
        )
    if approval.status == P.EXPIRED:
        return (
            f"This approval expired at {_when(approval.expires_at)}; nothing was approved. "
            "To ask again, the agent prepares the intent anew, superseding this one."
        )
    return f"Already {approval.status} by {who} at {_when(approval.decided_at)}."


def _may(user, perm: str, tenant_id: int) -> bool:
    return tenants_for_user(user, perm).filter(id=tenant_id).exists()


def _audit(
    *, actor, action: str, approval: Approval, tenant: Tenant, reason: str = "",
    before: dict | None = None, after: dict | None = None,
) -> None:
    audit_event_record(
        actor=actor, action=action, tenant=tenant, object_type="approval",
        object_id=approval.id, reason=reason, before=before,
        after={"operation": approval.operation_id, **(after or {})},
    )


def approval_request(*, operation: Operation, supersedes: Operation | None = None) -> Approval:
    """Ask a person to approve this intent; a changed intent supersedes the old request."""
    supersedes = supersedes or operation.supersedes
    policy = policy_for(operation.action)
    with transaction.atomic():
        approval = Approval.objects.create(
            operation=operation,
            payload_hash=operation.payload_hash,
            policy_version=operation.policy_version,
            expires_at=timezone.now() + policy.approval_ttl,
            authors=intent_authors(operation),
        )
        _audit(
            actor=None, action="approval.request", approval=approval, tenant=operation.tenant,
            after={
                "status": P.PENDING,
                "payload_hash": approval.payload_hash,
                "policy_version": approval.policy_version,
                "expires_at": approval.expires_at.isoformat(),
                "supersedes": supersedes.id if supersedes else None,
            },
        )
        if supersedes is not None:
            approvals_supersede_for(operation=supersedes, new_approval=approval)
    return approval


def approvals_supersede_for(*, operation: Operation, new_approval: Approval | None) -> None:
    """The replaced intent's pending approval, if any, can no longer be used. `new_approval`
    is None when the new intent needs no approval (the policy authorizes it)."""
    old = Approval.objects.filter(operation=operation, status=P.PENDING).first()
    if old is None:
        return
    with transaction.atomic():
        won = Approval.objects.filter(id=old.id, status=P.PENDING).update(
            status=P.SUPERSEDED, superseded_by=new_approval, decided_at=timezone.now()
        )
        if won:
            _audit(
                actor=None, action="approval.supersede", approval=old, tenant=operation.tenant,
                before={"status": P.PENDING},
                after={"status": P.SUPERSEDED,
                       "superseded_by": new_approval.id if new_approval else None},
            )


def _locked(approval_id: str) -> Approval:
    """The approval, locked, after its operation's row: a second decision waits here, then
    sees the first.

    Operation first, then approval, as prepare takes them when a changed intent supersedes
    this one (it locks the old operation, cancels it, then supersedes its approval). In the
    other order a decision and a supersede could each hold what the other waits for."""
    Operation.objects.select_for_update(of=("self",)).filter(
        approvals__id=approval_id
    ).values_list("id").first()
    return (
        Approval.objects.select_for_update(of=("self",))
        .select_related("operation", "operation__tenant", "operation__run")
        .get(id=approval_id)
    )


def _refuse_unless_decidable(approval: Approval, actor, *, now: datetime) -> None:
    op = approval.operation
    if not _may(actor, "approve_intents", op.tenant_id):
        raise ApprovalRefused(
            f"You may not decide intents of tenant {op.tenant.slug}: the approver role on "
            "that tenant is needed.",
            code="other_tenant",
        )
    if approval.status != P.PENDING:
        raise ApprovalRefused(_decided_message(approval), code=f"already_{approval.status}")
    if approval.expires_at <= now:
        raise ApprovalRefused(
            f"This approval expired at {_when(approval.expires_at)}; nothing was approved. "
            "The attempt is recorded; to ask again, the agent prepares the intent anew, "
            "superseding this one.",
            code="expired",
        )


def _refuse_secrets_in(text: str, *, what: str, verb: str) -> None:
    # A decision's words go to the approval, the journal and the audit trail, which every
    # viewer of the tenant reads.
    problem = secret_in_text(text)
    if problem:
        raise ApprovalRefused(
            f"The {what} looks like {problem}. Nothing was {verb}.", code="secret_in_text"
        )


def approval_decision_check(*, approval_id: str, actor, verb: str) -> None:
    """Refuse, and record, a decision this approval cannot take whatever its words say: it
    is decided, or expired (an attempt after expiry is recorded and closes it, as the
    decision itself would). For a decision whose words a form turned away: the person
    learns the approval ran out, not that a reason is missing, and the attempt is on the
    trail."""
    try:
        with transaction.atomic():
            _refuse_unless_decidable(_locked(approval_id), actor, now=timezone.now())
    except ApprovalRefused as refusal:
        _record_refusal(approval_id=approval_id, actor=actor, refusal=refusal, verb=verb,
                        typed={})
        raise


def approval_approve(*, approval_id: str, actor, comment: str = "") -> Approval:
    """Approve exactly the intent this approval was bound to, and enqueue its execution."""
    comment = comment.strip()
    try:
        _refuse_secrets_in(comment, what="comment", verb="approved")
        with transaction.atomic():
            approval = _locked(approval_id)
            op = approval.operation
            now = timezone.now()
            _refuse_unless_decidable(approval, actor, now=now)
            if approval.payload_hash != op.payload_hash:
                raise ApprovalRefused(
                    "The intent does not match what was put up for approval (hash mismatch); "
                    "it may have been tampered with. Nothing was approved.",
                    code="tampered",
                )
            in_force = approval_policy_moved_to(approval)
            if in_force:
                raise ApprovalRefused(
                    f"This intent was prepared under policy {approval.policy_version}, and "
                    f"{in_force} is now in force; the agent must prepare it again.",
                    code="policy_changed",
                )
            run_mode = approval_run_mode_problem(approval)
            if run_mode:
                # The engine would cancel it without a call: an approval saying "queued to
                # run" would be untrue.
                raise ApprovalRefused(
                    f"This intent can no longer be approved: {run_mode}. The engine would "
                    "cancel it without a call; rejecting it tells the agent why.",
                    code="run_mode",
                )
            if approval_is_own_intent(approval, actor):
                raise ApprovalRefused(
                    "Four eyes: you created this intent, one it replaces or repeats, or "
                    "launched the run of one of them, so someone else must approve it.",
                    code="four_eyes",
                )
            updated = Approval.objects.filter(id=approval.id, status=P.PENDING).update(
                status=P.APPROVED, decided_by=actor, decided_at=now, comment=comment
            )
            if updated != 1:
                raise ApprovalRefused("This approval was decided meanwhile.", code="race")
            try:
                operation_authorize(
                    operation_id=op.id,
                    approved_hash=approval.payload_hash,
                    policy_version=approval.policy_version,
                    approved_by=actor,
                    # A decision made in time leaves the worker time to start, even when it
                    # came in the approval's last minute.
                    expires_at=max(approval.expires_at, now + AUTHORIZATION_MIN_WINDOW),
                    reason=comment,
                )
            except AuthorizationRefused as exc:
                raise ApprovalRefused(
                    f"The operation cannot be authorized: {exc}", code="authorization"
                ) from exc
            _audit(
                actor=actor, action="approval.approve", approval=approval, tenant=op.tenant,
                reason=comment, before={"status": P.PENDING},
                after={"status": P.APPROVED, "payload_hash": approval.payload_hash},
            )
            execute_on_commit(op.id)
    except ApprovalRefused as refusal:
        _record_refusal(approval_id=approval_id, actor=actor, refusal=refusal, verb="approve",
                        typed={"comment": comment})
        raise
    approval.refresh_from_db()
    return approval


def approval_reject(*, approval_id: str, actor, reason: str) -> Approval:
    """Reject the intent with a reason; its operation is cancelled and never runs."""
    reason = reason.strip()
    try:
        _refuse_secrets_in(reason, what="reason", verb="rejected")
        with transaction.atomic():
            approval = _locked(approval_id)
            op = approval.operation
            now = timezone.now()
            _refuse_unless_decidable(approval, actor, now=now)
            if not reason:
                raise ApprovalRefused("A rejection needs a reason.", code="no_reason")
            updated = Approval.objects.filter(id=approval.id, status=P.PENDING).update(
                status=P.REJECTED, decided_by=actor, decided_at=now, comment=reason
            )
            if updated != 1:
                raise ApprovalRefused("This approval was decided meanwhile.", code="race")
            _audit(
                actor=actor, action="approval.reject", approval=approval, tenant=op.tenant,
                reason=reason, before={"status": P.PENDING}, after={"status": P.REJECTED},
            )
            if not operation_cancel(operation_id=op.id, actor=actor, reason=f"rejected: {reason}"):
                # The operation left not_started some other way: the rejection would say
                # something untrue, so none is recorded.
                # `op` was read under its lock (_locked): its status is the current one.
                raise ApprovalRefused(
                    f"The operation is already {op.status}; nothing was rejected.", code="race",
                )
    except ApprovalRefused as refusal:
        _record_refusal(approval_id=approval_id, actor=actor, refusal=refusal, verb="reject",
                        typed={"reason": reason})
        raise
    approval.refresh_from_db()
    return approval


def _record_refusal(
    *, approval_id: str, actor, refusal: ApprovalRefused, verb: str, typed: dict[str, str]
) -> None:
    """Outside the rolled-back decision: expire it if that was the reason, and audit what
    the person meant to say with it, except words refused for looking like a secret."""
    if refusal.code == "expired":
        approval_expire(approval_id=approval_id)
    approval = Approval.objects.select_related("operation__tenant").get(id=approval_id)
    words = {} if refusal.code == "secret_in_text" else {k: v for k, v in typed.items() if v}
    _audit(
        actor=actor, action=f"approval.{verb}_refused", approval=approval,
        tenant=approval.operation.tenant, reason=refusal.message,
        after={"status": approval.status, "refusal": refusal.code, **words},
    )


def approval_expire(*, approval_id: str) -> bool:
    """Expire a pending approval whose time is up, and cancel its never-run operation."""
    with transaction.atomic():
        approval = _locked(approval_id)  # the lock order of every change of an approval
        now = timezone.now()
        won = (
            Approval.objects.filter(
                id=approval_id, status=P.PENDING, expires_at__lte=now
            ).update(status=P.EXPIRED, decided_at=now)
            == 1
        )
        if not won:
            return False
        # The approval expires whatever became of its operation; the record says which.
        cancelled = operation_cancel(
            operation_id=approval.operation_id, actor=None, reason="approval expired"
        )
        _audit(
            actor=None, action="approval.expire", approval=approval,
            tenant=approval.operation.tenant, before={"status": P.PENDING},
            after={"status": P.EXPIRED, "expires_at": approval.expires_at.isoformat(),
                   "operation_cancelled": cancelled},
        )
    return True


def approvals_expire_overdue(*, limit: int = 500) -> int:
    """The beat sweep: expire every pending approval past its time, soonest first."""
    ids = list(
        Approval.objects.filter(status=P.PENDING, expires_at__lte=timezone.now())
        .order_by("expires_at", "id")
        .values_list("id", flat=True)[:limit]
    )
    expired = 0
    for approval_id in ids:
        try:
            expired += approval_expire(approval_id=approval_id)
        except Exception:
            # Soonest first, one that cannot be expired would head every sweep's list and
            # hold back all the others, each still approvable, for good: logged, and the
            # sweep goes on (its transaction rolled back alone).
            logger.exception("approval %s could not be expired", approval_id)
    return expired
