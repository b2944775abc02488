"""Switch a sandbox fault on (or off) from a terminal, for a demo or a manual test."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from operations.sandbox.models import FaultKind, Provider
from operations.sandbox.services import sandbox_fault_clear, sandbox_fault_set


class Command(BaseCommand):
    help = "Inject a fault into a sandbox provider: sandbox_fault PROVIDER KIND [--match OP]"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("provider", choices=Provider.values)
        parser.add_argument(
            "kind", choices=[*FaultKind.values, "clear"], metavar="KIND",
            help="; ".join([*(f"{kind}: {label}" for kind, label in FaultKind.choices),
                            "clear: remove the provider's faults"]),
        )
        parser.add_argument(
            "--match", default="*", help='an operation id or an Idempotency-Key, or "*" for all'
        )
        parser.add_argument("--times", type=int, default=1)
        parser.add_argument("--seconds", type=float, default=None)
        parser.add_argument(
            "--kind", dest="clear_kind", choices=FaultKind.values, default=None,
            help="with clear: only this kind (stop the 5xx, keep the held-back webhooks)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        provider, kind, match = options["provider"], options["kind"], options["match"]
        if kind == "clear":
            deleted = sandbox_fault_clear(
                provider=provider, kind=options["clear_kind"], match=None if match == "*" else match
            )
            self.stdout.write(f"cleared {deleted} fault(s) of {provider}")
            return
        params = {} if options["seconds"] is None else {"seconds": options["seconds"]}
        try:
            fault = sandbox_fault_set(
                provider=provider, kind=kind, match=match, times=options["times"], **params
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"fault {fault.pk}: {fault}")
