from __future__ import annotations

from django.core.management.base import BaseCommand

from console.roles import roles_setup


class Command(BaseCommand):
    help = "Create the role groups (Approver, Operator, Auditor, Admin). Idempotent."

    def handle(self, *args, **options) -> None:
        groups = roles_setup()
        self.stdout.write("roles: " + ", ".join(g.name for g in groups))
