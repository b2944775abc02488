"""The payments sandbox: the Stripe PaymentIntents subset the payments adapter speaks."""

from __future__ import annotations

import re
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from operations.providers.payments import PAYMENT_METHOD_ID, STRIPE_MAX_AMOUNT
from operations.sandbox import selectors, serializers, services
from operations.sandbox.models import (
    FaultKind,
    IdempotencyRecord,
    PaymentIntent,
    Provider,
)
from operations.sandbox.targeting import (
    SEARCH_CLAUSE,
    Params,
    payment_operations,
)
from operations.sandbox.views.common import (
    CURRENCY,
    METADATA_PARAM,
    endpoint,
    error,
    invalid,
    not_allowed,
    stall,
)

# Stripe's limits on a payment's amount, in its unit for the currency: "up to eight digits",
# and a minimum charge. The minimum is the account's settlement currency's, after conversion;
# the sandbox's account settles in each currency it charges, so it keeps Stripe's published
# minimums (docs.stripe.com/currencies, "Minimum and maximum charge amounts") for the
# currencies that table lists, and for any other currency takes any positive amount.
STRIPE_MIN_AMOUNT = {
    "usd": 50, "aed": 200, "aud": 50, "bgn": 100, "brl": 50, "cad": 50, "chf": 50, "czk": 1500,
    "dkk": 250, "eur": 50, "gbp": 30, "hkd": 400, "huf": 17500, "inr": 50, "jpy": 50,
    "mxn": 1000, "myr": 200, "nok": 300, "nzd": 50, "pln": 200, "ron": 200, "sek": 300,
    "sgd": 50, "thb": 1000,
}

# The subset of Stripe's create parameters beyond amount, currency, confirm and metadata
# that the payments adapter may send.
PAYMENT_METHOD_PARAMS = frozenset({
    "payment_method", "automatic_payment_methods[enabled]",
    "automatic_payment_methods[allow_redirects]", "return_url",
})
PAYMENT_METHOD_TYPE_PARAM = re.compile(r"^payment_method_types\[\d+\]$")
# From this API version, an intent that names no payment_method_types takes automatic
# payment methods, which may redirect the customer unless told never to.
AUTOMATIC_PAYMENT_METHODS_FROM = "2023-08-16"


def _boolean(params: Params, name: str, default: str) -> bool | None:
    value = str(params.get(name, default)).lower()
    return {"true": True, "false": False}.get(value)


def _payment_method_problem(params: Params, *, confirm: bool, version: str) -> JsonResponse | None:
    """What Stripe refuses about how a payment is to be paid, before it makes anything."""
    method = str(params.get("payment_method", ""))
    if method and not PAYMENT_METHOD_ID.fullmatch(method):
        return invalid(f"No such PaymentMethod: '{method}'", code="resource_missing",
                       param="payment_method")
    types = [name for name in params if PAYMENT_METHOD_TYPE_PARAM.match(name)]
    enabled = _boolean(params, "automatic_payment_methods[enabled]", "")
    redirects = str(params.get("automatic_payment_methods[allow_redirects]", "always"))
    if "automatic_payment_methods[enabled]" in params and enabled is None:
        return invalid("Invalid boolean: automatic_payment_methods[enabled]",
                       param="automatic_payment_methods[enabled]")
    if "automatic_payment_methods[allow_redirects]" in params and enabled is None:
        return invalid("Missing required param: automatic_payment_methods[enabled].",
                       code="parameter_missing", param="automatic_payment_methods[enabled]")
    if redirects not in {"always", "never"}:
        return invalid("Invalid automatic_payment_methods[allow_redirects]: must be one of "
                       "always or never", param="automatic_payment_methods[allow_redirects]")
    if types and enabled:
        return invalid("You may only specify one of these parameters: "
                       "automatic_payment_methods, payment_method_types.",
                       param="payment_method_types")
    if not confirm:
        return None
    if not method:
        return invalid(
            "You cannot confirm this PaymentIntent because it's missing a payment method. "
            "You can either update the PaymentIntent with a payment method and then confirm "
            "it again, or confirm it again directly with a payment method.",
            code="payment_intent_unexpected_state", param="payment_method",
        )
    automatic = enabled if enabled is not None else (
        not types and (not version or version[:10] >= AUTOMATIC_PAYMENT_METHODS_FROM))
    if automatic and redirects != "never" and not params.get("return_url"):
        return invalid(
            "A `return_url` must be specified because this Payment Intent is configured to "
            "automatically accept the payment methods enabled in the Dashboard, some of which "
            "may require a full page redirect to succeed. If you do not want to accept "
            "redirect-based payment methods, set `automatic_payment_methods[enabled]` to "
            "`true` and `automatic_payment_methods[allow_redirects]` to `never` when creating "
            "Setup Intents and Payment Intents.",
            # Stripe's message; the code is the sandbox's guess (Stripe documents none).
            code="parameter_missing", param="return_url",
        )
    return None


def _payment_params(
    params: Params, *, version: str
) -> tuple[dict[str, Any], JsonResponse | None]:
    metadata: dict[str, str] = {}
    for name, value in params.items():
        match = METADATA_PARAM.match(name)
        if match:
            metadata[match.group(1)] = str(value)
        elif name not in {"amount", "currency", "confirm", *PAYMENT_METHOD_PARAMS} and not (
            PAYMENT_METHOD_TYPE_PARAM.match(name)
        ):
            return {}, invalid(f"Received unknown parameter: {name}", code="parameter_unknown",
                               param=name)
    try:
        amount = int(params.get("amount", ""))
    except ValueError:
        return {}, invalid("Invalid integer: amount", code="parameter_invalid_integer",
                           param="amount")
    currency = str(params.get("currency", ""))
    if not CURRENCY.match(currency):
        return {}, invalid("Invalid currency", code="parameter_invalid", param="currency")
    minimum = STRIPE_MIN_AMOUNT.get(currency.lower(), 1)
    if amount < minimum:
        return {}, invalid(f"Amount must be at least {minimum} {currency.lower()}",
                           code="amount_too_small", param="amount")
    if amount > STRIPE_MAX_AMOUNT:
        return {}, invalid(f"Amount must be no more than {STRIPE_MAX_AMOUNT}",
                           code="amount_too_large", param="amount")
    confirm = _boolean(params, "confirm", "false")
    if confirm is None:
        return {}, invalid("Invalid boolean: confirm", param="confirm")
    problem = _payment_method_problem(params, confirm=confirm, version=version)
    if problem:
        return {}, problem
    return {"amount": amount, "currency": currency.lower(), "metadata": metadata,
            "confirm": confirm}, None


def _payment_made(
    request: HttpRequest, fields: dict[str, Any], claim: IdempotencyRecord | None = None
) -> JsonResponse:
    # The decline fault was taken with the request's other faults; a replay never gets here
    # and answers with what its key kept.
    declined = request.sandbox_fault == FaultKind.CARD_DECLINED and fields["confirm"]
    body = services.sandbox_payment_create(
        **fields, claim=claim, declined=declined,
        needs_action=request.sandbox_fault == FaultKind.REQUIRES_ACTION,
    )
    if declined:
        return JsonResponse(serializers.card_declined_json(body), status=402)
    return JsonResponse(body)


@endpoint(Provider.PAYMENTS)
def payment_intents(request: HttpRequest, params: Params) -> HttpResponse:
    if request.method != "POST":
        return not_allowed(request)
    fields, problem = _payment_params(params, version=request.headers.get("Stripe-Version", ""))
    key = request.headers.get("Idempotency-Key", "")
    if not key:
        if problem:
            return problem
        return _payment_made(request, fields)
    record, claimed = services.idempotency_claim(key=key, fingerprint=request.params_fingerprint)
    if not claimed:
        if record.fingerprint != request.params_fingerprint:
            return error(
                400, type="idempotency_error", code="idempotency_key_reused",
                message="Keys for idempotent requests can only be used with the same "
                        "parameters they were first used with.",
            )
        if record.response_status is None:
            return error(
                409, type="idempotency_error", code="idempotency_key_in_use",
                message="There is currently another in-progress request using this "
                        "Idempotent Key. Try again later.",
            )
        replay = JsonResponse(record.response_body, status=record.response_status)
        replay["Idempotent-Replayed"] = "true"
        return replay
    if problem:
        services.idempotency_release(record=record)
        return problem
    if request.sandbox_fault == FaultKind.SLOW:
        # Unlike `delay`, the key is claimed first: Stripe answers a same-key request that
        # arrives meanwhile with 409 idempotency_key_in_use.
        stall(request.sandbox_fault_seconds)
    try:
        return _payment_made(request, fields, claim=record)
    except Exception:
        services.idempotency_release(record=record)
        raise


@endpoint(Provider.PAYMENTS)
def payment_intents_search(request: HttpRequest, params: Params) -> HttpResponse:
    if request.method != "GET":
        return not_allowed(request)
    match = SEARCH_CLAUSE.match(str(params.get("query", "")))
    if not match:
        return invalid("Only metadata['field']:'value' queries are supported", param="query")
    field, value = match.groups()
    operation_ids = [value] if field == "operation_id" else []
    lag = selectors.sandbox_fault_active(
        provider=Provider.PAYMENTS, kind=FaultKind.SEARCH_LAG, operation_ids=operation_ids,
        keys=selectors.sandbox_keys_written(
            provider=Provider.PAYMENTS, operation_ids=operation_ids
        ).get(value, []),
    )
    intents = selectors.sandbox_payment_search(
        field=field, value=value, lag_seconds=float(lag.params.get("seconds", 60)) if lag else 0
    )
    return JsonResponse({
        "object": "search_result",
        "url": "/v1/payment_intents/search",
        "has_more": False,
        "data": [serializers.payment_intent_json(intent) for intent in intents],
    })


@endpoint(Provider.PAYMENTS, operations_of=payment_operations)
def payment_intent(request: HttpRequest, params: Params, intent_id: str) -> HttpResponse:
    if request.method != "GET":
        return not_allowed(request)
    intent = PaymentIntent.objects.filter(pk=intent_id).first()
    if intent is None:
        return error(404, type="invalid_request_error", code="resource_missing",
                     message=f"No such payment_intent: '{intent_id}'", param="intent")
    return JsonResponse(serializers.payment_intent_json(intent))
