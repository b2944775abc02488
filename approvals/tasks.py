"""Celery tasks of approvals; safe to receive twice (every change is conditional)."""

from __future__ import annotations

from celery import shared_task

from approvals.services import approvals_expire_overdue


@shared_task(name="approvals.expire_overdue")
def expire_overdue() -> int:
    """Beat: expire pending approvals whose time is up."""
    return approvals_expire_overdue()
