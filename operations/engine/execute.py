"""Execute: claim with a lease, check the authorization, call once, record what came back."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, Q
from django.utils import timezone

from operations.engine import core
from operations.engine.core import (
    S,
    held_reports,
    lease_duration,
    lease_expired,
    logger,
    next_attempt_number,
    person_text_check,
    snapshot,
    transition,
    unanswered_call_lands_by,
    worker_name,
)
from operations.engine.late_answers import (
    late_answer_decide,
    webhook_events_hold_another_object,
)
from operations.engine.prepare import call_problem
from operations.engine.reconcile import operation_reconcile
from operations.engine.webhooks import (
    webhook_events_decide_kept,
    webhook_events_kept_exist,
)
from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    Evidence,
    EvidenceKind,
    Operation,
    nothing_held_for_review,
)
from operations.policy import policy_version_current
from operations.providers.base import (
    CallOutcome,
    CallResult,
    ProviderAdapter,
)
from operations.providers.transport import LeaseLost, credentials_marked, send_deadline
from operations.services import audit_event_record


@dataclass(frozen=True)
class ExecuteReport:
    operation_id: str
    outcome: str  # called / already_succeeded / held_elsewhere / awaiting_authorization / …
    status: str
    detail: str = ""


def operation_execute(*, operation_id: str, worker: str = "", reason: str = "") -> ExecuteReport:
    """Run the approved intent at most once, in the resume order of the design brief.
    `reason`: a person asked for this run outside the queue (the command line); the audit
    trail then says who and why: in the claim's own transaction when it makes a call (so a
    run interrupted mid-call is on it), else with what the request moved, once it is done."""
    if not reason:
        return _operation_execute(operation_id=operation_id, worker=worker)
    person_text_check(reason=reason)
    op = Operation.objects.select_related("tenant").get(id=operation_id)
    asked = _Asked(reason=reason, status=op.status)
    report = _operation_execute(operation_id=op.id, worker=worker, asked=asked)
    if not asked.recorded:
        _asked_record(op, asked, after={
            "status": report.status, "outcome": report.outcome, "detail": report.detail})
    return report


@dataclass
class _Asked:
    """A person's request to run an operation now, until its audit row is written."""

    reason: str
    status: str
    recorded: bool = False


def _asked_record(op: Operation, asked: _Asked, *, after: dict[str, Any]) -> None:
    audit_event_record(
        actor=None, action="operation.execute", tenant=op.tenant, object_type="operation",
        object_id=op.id, reason=asked.reason, before={"status": asked.status}, after=after,
    )
    asked.recorded = True


def _operation_execute(
    *, operation_id: str, worker: str, asked: _Asked | None = None
) -> ExecuteReport:
    worker = worker or worker_name()
    op = Operation.objects.select_related("tenant", "run").get(id=operation_id)

    if op.status == S.SUCCEEDED:
        return ExecuteReport(op.id, "already_succeeded", op.status, "stored result returned")
    if op.status in (S.FAILED, S.CANCELLED, S.DISPUTED, S.ACCEPTED):
        return ExecuteReport(op.id, "nothing_to_do", op.status)

    if op.status == S.UNKNOWN or lease_expired(op):
        # Never call after an unknown outcome without asking the provider first.
        report = operation_reconcile(operation_id=op.id)
        op.refresh_from_db()
        if op.status != S.NOT_STARTED:
            return ExecuteReport(op.id, "reconciled", op.status, report.detail)
    elif op.status == S.IN_PROGRESS:
        return ExecuteReport(op.id, "held_elsewhere", op.status, f"leased by {op.lease_owner}")

    # The run's mode was checked at prepare; checked again here, as the launcher's
    # permission or the provider's endpoint may have changed since.
    code, problem = call_problem(op)
    if problem == "missing":
        return ExecuteReport(op.id, "awaiting_authorization", op.status)
    if problem and op.provider_calls:
        # Calls were made (a lookup proved them absent), and one the client gave up on may
        # still be carried out: not closed as never done until a later lookup confirms it.
        lands_by = unanswered_call_lands_by(
            op, late_landing=core.adapter(op.action).contract.late_landing
        )
        now = timezone.now()
        recheck = now + timedelta(seconds=settings.RECONCILE_DELAY_SECONDS)
        confirming = transition(
            op,
            to=S.UNKNOWN,
            sources={S.NOT_STARTED},
            evidence_kind=EvidenceKind.AUTHORIZATION,
            summary=f"not called again: {problem}; a lookup confirms no earlier call landed "
            "before it is closed",
            data={"problem": problem, "calls": op.provider_calls},
            fields={
                "error_code": code, "error_message": problem,
                "next_reconcile_at": max(recheck, lands_by) if lands_by else recheck,
            },
        )
        op.refresh_from_db()
        if not confirming:
            return ExecuteReport(op.id, "lost_claim", op.status, "moved on meanwhile")
        return ExecuteReport(op.id, "confirming_absence", op.status, problem)
    if problem:
        cancelled = transition(
            op,
            to=S.CANCELLED,
            sources={S.NOT_STARTED},
            # Never called: the read above may be older than another worker's call (which
            # a lookup proved absent so far, and which may still land). Then this loses, and
            # the next delivery confirms that no call landed before closing it.
            extra=Q(provider_calls=0),
            evidence_kind=EvidenceKind.AUTHORIZATION,
            summary=f"not executed: {problem}",
            data={"problem": problem},
            fields={"error_code": code, "error_message": problem},
        )
        op.refresh_from_db()
        if not cancelled:  # another worker claimed (or cancelled) it first
            return ExecuteReport(op.id, "lost_claim", op.status, "moved on meanwhile")
        return ExecuteReport(op.id, "cancelled", op.status, problem)

    adapter = core.adapter(op.action)
    account = adapter.account()
    elsewhere = _accounts_called_besides(op, account) if op.provider_calls else []
    if elsewhere:
        # A lookup proved absence in the account the earlier calls went to, and the key
        # dedups a repeat only there: sent now to another account (the API key or endpoint
        # changed since), the call is a new effect, and a given-up earlier call may still
        # land in the first one. Neither account's silence settles that: a person decides.
        why = (
            f"calls of this operation went to provider account {', '.join(elsewhere)}, and "
            f"requests now go to {account} (the API key or endpoint changed since), where "
            "its key dedups nothing"
        )
        return _left_to_a_person(
            op, code="provider_account", why=why,
            data={"calls": op.provider_calls, "call_accounts": elsewhere, "account": account},
        )

    with transaction.atomic():
        # The row lock first, then the claim in a statement of its own: a provider event
        # delivery holds an event for review under this lock, writing the event, not this
        # row. Alone, the claim would read the held events as of its start, wait for that
        # delivery, re-check only this row, and call on top of the effect just held (a
        # second payment). Started after the lock, it reads what the delivery held.
        Operation.objects.select_for_update().filter(id=op.id).values_list("id").first()
        # The claim's moment is read once the lock is ours: read before it, an approval
        # that ran out while this waited for the row would still pass the claim (and the
        # lease would start back then).
        now = timezone.now()
        lease_expires_at = now + lease_duration()
        # The claim re-checks the authorization in the same statement, so an approval that
        # expires between the read above and here cannot slip through.
        claimed = Operation.objects.filter(
            id=op.id,
            status=S.NOT_STARTED,
            authorized_hash=F("payload_hash"),
            authorization_expires_at__gt=now,
            authorized_policy_version=policy_version_current(op.action),
            # No call was made since the read above: the accounts checked against are all
            # the calls there are (a worker stalled across another's call, its lookup and a
            # key change would otherwise send to the new account unchecked).
            provider_calls=op.provider_calls,
        ).filter(
            # The provider reported an effect of this operation that a person has not looked
            # at yet (made outside the console with its id, or a call a lookup proved absent
            # landing after all): a call now could be the second one.
            nothing_held_for_review()
        ).update(
            status=S.IN_PROGRESS,
            status_changed_at=now,
            lease_owner=worker,
            lease_expires_at=lease_expires_at,
            provider_calls=F("provider_calls") + 1,
            unknown_since=None,
            next_reconcile_at=None,
        )
        if claimed != 1:
            op.refresh_from_db()
            held = held_reports(op.id)
            named = held.names()
            if named and op.status == S.NOT_STARTED:
                return _left_to_a_person(
                    op, code="held_for_review",
                    data={"held_events": held.events, "held_answers": held.answers},
                    why=f"the provider reported an effect of this operation ({', '.join(named)}) "
                    "that is held for review",
                )
            return ExecuteReport(op.id, "lost_claim", op.status, "another worker claimed it first")
        number = next_attempt_number(op.id)
        # The claim first, then the call it starts: the timeline orders by these times.
        Evidence.objects.create(
            operation_id=op.id,
            kind=EvidenceKind.TRANSITION,
            from_status=S.NOT_STARTED,
            to_status=S.IN_PROGRESS,
            summary=f"claimed by {worker}; calling the provider",
            data={"attempt": number, "idempotency_key": op.idempotency_key},
        )
        attempt = Attempt.objects.create(
            operation_id=op.id,
            number=number,
            kind=AttemptKind.CALL,
            worker=worker,
            idempotency_key=op.idempotency_key,
            provider_account=account,
            reach_until=core.call_reach_until(lease_expires_at),
        )
        if asked is not None:
            _asked_record(op, asked, after={"status": S.IN_PROGRESS, "call": number})

    # The attempt just created is the newest call: no need to read it back.
    op_snapshot = snapshot(op, last_call=attempt)
    # The claim checked the approval at its own moment only: a worker that stalls after it
    # (a GC pause, a frozen container) must not send on an approval that ran out meanwhile,
    # even with time left on its lease. (Read with the op above, checked there: it is set.)
    send_by = min(lease_expires_at, op.authorization_expires_at)
    deadline = send_deadline.set(send_by)
    try:
        result = adapter.call(op_snapshot)
    except LeaseLost as exc:
        # Stalled past our lease (the sweep may have taken the operation over) or past the
        # approval. Nothing was sent (the error class says so to whoever counts calls that
        # may still land); recorded as unknown, so a lookup, not this worker, decides what
        # comes next: with the approval run out, it closes the operation as never done.
        why = (
            str(exc) if send_by == lease_expires_at
            else f"the authorization ran out at {send_by:%H:%M:%S}; nothing sent"
        )
        result = CallResult(outcome=CallOutcome.UNKNOWN, error_class="lease_lost",
                            error_message=why)
    except Exception as exc:  # noqa: BLE001 - an adapter bug must still leave a true record
        logger.exception("adapter call failed for %s", op.id)
        result = CallResult(
            outcome=CallOutcome.UNKNOWN, error_class=type(exc).__name__,
            error_message=credentials_marked(str(exc)),
        )
    finally:
        send_deadline.reset(deadline)
    result = core.call_against_intent(adapter, op_snapshot, result)
    return _record_call_result(op, attempt, result, worker=worker, adapter=adapter)


def _left_to_a_person(op: Operation, *, code: str, why: str, data: dict[str, Any]) -> ExecuteReport:
    """Not called: unknown, with nothing scheduled, in the operators' queue."""
    left = transition(
        op,
        to=S.UNKNOWN,
        sources={S.NOT_STARTED},
        extra=Q(provider_calls=op.provider_calls),
        evidence_kind=EvidenceKind.TRANSITION,
        summary=f"not called: {why}; a person decides",
        data=data,
        fields={"error_code": code, "error_message": why, "next_reconcile_at": None},
    )
    op.refresh_from_db()
    if not left:
        return ExecuteReport(op.id, "lost_claim", op.status, "moved on meanwhile")
    return ExecuteReport(op.id, code, op.status, why)


def _accounts_called_besides(op: Operation, account: str) -> list[str]:
    """The provider accounts this operation's calls went to other than `account` (not the
    calls that reached none; a call recorded before accounts were kept may have gone to any)."""
    calls = Attempt.objects.filter(operation_id=op.id, kind=AttemptKind.CALL).values_list(
        "provider_account", "error_class")
    called = {core.call_account(provider_account=provider_account, error_class=error_class)
              for provider_account, error_class in calls}
    return sorted(called - {None, account})


def _records_no_other_object(external_id: str) -> Q:
    """For a filter on the operation: it records no object, or `external_id`. An answer
    that named none (a refusal: nothing made) says nothing about an object a lookup or an
    event recorded meanwhile, so it matches only an operation that records none."""
    return Q(external_id__in=["", external_id]) if external_id else Q(external_id="")


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
        ids: dict[str, str] = {}
        # An object that is not the approved effect is not this operation's (the attempt
        # row above names it for the person who decides).
        if result.external_id and result.error_class != core.NOT_THE_APPROVED_EFFECT:
            ids["external_id"] = result.external_id
        if result.provider_request_id:
            ids["provider_request_id"] = result.provider_request_id
        if ids:
            # Not over what an operator settled meanwhile (their provider reference stays),
            # nor over another object recorded since our lease ran out (an event or a lookup
            # named it): two objects then carry the operation, and the one it records
            # decided its status. Nor while a lookup since found several objects carrying
            # it: recorded, ours would be the one every later lookup reads by its id, picked
            # without the person it is left to. The attempt row above keeps these ids
            # either way.
            recorded = Operation.objects.filter(id=op.id, resolved_manually=False).filter(
                _records_no_other_object(ids.get("external_id", ""))
            ).exclude(error_code=core.SEVERAL_MATCHES).update(**ids)
            if not recorded and "external_id" in ids:
                webhook_events_hold_another_object(op, ours=ids["external_id"])
        # Events that arrived while this call was in flight, kept until its answer named the
        # object (read after the row lock above: a later one sees the object recorded).
        kept = "external_id" in ids and webhook_events_kept_exist(op_id=op.id)

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
        if not result.external_id:
            # A refusal that names no object proves only that this request did nothing. An
            # earlier call of this operation that our client gave up on (a lookup proved it
            # absent so far, and this one went with the same key) may still be carried out:
            # closed as failed now, it would land unseen, and a replacing intent with a new
            # key would pay twice. Unknown, until a lookup after it could land says which.
            lands_by = unanswered_call_lands_by(
                op, late_landing=adapter.contract.late_landing
            )
            if lands_by is not None:
                to = S.UNKNOWN
                fields["next_reconcile_at"] = now + timedelta(
                    seconds=settings.RECONCILE_DELAY_SECONDS
                )
                summary += (
                    "; an earlier call may still land (until "
                    f"{lands_by:%H:%M:%S}): looked up before it is closed as failed"
                )
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
        # A lost answer is checked again soon; a key reused with other parameters, or an
        # answer confirming another effect, is not something a lookup can settle: a person.
        retry = (
            result.error_class not in ("idempotency_error", core.NOT_THE_APPROVED_EFFECT)
            and adapter.contract.autonomous
        )
        fields = {
            "error_code": result.error_class or "unknown",
            "error_message": result.error_message,
            "next_reconcile_at": now
            + timedelta(seconds=settings.RECONCILE_DELAY_SECONDS)
            if retry
            else None,
        }
        summary = (
            f"the provider answered {result.error_message}"
            if result.error_class == core.NOT_THE_APPROVED_EFFECT
            else f"no reliable answer ({result.error_class or 'unknown'}); "
            "reconcile before any new call"
        )

    # With kept events, they are decided in the outcome's transaction: an agent that sees
    # the operation failed sees a second payment held with it (a failed intent may be
    # replaced). Without, no savepoint for the transitions' own transactions. A refusal that
    # names no object closes the operation too: what was kept while it was in flight is
    # looked for under the row lock its transition takes (a later event sees it failed).
    closes_unnamed = to == S.FAILED and "external_id" not in ids
    with transaction.atomic() if kept or closes_unnamed else nullcontext():
        won = transition(
            op,
            to=to,
            sources={S.IN_PROGRESS},
            extra=Q(lease_owner=worker) & _records_no_other_object(result.external_id),
            evidence_kind=EvidenceKind.CALL_RESULT,
            summary=summary,
            data=data,
            fields=fields,
        )
        if not won and to != S.UNKNOWN:
            # Our lease ran out while the call was in flight. The answer describes the object
            # as our call left it: older than anything a lookup or an event found about it
            # since (neither finds it before the call has made it). So it lands over the
            # unknown the lease's expiry set, which knows nothing newer (a lookup that found
            # nothing conclusive leaves its code), never over what a lookup or an event
            # learned: a payment found under way or waiting on its customer may have been
            # confirmed again after our decline (closed as failed, its intent could be
            # replaced and paid twice), and which of several objects found carrying the
            # operation is ours is a person's call. Those go to `late_answer_decide`. A
            # success still lands over its own object found under way: a payment that
            # succeeded stays so whichever was read first, and a succeeded operation is
            # never replaced.
            late = Q(status=S.UNKNOWN, error_code=core.LEASE_EXPIRED)
            if to == S.SUCCEEDED:
                late |= Q(status=S.ACCEPTED)
            newer_call = Attempt.objects.filter(
                operation_id=op.id, kind=AttemptKind.CALL, number__gt=attempt.number
            )
            won = transition(
                op,
                to=to,
                sources={S.UNKNOWN, S.ACCEPTED} if to == S.SUCCEEDED else {S.UNKNOWN},
                # Only while no newer call was made: its answer (or a lookup) outranks ours.
                extra=late & Q(resolved_manually=False) & ~Exists(newer_call)
                & _records_no_other_object(result.external_id),
                evidence_kind=EvidenceKind.CALL_RESULT,
                summary=summary + " (answer arrived late)",
                data=data,
                fields=fields,
            )
        decided = kept or (closes_unnamed and won)
        if decided:
            webhook_events_decide_kept(op_id=op.id)
    if not won and result.external_id and (
        to != S.UNKNOWN or result.error_class == core.NOT_THE_APPROVED_EFFECT
    ):
        late_answer_decide(op, attempt, result, reported=to, worker=worker)
    if won and not decided:
        # The conditional UPDATE that won set exactly this status; no need to read it back.
        return ExecuteReport(op.id, "called", to, summary)
    op.refresh_from_db()
    return ExecuteReport(op.id, "called", op.status, summary)
