"""CRM deals: create carrying `agent_operation_id`, find by it, update with an expected version."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from django.conf import settings

from operations.providers.base import (
    CallOutcome,
    CallResult,
    EffectClass,
    LookupMethod,
    LookupOutcome,
    LookupResult,
    OperationSnapshot,
    ToolContract,
    WebhookFacts,
)
from operations.providers.signing import (
    event_operation_id,
    header_get,
    hmac_signature_verify,
    signed_event_parse,
)
from operations.providers.transport import (
    Answer,
    absence_once_named,
    account_fingerprint,
    call_result,
    carried_ids,
    listed,
    lookup_by_id,
    lookup_common,
    lookup_failure,
    path_segment,
    send,
)

# The CRM contract's sizes of a deal's text fields (the sandbox's columns are these): a
# longer one is refused with a 400, after a person approved it if not checked before.
DEAL_TEXT_MAX_LENGTHS = {"name": 200, "owner": 150, "stage": 40}


# The event types the CRM contract sends: each reports a deal made or changed. Any other
# (a deal deleted, a type the contract does not know) reports no outcome of an operation:
# stored and on its timeline, nothing moved, as the payments and mail events do.
EVENT_STATUS: dict[str, CallOutcome] = {
    "deal.created": CallOutcome.SUCCEEDED,
    "deal.updated": CallOutcome.SUCCEEDED,
}


def _deal_text_problem(fields: Mapping[str, Any], *, action: str, prefix: str = "") -> str:
    for name, limit in DEAL_TEXT_MAX_LENGTHS.items():
        if len(str(fields.get(name, ""))) > limit:
            return (f"{action}: {prefix}{name} is longer than {limit} characters, the most "
                    "the CRM keeps")
    return ""


def _base() -> str:
    return settings.CRM_API_BASE.rstrip("/")


def _account() -> str:
    return account_fingerprint(settings.CRM_API_BASE, settings.CRM_API_KEY)


def _deal_facts(deal: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: deal.get(key)
        for key in ("id", "name", "amount_minor", "currency", "owner", "stage", "version")
    }


def _applied_ids(deal: Mapping[str, Any]) -> list[str]:
    """The CRM's record of which operations a deal's changes came from."""
    applied = deal.get("applied_operation_ids")
    return [str(op_id) for op_id in applied] if isinstance(applied, list) else []


def _applied(op: OperationSnapshot, deal: Mapping[str, Any]) -> bool:
    return op.id in _applied_ids(deal)


def _deal_retrieve(
    deal_id: str, *, carried: Callable[[Mapping[str, Any]], Iterable[str]]
) -> LookupResult:
    """The deal with this id; `carried` reads which operations it names as its origin."""

    def found(deal: Mapping[str, Any]) -> dict[str, Any]:
        facts = _deal_facts(deal)
        return {
            "status": CallOutcome.SUCCEEDED, "external_id": deal_id,
            "matches": [facts], "result": facts, "operation_ids": carried_ids(*carried(deal)),
        }

    return lookup_by_id(
        f"{_base()}/deals/{path_segment(deal_id)}", object_id=deal_id,
        api_key=settings.CRM_API_KEY, what=f"deal {deal_id}", found=found,
    )


def _call_result(
    answer: Answer, body: Mapping[str, Any], *, lacks: Callable[[Mapping[str, Any]], str]
) -> CallResult:
    # The CRM answers a create or an update with the deal as it now is: only that deal,
    # carrying this operation, shows the change made.
    result = call_result(
        answer, sent=body, outcome=lambda _: CallOutcome.SUCCEEDED, facts=_deal_facts,
        lacks=lacks,
    )
    existing = answer.error.get("existing_id") if result.error_class == "already_exists" else ""
    if isinstance(existing, str) and existing:
        # Refused as a second deal for this agent_operation_id, naming the deal that has it:
        # one an earlier call of ours made. It is this call's object, so the engine records
        # it and the deal's absence later (deleted in the CRM) proves nothing: a create on
        # it would be a second deal.
        return replace(result, external_id=existing)
    return result


class CrmCreateDealAdapter:
    contract = ToolContract(
        provider="crm",
        effect_class=EffectClass.CREATE_WITH_NATURAL_KEY,
        synchronous=True,
        lookup_methods=(LookupMethod.UNIQUE_FIELD,),
        key_retention=None,
        # The CRM takes no idempotency key: a blind resend can make a second deal.
        same_key_retry_safe=False,
        dedup_method="agent_operation_id, unique at the CRM (a second create is refused) "
        "+ list deals by it",
    )

    def endpoint(self) -> str:
        return _base()

    def account(self) -> str:
        return _account()

    def call(self, op: OperationSnapshot) -> CallResult:
        payload = op.payload
        body = {
            "name": payload["name"],
            "amount_minor": int(payload["amount_minor"]),
            "currency": str(payload["currency"]).upper(),
            "owner": payload.get("owner", ""),
            "agent_operation_id": op.id,
        }
        answer = send("POST", f"{_base()}/deals", api_key=settings.CRM_API_KEY, json=body)

        def lacks(deal: Mapping[str, Any]) -> str:
            if deal.get("id") and deal.get("agent_operation_id") == op.id:
                return ""
            return f"a deal carrying agent_operation_id {op.id}"

        return _call_result(answer, body, lacks=lacks)

    def lookup(self, op: OperationSnapshot) -> LookupResult:
        method = LookupMethod.UNIQUE_FIELD
        answer = send(
            "GET", f"{_base()}/deals", api_key=settings.CRM_API_KEY,
            params={"agent_operation_id": op.id},
        )
        if not answer.ok:
            return lookup_failure(answer, method=method)
        common = lookup_common(answer, method=method)
        listing, unexpected = listed(
            answer, method=method, what="deals carrying this agent_operation_id",
            belongs=lambda deal: deal.get("agent_operation_id") == op.id,
        )
        if unexpected:
            return unexpected
        deals = [_deal_facts(deal) for deal in listing]
        if not deals:
            # The CRM is strongly consistent: an empty answer is a proof, unless the CRM has
            # named our deal before (deleted since: a new one would be a second deal).
            return absence_once_named(
                LookupResult(outcome=LookupOutcome.ABSENT,
                             reason="no deal carries this agent_operation_id", **common),
                external_id=op.external_id,
            )
        if len(deals) > 1:
            # No retry_after: waiting will not make duplicates go away; a person decides.
            return LookupResult(
                outcome=LookupOutcome.INCONCLUSIVE, matches=deals,
                reason=f"data incident: {len(deals)} deals carry agent_operation_id", **common,
            )
        return LookupResult(
            outcome=LookupOutcome.FOUND, status=CallOutcome.SUCCEEDED,
            external_id=str(deals[0]["id"]), matches=deals, result=deals[0], **common,
        )

    def intent_problem(self, payload: Mapping[str, Any]) -> str:
        return _deal_text_problem(payload, action="crm.create_deal")

    def disagreement(self, *, payload: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
        # A deal is people's to edit in the CRM after it was created (its name, amount and
        # owner): a deal that differs from the intent proves nothing against it.
        return ""

    def retrieve(self, external_id: str) -> LookupResult:
        return _deal_retrieve(external_id, carried=lambda deal: [deal.get("agent_operation_id")])


class CrmUpdateDealAdapter:
    contract = ToolContract(
        provider="crm",
        effect_class=EffectClass.VERSIONED_UPDATE,
        synchronous=True,
        lookup_methods=(LookupMethod.EXTERNAL_ID,),
        key_retention=None,
        same_key_retry_safe=False,
        dedup_method="expected_version + applied_operation_ids on the deal",
    )

    def endpoint(self) -> str:
        return _base()

    def account(self) -> str:
        return _account()

    def call(self, op: OperationSnapshot) -> CallResult:
        payload = op.payload
        body = {
            "expected_version": int(payload["expected_version"]),
            "patch": dict(payload["patch"]),
            "agent_operation_id": op.id,
        }
        target = str(payload["target"])
        answer = send(
            # One path segment, as retrieve sends it: never a path to another deal or endpoint.
            "PATCH", f"{_base()}/deals/{path_segment(target)}",
            api_key=settings.CRM_API_KEY, json=body,
        )

        def lacks(deal: Mapping[str, Any]) -> str:
            if deal.get("id") == target and _applied(op, deal):
                return ""
            return f"deal {target} with this operation among its applied_operation_ids"

        result = _call_result(answer, body, lacks=lacks)
        current = result.result.get("current") or {}
        if result.outcome == CallOutcome.CONFLICT and _applied(op, current):
            # The version moved on because of us: an earlier PATCH of this operation, whose
            # answer we lost, already applied the change. That is success, not a conflict.
            return replace(
                result, outcome=CallOutcome.SUCCEEDED, external_id=target,
                result=_deal_facts(current), error_class="", error_message="",
            )
        if result.outcome == CallOutcome.CONFLICT:
            # The journal keeps the deal's fields a person decides on, not the CRM's whole
            # record (which may hold anything about anyone).
            return replace(result, result={**result.result, "current": _deal_facts(current)})
        return result

    def lookup(self, op: OperationSnapshot) -> LookupResult:
        target = str(op.payload["target"])
        found = self.retrieve(target)
        if found.outcome == LookupOutcome.ABSENT:
            # The deal is gone: whether our update landed before that cannot be told.
            return replace(found, outcome=LookupOutcome.INCONCLUSIVE)
        if found.outcome == LookupOutcome.FOUND and op.id not in found.operation_ids:
            return replace(
                found, outcome=LookupOutcome.ABSENT, status=None, matches=[],
                reason=f"deal {target} has not applied this operation",
            )
        return found

    def intent_problem(self, payload: Mapping[str, Any]) -> str:
        return _deal_text_problem(payload["patch"], action="crm.update_deal", prefix="patch.")

    def disagreement(self, *, payload: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
        # The deal as it is now carries every later change too: its current fields say
        # nothing against this update (the CRM's applied_operation_ids tie it to the deal).
        return ""

    def retrieve(self, external_id: str) -> LookupResult:
        return _deal_retrieve(external_id, carried=_applied_ids)


class CrmWebhookVerifier:
    def parse_webhook(self, *, headers: Mapping[str, str], body: bytes) -> WebhookFacts:
        hmac_signature_verify(
            secret=settings.CRM_WEBHOOK_SECRET, header=header_get(headers, "X-CRM-Signature"),
            body=body,
        )
        event = signed_event_parse(body, what="CRM")
        deal = event.object
        # An update names its own operation; a create carries it on the deal. The deal keeps
        # it through every later change: read from an update that names none (someone's
        # edit in the CRM), it would report that edit as an outcome of the deal's create.
        operation_id = event_operation_id(event.body.get("operation_id"), what="CRM")
        if not operation_id and event.type != "deal.updated":
            operation_id = event_operation_id(deal.get("agent_operation_id"), what="CRM")
        return WebhookFacts(
            event_id=event.id,
            event_type=event.type,
            operation_id=operation_id,
            external_id=event.object_id,
            status=EVENT_STATUS.get(event.type),
            created_at=event.created_at,
            data=_deal_facts(deal),
            linked_by_object=False,
        )
