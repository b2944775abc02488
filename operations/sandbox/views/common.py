"""What every sandbox API shares: parameters, authorization, faults, the request log and
its Request-Id, errors in each provider's shape.

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
from django.views.decorators.csrf import csrf_exempt

from operations.providers.base import request_fingerprint
from operations.providers.payments import METADATA_VALUE_MAX_LENGTH, STRIPE_VERSION
from operations.providers.signing import digests_equal, nested_deeper_than
from operations.sandbox import services
from operations.sandbox.models import (
    Deal,
    FaultKind,
    Message,
    Provider,
    request_id,
)
from operations.sandbox.targeting import (
    OperationsOf,
    Params,
    keys_named,
    operations_named,
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


def not_allowed(request: HttpRequest) -> JsonResponse:
    return error(405, type="invalid_request_error", code="method_not_allowed",
                 message=f"{request.method} is not allowed here")


# How deep a JSON body may nest. The answer walks it recursively (its NUL check, its
# fingerprint): past the stack, a nesting far below json.loads' own limit was a 500. The
# adapters' requests nest two levels.
PARAMS_DEPTH_MAX = 32


def _params(request: HttpRequest) -> Params | None:
    if request.method == "GET":
        return dict(request.GET.items())
    if request.content_type == "application/json":
        try:
            params = json.loads(request.body or b"{}")
        except (ValueError, RecursionError):
            return None
        if not isinstance(params, dict) or nested_deeper_than(params, PARAMS_DEPTH_MAX):
            return None
        return params
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


def _authorized(request: HttpRequest, provider: str) -> bool:
    expected = f"Bearer {getattr(settings, f'{provider.upper()}_API_KEY')}"
    return digests_equal(expected, request.headers.get("Authorization", ""))


def stall(seconds: float) -> None:
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
        stall(services.fault_seconds(fault))
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
            stall(services.fault_seconds(fault))
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
