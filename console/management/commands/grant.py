from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console.roles import UnknownRole, role_grant
from operations.models import Tenant


class Command(BaseCommand):
    help = "Grant ROLE on TENANT to USERNAME: grant USERNAME ROLE TENANT"

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("role")
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--reason", default="granted from the command line")

    def handle(self, *args, username: str, role: str, tenant: str, reason: str, **options):
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"no user named {username!r}") from None
        try:
            tenant_obj = Tenant.objects.get(slug=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {tenant!r}") from None
        try:
            perms = role_grant(user=user, role=role, tenant=tenant_obj, reason=reason)
        except UnknownRole as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"granted {role} on {tenant} to {username}: {', '.join(perms)}")
