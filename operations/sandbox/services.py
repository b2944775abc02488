"""Sandbox writes: faults, objects, the webhooks they raise (sent by `delivery`), the request
log."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from operations.ids import new_id
from operations.sandbox.models import (
    Deal,
    FaultKind,
    IdempotencyRecord,
    Message,
    PaymentIntent,
    Provider,
    SandboxFault,
    SandboxRequest,
    SandboxWebhook,
)
from operations.sandbox.selectors import sandbox_faults_matching
from operations.sandbox.serializers import (
    CARD_DECLINED,
    card_declined_json,
    deal_json,
    message_json,
    payment_intent_json,
)

# A claim this old whose request never finished belongs to a dead process: take it over,
# or the key would answer 409 forever.
IN_FLIGHT_STALE = timedelta(seconds=60)
# Stripe forgets a key after 24 hours; after that the same key makes a new payment.
PAYMENTS_KEY_RETENTION = timedelta(hours=24)
# The mail API forgets a key after 7 days (MailSendAdapter's contract): after that the same
# key sends a second email.
MAIL_KEY_RETENTION = timedelta(days=7)


class SandboxStateError(Exception):
    """The object is not in a state that allows the change."""


class DealExists(SandboxStateError):
    """A deal already carries this agent_operation_id."""

    def __init__(self, deal: Deal) -> None:
        super().__init__(f"deal {deal.id} already carries agent_operation_id "
                         f"{deal.agent_operation_id!r}")
        self.deal = deal


# --- faults -------------------------------------------------------------------------------


# Faults only the payments sandbox carries out, and why: taken for another provider they
# would never fire, or fire as something else, and a test would pass without its failure.
PAYMENTS_ONLY_FAULTS = {
    FaultKind.CARD_DECLINED: "only payments take cards",
    FaultKind.REQUIRES_ACTION: "only payments take cards",
    # The CRM takes no key; the mail API answers a known key with the message it made.
    FaultKind.HTTP_500_KEPT: "only the payments API keeps a request's answer for its key",
    FaultKind.SEARCH_LAG: "only the payments API has a search, which can lag",
    FaultKind.SLOW: "only the payments API holds a key while its request runs",
}


def sandbox_fault_set(
    *, provider: str, kind: str, match: str = "*", times: int = 1, **params: Any
) -> SandboxFault:
    if provider not in Provider.values:
        raise ValueError(f"unknown sandbox provider {provider!r}")
    if kind not in FaultKind.values:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(FaultKind.values)}")
    if times < 1:
        raise ValueError("times must be at least 1")
    limit = SandboxFault._meta.get_field("match").max_length
    if len(match) > limit:
        raise ValueError(
            f"match is an operation id, an Idempotency-Key or '*': at most {limit} characters")
    seconds = params.get("seconds")
    if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
        # Stored, -5 made the sandbox's sleep raise (a bare 500, the fault used up); nan
        # and inf are no JSON the database takes.
        raise ValueError("seconds must be a duration: a finite number, 0 or more")
    if kind in PAYMENTS_ONLY_FAULTS and provider != Provider.PAYMENTS:
        raise ValueError(f"{kind} is a payments fault: {PAYMENTS_ONLY_FAULTS[kind]}")
    return SandboxFault.objects.create(
        provider=provider, kind=kind, match=match or "*", remaining=times, params=params
    )


def sandbox_fault_clear(
    *, provider: str | None = None, kind: str | None = None, match: str | None = None
) -> int:
    faults = SandboxFault.objects.all()
    if provider:
        faults = faults.filter(provider=provider)
    if kind:
        faults = faults.filter(kind=kind)
    if match:
        faults = faults.filter(match=match)
    deleted, _ = faults.delete()
    return deleted


def sandbox_fault_take(
    *, provider: str, kinds: Iterable[str], operation_ids: Iterable[str] = (),
    keys: Iterable[str] = (),
) -> SandboxFault | None:
    """Consume one matching fault; a conditional UPDATE, so two requests never share one."""
    for fault in sandbox_faults_matching(
        provider=provider, kinds=kinds, operation_ids=operation_ids, keys=keys
    ):
        taken = SandboxFault.objects.filter(pk=fault.pk, remaining__gt=0).update(
            remaining=F("remaining") - 1
        )
        if taken:
            return fault
    return None


def fault_seconds(fault: SandboxFault) -> float:
    # Default: just past the client's timeout, so the answer is certainly lost.
    return float(fault.params.get("seconds", float(settings.PROVIDER_TIMEOUT_SECONDS) + 1))


# --- the request log ----------------------------------------------------------------------


def sandbox_request_log(
    *, provider: str, method: str, path: str, idempotency_key: str, operation_id: str,
    params_hash: str, request_id: str,
) -> SandboxRequest:
    """Logged before the work, so a request whose answer is dropped is counted too."""

    def text(value: str, limit: int) -> str:
        # PostgreSQL refuses a NUL byte in text: kept visible instead of raising (a 500).
        return value.replace("\x00", "\\x00")[:limit]

    return SandboxRequest.objects.create(
        provider=provider, method=text(method, 10), path=text(path, 300),
        idempotency_key=text(idempotency_key, 255), operation_id=text(operation_id, 120),
        params_hash=params_hash, request_id=request_id,
    )


def sandbox_request_answered(*, request: SandboxRequest, status: int) -> None:
    SandboxRequest.objects.filter(pk=request.pk).update(response_status=status)


# --- webhooks -----------------------------------------------------------------------------


def sandbox_webhook_record(
    *, provider: str, event_type: str, obj: dict[str, Any], operation_id: str = "",
    extra: dict[str, Any] | None = None,
) -> SandboxWebhook:
    """Joins the caller's transaction: the event exists exactly when the change does."""
    event_id = new_id("evt")
    body = json.dumps({
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created": int(time.time()),
        **(extra or {}),
        "data": {"object": obj},
    }, separators=(",", ":"))
    return SandboxWebhook.objects.create(
        provider=provider, event_id=event_id, type=event_type, operation_id=operation_id,
        body=body,
    )


# --- payments -----------------------------------------------------------------------------


def idempotency_claim(*, key: str, fingerprint: str) -> tuple[IdempotencyRecord, bool]:
    """Insert the claim in its own transaction, before any work; (record, claimed by us)."""
    for _ in range(3):
        now = timezone.now()
        try:
            with transaction.atomic():
                record = IdempotencyRecord.objects.create(
                    key=key, fingerprint=fingerprint, created_at=now
                )
            return record, True
        except IntegrityError:
            pass
        record = IdempotencyRecord.objects.filter(key=key).first()
        if record is None:
            continue  # the other claimant released it a moment ago: claim again
        if record.response_status is not None and record.created_at < now - PAYMENTS_KEY_RETENTION:
            IdempotencyRecord.objects.filter(pk=record.pk, created_at=record.created_at).delete()
            continue
        if (
            record.response_status is None
            and record.fingerprint == fingerprint
            and record.created_at < now - IN_FLIGHT_STALE
        ):
            taken = IdempotencyRecord.objects.filter(
                pk=record.pk, response_status__isnull=True, created_at=record.created_at
            ).update(created_at=now)
            if taken:
                record.created_at = now
                return record, True
        return record, False
    raise SandboxStateError(f"could not claim idempotency key {key!r}")


def idempotency_answer_keep(
    *, key: str, fingerprint: str, status: int, body: dict[str, Any]
) -> bool:
    """Claim a free key with this answer already kept, as Stripe keeps the answer of a
    request that began to run, a 500 included. False when the key is not free: it keeps
    what it holds."""
    record, claimed = idempotency_claim(key=key, fingerprint=fingerprint)
    if claimed:
        IdempotencyRecord.objects.filter(pk=record.pk, response_status__isnull=True).update(
            response_status=status, response_body=body
        )
    return claimed


def idempotency_answer_replace(*, key: str, status: int, body: dict[str, Any]) -> None:
    """The answer a finished request gave in the end (a 500 after its work was saved) is the
    one the key gives every retry."""
    IdempotencyRecord.objects.filter(key=key, response_status__isnull=False).update(
        response_status=status, response_body=body
    )


def idempotency_release(*, record: IdempotencyRecord) -> None:
    # Stripe saves no result when a request failed validation: the key may be used again.
    IdempotencyRecord.objects.filter(pk=record.pk, response_status__isnull=True).delete()


def sandbox_payment_create(
    *, amount: int, currency: str, metadata: dict[str, str], confirm: bool,
    claim: IdempotencyRecord | None = None, declined: bool = False, needs_action: bool = False,
) -> dict[str, Any]:
    """Create the intent, its webhook and the saved idempotent response in one transaction.
    A declined attempt still makes the intent; its key keeps the 402 (card_declined_json).
    `needs_action`: the card asks for 3-D Secure, so the intent waits in `requires_action`
    for a customer to authenticate (sandbox_payment_settle stands in for them)."""
    declined = declined and confirm
    if not confirm:
        status = "requires_confirmation"
    elif declined:
        status = "requires_payment_method"
    elif needs_action:
        status = "requires_action"
    elif amount >= int(settings.SANDBOX_PAYMENTS_ASYNC_FROM_MINOR):
        status = "processing"
    else:
        status = "succeeded"
    with transaction.atomic():
        intent = PaymentIntent.objects.create(
            amount=amount, currency=currency, status=status, metadata=metadata,
            last_payment_error=dict(CARD_DECLINED) if declined else None,
        )
        body = payment_intent_json(intent)
        event = "payment_failed" if declined else status
        if event in {"succeeded", "processing", "payment_failed", "requires_action"}:
            sandbox_webhook_record(
                provider=Provider.PAYMENTS, event_type=f"payment_intent.{event}", obj=body,
                operation_id=metadata.get("operation_id", ""),
            )
        if claim is not None:
            saved = IdempotencyRecord.objects.filter(
                pk=claim.pk, response_status__isnull=True
            ).update(
                response_status=402 if declined else 200,
                response_body=card_declined_json(body) if declined else body,
            )
            if not saved:
                raise SandboxStateError("the idempotency claim was lost; nothing is created")
    return body


def sandbox_payment_settle(
    *, payment_intent_id: str, status: str = "succeeded"
) -> PaymentIntent:
    """Finish a `processing` payment as the bank would, or one in `requires_action` as its
    customer's 3-D Secure answer would, and record the webhook."""
    if status not in {"succeeded", "failed"}:
        raise ValueError("status is 'succeeded' or 'failed'")
    new_status = "succeeded" if status == "succeeded" else "requires_payment_method"
    error = None if status == "succeeded" else {
        "code": "card_declined", "message": "The bank declined the payment."
    }
    with transaction.atomic():
        changed = PaymentIntent.objects.filter(
            pk=payment_intent_id, status__in=["processing", "requires_action"]
        ).update(status=new_status, last_payment_error=error)
        if not changed:
            raise SandboxStateError(f"payment {payment_intent_id} is not pending")
        intent = PaymentIntent.objects.get(pk=payment_intent_id)
        event_type = (
            "payment_intent.succeeded" if status == "succeeded"
            else "payment_intent.payment_failed"
        )
        sandbox_webhook_record(
            provider=Provider.PAYMENTS, event_type=event_type,
            obj=payment_intent_json(intent),
            operation_id=intent.metadata.get("operation_id", ""),
        )
    return intent


def sandbox_settle_due(*, older_than: timedelta) -> dict[str, int]:
    """What a bank and a mail server do in their own time: settle `processing` payments as
    succeeded and deliver `queued` messages, once they are `older_than` (each with its
    webhook). For `make run`'s demo; tests settle by hand."""
    cutoff = timezone.now() - older_than

    def finish(objects: QuerySet, status: str, step) -> int:
        done = 0
        for pk in objects.filter(status=status, created_at__lte=cutoff).values_list(
            "pk", flat=True
        )[:100]:
            try:
                step(pk)
                done += 1
            except SandboxStateError:
                pass  # finished by hand meanwhile
        return done

    return {
        "payments_settled": finish(
            PaymentIntent.objects, "processing",
            lambda pk: sandbox_payment_settle(payment_intent_id=pk),
        ),
        "messages_delivered": finish(
            Message.objects, "queued", lambda pk: sandbox_message_deliver(message_id=pk)
        ),
    }


# --- CRM ----------------------------------------------------------------------------------

DEAL_PATCHABLE = frozenset({"name", "amount_minor", "currency", "owner", "stage"})


def sandbox_deal_create(
    *, name: str, amount_minor: int, currency: str, owner: str, agent_operation_id: str
) -> Deal:
    """`agent_operation_id` is unique through the API, as the CRM contract declares: that is
    what makes a create after a proven absence safe even when an earlier, timed-out request
    is still running. A second create is refused (DealExists).

    Enforced here under an advisory lock rather than by a unique index, because the table
    must still be able to hold the duplicates of a data incident (an import, another
    integration) that the console has to show a person."""
    with transaction.atomic():
        if agent_operation_id:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                    [f"sandbox-deal:{agent_operation_id}"],
                )
            existing = Deal.objects.filter(agent_operation_id=agent_operation_id).first()
            if existing is not None:
                raise DealExists(existing)
        deal = Deal.objects.create(
            name=name, amount_minor=amount_minor, currency=currency, owner=owner,
            agent_operation_id=agent_operation_id,
        )
        sandbox_webhook_record(
            provider=Provider.CRM, event_type="deal.created", obj=deal_json(deal),
            operation_id=agent_operation_id, extra={"operation_id": agent_operation_id},
        )
    return deal


def sandbox_deal_update(
    *, deal: Deal, expected_version: int, patch: dict[str, Any], operation_id: str
) -> tuple[Deal, bool]:
    """(deal, applied), from the deal as the caller read it. Not applied: the version moved
    on; the deal is returned as it is now."""
    if deal.version != expected_version:
        return deal, False
    with transaction.atomic():
        applied = [*deal.applied_operation_ids, operation_id]
        # Every change bumps the version, so a matching version means `applied` is current.
        changed = Deal.objects.filter(pk=deal.pk, version=expected_version).update(
            version=F("version") + 1, applied_operation_ids=applied,
            updated_at=timezone.now(), **patch,
        )
        deal.refresh_from_db()
        if not changed:
            return deal, False
        sandbox_webhook_record(
            provider=Provider.CRM, event_type="deal.updated", obj=deal_json(deal),
            operation_id=operation_id, extra={"operation_id": operation_id},
        )
    return deal, True


# --- mail ---------------------------------------------------------------------------------


def sandbox_message_create(
    *, to: str, template: str, params: dict[str, Any], operation_id: str,
    idempotency_key: str, fingerprint: str,
) -> Message:
    """A known key returns the message it made the first time, for as long as the provider
    keeps keys; past that the key is forgotten (the old message no longer answers a lookup
    by it) and the send makes a new message."""
    if idempotency_key:
        existing = Message.objects.filter(idempotency_key=idempotency_key).first()
        if existing is not None and existing.created_at >= timezone.now() - MAIL_KEY_RETENTION:
            return existing
        if existing is not None:
            Message.objects.filter(pk=existing.pk, idempotency_key=idempotency_key).update(
                idempotency_key=None
            )
    try:
        with transaction.atomic():
            message = Message.objects.create(
                to=to, template=template, params=params, operation_id=operation_id,
                idempotency_key=idempotency_key or None, fingerprint=fingerprint,
            )
        return message
    except IntegrityError:
        # A concurrent request with the same key won the unique constraint.
        return Message.objects.get(idempotency_key=idempotency_key)


def sandbox_message_deliver(*, message_id: str, status: str = "delivered") -> Message:
    if status not in {"delivered", "bounced"}:
        raise ValueError("status is 'delivered' or 'bounced'")
    with transaction.atomic():
        changed = Message.objects.filter(pk=message_id, status="queued").update(status=status)
        if not changed:
            raise SandboxStateError(f"message {message_id} is not queued")
        message = Message.objects.get(pk=message_id)
        sandbox_webhook_record(
            provider=Provider.MAIL, event_type=f"message.{status}", obj=message_json(message),
            operation_id=message.operation_id,
        )
    return message
