"""Payments: the Stripe PaymentIntents API subset (create, retrieve, search, signed webhooks)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.utils import timezone

from operations.currencies import currency_exponent
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
    WebhookSignatureError,
)
from operations.providers.signing import (
    event_operation_id,
    header_get,
    signed_event_parse,
    stripe_signature_verify,
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

STATUS_MAP: dict[str, CallOutcome] = {
    "succeeded": CallOutcome.SUCCEEDED,
    "processing": CallOutcome.ACCEPTED,
    "requires_capture": CallOutcome.ACCEPTED,
    "canceled": CallOutcome.FAILED,
    "requires_payment_method": CallOutcome.FAILED,
}

EVENT_STATUS: dict[str, CallOutcome] = {
    "payment_intent.succeeded": CallOutcome.SUCCEEDED,
    "payment_intent.payment_failed": CallOutcome.FAILED,
    "payment_intent.processing": CallOutcome.ACCEPTED,
    # A failed attempt past Stripe's confirmation limit, or a rare cancel while processing,
    # ends the payment here instead of in requires_payment_method: the same final answer.
    "payment_intent.canceled": CallOutcome.FAILED,
}


def _waits_on(intent: Mapping[str, Any]) -> str:
    if intent.get("status") == "requires_action":
        return ("the customer must authenticate the payment (3-D Secure, Stripe's "
                "requires_action), which nobody does from this console")
    return ""


def payment_status(status: str) -> CallOutcome:
    # Anything else (requires_action, requires_confirmation) is taken but not final.
    return STATUS_MAP.get(status, CallOutcome.ACCEPTED)


def _facts(intent: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": intent.get("id", ""),
        "status": intent.get("status", ""),
        "amount": intent.get("amount"),
        "currency": intent.get("currency", ""),
    }


def _operation_of(intent: Mapping[str, Any]) -> str:
    metadata = intent.get("metadata")
    return str(metadata.get("operation_id") or "") if isinstance(metadata, dict) else ""


def _attempted_intent(answer: Answer) -> Mapping[str, Any] | None:
    """The PaymentIntent a refused create made anyway: Stripe answers a confirm=true create
    whose card is declined with a 402 card_error whose `payment_intent` is that object."""
    intent = answer.error.get("payment_intent")
    if answer.status is None or not 400 <= answer.status < 500:
        return None
    if not isinstance(intent, dict) or not intent.get("id"):
        return None
    return intent


# An intent's amount_minor is in ISO 4217 minor units, as the approver reads it. Stripe's API
# counts amounts in its own unit per currency (docs.stripe.com/currencies): none for its
# zero-decimal currencies, thousandths for its three-decimal ones, hundredths for the rest.
# They differ from ISO 4217 for ISK (zero-decimal in ISO, hundredths at Stripe: 100 is one
# króna), MGA (two decimals in ISO, none at Stripe), IQD and LYD (three in ISO, two at
# Stripe): sent as they are, 500 ISK approved would pay 5 ISK.
STRIPE_ZERO_DECIMAL = frozenset({
    "BIF", "CLP", "DJF", "GNF", "JPY", "KMF", "KRW", "MGA", "PYG", "RWF", "UGX", "VND", "VUV",
    "XAF", "XOF", "XPF",
})
STRIPE_THREE_DECIMAL = frozenset({"BHD", "JOD", "KWD", "OMR", "TND"})


# "The amount value supports up to eight digits" in Stripe's unit, whatever the currency. Its
# minimum charge depends on the account's settlement currency (and a conversion into it), so
# only the provider's answer can say whether a small sum is too small.
STRIPE_MAX_AMOUNT = 99_999_999


def _stripe_shift(currency: str) -> int:
    """Stripe's unit against ISO 4217's, as a power of ten: 2 for ISK (Stripe counts
    hundredths of what ISO counts whole), -2 for MGA, 0 wherever they agree."""
    code = currency.upper()
    stripe = 0 if code in STRIPE_ZERO_DECIMAL else 3 if code in STRIPE_THREE_DECIMAL else 2
    iso = currency_exponent(code)
    return 0 if iso is None else stripe - iso


def stripe_amount(amount_minor: int, currency: str) -> int | None:
    """The amount in Stripe's unit for the currency, or None where it has none (a fraction
    of an ariary, which Stripe cannot charge)."""
    shift = _stripe_shift(currency)
    if shift >= 0:
        return amount_minor * 10**shift
    unit = 10**-shift
    return amount_minor // unit if amount_minor % unit == 0 else None


def _iso_minor(amount: Any, currency: str) -> str:
    """An amount Stripe reports, in the currency's ISO 4217 minor units, as the approval card
    counts them (a fraction of one written as such); what is no number, as it is."""
    if not isinstance(amount, int) or isinstance(amount, bool):
        return str(amount)
    shift = _stripe_shift(currency)
    if shift <= 0:
        return str(amount * 10**-shift)
    whole, rest = divmod(amount, 10**shift)
    return str(whole) if not rest else str(Decimal(amount).scaleb(-shift))


# Stripe holds a metadata value of at most 500 characters (docs.stripe.com/metadata) and
# refuses a longer one with a 400; the sandbox holds its stand-in to the same number.
METADATA_VALUE_MAX_LENGTH = 500
# The intent's references, sent as metadata values.
_METADATA_FIELDS = ("invoice_id", "beneficiary_id")
# Stripe's saved PaymentMethod ids (its test ones too: pm_card_visa). The console pays with
# one (PAYMENTS_PAYMENT_METHOD, refused at start when it is not one) and the sandbox, as
# Stripe, takes no other.
PAYMENT_METHOD_ID = re.compile(r"(?:pm|card|src)_[A-Za-z0-9_]+")
# Stripe's secret and restricted API keys and webhook secrets: never repeated in a message.
STRIPE_SECRET = re.compile(r"(?:sk|rk)_(?:live|test)_|whsec_")
# Stripe's API versions: a date, since 2024-09-30 with a release name ("2024-12-18.acacia").
# Stripe refuses any other (PAYMENTS_API_VERSION is checked at start; the sandbox refuses so).
STRIPE_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}(?:\.[a-z]+)?")


class PaymentsCreateAdapter:
    @property
    def contract(self) -> ToolContract:
        return ToolContract(
            provider="payments",
            effect_class=EffectClass.IRREVERSIBLE,
            # `processing` payments finish later, by webhook or lookup.
            synchronous=False,
            lookup_methods=(LookupMethod.EXTERNAL_ID, LookupMethod.UNIQUE_FIELD),
            key_retention=timedelta(hours=24),
            same_key_retry_safe=True,
            search_lag=timedelta(seconds=float(settings.PAYMENTS_SEARCH_LAG_SECONDS)),
            search_lag_outage=timedelta(
                seconds=float(settings.PAYMENTS_SEARCH_LAG_OUTAGE_SECONDS)),
            dedup_method="Idempotency-Key header + search by metadata['operation_id']",
        )

    def endpoint(self) -> str:
        return settings.PAYMENTS_API_BASE.rstrip("/")

    def account(self) -> str:
        return account_fingerprint(settings.PAYMENTS_API_BASE, settings.PAYMENTS_API_KEY)

    def _headers(self) -> dict[str, str]:
        """Every request names the API version this adapter reads: without one the account's
        default applies, under which search may not exist (before 2020-08-27) and statuses
        have other names (before 2019-02-11)."""
        version = settings.PAYMENTS_API_VERSION
        return {"Stripe-Version": version} if version else {}

    def params(self, op: OperationSnapshot) -> dict[str, str]:
        payload = op.payload
        params = {
            # Checked representable when the intent was prepared (intent_problem).
            "amount": str(stripe_amount(int(payload["amount_minor"]), str(payload["currency"]))),
            "currency": str(payload["currency"]).lower(),
            "confirm": "true",
            # Stripe confirms only with a payment method, and since API version 2023-08-16
            # lets automatic payment methods redirect the customer unless told never to,
            # refusing a confirm without a return_url: nobody is here to come back to one.
            "payment_method": settings.PAYMENTS_PAYMENT_METHOD,
            "automatic_payment_methods[enabled]": "true",
            "automatic_payment_methods[allow_redirects]": "never",
            "metadata[operation_id]": op.id,
            "metadata[tenant]": op.tenant,
        }
        # Stripe reads an empty metadata value as "unset", so absent fields are not sent.
        for name in _METADATA_FIELDS:
            if payload.get(name):
                params[f"metadata[{name}]"] = str(payload[name])
        return params

    def call(self, op: OperationSnapshot) -> CallResult:
        params = self.params(op)
        answer = send(
            "POST", f"{self.endpoint()}/v1/payment_intents", api_key=settings.PAYMENTS_API_KEY,
            headers={**self._headers(), "Idempotency-Key": op.idempotency_key}, data=params,
        )

        def lacks(intent: Mapping[str, Any]) -> str:
            # Stripe answers a create, or its replay by key, with the PaymentIntent it made,
            # which carries the metadata sent.
            if (intent.get("object") == "payment_intent" and intent.get("id")
                    and _operation_of(intent) == op.id):
                return ""
            return f"a PaymentIntent carrying metadata operation_id {op.id}"

        result = call_result(
            answer, sent=params, outcome=lambda body: payment_status(str(body.get("status", ""))),
            facts=_facts, lacks=lacks,
        )
        intent = _attempted_intent(answer)
        if intent is None:
            return result
        # The attempt failed, but the request made a PaymentIntent and the error carries it:
        # that object is this operation's, and its status, not the HTTP status, says what
        # became of the money (requires_payment_method: nothing moved).
        outcome = payment_status(str(intent.get("status", "")))
        failed = outcome is CallOutcome.FAILED
        return replace(
            result, outcome=outcome, external_id=str(intent["id"]), result=_facts(intent),
            error_class=str(answer.error.get("code") or "card_error") if failed else "",
            error_message=result.error_message if failed else "",
        )

    def intent_problem(self, payload: Mapping[str, Any]) -> str:
        for name in _METADATA_FIELDS:
            if len(str(payload.get(name, ""))) > METADATA_VALUE_MAX_LENGTH:
                return (f"payments.create: {name} is longer than {METADATA_VALUE_MAX_LENGTH} "
                        "characters, the most the payments provider keeps of a reference")
        currency = str(payload["currency"])
        amount = stripe_amount(int(payload["amount_minor"]), currency)
        if amount is None:
            return (f"payments.create: the payments provider takes {currency} in "
                    "whole units only; the amount has a fraction")
        if amount > STRIPE_MAX_AMOUNT:
            # Refused now, not by the provider after a person approved a payment it cannot
            # make.
            return (f"payments.create: the payments provider takes at most "
                    f"{_iso_minor(STRIPE_MAX_AMOUNT, currency)} {currency} (minor units) "
                    "in one payment; the amount is larger")
        return ""

    def disagreement(self, *, payload: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
        # A payment can carry this operation's id and still move another sum: one made by
        # hand in the provider's dashboard, or under this key by something else. It is not
        # the approved effect, and settling the operation with it would hide that. What the
        # provider does not report (an event without the object's amount) contradicts nothing.
        amount, currency = facts.get("amount"), str(facts.get("currency") or "").lower()
        expected_currency = str(payload["currency"]).lower()
        # The provider reports its own unit (stripe_amount): compared in it, and said in the
        # intent's ISO 4217 minor units, as the approval card showed the sum.
        if (
            amount is None
            or amount == stripe_amount(int(payload["amount_minor"]), expected_currency)
        ) and (not currency or currency == expected_currency):
            return ""
        return (
            f"{facts.get('id') or 'the payment'} is for "
            f"{_iso_minor(amount, currency or expected_currency)} {currency.upper() or '?'}, "
            f"the approved intent for {payload['amount_minor']} {expected_currency.upper()} "
            "(minor units)"
        )

    def lookup(self, op: OperationSnapshot) -> LookupResult:
        if op.external_id:
            return absence_once_named(self.retrieve(op.external_id), external_id=op.external_id)
        return self._search(op)

    def retrieve(self, external_id: str) -> LookupResult:
        def found(intent: Mapping[str, Any]) -> dict[str, Any]:
            return {
                "status": payment_status(str(intent.get("status"))),
                "external_id": str(intent.get("id", external_id)),
                "matches": [_facts(intent)], "result": _facts(intent),
                "operation_ids": carried_ids(_operation_of(intent)),
                "waits_on": _waits_on(intent),
            }

        return lookup_by_id(
            f"{self.endpoint()}/v1/payment_intents/{path_segment(external_id)}",
            object_id=external_id, api_key=settings.PAYMENTS_API_KEY,
            what=f"payment {external_id}", found=found, headers=self._headers(),
        )

    def _search(self, op: OperationSnapshot) -> LookupResult:
        method = LookupMethod.UNIQUE_FIELD
        answer = send(
            "GET", f"{self.endpoint()}/v1/payment_intents/search",
            api_key=settings.PAYMENTS_API_KEY, headers=self._headers(),
            params={"query": f"metadata['operation_id']:'{op.id}'"},
        )
        if not answer.ok:
            return lookup_failure(answer, method=method)
        common = lookup_common(answer, method=method)
        found, unexpected = listed(
            answer, method=method, what="payments carrying this operation id",
            belongs=lambda intent: _operation_of(intent) == op.id, list_object="search_result",
        )
        if unexpected:
            return unexpected
        matches = [_facts(item) for item in found]
        if len(found) > 1 or answer.body.get("has_more"):
            # Never pick one: which of several charges is "ours" is a person's call.
            return LookupResult(
                outcome=LookupOutcome.INCONCLUSIVE, matches=matches,
                reason=f"{len(found)} payments carry this operation id", **common,
            )
        if len(found) == 1:
            return LookupResult(
                outcome=LookupOutcome.FOUND, status=payment_status(str(found[0].get("status"))),
                external_id=str(found[0].get("id", "")), matches=matches, result=matches[0],
                waits_on=_waits_on(found[0]), **common,
            )
        lag = self.contract.search_lag
        if op.last_call_at is not None:
            elapsed = timezone.now() - op.last_call_at
            if elapsed < lag:
                return LookupResult(
                    outcome=LookupOutcome.INCONCLUSIVE,
                    reason="search inside the provider's lag window",
                    retry_after=lag - elapsed, **common,
                )
        return LookupResult(
            outcome=LookupOutcome.ABSENT,
            reason="no payment carries this operation id", **common,
        )


class PaymentsWebhookVerifier:
    def parse_webhook(self, *, headers: Mapping[str, str], body: bytes) -> WebhookFacts:
        stripe_signature_verify(
            secret=settings.PAYMENTS_WEBHOOK_SECRET,
            header=header_get(headers, "Stripe-Signature"), body=body,
        )
        event = signed_event_parse(body, what="Stripe")
        metadata = event.object.get("metadata") or {}
        if not isinstance(metadata, dict):
            # Signed but not Stripe's shape: refused (400) like any malformed event, not a 500.
            raise WebhookSignatureError("signed Stripe event has metadata that is not an object")
        return WebhookFacts(
            event_id=event.id,
            event_type=event.type,
            operation_id=event_operation_id(metadata.get("operation_id"), what="Stripe"),
            external_id=event.object_id,
            status=EVENT_STATUS.get(event.type),
            created_at=event.created_at,
            data=_facts(event.object),
        )
