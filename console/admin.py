from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest

from console.roles import user_delete

User = get_user_model()

# The admin asks for no reason; the trail says where the deletion came from.
DELETED_IN_ADMIN = "user deleted in /admin/"


class AuditedUserAdmin(UserAdmin):
    """Django's user admin, with what it does to a person's access on the audit trail of
    each tenant they hold a role on, as `manage.py grant` puts it there."""

    def delete_model(self, request: HttpRequest, obj) -> None:
        user_delete(user=obj, actor=request.user, reason=DELETED_IN_ADMIN)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        # "Delete selected" deletes all of them or none, as the stock action does.
        with transaction.atomic():
            for user in queryset:
                user_delete(user=user, actor=request.user, reason=DELETED_IN_ADMIN)


admin.site.unregister(User)
admin.site.register(User, AuditedUserAdmin)
