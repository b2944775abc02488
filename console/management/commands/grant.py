from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console.roles import ReasonRefused, RoleNotHeld, UnknownRole, role_grant, role_revoke
from operations.management.arguments import text_arguments_check
from operations.models import Tenant
from operations.services import audit_actor_from_shell


class Command(BaseCommand):
    help = (
        "Grant ROLE on TENANT to USERNAME: grant USERNAME ROLE TENANT; "
        "take it back with --revoke"
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("role")
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--revoke", action="store_true", help="take the role away instead")
        parser.add_argument("--reason", default="", help="recorded on the audit trail")

    def handle(
        self, *args, username: str, role: str, tenant: str, revoke: bool, reason: str, **options
    ):
        text_arguments_check(
            {"username": username, "role": role, "tenant": tenant, "reason": reason, **options}
        )
        try:
            user = get_user_model().objects.get(username=username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"no user named {username!r}") from None
        try:
            tenant_obj = Tenant.objects.get(slug=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {tenant!r}") from None
        try:
            # The audit trail names the shell's user as who granted or revoked.
            with audit_actor_from_shell():
                if revoke:
                    removed = role_revoke(user=user, role=role, tenant=tenant_obj,
                                          reason=reason or "revoked from the command line")
                    self.stdout.write(
                        f"revoked {role} on {tenant} from {username}; permissions removed: "
                        f"{', '.join(removed) or 'none (other roles there still give them)'}"
                    )
                    return
                granted = role_grant(user=user, role=role, tenant=tenant_obj,
                                     reason=reason or "granted from the command line")
        except (UnknownRole, RoleNotHeld, ReasonRefused) as exc:
            raise CommandError(str(exc)) from None
        if granted.already_held:
            self.stdout.write(
                f"{username} already holds {role} on {tenant}: "
                + (f"gave back {', '.join(granted.restored)} (recorded)" if granted.restored
                   else "nothing recorded")
            )
            return
        self.stdout.write(
            f"granted {role} on {tenant} to {username}: {', '.join(granted.permissions)}"
        )
