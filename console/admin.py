from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils.decorators import method_decorator
from django.views.decorators.debug import sensitive_post_parameters

from console.roles import (
    group_delete,
    group_save,
    user_create,
    user_delete,
    user_password_record,
    user_save,
)

User = get_user_model()

# The admin asks for no reason; the trail says where the deletion came from.
DELETED_IN_ADMIN = "user deleted in /admin/"


class AuditedUserAdmin(UserAdmin):
    """Django's user admin, with what it does to a person's access on the audit trail of
    each tenant they hold a role on, as `manage.py grant` puts it there."""

    def save_model(self, request: HttpRequest, obj, form: Any, change: bool) -> None:
        if not change:
            user_create(user=obj, actor=request.user)
        # A change is saved with its groups and permissions (save_related): one event on the
        # trail says all that one save changed.

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        if not change:
            super().save_related(request, form, formsets, change)
            return
        user_save(user=form.instance, actor=request.user,
                  save_related=lambda: super(AuditedUserAdmin, self).save_related(
                      request, form, formsets, change))

    @method_decorator(sensitive_post_parameters())
    def user_change_password(
        self, request: HttpRequest, id: str, form_url: str = ""
    ) -> HttpResponse:
        # The stock view saves the password outside any transaction and says nothing of it
        # to the audit trail: here the new password and its audit events commit together.
        with transaction.atomic():
            user = self.get_object(request, unquote(id))
            passwords = User.objects.select_for_update(no_key=True).values_list(
                "password", flat=True)
            before = passwords.get(pk=user.pk) if user is not None else None
            response = super().user_change_password(request, id, form_url)
            if user is not None:
                user.refresh_from_db(fields=["password"])
                # Set again to the same words, it is hashed with a new salt: still recorded.
                if user.password != before:
                    user_password_record(user=user, actor=request.user)
            return response

    def delete_model(self, request: HttpRequest, obj) -> None:
        user_delete(user=obj, actor=request.user, reason=DELETED_IN_ADMIN)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        # "Delete selected" deletes all of them or none, as the stock action does.
        with transaction.atomic():
            for user in queryset:
                user_delete(user=user, actor=request.user, reason=DELETED_IN_ADMIN)


class AuditedGroupAdmin(GroupAdmin):
    """Django's group admin, with a group made, renamed, given or taken permissions, or
    deleted on the trail: every member holds what it gives."""

    def save_model(self, request: HttpRequest, obj: Group, form: Any, change: bool) -> None:
        # Saved with its permissions (save_related): one event says all one save changed.
        pass

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        group_save(group=form.instance, actor=request.user,
                   save_related=lambda: super(AuditedGroupAdmin, self).save_related(
                       request, form, formsets, change))

    def delete_model(self, request: HttpRequest, obj: Group) -> None:
        group_delete(group=obj, actor=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        with transaction.atomic():
            for group in queryset:
                group_delete(group=group, actor=request.user)


admin.site.unregister(User)
admin.site.register(User, AuditedUserAdmin)
admin.site.unregister(Group)
admin.site.register(Group, AuditedGroupAdmin)
