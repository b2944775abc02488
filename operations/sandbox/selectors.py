"""Sandbox reads: the faults that apply to a request, the request log (for tests), search."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.db.models import Q, QuerySet
from django.utils import timezone

from operations.sandbox.models import (
    Deal,
    Message,
    PaymentIntent,
    SandboxFault,
    SandboxRequest,
    SandboxWebhook,
)


def sandbox_faults_matching(
    *, provider: str, kinds: Iterable[str], operation_ids: Iterable[str],
    keys: Iterable[str] = (),
) -> list[SandboxFault]:
    """The faults left for this request; one aimed at its operations or its idempotency
    keys before a blanket one."""
    ids = [target for target in [*operation_ids, *keys] if target]
    faults = list(SandboxFault.objects.filter(
        Q(match="*") | Q(match__in=ids), provider=provider, kind__in=list(kinds), remaining__gt=0
    ).order_by("id"))
    faults.sort(key=lambda fault: (fault.match == "*", fault.id))
    return faults


def sandbox_fault_active(
    *, provider: str, kind: str, operation_ids: Iterable[str] = (), keys: Iterable[str] = ()
) -> SandboxFault | None:
    faults = sandbox_faults_matching(
        provider=provider, kinds=[kind], operation_ids=operation_ids, keys=keys
    )
    return faults[0] if faults else None


def sandbox_requests(
    *,
    provider: str | None = None,
    method: str | None = None,
    path_endswith: str | None = None,
    idempotency_key: str | None = None,
    operation_id: str | None = None,
) -> QuerySet[SandboxRequest]:
    requests = SandboxRequest.objects.all()
    if provider:
        requests = requests.filter(provider=provider)
    if method:
        requests = requests.filter(method=method.upper())
    if path_endswith:
        requests = requests.filter(path__endswith=path_endswith)
    if idempotency_key is not None:
        requests = requests.filter(idempotency_key=idempotency_key)
    if operation_id is not None:
        requests = requests.filter(operation_id=operation_id)
    return requests


def sandbox_writes(*, provider: str, operation_id: str | None = None) -> QuerySet[SandboxRequest]:
    """The requests that could have made an effect (POST and PATCH)."""
    return sandbox_requests(provider=provider, operation_id=operation_id).filter(
        method__in=["POST", "PATCH"]
    )


def sandbox_operations_written(
    *, provider: str, path: str | None = None, idempotency_key: str | None = None
) -> list[str]:
    """The operations whose writes reached this path or carried this key, newest first."""
    writes = sandbox_writes(provider=provider).exclude(operation_id="")
    if path is not None:
        writes = writes.filter(path=path)
    if idempotency_key is not None:
        writes = writes.filter(idempotency_key=idempotency_key)
    return list(dict.fromkeys(writes.order_by("-id").values_list("operation_id", flat=True)))


def sandbox_keys_written(
    *, provider: str, operation_ids: Iterable[str]
) -> dict[str, list[str]]:
    """The idempotency keys each operation's writes carried. A webhook or a search carries
    no key of its own: a fault aimed at a key reaches those of the operations it made."""
    keys: dict[str, list[str]] = {}
    writes = sandbox_writes(provider=provider).filter(
        operation_id__in=[op_id for op_id in operation_ids if op_id]
    ).exclude(idempotency_key="")
    for op_id, key in writes.values_list("operation_id", "idempotency_key").distinct():
        keys.setdefault(op_id, []).append(key)
    return keys


def sandbox_counts() -> dict[str, int]:
    return {
        "payment_intents": PaymentIntent.objects.count(),
        "deals": Deal.objects.count(),
        "messages": Message.objects.count(),
        "webhooks": SandboxWebhook.objects.count(),
        "webhooks_undelivered": SandboxWebhook.objects.filter(delivered_at__isnull=True).count(),
        "requests": SandboxRequest.objects.count(),
    }


def sandbox_payment_search(
    *, field: str, value: str, lag_seconds: float = 0
) -> list[PaymentIntent]:
    intents = PaymentIntent.objects.filter(metadata__contains={field: value})
    if lag_seconds:
        # What Stripe's search index has not caught up with yet is invisible to search.
        intents = intents.filter(
            created_at__lte=timezone.now() - timedelta(seconds=lag_seconds)
        )
    return list(intents[:100])
