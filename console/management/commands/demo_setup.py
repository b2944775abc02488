from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from console.roles import ADMIN, APPROVER, AUDITOR, OPERATOR, role_grant, roles_setup
from operations.engine import operation_prepare
from operations.ids import new_id
from operations.intents import intent_canonical
from operations.models import Checkpoint, Operation, Run, RunStatus
from operations.services import audit_actor_from_shell, tenant_create

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
        # The tenants, grants and intents it makes are on the audit trail under the shell's
        # user, as grant's and `operations prepare`'s are: not under no one.
        with audit_actor_from_shell():
            self._setup()

    def _setup(self) -> None:
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
                    role_grant(user=user, role=role, tenant=tenants[slug], reason="demo setup")
                elif settings.DEMO_PASSWORD:
                    # An explicit DEMO_PASSWORD is the operator's wish on every start.
                    user.set_password(password)
                    user.save(update_fields=["password"])
        intents = self._demo_intents(tenants)
        if intents:
            self.stdout.write(f"demo intents waiting for approval: {intents}")
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

    def _demo_intents(self, tenants) -> int:
        """Intents an approver can act on right away, made by the real engine (once)."""
        if Operation.objects.exists():
            return 0
        count = 0
        for slug, invoices in (
            (
                "acme",
                (
                    ("inv_9182", "vendor_778812345", 1250000, "KZT"),
                    ("inv_9190", "vendor_550012399", 89900, "EUR"),
                ),
            ),
            ("globex", (("inv_4410", "supplier_330017", 420000, "USD"),)),
        ):
            tenant = tenants[slug]
            run = Run.objects.create(
                conversation_id=new_id("conv"),
                tenant=tenant,
                workflow_name="pay_invoices",
                workflow_version=7,
                state_schema_version=4,
                status=RunStatus.WAITING_APPROVAL,
            )
            for n, (invoice, beneficiary, amount, currency) in enumerate(invoices, start=1):
                payload = {
                    "invoice_id": invoice,
                    "beneficiary_id": beneficiary,
                    "amount_minor": amount,
                    "currency": currency,
                }
                state = {"invoice": invoice, "proposed_payment": payload}
                checkpoint = Checkpoint.objects.create(
                    run=run,
                    sequence=n,
                    node="prepare_payment",
                    state=state,
                    state_hash=intent_canonical(
                        action="checkpoint", tenant=slug, payload=state, policy_version="-"
                    )[1],
                )
                op = operation_prepare(
                    tenant=tenant,
                    action="payments.create",
                    payload=payload,
                    run=run,
                    checkpoint=checkpoint,
                    command_id=f"cmd_pay_{n:02d}",
                )
                count += 1
                if n == 1 and slug == "acme":
                    # The agent re-read the invoice and changed the amount: a new intent that
                    # supersedes the first, shown to the approver as a diff.
                    operation_prepare(
                        tenant=tenant,
                        action="payments.create",
                        payload={**payload, "amount_minor": amount + 150000},
                        supersedes=op,
                    )  # it replaces the first: still one intent waiting
        return count
