"""Which operations and idempotency keys a sandbox request is about.

A fault aimed at an operation or a key reaches the requests found here, and the request log
names the operation. A write or a search names its operation; a read by the provider's id
or by key names none, so it is about the operations the object names and those whose
writes reached it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest

from operations.sandbox import selectors
from operations.sandbox.models import Deal, Message, PaymentIntent, Provider

SEARCH_CLAUSE = re.compile(r"^\s*metadata\['([A-Za-z0-9_]+)'\]\s*:\s*'([^']*)'\s*$")

Params = dict[str, Any]


def operation_named(params: Params) -> str:
    for name in ("metadata[operation_id]", "agent_operation_id", "operation_id"):
        value = params.get(name)
        if isinstance(value, str) and value:
            return value
    match = SEARCH_CLAUSE.match(str(params.get("query", "")))
    if match and match.group(1) == "operation_id":
        return match.group(2)
    return ""


OperationsOf = Callable[[HttpRequest, Params, dict[str, Any]], list[str]]


def operations_named(request: HttpRequest, params: Params, kwargs: dict[str, Any]) -> list[str]:
    operation_id = operation_named(params)
    return [operation_id] if operation_id else []


def distinct(ids: list[Any]) -> list[str]:
    return list(dict.fromkeys(str(op_id) for op_id in ids if op_id))


def payment_operations(
    request: HttpRequest, params: Params, kwargs: dict[str, Any]
) -> list[str]:
    intent = PaymentIntent.objects.filter(pk=kwargs["intent_id"]).first()
    return distinct([intent.metadata.get("operation_id")] if intent else [])


def deal_operations(request: HttpRequest, params: Params, kwargs: dict[str, Any]) -> list[str]:
    if request.method != "GET":
        return operations_named(request, params, kwargs)
    # A lookup of an update reads the deal, which names the update only once it applied
    # (not after a 500 that applied nothing): the PATCHes sent to it name the rest. The
    # newest writer first, the one most likely asking.
    deal = Deal.objects.filter(pk=kwargs["deal_id"]).first()
    applied = [*reversed(deal.applied_operation_ids), deal.agent_operation_id] if deal else []
    return distinct([
        *selectors.sandbox_operations_written(provider=Provider.CRM, path=request.path),
        *applied,
    ])


def messages_operations(
    request: HttpRequest, params: Params, kwargs: dict[str, Any]
) -> list[str]:
    key = params.get("idempotency_key")
    if request.method != "GET" or not isinstance(key, str) or not key:
        return operations_named(request, params, kwargs)
    # The message the key made, or, when none was made (a 500 before it), the sends that
    # carried the key.
    message = Message.objects.filter(idempotency_key=key).first()
    return distinct([
        message.operation_id if message else "",
        *selectors.sandbox_operations_written(provider=Provider.MAIL, idempotency_key=key),
    ])


def message_operations(
    request: HttpRequest, params: Params, kwargs: dict[str, Any]
) -> list[str]:
    message = Message.objects.filter(pk=kwargs["message_id"]).first()
    return distinct([message.operation_id] if message else [])


def keys_named(request: HttpRequest, params: Params) -> list[str]:
    """The idempotency keys a request carries (a write's header) or asks about (a lookup by
    key), for the faults aimed at a key."""
    keys = [request.headers.get("Idempotency-Key", "")]
    if request.method == "GET" and isinstance(params.get("idempotency_key"), str):
        keys.append(params["idempotency_key"])
    return [key for key in keys if key]
