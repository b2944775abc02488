from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from console.roles import ADMIN, APPROVER, AUDITOR, OPERATOR, role_grant, roles_setup
from operations.services import tenant_create

DEMO_USERS = (
    ("approver", APPROVER, "acme"),
    ("operator", OPERATOR, "acme"),
    ("auditor", AUDITOR, "acme"),
    ("admin", ADMIN, "acme"),
    ("approver2", APPROVER, "globex"),
)


class Command(BaseCommand):
    help = "Create the demo tenants (acme, globex) and demo users. Only with DEBUG on."

    def handle(self, *args, **options) -> None:
        if not settings.DEBUG:
            raise CommandError("demo users are never created when DEBUG is off")
        User = get_user_model()
        roles_setup()
        tenants = {
            "acme": tenant_create(slug="acme", name="Acme Corp", legal_entity="Acme Corp LLP"),
            "globex": tenant_create(
                slug="globex", name="Globex", legal_entity="Globex Holdings Ltd"
            ),
        }
        password = settings.DEMO_PASSWORD
        generated = not password
        if generated:
            password = secrets.token_urlsafe(12)
        created = []
        with transaction.atomic():
            for username, role, slug in DEMO_USERS:
                user, was_created = User.objects.get_or_create(username=username)
                if was_created:
                    user.set_password(password)
                    user.save(update_fields=["password"])
                    created.append(username)
                    role_grant(
                        user=user, role=role, tenant=tenants[slug], reason="demo setup"
                    )
                elif settings.DEMO_PASSWORD:
                    # An explicit DEMO_PASSWORD is the operator's wish on every start.
                    user.set_password(password)
                    user.save(update_fields=["password"])
        if created:
            self.stdout.write(f"demo users created: {', '.join(created)}")
            if generated:
                self.stdout.write(
                    self.style.WARNING(
                        f"demo password (shown once, set DEMO_PASSWORD to choose): {password}"
                    )
                )
        else:
            self.stdout.write("demo users already exist")
