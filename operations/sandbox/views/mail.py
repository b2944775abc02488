"""The mail sandbox: an idempotent send keyed by operation, and its lookup."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from operations.sandbox import serializers, services
from operations.sandbox.models import (
    Message,
    Provider,
)
from operations.sandbox.targeting import (
    Params,
    message_operations,
    messages_operations,
)

# --- mail ---------------------------------------------------------------------------------
from operations.sandbox.views.common import endpoint, error, invalid, not_allowed


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
        return not_allowed(request)
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
        return not_allowed(request)
    found = Message.objects.filter(pk=message_id).first()
    if found is None:
        return error(404, type="invalid_request_error", code="resource_missing",
                     message=f"No such message: '{message_id}'")
    return JsonResponse(serializers.message_json(found))
