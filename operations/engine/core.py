"""What every engine step shares: the one conditional-UPDATE transition, leases, snapshots."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from operations import transitions
from operations.intents import secret_in_text
from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    Evidence,
    Operation,
    OperationStatus,
    WebhookEvent,
)
from operations.providers.base import (
    CallOutcome,
    CallResult,
    LookupOutcome,
    LookupResult,
    OperationSnapshot,
    ProviderAdapter,
)
from operations.providers.transport import (
    LOOKUP_RETRY_AFTER,
    LOOKUP_RETRY_MAX,
    REACHED_NO_ACCOUNT,
)
from operations.selectors import tenant_perm_held
from operations.services import audit_event_record

S = OperationStatus
# The error class of a call whose answer confirmed another effect than the approved one.
NOT_THE_APPROVED_EFFECT = "disagreement"
# The error code of an operation whose last lookup found several objects carrying it (a data
# incident): which one is its effect is a person's call, so no event or answer picks one.
SEVERAL_MATCHES = "several_matches"
# The error code of an operation whose worker's lease ran out with no answer recorded: what
# it says is that nothing is known, so the worker's late answer may still land over it.
LEASE_EXPIRED = "lease_expired"
logger = logging.getLogger(__name__)


class EngineError(Exception):
    # The form field a person can fix the refusal in, if any: the page shows it there.
    field = ""


class AuthorizationRefused(EngineError):
    pass


class TransitionRefused(EngineError):
    pass


class ReferenceRefused(TransitionRefused):
    """The provider did not confirm the reference an operator gave."""

    field = "provider_reference"


def lease_duration() -> timedelta:
    return timedelta(seconds=settings.OPERATION_LEASE_SECONDS)


def call_reach_until(lease_expires_at: datetime) -> datetime:
    """Until when a call made under a lease ending then may reach the provider: it may be
    sent as late as the lease runs out (execute sends nothing after), and is out or given up
    within the client's timeout (`send_timeout`). Kept on the call (`Attempt.reach_until`)."""
    return lease_expires_at + timedelta(seconds=float(settings.PROVIDER_TIMEOUT_SECONDS))


def _process_token_new() -> None:
    global _process_token
    _process_token = secrets.token_hex(3)


_process_token = ""
_process_token_new()
# A forked child (Celery's prefork pool) is another lease owner than its parent.
os.register_at_fork(after_in_child=_process_token_new)


def worker_name() -> str:
    """Who holds a lease: unique per executing thread, because the lease owner is what lets
    a late answer land. Two threads of one worker process (Celery's threads pool) sharing a
    name could each finish the other's claim. Host and pid alone repeat across containers:
    each runs its worker as pid 1, and replicas of one deployment share a long name prefix;
    so each process adds a random token."""
    # The host's head is cut, never its tail (a replica's own suffix) nor the ids, to fit
    # the 64-character column.
    name = f"{socket.gethostname()[-32:]}:{os.getpid()}:{_process_token}"
    if threading.current_thread() is not threading.main_thread():
        name += f":{threading.get_native_id()}"
    return name


def execute_recheck_at(now: datetime) -> datetime:
    """When an operation that should be running (approved, or proven absent and free to be
    called again) is queued again if no worker has claimed it: its execute message may have
    been lost (the broker down at the moment of approval, a worker gone mid-delivery)."""
    return now + timedelta(seconds=settings.EXECUTE_RECHECK_SECONDS)


def accepted_recheck_wait(*, accepted_since: datetime | None, now: datetime) -> timedelta:
    """How long an accepted operation (the provider's final answer still pending) waits for
    its next lookup, if no webhook settles it first: ACCEPTED_RECONCILE_SECONDS, then as long
    as it has been accepted, up to LOOKUP_RETRY_MAX. A card payment settles in seconds; a bank
    debit stays `processing` for days, and looked up every two minutes it cost the provider
    two thousand requests and its page as many timeline rows; now some three hundred."""
    wait = timedelta(seconds=settings.ACCEPTED_RECONCILE_SECONDS)
    if accepted_since is not None:
        wait = max(wait, min(now - accepted_since, LOOKUP_RETRY_MAX))
    return wait


def accepted_recheck_at(now: datetime, *, accepted_since: datetime | None = None) -> datetime:
    return now + accepted_recheck_wait(accepted_since=accepted_since, now=now)


def lease_expired(op: Operation) -> bool:
    """Held by a worker whose lease ran out: it may have died mid-call."""
    return (
        op.status == S.IN_PROGRESS
        and op.lease_expires_at is not None
        and op.lease_expires_at <= timezone.now()
    )


def outcome_open(op: Operation) -> bool:
    """Unknown or accepted, and no person has settled it: what a lookup may still move."""
    return op.status in (S.UNKNOWN, S.ACCEPTED) and not op.resolved_manually


def dispute_applies(op: Operation) -> bool:
    """Whether an operator may mark it disputed: where the manual table allows it, and for
    an in-progress one only once its lease ran out (operation_dispute's own condition)."""
    return transitions.allowed(op.status, S.DISPUTED, manual=True) and (
        op.status != S.IN_PROGRESS or lease_expired(op)
    )


def reconcile_applies(op: Operation) -> bool:
    """Whether a reconcile would ask the provider: an open outcome, or an expired lease
    (which it first turns into unknown)."""
    return outcome_open(op) or lease_expired(op)


def adapter(action: str) -> ProviderAdapter:
    from operations.providers import adapter_for

    return adapter_for(action)


# Where a call recorded before 0014 went: 0014 kept no account for it, and the key may have
# changed since (test mode to live mode), so no account's silence proves it absent. Calls
# made since always record theirs.
UNRECORDED_ACCOUNT = "(not recorded: a call made before accounts were kept)"


def call_account(*, provider_account: str, error_class: str) -> str | None:
    """The provider account a call counts for in the account rule: None for a call that
    reached none (refused at the door, or answered by something that is not the provider's
    API), and one recorded before accounts were kept may have gone to any."""
    if error_class in REACHED_NO_ACCOUNT:
        return None
    return provider_account or UNRECORDED_ACCOUNT


def snapshot(op: Operation, *, last_call: Attempt | None = None) -> OperationSnapshot:
    """`last_call`: the call attempt execute has just created, with `op` as read before its
    claim. When that is the operation's first call, no call needs reading back."""
    if last_call is not None and op.provider_calls == 0:
        # The call just claimed is the first: the key was never sent before it.
        calls = [{"started_at": last_call.started_at, "finished_at": last_call.finished_at,
                  "reach_until": last_call.reach_until,
                  "provider_account": last_call.provider_account,
                  "error_class": last_call.error_class}]
    else:
        calls = list(
            op.attempts.filter(kind=AttemptKind.CALL)
            .order_by("number")
            .values("started_at", "finished_at", "reach_until", "provider_account",
                    "error_class")
        )
    last_call_at = key_first_sent_at = None
    if calls:
        # The provider may act at any moment until the answer arrives.
        last_call_at = calls[-1]["finished_at"] or calls[-1]["reach_until"]
        # Providers age a key from its first use, which was no earlier than this.
        key_first_sent_at = calls[0]["started_at"]
    return OperationSnapshot(
        id=op.id,
        action=op.action,
        tenant=op.tenant.slug,
        payload=op.payload,
        idempotency_key=op.idempotency_key,
        external_id=op.external_id,
        key_first_sent_at=key_first_sent_at,
        last_call_at=last_call_at,
        call_accounts=frozenset(
            account for c in calls
            if (account := call_account(provider_account=c["provider_account"],
                                        error_class=c["error_class"]))
        ),
    )


def unanswered_call_lands_by(
    op: Operation, *, late_landing: timedelta | None = None
) -> datetime | None:
    """Until when a call without a definite answer may still be carried out by the provider;
    None when there is no such call.

    Without `late_landing`: the calls that never got any answer (their worker died or
    stalled), each until its `reach_until`. Enough before calling again, which the
    provider dedups (by key, natural key or version). With it (the contract's, before
    closing an operation as never done): those calls and the ones the client gave up on
    (timeout, lost connection, 5xx) too, each that much longer. A call refused before it
    was sent (lease_lost) never counts."""
    unanswered = Q(finished_at__isnull=True)
    if late_landing is not None:
        unanswered |= Q(outcome=AttemptOutcome.UNKNOWN)
    ends = [
        (finished or reach_until) + (late_landing or timedelta(0))
        for reach_until, finished in Attempt.objects.filter(
            unanswered, operation_id=op.id, kind=AttemptKind.CALL,
        ).exclude(error_class="lease_lost").values_list("reach_until", "finished_at")
    ]
    return max(ends, default=None)


@dataclass(frozen=True)
class HeldReports:
    """What the provider reported about an operation that waits for a person: the held
    events (their ids) and the calls whose late answers are held (their numbers)."""

    events: list[str]
    answers: list[int]

    def names(self) -> list[str]:
        # "Attempt", as the timeline numbers them: a held answer is a late call's, or a
        # lookup's that found a second effect.
        return [*self.events, *(f"the answer to attempt {number}" for number in self.answers)]


def held_reports(operation_id: str) -> HeldReports:
    """Its provider events and call answers held for review that no person has answered."""
    return HeldReports(
        events=list(
            WebhookEvent.objects.held_for_review().filter(operation_id=operation_id)
            .order_by("event_id").values_list("event_id", flat=True)
        ),
        answers=list(
            Attempt.objects.held_for_review().filter(operation_id=operation_id)
            .order_by("number").values_list("number", flat=True)
        ),
    )


def next_attempt_number(operation_id: str) -> int:
    # Called inside the transaction that owns the operation row (claim or lookup start),
    # so two attempts can never draw the same number; the unique constraint backs it up.
    last = (
        Attempt.objects.filter(operation_id=operation_id)
        .order_by("-number")
        .values_list("number", flat=True)
        .first()
    )
    return (last or 0) + 1


def transition(
    op: Operation,
    *,
    to: str,
    sources: set[str] | frozenset[str],
    evidence_kind: str,
    summary: str,
    data: dict[str, Any] | None = None,
    extra: Q | None = None,
    fields: dict[str, Any] | None = None,
    actor: AbstractUser | None = None,
    manual: bool = False,
    audit_action: str = "",
    reason: str = "",
    audit_facts: dict[str, Any] | None = None,
    held_shown: Collection[int] | None = None,
    held_answers_shown: Collection[int] | None = None,
) -> bool:
    """One conditional UPDATE plus its evidence (and audit) row; True when this call won.
    `audit_facts`: what the person went by, for an auditor who reads the trail alone.
    `held_shown`: on a manual transition, the held provider events (ids) the person's page
    showed, which their decision answers; None (a caller with no page): all of them.
    `held_answers_shown`: the same for held call answers (attempt ids)."""
    for source in sources:
        if not transitions.allowed(source, to, manual=manual):
            raise TransitionRefused(f"{source} → {to} is not in the transition table")
    now = timezone.now()
    # Failing lookups are an accepted effect's history; the next status starts without it.
    values: dict[str, Any] = {
        "status": to, "status_changed_at": now, "lookups_failing_since": None,
    }
    if to != S.IN_PROGRESS:
        values.update(lease_owner="", lease_expires_at=None)
    if to == S.UNKNOWN:
        values["unknown_since"] = now
    else:
        values["unknown_since"] = None
        values["next_reconcile_at"] = (
            accepted_recheck_at(now) if to == S.ACCEPTED
            else execute_recheck_at(now) if to == S.NOT_STARTED
            else None
        )
    if to in (S.SUCCEEDED, S.ACCEPTED):
        # The effect is confirmed (or accepted): an earlier lost answer's error is no longer
        # the operation's state, and the page must not show one beside "Succeeded". The
        # attempt and the evidence keep that story.
        values.update(error_code="", error_message="")
    values.update(fields or {})
    condition = Q(id=op.id, status__in=list(sources))
    if extra is not None:
        condition &= extra
    # A caller that read the operation stuck (its lease run out, no answer recorded) has it
    # read again under the lock: what the call did has been unknown since the lease ran out,
    # and a provider event settling it before any sweep is that long a time to reconcile.
    maybe_stuck = (
        op.status == S.IN_PROGRESS and op.lease_expires_at is not None
        and op.lease_expires_at <= now
    )
    with transaction.atomic():
        if len(sources) == 1 and S.UNKNOWN not in sources and not maybe_stuck:
            # A win can only have come from that one status, and every status but unknown
            # keeps unknown_since empty: nothing to read (this is execute's hot path).
            before = {"status": next(iter(sources)), "unknown_since": None,
                      "lease_expires_at": None}
        else:
            # Locked, so the status the evidence records as "from" is the one this UPDATE
            # changed, not one a concurrent transition replaced between the two statements.
            before = (
                Operation.objects.select_for_update()
                .filter(id=op.id)
                .values("status", "unknown_since", "lease_expires_at")
                .first()
            )
        won = Operation.objects.filter(condition).update(**values) == 1
        if not won:
            return False
        payload = dict(data or {})
        if manual:
            # A person's decision on the operation answers the provider events and call
            # answers held for them that they saw: those leave the queue now, and the record
            # says which.
            for manager, shown, name, key in (
                (WebhookEvent.objects, held_shown, "event_id", "reviewed_events"),
                (Attempt.objects, held_answers_shown, "number", "reviewed_answers"),
            ):
                held = manager.held_for_review().filter(operation_id=op.id)
                if shown is not None:
                    # One that arrived while the person was deciding stays for them to see.
                    held = held.filter(id__in=list(shown))
                reviewed = sorted(held.values_list(name, flat=True))
                if reviewed:
                    held.update(reviewed_at=now)
                    payload[key] = reviewed
        unknown_since = before["unknown_since"]
        if unknown_since is None and before["status"] == S.IN_PROGRESS and (
            before["lease_expires_at"] is not None and before["lease_expires_at"] <= now
        ):
            # Stuck: the worker's lease ran out with no answer recorded (a person holds it
            # before any sweep came); what the call did has been unknown since.
            unknown_since = before["lease_expires_at"]
        if unknown_since is not None and to != S.UNKNOWN:
            payload["unknown_seconds"] = round((now - unknown_since).total_seconds(), 3)
        elif before["status"] == S.DISPUTED and to not in (S.UNKNOWN, S.DISPUTED):
            # A hold a person put on an unknown (or stuck) operation: its time to a known
            # outcome runs from when it went unknown, through the hold, to this resolution
            # (else the hardest cases, the ones a person settled, never reach the p95).
            # The hold is the move into disputed: provider events and late answers kept on
            # a disputed operation's timeline (disputed to disputed) carry no sample.
            hold = (
                Evidence.objects.filter(operation_id=op.id, to_status=S.DISPUTED)
                .exclude(from_status=S.DISPUTED)
                .order_by("-id").values("data", "created_at").first()
            )
            if hold and "unknown_seconds" in hold["data"]:
                payload["unknown_seconds"] = round(
                    hold["data"]["unknown_seconds"] + (now - hold["created_at"]).total_seconds(),
                    3,
                )
        Evidence.objects.create(
            operation_id=op.id,
            kind=evidence_kind,
            from_status=before["status"],
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
                before={"status": before["status"]},
                after={
                    "status": to,
                    **{
                        k: v
                        for k, v in (fields or {}).items()
                        if k in {"external_id", "error_code"}
                    },
                    **(audit_facts or {}),
                },
            )
    return True


LOOKUP_STATUS = {
    CallOutcome.SUCCEEDED: S.SUCCEEDED,
    CallOutcome.ACCEPTED: S.ACCEPTED,
    CallOutcome.FAILED: S.FAILED,
}


def lookup_guarded(operation_id: str, read: Callable[[], LookupResult]) -> LookupResult:
    """One adapter read, made outside any transaction. An adapter bug is an inconclusive
    answer, so a true record (or a clear refusal) follows, never a 500."""
    try:
        return read()
    except Exception as exc:
        logger.exception("adapter lookup failed for %s", operation_id)
        return LookupResult(
            outcome=LookupOutcome.INCONCLUSIVE,
            reason=f"lookup raised {type(exc).__name__}",
            retry_after=LOOKUP_RETRY_AFTER, backoff=True,
        )


def _not_the_approved_effect(
    adapter: ProviderAdapter, op_snapshot: OperationSnapshot, facts: dict[str, Any]
) -> str:
    """Why the object the provider reports is not the effect the intent describes (another
    sum, say); empty when nothing it reports contradicts the intent."""
    mismatch = adapter.disagreement(payload=op_snapshot.payload, facts=facts)
    return f"{mismatch}: not the approved effect; a person decides" if mismatch else ""


def lookup_against_intent(
    adapter: ProviderAdapter, op_snapshot: OperationSnapshot, found: LookupResult
) -> LookupResult:
    """A found object that names this operation but is not the effect its intent describes
    settles nothing: inconclusive, for a person, never retried by itself."""
    if found.outcome != LookupOutcome.FOUND:
        return found
    reason = _not_the_approved_effect(adapter, op_snapshot, found.result)
    if not reason:
        return found
    return replace(
        found, outcome=LookupOutcome.INCONCLUSIVE, status=None, retry_after=None, reason=reason
    )


def lookup_in_calls_account(
    op_snapshot: OperationSnapshot, found: LookupResult, *, account: str
) -> LookupResult:
    """An empty answer from one provider account says nothing of calls made in another: the
    API key (or endpoint) changed since they went out, from test to live mode, say, or to
    another company's account. Calling again on that absence would make the effect a second
    time there. Inconclusive, for a person, never retried by itself."""
    elsewhere = sorted(op_snapshot.call_accounts - {account})
    if found.outcome != LookupOutcome.ABSENT or not elsewhere:
        return found
    return replace(
        found, outcome=LookupOutcome.INCONCLUSIVE, retry_after=None,
        reason=f"no effect in provider account {account}, but calls of this operation went "
        f"to {', '.join(elsewhere)} (the API key or endpoint changed since): an empty answer "
        "here proves nothing about them",
    )


def call_against_intent(
    adapter: ProviderAdapter, op_snapshot: OperationSnapshot, result: CallResult
) -> CallResult:
    """The call's own answer, held to the same test as a lookup: a provider that confirms
    another effect than the one approved has not done what was approved, and calling again
    cannot mend that. Unknown, for a person, never retried by itself."""
    if result.outcome not in (CallOutcome.SUCCEEDED, CallOutcome.ACCEPTED):
        return result
    reason = _not_the_approved_effect(adapter, op_snapshot, result.result)
    if not reason:
        return result
    return replace(
        result, outcome=CallOutcome.UNKNOWN, error_class=NOT_THE_APPROVED_EFFECT,
        error_message=reason,
    )


_ATTEMPT_OUTCOME = {
    LookupOutcome.FOUND: AttemptOutcome.FOUND,
    LookupOutcome.ABSENT: AttemptOutcome.ABSENT,
    LookupOutcome.INCONCLUSIVE: AttemptOutcome.INCONCLUSIVE,
}


def lookup_attempt_fields(found: LookupResult, *, finished_at: datetime) -> dict[str, Any]:
    """What a lookup attempt row records of the provider's answer."""
    return {
        "finished_at": finished_at,
        "outcome": _ATTEMPT_OUTCOME[found.outcome],
        "http_status": found.http_status,
        "provider_request_id": found.provider_request_id,
        "external_id": found.external_id,
        "error_message": found.reason[:2000],
    }


def lookup_data(found: LookupResult, *, attempt: int) -> dict[str, Any]:
    """What the evidence of a lookup keeps: what the provider said, and where it said it."""
    return {
        "attempt": attempt,
        "method": found.method or "",
        "reason": found.reason,
        "matches": found.matches[:10],
        "external_id": found.external_id,
        "status": found.status or "",
        "operation_ids": list(found.operation_ids),
        "provider_request_id": found.provider_request_id,
    }


def person_text_check(**texts: str) -> None:
    """A person's words go to the journal and the audit trail, which every viewer of the
    tenant reads: refused when they carry a card number or a secret (the forms say so
    first; this holds for every other caller)."""
    for name, text in texts.items():
        problem = secret_in_text(text)
        if problem:
            raise TransitionRefused(f"{name}: looks like {problem}")


def require_perm(actor: AbstractUser | None, perm: str, op: Operation) -> None:
    if not tenant_perm_held(actor, perm, op.tenant):
        raise PermissionDenied(f"{perm} on {op.tenant.slug} is required")
