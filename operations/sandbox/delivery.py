"""The sandbox's webhook outbox: delivery rounds of its undelivered events to the console,
signed as each provider signs them, with the webhook faults (late, duplicate, out of order)
carried out on the way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from django.conf import settings
from django.db import connection
from django.utils import timezone

from operations.providers.signing import hmac_signature_header, stripe_signature_header
from operations.sandbox.models import FaultKind, Provider, SandboxWebhook
from operations.sandbox.selectors import sandbox_keys_written
from operations.sandbox.services import sandbox_fault_take


def _signature_headers(provider: str, body: bytes) -> dict[str, str]:
    if provider == Provider.PAYMENTS:
        return {"Stripe-Signature": stripe_signature_header(
            secret=settings.PAYMENTS_WEBHOOK_SECRET, body=body)}
    if provider == Provider.CRM:
        return {"X-CRM-Signature": hmac_signature_header(
            secret=settings.CRM_WEBHOOK_SECRET, body=body)}
    return {"X-Mail-Signature": hmac_signature_header(
        secret=settings.MAIL_WEBHOOK_SECRET, body=body)}


# Two rounds at once would read the same undelivered batch and each POST it, and one would
# send the event a late_webhook fault has the other hold back. A session-level advisory lock
# keeps it to one round at a time without a transaction open across the POSTs, and, unlike a
# claim column, leaves nothing behind to expire when a worker dies mid-round: the lock ends
# with its session.
WEBHOOK_ROUND_LOCK = "sandbox-webhooks-deliver"


@contextmanager
def _webhook_round() -> Iterator[bool]:
    """Whether this session holds the delivery round, for the block."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [WEBHOOK_ROUND_LOCK]
        )
        (held,) = cursor.fetchone()
    try:
        yield held
    finally:
        if held:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [WEBHOOK_ROUND_LOCK]
                )


def _webhooks_reordered(
    *, provider: str, batch: list[SandboxWebhook], keys_of: dict[str, list[str]]
) -> list[SandboxWebhook]:
    """The round as an out_of_order_webhooks fault sends it. One aimed at an operation (or
    at a key its writes carried) swaps only that operation's events, among the places they
    hold, so the other operations' events keep the order the fault was not aimed at; a
    blanket one reverses the round. Either is taken only by a round where it has two events
    to swap."""
    if len(batch) < 2:
        return batch
    events_of = Counter(hook.operation_id for hook in batch)
    swappable = [op_id for op_id, count in events_of.items() if count > 1]
    fault = sandbox_fault_take(
        provider=provider, kinds=[FaultKind.OUT_OF_ORDER_WEBHOOKS], operation_ids=swappable,
        keys=[key for op_id in swappable for key in keys_of.get(op_id, [])],
    )
    if fault is None:
        return batch
    if fault.match == "*":
        return batch[::-1]
    reordered = list(batch)
    for op_id in swappable:
        if fault.match == op_id or fault.match in keys_of.get(op_id, []):
            _swap_events_of(reordered, op_id)
    return reordered


def _swap_events_of(batch: list[SandboxWebhook], op_id: str) -> None:
    """Reverse one operation's events in place, among the places they hold."""
    places = [i for i, hook in enumerate(batch) if hook.operation_id == op_id]
    for place, hook in zip(places, [batch[i] for i in reversed(places)], strict=True):
        batch[place] = hook


def sandbox_webhooks_deliver(*, target_base_url: str) -> int:
    """POST every undelivered event, signed; returns how many POSTs were answered 2xx.

    An event whose POST fails stays undelivered and goes out again next time, as providers do.
    While another round is under way this one sends nothing: that round or the next sends it.
    """
    with _webhook_round() as held:
        if not held:
            return 0
        return _webhooks_deliver_round(target_base_url=target_base_url)


def _webhooks_deliver_round(*, target_base_url: str) -> int:
    sent = 0
    base = target_base_url.rstrip("/")
    timeout = float(settings.PROVIDER_TIMEOUT_SECONDS)
    with httpx.Client(timeout=timeout) as client:
        for provider in Provider.values:
            batch = list(
                SandboxWebhook.objects.filter(provider=provider, delivered_at__isnull=True)
            )
            if not batch:
                continue
            keys_of = sandbox_keys_written(
                provider=provider, operation_ids={hook.operation_id for hook in batch}
            )
            # Held-back events first, so a reversal is spent only on a round it can reorder.
            batch = [
                hook for hook in batch
                if not sandbox_fault_take(provider=provider, kinds=[FaultKind.LATE_WEBHOOK],
                                          operation_ids=[hook.operation_id],
                                          keys=keys_of.get(hook.operation_id, []))
            ]
            batch = _webhooks_reordered(provider=provider, batch=batch, keys_of=keys_of)
            for hook in batch:
                url = f"{base}/webhooks/{provider}/"
                if not _webhook_post(client, url=url, provider=provider, hook=hook):
                    continue
                sent += 1
                SandboxWebhook.objects.filter(pk=hook.pk, delivered_at__isnull=True).update(
                    delivered_at=timezone.now()
                )
                # Taken only once the console has the first copy: a round it refused has
                # nothing to duplicate, and would use the fault up on no second copy.
                if sandbox_fault_take(
                    provider=provider, kinds=[FaultKind.DUPLICATE_WEBHOOK],
                    operation_ids=[hook.operation_id], keys=keys_of.get(hook.operation_id, []),
                ) and _webhook_post(client, url=url, provider=provider, hook=hook):
                    sent += 1
    return sent


def _webhook_post(client: httpx.Client, *, url: str, provider: str, hook: SandboxWebhook) -> bool:
    """Whether the console acknowledged the event (2xx)."""
    body = hook.body.encode()
    headers = {"Content-Type": "application/json", **_signature_headers(provider, body)}
    try:
        response = client.post(url, content=body, headers=headers)
    except httpx.HTTPError:
        return False
    return 200 <= response.status_code < 300
