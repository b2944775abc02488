"""Who may see what: a tenant's objects are visible to the users granted on it."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404
from guardian.shortcuts import get_objects_for_user

from operations.models import Operation, Tenant


def tenants_for_user(user, perm: str = "view_tenant") -> QuerySet[Tenant]:
    """The tenants on which the user was granted `perm`. Only a grant counts: Django's and
    guardian's superuser shortcut would hand the installation's administrator (README's
    `createsuperuser`, for /admin/) every tenant's approvals and unmasked data, unaudited;
    global (model) permissions count for nothing either."""
    if not (user.is_authenticated and user.is_active):
        return Tenant.objects.none()
    return get_objects_for_user(
        user, f"operations.{perm}", klass=Tenant, accept_global_perms=False,
        with_superuser=False,
    )


def tenant_perm_held(user, perm: str, tenant: Tenant) -> bool:
    """Whether the user was granted `perm` on this tenant (see tenants_for_user); used in
    place of `user.has_perm`, which answers yes to every superuser."""
    return user is not None and tenants_for_user(user, perm).filter(pk=tenant.pk).exists()


def tenant_ids_for_user(user, perm: str = "view_tenant") -> list[int]:
    return list(tenants_for_user(user, perm).values_list("id", flat=True))


def operations_for_user(user, perm: str = "view_tenant"):
    # The ids are fetched first on purpose: guardian's subquery compares text object_pk
    # with a cast, which hides the (tenant, id) index from the planner; a literal list keeps
    # a page of a million-row journal an index scan.
    return Operation.objects.filter(tenant_id__in=tenant_ids_for_user(user, perm))


def operation_for_user(user, operation_id: str, perm: str = "view_tenant"):
    """One operation: 404 when its tenant is not visible to the user, 403 without `perm`."""
    op = (
        Operation.objects.select_related(
            "tenant", "run", "checkpoint", "supersedes", "authorized_by"
        )
        .filter(id=operation_id)
        .first()
    )
    if op is None:
        raise Http404("no such operation")
    tenant_access_require(user, op.tenant, perm, what="operation")
    return op


def tenant_access_require(user, tenant: Tenant, perm: str, *, what: str) -> None:
    """The one access rule for anything of a tenant: 404 when the tenant is not visible to
    the user at all, 403 when it is visible but `perm` is missing."""
    if not tenant_perm_held(user, "view_tenant", tenant):
        raise Http404(f"no such {what}")
    if perm != "view_tenant" and not tenant_perm_held(user, perm, tenant):
        raise PermissionDenied(f"{perm} on {tenant.slug} is required for this {what}")
