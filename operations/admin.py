from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from operations.models import Tenant
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
