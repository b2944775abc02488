"""The sandbox providers' HTTP APIs: the same contracts the adapters speak to real providers.

Every request is logged before it is answered and every answer carries a Request-Id, so a test
can count exactly what reached the provider.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from operations.providers.base import request_fingerprint
from operations.providers.payments import METADATA_VALUE_MAX_LENGTH
from operations.providers.signing import digests_equal
from operations.sandbox import selectors, serializers, services
from operations.sandbox.models import (
    Deal,
    FaultKind,
    IdempotencyRecord,
    Message,
    PaymentIntent,
    Provider,
    request_id,
)
from operations.sandbox.targeting import (
    SEARCH_CLAUSE,
    OperationsOf,
    Params,
    deal_operations,
    keys_named,
    message_operations,
    messages_operations,
    operations_named,
    payment_operations,
)

METADATA_PARAM = re.compile(r"^metadata\[([A-Za-z0-9_]+)\]$")
CURRENCY = re.compile(r"^[A-Za-z]{3}$")
WRITE_METHODS = frozenset({"POST", "PATCH"})
# The columns' sizes: a longer value is the client's mistake (400), never our crash (500).
MAX_LENGTHS = {
    "Idempotency-Key": 255, "metadata": METADATA_VALUE_MAX_LENGTH,
    "name": Deal._meta.get_field("name").max_length,
    "owner": Deal._meta.get_field("owner").max_length,
    "to": Message._meta.get_field("to").max_length,
    "template": 100, "agent_operation_id": 120, "operation_id": 120,
}
# The amount columns' size (bigint): a larger amount is refused too, never an insert's crash.
MAX_AMOUNT = 2**63 - 1
# Stripe's limits on a payment's amount, in its unit for the currency: "up to eight digits",
# and a minimum charge. The minimum is the account's settlement currency's, after conversion;
# the sandbox's account settles in each currency it charges, so it keeps Stripe's published
# minimums (docs.stripe.com/currencies, "Minimum and maximum charge amounts") for the
# currencies that table lists, and for any other currency takes any positive amount.
STRIPE_MAX_AMOUNT = 99_999_999
STRIPE_MIN_AMOUNT = {
    "usd": 50, "aed": 200, "aud": 50, "bgn": 100, "brl": 50, "cad": 50, "chf": 50, "czk": 1500,
    "dkk": 250, "eur": 50, "gbp": 30, "hkd": 400, "huf": 17500, "inr": 50, "jpy": 50,
    "mxn": 1000, "myr": 200, "nok": 300, "nzd": 50, "pln": 200, "ron": 200, "sek": 300,
    "sgd": 50, "thb": 1000,
}
READ_FAULTS = (FaultKind.DELAY, FaultKind.HTTP_500)
WRITE_FAULTS = (
    FaultKind.DELAY, FaultKind.SLOW, FaultKind.HTTP_500, FaultKind.VALIDATION_ERROR,
    FaultKind.COMMIT_THEN_DROP, FaultKind.HTTP_500_AFTER_COMMIT, FaultKind.HTTP_500_KEPT,
    FaultKind.CARD_DECLINED, FaultKind.REQUIRES_ACTION,
)

View = Callable[..., HttpResponse]


def error(status: int, *, type: str, code: str, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse(
        {"error": {"type": type, "code": code, "message": message, **extra}}, status=status
    )


def invalid(message: str, *, code: str = "parameter_invalid", param: str = "") -> JsonResponse:
    return error(400, type="invalid_request_error", code=code, message=message, param=param)


def _server_error_body(message: str) -> dict[str, Any]:
    return {"error": {"type": "api_error", "code": "sandbox_fault", "message": message}}


def _not_allowed(request: HttpRequest) -> JsonResponse:
    return error(405, type="invalid_request_error", code="method_not_allowed",
                 message=f"{request.method} is not allowed here")


def _params(request: HttpRequest) -> Params | None:
    if request.method == "GET":
        return dict(request.GET.items())
    if request.content_type == "application/json":
        try:
            params = json.loads(request.body or b"{}")
        except ValueError:
            return None
        return params if isinstance(params, dict) else None
    return dict(request.POST.items())


def _too_long(request: HttpRequest, params: Params) -> JsonResponse | None:
    values = [("Idempotency-Key", request.headers.get("Idempotency-Key", ""))]
    for name, value in params.items():
        values.append(("metadata" if METADATA_PARAM.match(name) else name, value))
    for name, value in values:
        limit = MAX_LENGTHS.get(name)
        if limit and isinstance(value, str) and len(value) > limit:
            return invalid(f"{name} is longer than {limit} characters", param=name)
    return None


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return False


def _nul_byte(request: HttpRequest, params: Params, kwargs: dict[str, Any]) -> JsonResponse | None:
    """PostgreSQL refuses a NUL byte in text: an id, a parameter or a key holding one is the
    client's mistake (400), never our crash (500)."""
    if _holds_nul([request.headers.get("Idempotency-Key", ""), params, kwargs]):
        return invalid("A value contains a NUL byte, which no parameter may hold")
    return None


# Stripe's API versions: a date, since 2024-09-30 with a release name ("2024-12-18.acacia").
STRIPE_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}(?:\.[a-z]+)?")


def _authorized(request: HttpRequest, provider: str) -> bool:
    expected = f"Bearer {getattr(settings, f'{provider.upper()}_API_KEY')}"
    return digests_equal(expected, request.headers.get("Authorization", ""))


def _stall(seconds: float) -> None:
    """Hold the answer back without holding a database connection meanwhile, as a real
    provider's stalled request would not pin one of ours (nor keep a test database busy)."""
    if not connection.in_atomic_block:
        connection.close()
    time.sleep(seconds)


def _answer(
    request: HttpRequest, provider: str, view: View, params: Params | None,
    operation_ids: list[str], kwargs: dict[str, Any],
) -> HttpResponse:
    if not _authorized(request, provider):
        return error(401, type="authentication_error", code="invalid_api_key",
                     message="Invalid API key provided")
    version = request.headers.get("Stripe-Version", "")
    if provider == Provider.PAYMENTS and version and not STRIPE_VERSION.fullmatch(version):
        # Stripe refuses a version it does not know before it does anything.
        return error(400, type="invalid_request_error", code="",
                     message=f"Invalid Stripe API version: {version[:40]}")
    if params is None:
        return invalid("The body is not a JSON object", code="parameter_invalid_json")
    problem = _too_long(request, params) or _nul_byte(request, params, kwargs)
    if problem:
        return problem
    kinds = WRITE_FAULTS if request.method in WRITE_METHODS else READ_FAULTS
    fault = services.sandbox_fault_take(
        provider=provider, kinds=kinds, operation_ids=operation_ids,
        keys=keys_named(request, params),
    )
    kind = fault.kind if fault else ""
    # The view acts on the faults that change what it does (a declined card, 3-D Secure, a
    # stall once the key is claimed).
    request.sandbox_fault = kind
    request.sandbox_fault_seconds = services.fault_seconds(fault) if fault else 0.0
    # Only the payments API keeps answers by key (Stripe's idempotency layer).
    key = request.headers.get("Idempotency-Key", "") if provider == Provider.PAYMENTS else ""
    if kind == FaultKind.DELAY:
        _stall(services.fault_seconds(fault))
    elif kind == FaultKind.HTTP_500:
        return JsonResponse(
            _server_error_body("An error occurred while processing your request."), status=500
        )
    elif kind == FaultKind.HTTP_500_KEPT:
        failed = _server_error_body("An error occurred while processing your request.")
        # Stripe keeps the answer of a request that began to run, a 500 included, and gives
        # it to every retry with the key. A key that already holds an answer keeps it.
        if not key or services.idempotency_answer_keep(
            key=key, fingerprint=request.params_fingerprint, status=500, body=failed
        ):
            return JsonResponse(failed, status=500)
    elif kind == FaultKind.VALIDATION_ERROR:
        return invalid("Sandbox fault: the request was refused as invalid",
                       code="sandbox_validation_error")
    response = view(request, params, **kwargs)
    if 200 <= response.status_code < 300:
        if kind == FaultKind.COMMIT_THEN_DROP:
            # The write is committed; the client gives up before this answer arrives.
            _stall(services.fault_seconds(fault))
        elif kind == FaultKind.HTTP_500_AFTER_COMMIT:
            failed = _server_error_body("An error occurred after the change was saved.")
            if key and response.get("Idempotent-Replayed") != "true":
                # What the key gives every retry from now on, as Stripe would.
                services.idempotency_answer_replace(key=key, status=500, body=failed)
            return JsonResponse(failed, status=500)
    return response


def endpoint(
    provider: str, *, operations_of: OperationsOf = operations_named
) -> Callable[[View], View]:
    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponse:
            params = _params(request)
            # A NUL byte is refused with a 400 (_nul_byte); PostgreSQL would raise on it here.
            operation_ids = (
                [] if _holds_nul([params, kwargs]) else operations_of(request, params or {}, kwargs)
            )
            # Computed once: the log, the idempotency claim and the key-reuse check use it.
            request.params_fingerprint = request_fingerprint(params) if params is not None else ""
            rid = request_id()
            log = services.sandbox_request_log(
                provider=provider, method=request.method or "", path=request.path,
                idempotency_key=request.headers.get("Idempotency-Key", ""),
                operation_id=operation_ids[0] if operation_ids else "",
                params_hash=request.params_fingerprint,
                request_id=rid,
            )
            response = _answer(request, provider, view, params, operation_ids, kwargs)
            services.sandbox_request_answered(request=log, status=response.status_code)
            response["Request-Id"] = rid
            return response

        # Machine-to-machine APIs: authenticated by the Bearer key, not by a session.
        return csrf_exempt(login_not_required(wrapper))

    return decorate


# --- payments (Stripe PaymentIntents subset) ----------------------------------------------


# The subset of Stripe's create parameters beyond amount, currency, confirm and metadata
# that the payments adapter may send.
PAYMENT_METHOD_PARAMS = frozenset({
    "payment_method", "automatic_payment_methods[enabled]",
    "automatic_payment_methods[allow_redirects]", "return_url",
})
PAYMENT_METHOD_TYPE_PARAM = re.compile(r"^payment_method_types\[\d+\]$")
# Stripe's saved payment method ids (its test ones too: pm_card_visa).
PAYMENT_METHOD_ID = re.compile(r"^(?:pm|card|src)_[A-Za-z0-9_]+$")
# From this API version, an intent that names no payment_method_types takes automatic
# payment methods, which may redirect the customer unless told never to.
AUTOMATIC_PAYMENT_METHODS_FROM = "2023-08-16"


def _boolean(params: Params, name: str, default: str) -> bool | None:
    value = str(params.get(name, default)).lower()
    return {"true": True, "false": False}.get(value)


def _payment_method_problem(params: Params, *, confirm: bool, version: str) -> JsonResponse | None:
    """What Stripe refuses about how a payment is to be paid, before it makes anything."""
    method = str(params.get("payment_method", ""))
    if method and not PAYMENT_METHOD_ID.match(method):
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
        return _not_allowed(request)
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
        _stall(request.sandbox_fault_seconds)
    try:
        return _payment_made(request, fields, claim=record)
    except Exception:
        services.idempotency_release(record=record)
        raise


@endpoint(Provider.PAYMENTS)
def payment_intents_search(request: HttpRequest, params: Params) -> HttpResponse:
    if request.method != "GET":
        return _not_allowed(request)
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
        return _not_allowed(request)
    intent = PaymentIntent.objects.filter(pk=intent_id).first()
    if intent is None:
        return error(404, type="invalid_request_error", code="resource_missing",
                     message=f"No such payment_intent: '{intent_id}'", param="intent")
    return JsonResponse(serializers.payment_intent_json(intent))


# --- CRM ----------------------------------------------------------------------------------


def _deal_value_problem(field: str, value: Any, *, param: str) -> JsonResponse | None:
    """One deal field, on create or inside a PATCH: a value the deal cannot hold is the
    client's mistake (400), never our crash (500)."""
    if field == "amount_minor":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_AMOUNT:
            return invalid(f"amount_minor must be an integer from 0 to {MAX_AMOUNT}",
                           param=param)
    elif field == "currency":
        if not isinstance(value, str) or not CURRENCY.match(value):
            return invalid("currency must be three letters", param=param)
    else:
        limit = Deal._meta.get_field(field).max_length
        if not isinstance(value, str) or len(value) > limit or (
            field != "owner" and not value.strip()
        ):
            return invalid(f"{field} must be text of 1 to {limit} characters", param=param)
    return None


def _deal_fields(params: Params) -> tuple[dict[str, Any], JsonResponse | None]:
    fields = {"name": params.get("name"), "amount_minor": params.get("amount_minor"),
              "currency": params.get("currency"), "owner": params.get("owner", "")}
    for field, value in fields.items():
        problem = _deal_value_problem(field, value, param=field)
        if problem:
            return {}, problem
    operation_id = params.get("agent_operation_id", "")
    if not isinstance(operation_id, str):
        return {}, invalid("agent_operation_id must be a string", param="agent_operation_id")
    return {**fields, "currency": fields["currency"].upper(),
            "agent_operation_id": operation_id}, None


def _patch_problem(patch: dict[str, Any]) -> JsonResponse | None:
    for field, value in patch.items():
        problem = _deal_value_problem(field, value, param=f"patch[{field}]")
        if problem:
            return problem
    return None


@endpoint(Provider.CRM)
def deals(request: HttpRequest, params: Params) -> HttpResponse:
    if request.method == "GET":
        found = Deal.objects.all()
        if "agent_operation_id" in params:
            found = found.filter(agent_operation_id=params["agent_operation_id"])
        return JsonResponse({"data": [serializers.deal_json(deal) for deal in found[:100]]})
    if request.method != "POST":
        return _not_allowed(request)
    fields, problem = _deal_fields(params)
    if problem:
        return problem
    try:
        created = services.sandbox_deal_create(**fields)
    except services.DealExists as exc:
        return error(
            409, type="invalid_request_error", code="resource_already_exists",
            message=str(exc), existing_id=exc.deal.id,
        )
    return JsonResponse(serializers.deal_json(created), status=201)


@endpoint(Provider.CRM, operations_of=deal_operations)
def deal(request: HttpRequest, params: Params, deal_id: str) -> HttpResponse:
    current = Deal.objects.filter(pk=deal_id).first()
    if current is None:
        return error(404, type="invalid_request_error", code="resource_missing",
                     message=f"No such deal: '{deal_id}'")
    if request.method == "GET":
        return JsonResponse(serializers.deal_json(current))
    if request.method != "PATCH":
        return _not_allowed(request)
    expected = params.get("expected_version")
    patch = params.get("patch")
    operation_id = params.get("agent_operation_id", "")
    if not isinstance(expected, int) or isinstance(expected, bool):
        return invalid("expected_version must be an integer", param="expected_version")
    if not isinstance(patch, dict) or not patch or set(patch) - services.DEAL_PATCHABLE:
        return invalid(
            f"patch must change some of {', '.join(sorted(services.DEAL_PATCHABLE))}",
            param="patch",
        )
    if not isinstance(operation_id, str):
        return invalid("agent_operation_id must be a string", param="agent_operation_id")
    problem = _patch_problem(patch)
    if problem:
        return problem
    if "currency" in patch:
        patch = {**patch, "currency": patch["currency"].upper()}
    updated, applied = services.sandbox_deal_update(
        deal=current, expected_version=expected, patch=patch, operation_id=operation_id
    )
    if not applied:
        return error(
            409, type="invalid_request_error", code="version_conflict",
            message=f"deal {deal_id} is at version {updated.version}, not {expected}",
            current_version=updated.version, current=serializers.deal_json(updated),
        )
    return JsonResponse(serializers.deal_json(updated))


# --- mail ---------------------------------------------------------------------------------


@endpoint(Provider.MAIL, operations_of=messages_operations)
def messages(request: HttpRequest, params: Params) -> HttpResponse:
    if request.method == "GET":
        found = Message.objects.all()
        if "idempotency_key" in params:
            # A key past its retention is forgotten: it no longer finds its message either.
            found = found.filter(
                idempotency_key=params["idempotency_key"],
                created_at__gte=timezone.now() - services.MAIL_KEY_RETENTION,
            )
        return JsonResponse({"data": [serializers.message_json(m) for m in found[:100]]})
    if request.method != "POST":
        return _not_allowed(request)
    to, template = params.get("to"), params.get("template")
    template_params = params.get("params", {})
    if not isinstance(to, str) or "@" not in to:
        return invalid("to must be an email address", param="to")
    if not isinstance(template, str) or not template:
        return invalid("template is required", param="template")
    if not isinstance(template_params, dict):
        return invalid("params must be an object", param="params")
    key = request.headers.get("Idempotency-Key", "")
    fingerprint = request.params_fingerprint
    message = services.sandbox_message_create(
        to=to, template=template, params=template_params,
        operation_id=str(params.get("operation_id", "")), idempotency_key=key,
        fingerprint=fingerprint,
    )
    if key and message.fingerprint != fingerprint:
        return error(
            400, type="idempotency_error", code="idempotency_key_reused",
            message="This idempotency key was used with other parameters.",
        )
    return JsonResponse(serializers.message_json(message), status=202)


@endpoint(Provider.MAIL, operations_of=message_operations)
def message(request: HttpRequest, params: Params, message_id: str) -> HttpResponse:
    if request.method != "GET":
        return _not_allowed(request)
    found = Message.objects.filter(pk=message_id).first()
    if found is None:
        return error(404, type="invalid_request_error", code="resource_missing",
                     message=f"No such message: '{message_id}'")
    return JsonResponse(serializers.message_json(found))
