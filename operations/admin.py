from __future__ import annotations

from django.contrib import admin
from guardian.admin import GuardedModelAdmin

from operations.models import Tenant


@admin.register(Tenant)
class TenantAdmin(GuardedModelAdmin):
    list_display = ("slug", "name", "legal_entity", "created_at")
