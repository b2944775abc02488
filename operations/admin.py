from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from operations.models import AuditEvent, Tenant
from operations.services import tenant_create, tenant_update


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    """Tenants are added and renamed here, each change on the audit trail. Who may do what on
    a tenant is granted with `manage.py grant`, never here: it keeps a person's roles and
    their object permissions in step, and audits both."""

    list_display = ("slug", "name", "legal_entity", "created_at")
    fields = ("slug", "name", "legal_entity")

    def get_readonly_fields(self, request: HttpRequest, obj: Tenant | None = None) -> Any:
        return ("slug",) if obj is not None else ()

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        if change:
            saved = tenant_update(tenant_id=obj.pk, name=obj.name,
                                  legal_entity=obj.legal_entity, actor=request.user)
        else:
            saved = tenant_create(slug=obj.slug, name=obj.name,
                                  legal_entity=obj.legal_entity, actor=request.user)
        # The admin reads the saved object back (its pk for the redirect and the log entry).
        obj.pk, obj.created_at = saved.pk, saved.created_at

    def has_delete_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        # A tenant's journal and audit trail are kept for good.
        return False


@admin.register(AuditEvent)
class InstallationAuditEventAdmin(admin.ModelAdmin):
    """The events on no tenant's trail: what was done to the account of a person who holds
    no role anywhere (a password set, a rename, a deletion). No tenant's auditor is shown
    them, so the installation's administrator reads them here. Tenants' own trails stay on
    the audit page, for those granted there: a superuser gets no tenant's data by being one."""

    list_display = ("created_at", "actor_username", "action", "object_type", "object_id",
                    "reason")
    list_filter = ("action",)
    search_fields = ("=object_id", "=actor_username")
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[AuditEvent]:
        return super().get_queryset(request).filter(tenant__isnull=True)

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        return super().changelist_view(
            request, {**(extra_context or {}), "title": "Audit events on no tenant"})

    def has_view_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return request.user.is_active and request.user.is_superuser

    # The trail is append-only (a trigger refuses changes); here it is only read.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False
