"""Writes that are not engine transitions: the audit trail, tenants."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from operations.models import AuditEvent, Tenant
from operations.selectors import AuditFilters, tenants_for_user

# Who runs the management command this process is in: the audit trail names them on what
# they do from a shell (a grant, a prepare, a reconcile), where there is no signed-in user.
_shell_actor: ContextVar[str] = ContextVar("shell_actor", default="")


def _shell_name() -> str:
    # Behind sudo, the person who typed it, not root; a container's user may have no name.
    try:
        return os.environ.get("SUDO_USER") or getpass.getuser()
    except (OSError, KeyError):
        return f"uid {os.getuid()}"


def _shell_user() -> str:
    return f"shell:{_shell_name()}"[:150]


def shell_person() -> AbstractBaseUser | None:
    """The console account of the shell's user (the same username), if there is one: what
    they prepare from a shell is their own intent, which four eyes keeps them from
    approving in the console."""
    from django.contrib.auth import get_user_model

    return get_user_model().objects.filter(username=_shell_name(), is_active=True).first()


@contextmanager
def audit_actor_from_shell() -> Iterator[str]:
    """Audit rows written inside name the shell's user when they have no signed-in actor."""
    token = _shell_actor.set(_shell_user())
    try:
        yield _shell_actor.get()
    finally:
        _shell_actor.reset(token)


def audit_event_record(
    *,
    actor: AbstractBaseUser | None,
    action: str,
    tenant: Tenant | None = None,
    object_type: str = "",
    object_id: str = "",
    reason: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEvent:
    """Append one audit event; joins the caller's transaction so both commit or neither."""
    with transaction.atomic():
        return AuditEvent.objects.create(
            actor=actor if actor is not None and actor.is_authenticated else None,
            actor_username=getattr(actor, "username", "") or _shell_actor.get(),
            tenant=tenant,
            action=action,
            object_type=object_type,
            object_id=object_id,
            reason=reason,
            before=before,
            after=after,
        )


def audit_trail_export_record(*, actor: AbstractBaseUser, filters: AuditFilters) -> int:
    """An export takes the trail out of the console: each tenant it covers records who took
    it and with which filters, on that tenant's own trail (its auditors see it, no one
    else's do). Returns how many tenants it covered."""
    applied = {
        name: value.isoformat() if hasattr(value, "isoformat") else value
        for name, value in asdict(filters).items()
        if value
    }
    with transaction.atomic():
        tenants = list(tenants_for_user(actor, "export_audit").order_by("slug"))
        for tenant in tenants:
            audit_event_record(
                actor=actor, action="audit.export", tenant=tenant, object_type="audit_trail",
                object_id=tenant.slug, after={"filters": applied},
            )
    return len(tenants)


def tenant_create(
    *, slug: str, name: str, legal_entity: str = "", actor: AbstractBaseUser | None = None
) -> Tenant:
    with transaction.atomic():
        tenant, created = Tenant.objects.get_or_create(
            slug=slug, defaults={"name": name, "legal_entity": legal_entity}
        )
        if created:
            audit_event_record(
                actor=actor, action="tenant.create", tenant=tenant, object_type="tenant",
                object_id=tenant.slug, after={"name": name, "legal_entity": legal_entity},
            )
        return tenant


def tenant_update(
    *, tenant_id: int, name: str, legal_entity: str, actor: AbstractBaseUser | None
) -> Tenant:
    """Rename a tenant or change its legal entity, which approvers read on every card: the
    old and new values go on the audit trail. The slug never changes (scripts and links
    name tenants by it)."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(id=tenant_id)
        before = {"name": tenant.name, "legal_entity": tenant.legal_entity}
        after = {"name": name, "legal_entity": legal_entity}
        if before != after:
            Tenant.objects.filter(id=tenant_id).update(**after)
            audit_event_record(
                actor=actor, action="tenant.update", tenant=tenant, object_type="tenant",
                object_id=tenant.slug, before=before, after=after,
            )
        tenant.refresh_from_db()
        return tenant
