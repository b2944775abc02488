"""The sandbox providers' own background work, on the beat when the sandbox is enabled."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings

from operations.sandbox.delivery import sandbox_webhooks_deliver
from operations.sandbox.services import sandbox_settle_due


@shared_task(name="sandbox.tick", ignore_result=True)
def sandbox_tick() -> dict[str, int]:
    """Settle what a bank would have settled by now, then send the providers' pending
    webhooks to the console, as the real providers would. Safe to run twice: settling is a
    conditional update, a tick that finds another's delivery round under way leaves the
    sending to it, and the console stores each event once."""
    if not settings.SANDBOX_ENABLED:
        # A tick that outlived the restart turning the sandbox off (queued before it, or sent
        # by the old beat in a deploy's overlap) would sign the sandbox's events with this
        # worker's secrets, the real provider's by then: the console would take them for
        # the provider's own facts.
        return {}
    counts = sandbox_settle_due(older_than=timedelta(seconds=settings.SANDBOX_SETTLE_SECONDS))
    counts["webhooks_sent"] = sandbox_webhooks_deliver(
        target_base_url=settings.SANDBOX_WEBHOOK_TARGET
    )
    return counts
