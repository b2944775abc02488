"""Roles are groups; what a role may do is held per tenant as guardian object permissions."""

from __future__ import annotations

from django.contrib.auth.models import Group
from django.db import transaction
from guardian.shortcuts import assign_perm, remove_perm

from operations.models import Tenant
from operations.services import audit_event_record

APPROVER = "Approver"
OPERATOR = "Operator"
AUDITOR = "Auditor"
ADMIN = "Admin"

# Tenant permissions each role holds on a tenant it is granted on.
ROLE_PERMISSIONS: dict[str, tuple[str, ...]] = {
    APPROVER: ("view_tenant", "approve_intents"),
    OPERATOR: ("view_tenant", "operate_operations", "replay_runs"),
    AUDITOR: ("view_tenant", "view_audit", "export_audit"),
    ADMIN: (
        "view_tenant",
        "approve_intents",
        "operate_operations",
        "replay_runs",
        "view_audit",
        "export_audit",
        "redeliver_effects",
        "replay_live_irreversible",
        "view_unmasked",
    ),
}
ROLES = tuple(ROLE_PERMISSIONS)


class UnknownRole(ValueError):
    pass


def roles_setup() -> list[Group]:
    """Create the role groups; safe to run any number of times."""
    with transaction.atomic():
        return [Group.objects.get_or_create(name=name)[0] for name in ROLES]


def _role_name(role: str) -> str:
    for name in ROLES:
        if name.lower() == role.strip().lower():
            return name
    raise UnknownRole(f"unknown role {role!r}; choose one of: {', '.join(ROLES)}")


def role_grant(*, user, role: str, tenant: Tenant, actor=None, reason: str = "") -> list[str]:
    """Put the user in the role's group and give them its permissions on this tenant."""
    name = _role_name(role)
    with transaction.atomic():
        group, _ = Group.objects.get_or_create(name=name)
        user.groups.add(group)
        granted = []
        for codename in ROLE_PERMISSIONS[name]:
            assign_perm(f"operations.{codename}", user, tenant)
            granted.append(codename)
        audit_event_record(
            actor=actor, action="role.grant", tenant=tenant, object_type="user",
            object_id=user.username, reason=reason, after={"role": name, "permissions": granted},
        )
        return granted


def role_revoke(*, user, role: str, tenant: Tenant, actor=None, reason: str = "") -> None:
    name = _role_name(role)
    with transaction.atomic():
        for codename in ROLE_PERMISSIONS[name]:
            remove_perm(f"operations.{codename}", user, tenant)
        audit_event_record(
            actor=actor, action="role.revoke", tenant=tenant, object_type="user",
            object_id=user.username, reason=reason, before={"role": name},
        )


def user_roles(user) -> list[str]:
    if not user.is_authenticated:
        return []
    return sorted(g.name for g in user.groups.all() if g.name in ROLE_PERMISSIONS)
