"""The CRM sandbox: deals carrying a unique agent_operation_id, updated by expected version."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from operations.sandbox import serializers, services
from operations.sandbox.models import (
    Deal,
    Provider,
)
from operations.sandbox.targeting import (
    Params,
    deal_operations,
)

# --- CRM ----------------------------------------------------------------------------------
from operations.sandbox.views.common import (
    CURRENCY,
    MAX_AMOUNT,
    endpoint,
    error,
    invalid,
    not_allowed,
)


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
        return not_allowed(request)
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
        return not_allowed(request)
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
