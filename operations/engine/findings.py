"""What a reconcile's lookup found, written to the journal: the operation moved toward the
fact the provider reported, or left where it is with the evidence and when to look again."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.db import transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from operations.engine.core import (
    LOOKUP_STATUS,
    SEVERAL_MATCHES,
    S,
    accepted_recheck_at,
    accepted_recheck_wait,
    lookup_attempt_fields,
    lookup_data,
    outcome_open,
    transition,
    unanswered_call_lands_by,
)
from operations.engine.prepare import call_problem
from operations.engine.webhooks import (
    first_object_record,
    first_object_reported,
    provider_report_held,
    webhook_events_decide_kept,
)
from operations.models import (
    Attempt,
    AttemptKind,
    AttemptOutcome,
    Evidence,
    EvidenceKind,
    Operation,
)
from operations.providers.base import (
    EffectClass,
    LookupOutcome,
    LookupResult,
    OperationSnapshot,
    ProviderAdapter,
    ToolContract,
)
from operations.providers.transport import LOOKUP_RETRY_MAX, REPLAYED_5XX


@dataclass(frozen=True)
class ReconcileReport:
    operation_id: str
    outcome: str  # found / absent / inconclusive / stale / nothing_to_do
    status: str
    detail: str = ""
    may_call_again: bool = False
    # False when another fact (an event, a late answer, a person) moved the operation while
    # the lookup was out and the lookup's own write lost: its audit row must not read as the
    # move.
    moved: bool = True


def lookup_record(
    op: Operation,
    op_snapshot: OperationSnapshot,
    attempt: Attempt,
    found: LookupResult,
    *,
    adapter: ProviderAdapter,
    actor: AbstractUser | None,
    calls_before: int,
    looked_up_status: str,
) -> ReconcileReport:
    """Write what a lookup found and move the operation toward it: an object in a known
    state, proven absence, or nothing conclusive. Each outcome is its own function below.
    `looked_up_status` is the status the lookup was made for, read with its snapshot."""
    now = timezone.now()
    Attempt.objects.filter(id=attempt.id).update(**lookup_attempt_fields(found, finished_at=now))
    data = lookup_data(found, attempt=attempt.number)
    op.refresh_from_db()
    found_at = (
        LOOKUP_STATUS[found.status]
        if found.outcome == LookupOutcome.FOUND and found.status in LOOKUP_STATUS else None
    )
    if not outcome_open(op):
        if found_at is not None and _second_effect_found(op, found, to=found_at):
            # An event settled it with another object meanwhile: this one moved money too.
            return _another_object_found(op, attempt, found, to=found_at, data=data,
                                         actor=actor)
        if found_at is not None and _decided_by_a_person(op):
            # A person decided while this lookup was out: what it found may contradict them.
            return _found_after_a_decision(op, attempt, found, to=found_at, data=data,
                                           actor=actor)
        return ReconcileReport(op.id, "nothing_to_do", op.status, "settled meanwhile")
    if found_at is None and (
        op.status != looked_up_status or op.external_id != op_snapshot.external_id
    ):
        return _stale_lookup_record(op, found, looked_up_status=looked_up_status, data=data,
                                    actor=actor)
    if found_at is not None:
        return _found_record(
            op, attempt, found, to=found_at, data=data, actor=actor,
            calls_before=calls_before, now=now,
        )
    if found.outcome == LookupOutcome.ABSENT and op.status == S.UNKNOWN:
        return _absence_record(
            op, attempt, found, contract=adapter.contract, data=data, actor=actor,
            calls_before=calls_before,
        )
    return _inconclusive_record(
        op, op_snapshot, found, contract=adapter.contract, data=data, actor=actor,
        calls_before=calls_before, now=now,
    )


def _stale_lookup_record(
    op: Operation, found: LookupResult, *, looked_up_status: str, data: dict[str, Any],
    actor: AbstractUser | None,
) -> ReconcileReport:
    """Nothing found, by a lookup an event or a late answer overtook: a search made before
    the provider's object was recorded trails the provider's writes (Stripe's search lags),
    so its "absent" says nothing against the object now on record. Kept as evidence; the
    status, and the next check the newer fact scheduled, stand."""
    Evidence.objects.create(
        operation=op, kind=EvidenceKind.LOOKUP, from_status=op.status, to_status=op.status,
        summary=f"lookup made while {looked_up_status} answered "
        f"{found.reason or found.outcome}; overtaken by what was recorded meanwhile, it "
        "changes nothing",
        data=data, actor=actor,
    )
    return ReconcileReport(op.id, "stale", op.status, "overtaken by a newer fact")


def _found_record(
    op: Operation, attempt: Attempt, found: LookupResult, *, to: str, data: dict[str, Any],
    actor: AbstractUser | None, calls_before: int, now: datetime,
) -> ReconcileReport:
    """The provider holds this operation's object, in a state the journal maps to `to`."""
    if _another_object_recorded(op, found):
        return _another_object_found(op, attempt, found, to=to, data=data, actor=actor)
    if to == S.ACCEPTED and found.waits_on:
        return _left_waiting_on_someone_else(
            op, attempt, found, data=data, actor=actor, calls_before=calls_before
        )
    if to == op.status:
        # Still pending at the provider: look again after the usual wait, not at every
        # sweep (a due time left in the past would ask the provider every few seconds).
        noted = _lookup_noted(
            op, calls_before=calls_before,
            summary=f"provider still reports {found.status} for {found.external_id}",
            data=data, actor=actor,
            # Only accepted stays put; status_changed_at is when it became so.
            next_reconcile_at=accepted_recheck_at(now, accepted_since=op.status_changed_at),
            # The provider answers again: any earlier failing lookups are behind us.
            fields={"lookups_failing_since": None},
        )
        if not noted:
            op.refresh_from_db()
            if _decided_by_a_person(op):
                return _found_after_a_decision(op, attempt, found, to=to, data=data,
                                               actor=actor)
        return ReconcileReport(op.id, "found", op.status, "unchanged")
    fields: dict[str, Any] = {
        "external_id": found.external_id or op.external_id,
        "result": found.result or None,
    }
    if to == S.FAILED:
        fields.update(error_code="provider_failed", error_message=found.reason)
    won = _transition_deciding_kept(
        op,
        to=to,
        sources={op.status},
        # A provider event may record its object while this lookup is on its way.
        extra=_no_other_object(found),
        evidence_kind=EvidenceKind.LOOKUP,
        summary=f"provider lookup ({found.method}) found {found.external_id}: {found.status}",
        data=data,
        fields=fields,
        actor=actor,
    )
    op.refresh_from_db()
    if not won and (
        _second_effect_found(op, found, to=to)
        or (outcome_open(op) and _another_object_recorded(op, found))
    ):
        return _another_object_found(op, attempt, found, to=to, data=data, actor=actor)
    if not won and _decided_by_a_person(op):
        # A person decided between the read above and this transition: what the lookup
        # found may contradict them (a payment after they failed it), and dropped here it
        # would let the intent be replaced and paid again.
        return _found_after_a_decision(op, attempt, found, to=to, data=data, actor=actor)
    return ReconcileReport(op.id, "found", op.status, f"found {found.external_id}", moved=won)


def _absence_record(
    op: Operation, attempt: Attempt, found: LookupResult, *, contract: ToolContract,
    data: dict[str, Any], actor: AbstractUser | None, calls_before: int,
) -> ReconcileReport:
    """The provider proved no object exists for an unknown operation: wait while a call may
    still land, close it when no call may follow, or let the same key be sent again."""
    code, problem = call_problem(op)
    newest = _newest_call(op)
    refusal = _refusal(newest)
    # Absent so far is not absent while an earlier call may still reach the provider.
    # Calling again waits only for calls that never got an answer (the provider dedups
    # a repeat); closing (as never done, or as refused), when no call may follow,
    # waits out the calls the client gave up on too.
    closing = bool(problem or refusal)
    lands_by = unanswered_call_lands_by(
        op, late_landing=contract.late_landing if closing else None
    )
    if lands_by is not None and closing:
        # And a call that lands at the end of that window shows in the provider's search
        # only its lag later (the adapter measures the lag from the call, not from
        # then); closing is for good, so the lag as long as it gets in an outage.
        lands_by += contract.search_lag_closing
    # Compared with when the lookup was sent, not when its answer came back: an empty
    # answer says nothing about what landed while it was on its way.
    if lands_by is not None and lands_by > attempt.started_at:
        _lookup_noted(
            op, calls_before=calls_before,
            summary="absent so far, but an earlier call may still land (or not show in "
            f"the provider's search yet) until {lands_by:%H:%M:%S}; next check then",
            data=data, actor=actor,
            next_reconcile_at=lands_by,
        )
        return ReconcileReport(op.id, "inconclusive", op.status, "a call may still land")
    if refusal is not None or problem:
        if refusal is not None:
            # The newest call was refused, and no earlier one landed: the refusal stands.
            to, detail = S.FAILED, "refused"
            why = ("the provider refused the intent: "
                   f"{refusal['error_message'] or refusal['error_class']}")
            fields = {"error_code": refusal["error_class"] or "rejected",
                      "error_message": refusal["error_message"]}
        else:
            to, detail, why = S.CANCELLED, problem, f"not called again: {problem}"
            fields = {"error_code": code, "error_message": problem}
        # An object the provider reported while a call was in flight is one this lookup
        # did not see: held with the closing.
        _transition_deciding_kept(
            op,
            to=to,
            sources={S.UNKNOWN},
            extra=Q(provider_calls=calls_before),
            evidence_kind=EvidenceKind.LOOKUP,
            summary=f"provider lookup ({found.method}) proved no effect exists after "
            f"every call could have landed; {why}",
            data=data,
            fields=fields,
            actor=actor,
        )
        op.refresh_from_db()
        return ReconcileReport(op.id, "absent", op.status, detail)

    # Absence proven by an authoritative lookup makes a new call safe where the provider
    # dedups by key, or where a natural key / expected version turns a duplicate into a
    # refusal instead of a second effect.
    may_call = contract.same_key_retry_safe or contract.effect_class in (
        EffectClass.CREATE_WITH_NATURAL_KEY,
        EffectClass.VERSIONED_UPDATE,
    )
    if may_call and _key_answers_a_kept_error(newest):
        _lookup_noted(
            op, calls_before=calls_before,
            summary="proven absent, but the provider answers this operation's idempotency "
            "key with the 5xx it kept for it: a call with the key cannot succeed, and "
            "only a new intent has a new key; a person decides", data=data, actor=actor,
            next_reconcile_at=None,
        )
        return ReconcileReport(op.id, "absent", op.status, "the key answers a kept error")
    max_calls = settings.OPERATION_MAX_AUTOMATIC_CALLS
    if may_call and op.provider_calls >= max_calls:
        # A provider that fails the same request every time (a 5xx it always gives)
        # would otherwise be called every few seconds until the approval runs out.
        _lookup_noted(
            op, calls_before=calls_before,
            summary=f"proven absent after {op.provider_calls} calls; no more automatic "
            "calls, a person decides", data=data, actor=actor, next_reconcile_at=None,
        )
        return ReconcileReport(op.id, "absent", op.status, "call limit reached")
    if may_call:
        # An object the provider reported while a call was in flight is one this lookup
        # did not see: held with the absence, so the next call's claim refuses (a person
        # looks before a second payment).
        won = _transition_deciding_kept(
            op,
            to=S.NOT_STARTED,
            sources={S.UNKNOWN},
            # Stale if a call was claimed since the lookup began: that call's own answer
            # (or the next lookup) decides, never this older absence.
            extra=Q(provider_calls=calls_before),
            evidence_kind=EvidenceKind.LOOKUP,
            summary=f"provider lookup ({found.method}) proved no effect exists; "
            "may call again with the same key",
            data=data,
            fields={"error_code": "", "error_message": ""},
            actor=actor,
        )
        op.refresh_from_db()
        if not won and not (
            op.status == S.NOT_STARTED and op.provider_calls == calls_before
        ):
            return ReconcileReport(
                op.id, "stale", op.status, "a call was made after this lookup began"
            )
        # Won, or a concurrent reconcile proved the same absence first: either way the
        # call may go again, and the execute's claim lets only one of us make it.
        return ReconcileReport(op.id, "absent", op.status, "proven absent", may_call_again=True)
    _lookup_noted(
        op, calls_before=calls_before,
        summary="proven absent, but the provider's contract does not make a new call "
        "safe; a person decides", data=data, actor=actor, next_reconcile_at=None,
    )
    return ReconcileReport(op.id, "absent", op.status, "a person decides")


def _inconclusive_record(
    op: Operation, op_snapshot: OperationSnapshot, found: LookupResult, *,
    contract: ToolContract, data: dict[str, Any], actor: AbstractUser | None,
    calls_before: int, now: datetime,
) -> ReconcileReport:
    """Inconclusive (or absent while accepted): stay where we are, with everything found."""
    wait = _lookup_retry_wait(op, found, now=now)
    retry_at = now + wait if wait is not None else None
    # Several objects carry the operation: recorded on it until a lookup finds one, or none,
    # or a person decides, so no provider event or late answer settles it with one of them
    # meanwhile (`provider_report_held`). A lookup that fails later leaves that standing.
    incident = (
        {"error_code": SEVERAL_MATCHES, "error_message": found.reason[:2000]}
        if len(found.matches) > 1 else {}
    )
    if op.status == S.ACCEPTED and retry_at is None:
        # The provider can no longer tell us (a key past its retention, say): it is a
        # person's now, in the operators' queue, not an accepted row nobody looks at.
        transition(
            op, to=S.UNKNOWN, sources={S.ACCEPTED},
            extra=Q(provider_calls=calls_before) & _no_other_object(found),
            evidence_kind=EvidenceKind.LOOKUP,
            summary="the final answer can no longer be looked up "
            f"({found.reason or found.outcome}); a person decides",
            data=data, fields={"next_reconcile_at": None, **incident}, actor=actor,
        )
        op.refresh_from_db()
        return ReconcileReport(op.id, "inconclusive", op.status, found.reason)
    if op.status != S.ACCEPTED and contract.key_retention is not None and retry_at is not None:
        # (An accepted effect's failed lookup is tried again, key or not.)
        # The snapshot taken before the lookup: a lookup is not a call, so its calls stand.
        # Aged from the key's first use, as the provider ages it: later calls with the same
        # key do not extend it.
        first_sent = op_snapshot.key_first_sent_at
        kept_until = first_sent + contract.key_retention if first_sent is not None else None
        if kept_until is not None and now + found.retry_after > kept_until:
            retry_at = None  # past the key's retention a retry proves nothing: a person
        elif kept_until is not None:
            # The backoff never skips the last lookup that can still prove something.
            retry_at = min(retry_at, kept_until)
    failing: dict[str, Any] = {}
    if op.status == S.ACCEPTED:
        # Looked up again, but a person must see it if this goes on (a wrong API base or
        # key after a deploy fails every lookup for ever): dated by the first failure, kept
        # by the ones after it, in the same conditional UPDATE as this lookup's schedule.
        failing = {"lookups_failing_since": Coalesce(F("lookups_failing_since"), Value(now))}
    _lookup_noted(
        op, calls_before=calls_before,
        summary=f"lookup inconclusive: {found.reason or found.outcome}"
        + (f"; next check {retry_at:%H:%M:%S}" if retry_at else "; waiting for a person"),
        data=data, actor=actor, next_reconcile_at=retry_at,
        fields={**incident, **failing} or None,
    )
    return ReconcileReport(op.id, "inconclusive", op.status, found.reason)


def _lookup_retry_wait(
    op: Operation, found: LookupResult, *, now: datetime
) -> timedelta | None:
    """How long until a lookup that settled nothing is made again; None: a person decides.
    After a failure, as long as the lookups have been failing (since the operation became
    unknown, or since an accepted one's lookups began to fail), so each wait doubles the
    time failing, from the adapter's own (LOOKUP_RETRY_AFTER, or a provider's longer
    Retry-After) to at most LOOKUP_RETRY_MAX: an outage costs a few lookups an hour per
    operation, not two a minute for as long as it lasts. An accepted effect is never looked
    up more often than while the provider answers (accepted_recheck_wait)."""
    if not found.retry_after:
        return None
    wait = found.retry_after
    if found.backoff:
        since = op.lookups_failing_since if op.status == S.ACCEPTED else op.unknown_since
        failing = now - since if since is not None else timedelta(0)
        wait = max(wait, min(failing, LOOKUP_RETRY_MAX))
    if op.status == S.ACCEPTED:
        wait = max(wait, accepted_recheck_wait(accepted_since=op.status_changed_at, now=now))
    return wait


def _newest_call(op: Operation) -> dict[str, Any] | None:
    """How the newest call ended: what a proven absence still turns on."""
    return (
        op.attempts.filter(kind=AttemptKind.CALL)
        .order_by("-number")
        .values("outcome", "external_id", "error_class", "error_message")
        .first()
    )


def _key_answers_a_kept_error(newest: dict[str, Any] | None) -> bool:
    """Whether the newest call got back a 5xx the provider kept for the key (Stripe keeps
    the answer of a request that began to run, and replays it for as long as it keeps the
    key): calling again with the same key would only fetch it once more."""
    return newest is not None and newest["error_class"] == REPLAYED_5XX


def _refusal(newest: dict[str, Any] | None) -> dict[str, str] | None:
    """The newest call's refusal (a 4xx that named no object at the provider), if that is
    how it ended: what the operation is closed with once no earlier call can land."""
    if (
        newest is None
        or newest["outcome"] != AttemptOutcome.FAILED
        or newest["external_id"]
        or newest["error_class"] == "version_conflict"
    ):
        return None
    return {"error_class": newest["error_class"], "error_message": newest["error_message"]}


def _no_other_object(found: LookupResult) -> Q:
    """The operation records no object, or the one the lookup found."""
    return Q(external_id__in=["", found.external_id]) if found.external_id else Q()


def _another_object_recorded(op: Operation, found: LookupResult) -> bool:
    return bool(found.external_id and op.external_id and op.external_id != found.external_id)


def _decided_by_a_person(op: Operation) -> bool:
    """Settled by a person's resolution, or on hold by their dispute (`op` as just read)."""
    return not outcome_open(op) and (op.resolved_manually or op.status == S.DISPUTED)


def _second_effect_found(op: Operation, found: LookupResult, *, to: str) -> bool:
    """Another object than the recorded one, that moved money or is moving it: a second
    effect of one intent, whatever the operation's status now."""
    return _another_object_recorded(op, found) and to in (S.SUCCEEDED, S.ACCEPTED)


def _another_object_found(
    op: Operation, attempt: Attempt, found: LookupResult, *, to: str, data: dict[str, Any],
    actor: AbstractUser | None,
) -> ReconcileReport:
    """The lookup (a search, which began before the operation knew its object) found another
    object than the one a provider event recorded meanwhile. Never put in its place: if the
    found one moved money too, one intent has two effects, held for a person as the same
    report by webhook is, so nothing calls again or replaces the intent until they decide;
    if not, the recorded object is what the next lookup follows, by its id."""
    with transaction.atomic():
        locked = Operation.objects.select_for_update(of=("self",)).get(id=op.id)
        why = provider_report_held(locked, external_id=found.external_id, target=to, mismatch="")
        seen = (
            f"provider lookup ({found.method}) found {found.external_id}: {found.status}, "
            f"not {locked.external_id}, which the operation records"
        )
        if why:
            Attempt.objects.filter(id=attempt.id).update(needs_review=True, review_note=why[:500])
            summary = f"{seen}; held for review: {why}"
        else:
            summary = f"{seen}; the next lookup follows {locked.external_id}"
        Evidence.objects.create(
            operation=locked, kind=EvidenceKind.LOOKUP, from_status=locked.status,
            to_status=locked.status, summary=summary, data=data, actor=actor,
        )
    op.refresh_from_db()
    return ReconcileReport(
        op.id, "found", op.status,
        f"found {found.external_id}, not the recorded {op.external_id}", moved=False,
    )


def _found_after_a_decision(
    op: Operation, attempt: Attempt, found: LookupResult, *, to: str, data: dict[str, Any],
    actor: AbstractUser | None,
) -> ReconcileReport:
    """The lookup found the operation's object in a state that a person's resolution or hold,
    made while the lookup was out, may contradict (a decline read after they resolved it as
    succeeded): held for that person as the same report by event or late answer is, or with
    its event lost nobody would learn it. One that agrees with them changes no status; it
    may give a success settled on words alone its object."""
    with transaction.atomic():
        locked = Operation.objects.select_for_update(of=("self",)).get(id=op.id)
        why = provider_report_held(locked, external_id=found.external_id, target=to, mismatch="")
        if not why:
            # Resolved as succeeded on a person's words, and this is the payment they meant:
            # recorded as the operation's object, as a provider event about it is.
            if first_object_reported(locked, external_id=found.external_id, target=to) and (
                first_object_record(locked, external_id=found.external_id)
            ):
                Evidence.objects.create(
                    operation=locked, kind=EvidenceKind.LOOKUP, from_status=locked.status,
                    to_status=locked.status, data=data, actor=actor,
                    summary=f"provider lookup ({found.method}) found {found.external_id}: "
                    f"{found.status}, agreeing with a person's decision; it records "
                    f"{found.external_id} as its object",
                )
            return ReconcileReport(op.id, "nothing_to_do", locked.status, "settled meanwhile",
                                   moved=False)
        Attempt.objects.filter(id=attempt.id).update(needs_review=True, review_note=why[:500])
        Evidence.objects.create(
            operation=locked, kind=EvidenceKind.LOOKUP, from_status=locked.status,
            to_status=locked.status, data=data, actor=actor,
            summary=f"provider lookup ({found.method}) found {found.external_id}: "
            f"{found.status}, after a person's decision; held for review: {why}",
        )
    return ReconcileReport(op.id, "found", locked.status, f"held for review: {why}",
                           moved=False)


def _transition_deciding_kept(op: Operation, **transition_args: Any) -> bool:
    """A lookup's transition, with the events kept while a call was in flight decided in its
    transaction (`webhook_events_decide_kept`): an agent that sees the outcome sees them held
    with it (a closed intent may be replaced, an absent one called again)."""
    with transaction.atomic():
        won = transition(op, **transition_args)
        if won:
            webhook_events_decide_kept(op_id=op.id)
    return won


def _left_waiting_on_someone_else(
    op: Operation, attempt: Attempt, found: LookupResult, *, data: dict[str, Any],
    actor: AbstractUser | None, calls_before: int,
) -> ReconcileReport:
    """Taken by the provider, and pending on someone the console cannot reach (a customer's
    3-D Secure): no lookup will settle it, so it goes to the operators' queue (an unknown one
    stays there) with the provider's id, where a webhook may still settle it."""
    summary = (
        f"provider lookup ({found.method}) found {found.external_id}, still pending: "
        f"{found.waits_on}; a person decides"
    )
    fields = {
        "external_id": found.external_id or op.external_id,
        "error_code": "outside_action", "error_message": found.waits_on,
        "next_reconcile_at": None,
    }
    if op.status == S.ACCEPTED:
        transition(
            op, to=S.UNKNOWN, sources={S.ACCEPTED},
            extra=Q(provider_calls=calls_before) & _no_other_object(found),
            evidence_kind=EvidenceKind.LOOKUP, summary=summary, data=data, fields=fields,
            actor=actor,
        )
    else:
        _lookup_noted(
            op, calls_before=calls_before, summary=summary, data=data, actor=actor,
            next_reconcile_at=None, fields=fields,
        )
    op.refresh_from_db()
    if _another_object_recorded(op, found):
        # An event recorded another payment after this lookup's read: the write above kept
        # off it, and the one found, under way too, is a second effect.
        return _another_object_found(op, attempt, found, to=S.ACCEPTED, data=data, actor=actor)
    if _decided_by_a_person(op):
        # A person failed or held it while this lookup was out: a payment still under way
        # is for them to see, not dropped with the write that lost.
        return _found_after_a_decision(op, attempt, found, to=S.ACCEPTED, data=data,
                                       actor=actor)
    if found.external_id and op.external_id == found.external_id:
        # Events kept while a call was in flight, now that its object is known (its
        # customer's answer, reported meanwhile, settles it here).
        with transaction.atomic():
            webhook_events_decide_kept(op_id=op.id)
        op.refresh_from_db()
    return ReconcileReport(op.id, "found", op.status, "waits on someone outside the console")


def _lookup_noted(
    op: Operation, *, calls_before: int, summary: str, data: dict[str, Any],
    actor: AbstractUser | None, next_reconcile_at: datetime | None,
    fields: dict[str, Any] | None = None,
) -> bool:
    """A lookup that leaves the status where it is: its evidence, and when to look again
    (and `fields` it found out), in one transaction. The schedule only while the status is
    still the one looked up and no call was made since the lookup began: that call's own
    schedule stands. False when it did not (the operation moved on meanwhile)."""
    with transaction.atomic():
        found_object = (fields or {}).get("external_id")
        noted = Operation.objects.filter(
            # Nor another object than the one found, recorded by an event meanwhile.
            Q(external_id__in=["", found_object]) if found_object else Q(),
            id=op.id, status=op.status, provider_calls=calls_before,
        ).update(**{**(fields or {}), "next_reconcile_at": next_reconcile_at}) == 1
        # Moved on meanwhile: the evidence says the status it stands beside.
        status = op.status if noted else (
            Operation.objects.values_list("status", flat=True).get(id=op.id))
        Evidence.objects.create(
            operation=op, kind=EvidenceKind.LOOKUP, from_status=status,
            to_status=status, summary=summary, data=data, actor=actor,
        )
    return noted
