from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from console.celery import broker_connection_check
from console.tasks import ping


class Command(BaseCommand):
    help = "Send a ping task through the broker and wait for a worker to answer it."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--timeout", type=float, default=10.0)

    def handle(self, *args, timeout: float, **options) -> None:
        # The broker first, once: a broker that is down made the wait below retry its
        # connection for about 20 s, whatever the timeout, and then blame the workers.
        try:
            broker_connection_check(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - any failure means "unreachable"
            raise CommandError(f"the broker is unreachable: {exc}") from None
        try:
            answer = ping.delay().get(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - any failure means "no worker answered"
            raise CommandError(f"no worker answered within {timeout:g}s: {exc}") from None
        self.stdout.write(f"worker answered: {answer}")
