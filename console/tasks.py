from __future__ import annotations

from celery import shared_task


@shared_task(name="console.ping")
def ping() -> str:
    """Answers from a live worker; used by the worker health check and the tests."""
    return "pong"
