"""Roles: held per tenant (TenantRole), carried out as guardian object permissions on the
tenant, and mirrored as groups (a user is in a role's group while they hold it anywhere);
what a person is shown they hold comes from TenantRole, never from their groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from guardian.shortcuts import assign_perm, get_user_perms, remove_perm

from operations.intents import secret_in_text
from operations.models import Role, Tenant, TenantRole
from operations.services import audit_event_record

APPROVER = Role.APPROVER.value
OPERATOR = Role.OPERATOR.value
AUDITOR = Role.AUDITOR.value
ADMIN = Role.ADMIN.value

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


class RoleNotHeld(ValueError):
    pass


class ReasonRefused(ValueError):
    """The reason would carry card data or a secret onto the audit trail."""


class RoleGranted(NamedTuple):
    permissions: list[str]
    already_held: bool
    restored: list[str]  # of a role already held, the permissions it had lost meanwhile


def _reason_check(reason: str) -> None:
    problem = secret_in_text(reason)
    if problem:
        raise ReasonRefused(f"the reason looks like {problem}")


def roles_setup() -> list[Group]:
    """Create the role groups; safe to run any number of times."""
    with transaction.atomic():
        return [Group.objects.get_or_create(name=name)[0] for name in ROLES]


def _user_lock(user) -> None:
    """Hold the user's row until the transaction ends, taken before their roles or
    permissions on the tenant are read. Two grants or revokes at once each read what the
    other was still changing: two revokes each kept view_tenant for the other's role, and a
    grant skipped view_tenant as held while a revoke took it away. The user row, not their
    TenantRole rows, so the first grant (no row to lock yet) waits too; NO KEY, so rows
    that merely reference the user (their audit events, decisions) are not held up."""
    get_user_model().objects.select_for_update(no_key=True).filter(pk=user.pk).values_list(
        "pk"
    ).first()


def _role_name(role: str) -> str:
    for name in ROLES:
        if name.lower() == role.strip().lower():
            return name
    raise UnknownRole(f"unknown role {role!r}; choose one of: {', '.join(ROLES)}")


def role_grant(
    *, user, role: str, tenant: Tenant, actor=None, reason: str = ""
) -> RoleGranted:
    """Record the role on this tenant, give its permissions there, and put the user in the
    role's group. A role already held is not recorded as a second grant; permissions of it
    taken another way meanwhile are given back, and that is recorded."""
    name = _role_name(role)
    _reason_check(reason)
    with transaction.atomic():
        _user_lock(user)
        group, _ = Group.objects.get_or_create(name=name)
        _, created = TenantRole.objects.get_or_create(user=user, tenant=tenant, role=name)
        user.groups.add(group)
        held = set(get_user_perms(user, tenant))
        granted = list(ROLE_PERMISSIONS[name])
        missing = [codename for codename in granted if codename not in held]
        for codename in missing:
            assign_perm(f"operations.{codename}", user, tenant)
        if created or missing:
            after: dict = {"role": name, "permissions": granted}
            if not created:
                after["restored"] = missing
            audit_event_record(
                actor=actor, action="role.grant", tenant=tenant, object_type="user",
                object_id=user.username, reason=reason, after=after,
            )
        return RoleGranted(granted, already_held=not created,
                           restored=[] if created else missing)


def role_revoke(*, user, role: str, tenant: Tenant, actor=None, reason: str = "") -> list[str]:
    """Take the role away on this tenant. Only the permissions no other role the user still
    holds there gives are removed (Approver and Operator both give view_tenant); returns
    those removed."""
    name = _role_name(role)
    _reason_check(reason)
    with transaction.atomic():
        _user_lock(user)
        deleted, _ = TenantRole.objects.filter(user=user, tenant=tenant, role=name).delete()
        if not deleted:
            raise RoleNotHeld(f"{user.username} does not hold {name} on {tenant.slug}")
        kept = {
            codename
            for other in TenantRole.objects.filter(user=user, tenant=tenant)
            .values_list("role", flat=True)
            for codename in ROLE_PERMISSIONS[other]
        }
        removed = [codename for codename in ROLE_PERMISSIONS[name] if codename not in kept]
        for codename in removed:
            remove_perm(f"operations.{codename}", user, tenant)
        if not TenantRole.objects.filter(user=user, role=name).exists():
            user.groups.remove(*Group.objects.filter(name=name))
        audit_event_record(
            actor=actor, action="role.revoke", tenant=tenant, object_type="user",
            object_id=user.username, reason=reason,
            before={"role": name}, after={"removed_permissions": removed},
        )
        return removed


def _tenants_held(user) -> list[Tenant | None]:
    """The tenants a change to this person's account goes on the trail of: those they hold a
    role on, where it changes who can act in their name. One who holds none gets a single
    event on no tenant, kept though no tenant's auditor is shown it."""
    return list(Tenant.objects.filter(user_roles__user=user).distinct()) or [None]


def _user_event_record(*, user, tenants, actor, action: str, **event) -> None:
    for tenant in tenants:
        audit_event_record(actor=actor, action=action, tenant=tenant, object_type="user",
                           object_id=user.username, **event)


def user_delete(*, user, actor=None, reason: str = "") -> None:
    """Delete a person's account. Their roles and permissions would go with it unrecorded
    (they cascade), so each role is revoked first, on its tenant's trail, in the same
    transaction as the delete."""
    _reason_check(reason)
    with transaction.atomic():
        _user_lock(user)
        tenants = _tenants_held(user)
        for held in list(TenantRole.objects.filter(user=user).select_related("tenant")):
            role_revoke(user=user, role=held.role, tenant=held.tenant, actor=actor,
                        reason=reason)
        _user_event_record(user=user, tenants=tenants, actor=actor, action="user.delete",
                           reason=reason)
        user.delete()


# Whether a person may sign in at all, and whether they may use /admin/; and the name the
# trail knows them by (its events name the user and the actor by username, so a rename
# unrecorded would cut a person's history in two for an auditor searching it).
TRAILED_FIELDS = ("is_active", "is_staff", "is_superuser", "username")


def _permission_names(permissions) -> list[str]:
    """Model permissions as `app.codename`, sorted: how the trail names them."""
    return sorted(
        f"{app}.{codename}"
        for app, codename in permissions.values_list("content_type__app_label", "codename")
    )


def _changes(before: dict, after: dict) -> dict[str, dict]:
    """An update event's before and after: only what changed; empty when nothing did."""
    changed = [name for name in before if before[name] != after[name]]
    if not changed:
        return {}
    return {"before": {name: before[name] for name in changed},
            "after": {name: after[name] for name in changed}}


def _access_held(user) -> dict[str, list[str]]:
    """The groups and model permissions /admin/ gives a person: with them a staff member may
    change other people's accounts there (their flags, their passwords)."""
    return {
        "groups": sorted(user.groups.values_list("name", flat=True)),
        "user_permissions": _permission_names(user.user_permissions),
    }


def user_create(*, user, actor=None) -> None:
    """Save an account made in /admin/. It holds no role yet: it goes on the trail of no
    tenant, which the installation's administrator reads."""
    with transaction.atomic():
        user.save()
        _user_event_record(
            user=user, tenants=[None], actor=actor, action="user.create",
            after={flag: getattr(user, flag) for flag in TRAILED_FIELDS},
        )


def user_save(*, user, actor=None, save_related: Callable[[], None] | None = None) -> None:
    """Save a person's account as changed in /admin/, and with `save_related` their groups
    and permissions; a change of its access flags, its username, its groups or its
    permissions goes on the trail of each tenant they hold a role on (deactivating an
    approver stops their approvals there as surely as a revoke), as one event."""
    with transaction.atomic():
        _user_lock(user)
        before = {
            **get_user_model().objects.filter(pk=user.pk).values(*TRAILED_FIELDS).get(),
            **_access_held(user),
        }
        user.save()
        if save_related is not None:
            save_related()
        after = {**{flag: getattr(user, flag) for flag in TRAILED_FIELDS}, **_access_held(user)}
        changes = _changes(before, after)
        if changes:
            _user_event_record(
                user=user, tenants=_tenants_held(user), actor=actor, action="user.update",
                **changes,
            )


def _group_event_record(*, group: Group, actor, action: str, **event) -> None:
    """On the trail of each tenant a member holds a role on (what the group gives, each of
    them holds); a group no such person is in, on no tenant's."""
    tenants = list(
        Tenant.objects.filter(user_roles__user__groups=group).distinct()
    ) or [None]
    for tenant in tenants:
        audit_event_record(actor=actor, action=action, tenant=tenant, object_type="group",
                           object_id=group.name, **event)


def group_save(
    *, group: Group, actor=None, save_related: Callable[[], None] | None = None
) -> None:
    """Save a group as made or changed in /admin/, and with `save_related` its permissions.
    Every member holds what it gives (with the user admin's, they may change other people's
    accounts): one made, or its name or permissions changed, goes on the trail."""
    with transaction.atomic():
        if group.pk is None:
            before = None
        else:
            locked = Group.objects.select_for_update().filter(pk=group.pk)
            before = {"name": locked.values_list("name", flat=True).get(),
                      "permissions": _permission_names(group.permissions)}
        group.save()
        if save_related is not None:
            save_related()
        after = {"name": group.name, "permissions": _permission_names(group.permissions)}
        if before is None:
            _group_event_record(group=group, actor=actor, action="group.create", after=after)
            return
        changes = _changes(before, after)
        if changes:
            _group_event_record(group=group, actor=actor, action="group.update", **changes)


def group_delete(*, group: Group, actor=None) -> None:
    """Delete a group: its members lose what it gave them, recorded as they would lose a
    permission taken away one by one."""
    with transaction.atomic():
        Group.objects.select_for_update().filter(pk=group.pk).values_list("pk").first()
        _group_event_record(
            group=group, actor=actor, action="group.delete",
            before={"name": group.name, "permissions": _permission_names(group.permissions)},
        )
        group.delete()


def user_password_record(*, user, actor=None) -> None:
    """Record that the person's password was set (or taken away) by someone else: whoever
    sets it can sign in as them and act in their name on every tenant they hold a role on.
    Joins the caller's transaction, the one that saved the password."""
    with transaction.atomic():
        _user_lock(user)
        _user_event_record(
            user=user, tenants=_tenants_held(user), actor=actor, action="user.password_set",
            after={"usable_password": user.has_usable_password()},
        )


def user_roles(user) -> list[str]:
    """The roles the user holds on some tenant, as the header names them. From the grants,
    not the groups: a superuser can put anyone into a role's group in /admin/, which gives
    nothing on any tenant, and the header then named a role they did not hold."""
    if not user.is_authenticated:
        return []
    return list(
        TenantRole.objects.filter(user=user).order_by("role").values_list("role", flat=True)
        .distinct()
    )
