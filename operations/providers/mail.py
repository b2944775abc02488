"""Mail: send with an Idempotency-Key, find by it, delivery and bounce by webhook."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.crypto import salted_hmac

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

# The mail contract's longest recipient, RFC 5321's (a path of 256 less its angle brackets):
# the sandbox's column is this, and a longer one is refused with a 400.
ADDRESS_MAX_LENGTH = 254

STATUS_MAP: dict[str, CallOutcome] = {
    "queued": CallOutcome.ACCEPTED,
    "delivered": CallOutcome.SUCCEEDED,
    "bounced": CallOutcome.FAILED,
}


def message_status(message: Mapping[str, Any]) -> CallOutcome:
    """A message the provider holds and has not finished with is accepted, not done."""
    return STATUS_MAP.get(str(message.get("status")), CallOutcome.ACCEPTED)


EVENT_STATUS: dict[str, CallOutcome] = {
    "message.delivered": CallOutcome.SUCCEEDED,
    "message.bounced": CallOutcome.FAILED,
}


def _base() -> str:
    return settings.MAIL_API_BASE.rstrip("/")


def _digest(value: Any, *, secret: str | None = None) -> str:
    # Keyed, so the journal keeps nothing an outsider could match against a guessed address.
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return salted_hmac(
        "operations.providers.mail", blob, secret=secret, algorithm="sha256"
    ).hexdigest()


def _digest_matches(digest: Any, value: Any) -> bool:
    # A digest stored before SECRET_KEY was rotated (facts kept on an event, decided later,
    # or by a process still on the old key) is ours under a fallback, as Django's signing
    # reads its own: compared under the current key alone, our own message read as another.
    secrets = [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]
    return any(digest == _digest(value, secret=secret) for secret in secrets)


def _recipient(address: str) -> str:
    # A domain is case-insensitive: a provider that writes it in lower case sent it to the
    # same mailbox.
    local, at, domain = address.strip().rpartition("@")
    return f"{local}{at}{domain.lower()}" if at else address.strip()


def _message_facts(message: Mapping[str, Any]) -> dict[str, Any]:
    # Never the recipient or the template parameters themselves (personal data): their
    # digests, which are enough to tell a message sent to someone else from the approved one.
    facts: dict[str, Any] = {"id": message.get("id", ""), "status": message.get("status", "")}
    if isinstance(message.get("to"), str):
        facts["to_digest"] = _digest(_recipient(message["to"]))
    if isinstance(message.get("template"), str):
        facts["template"] = message["template"]
    if isinstance(message.get("params"), dict):
        facts["params_digest"] = _digest(message["params"])
    return facts


class MailSendAdapter:
    contract = ToolContract(
        provider="mail",
        effect_class=EffectClass.IRREVERSIBLE,
        synchronous=False,
        lookup_methods=(LookupMethod.EXTERNAL_ID, LookupMethod.IDEMPOTENCY_KEY),
        key_retention=timedelta(days=7),
        same_key_retry_safe=True,
        dedup_method="Idempotency-Key header + list messages by it",
    )

    def endpoint(self) -> str:
        return _base()

    def account(self) -> str:
        return account_fingerprint(settings.MAIL_API_BASE, settings.MAIL_API_KEY)

    def call(self, op: OperationSnapshot) -> CallResult:
        payload = op.payload
        body = {
            "to": payload["to"],
            "template": payload["template"],
            "params": dict(payload.get("params") or {}),
            "operation_id": op.id,
        }
        answer = send(
            "POST", f"{_base()}/messages", api_key=settings.MAIL_API_KEY,
            headers={"Idempotency-Key": op.idempotency_key}, json=body,
        )

        def lacks(message: Mapping[str, Any]) -> str:
            # The message this key made, now or the first time: it carries this operation.
            if message.get("id") and message.get("operation_id") == op.id:
                return ""
            return f"a message carrying operation_id {op.id}"

        return call_result(
            answer, sent=body, outcome=message_status, facts=_message_facts, lacks=lacks,
        )

    def lookup(self, op: OperationSnapshot) -> LookupResult:
        if op.external_id:
            # Once the provider named the message, asked by its id: that outlives the key,
            # which the provider forgets after 7 days while a message may still be queued.
            return absence_once_named(self.retrieve(op.external_id), external_id=op.external_id)
        method = LookupMethod.IDEMPOTENCY_KEY
        answer = send(
            "GET", f"{_base()}/messages", api_key=settings.MAIL_API_KEY,
            params={"idempotency_key": op.idempotency_key},
        )
        if not answer.ok:
            return lookup_failure(answer, method=method)
        common = lookup_common(answer, method=method)
        messages, unexpected = listed(
            answer, method=method, what="messages carrying this idempotency key",
            belongs=lambda message: message.get("idempotency_key") == op.idempotency_key,
        )
        if unexpected:
            return unexpected
        matches = [_message_facts(m) for m in messages]
        if len(messages) > 1:
            return LookupResult(
                outcome=LookupOutcome.INCONCLUSIVE, matches=matches,
                reason=f"{len(messages)} messages carry this idempotency key", **common,
            )
        if len(messages) == 1:
            return LookupResult(
                outcome=LookupOutcome.FOUND,
                status=message_status(messages[0]),
                external_id=str(messages[0].get("id", "")), matches=matches, result=matches[0],
                **common,
            )
        retention = self.contract.key_retention
        if op.key_first_sent_at is not None and retention is not None:
            if timezone.now() - op.key_first_sent_at > retention:
                # The provider may have forgotten the key: an empty answer proves nothing.
                return LookupResult(
                    outcome=LookupOutcome.INCONCLUSIVE,
                    reason="key retention window passed", **common,
                )
        return LookupResult(
            outcome=LookupOutcome.ABSENT, reason="no message carries this idempotency key",
            **common,
        )

    def intent_problem(self, payload: Mapping[str, Any]) -> str:
        if len(str(payload["to"])) > ADDRESS_MAX_LENGTH:
            return (f"mail.send: to is longer than {ADDRESS_MAX_LENGTH} characters, the most "
                    "an email address may be")
        return ""

    def disagreement(self, *, payload: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
        # A message can carry this operation's key or id and still go to someone else, or
        # say something else: one sent under this key by something else. It is not the
        # approved email. What the provider does not report contradicts nothing. Named by
        # what differs, never by address: these words reach the timeline and the audit.
        differs = []
        if "to_digest" in facts and not _digest_matches(
            facts["to_digest"], _recipient(str(payload["to"]))
        ):
            differs.append("recipient")
        if "template" in facts and facts["template"] != payload["template"]:
            differs.append("template")
        params = dict(payload.get("params") or {})
        if "params_digest" in facts and not _digest_matches(facts["params_digest"], params):
            differs.append("parameters")
        if not differs:
            return ""
        return (f"{facts.get('id') or 'the message'} has another {' and '.join(differs)} "
                "than the approved email")

    def retrieve(self, external_id: str) -> LookupResult:
        def found(message: Mapping[str, Any]) -> dict[str, Any]:
            facts = _message_facts(message)
            return {
                "status": message_status(message),
                "external_id": str(facts["id"] or external_id),
                "matches": [facts], "result": facts,
                "operation_ids": carried_ids(message.get("operation_id")),
            }

        return lookup_by_id(
            f"{_base()}/messages/{path_segment(external_id)}", object_id=external_id,
            api_key=settings.MAIL_API_KEY, what=f"message {external_id}", found=found,
        )


class MailWebhookVerifier:
    def parse_webhook(self, *, headers: Mapping[str, str], body: bytes) -> WebhookFacts:
        hmac_signature_verify(
            secret=settings.MAIL_WEBHOOK_SECRET, header=header_get(headers, "X-Mail-Signature"),
            body=body,
        )
        event = signed_event_parse(body, what="mail")
        return WebhookFacts(
            event_id=event.id,
            event_type=event.type,
            operation_id=event_operation_id(event.object.get("operation_id"), what="mail"),
            external_id=event.object_id,
            status=EVENT_STATUS.get(event.type),
            created_at=event.created_at,
            data=_message_facts(event.object),
        )
