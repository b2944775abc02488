#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from console.env import ConfigError

    try:
        from django.conf import settings

        settings.INSTALLED_APPS  # noqa: B018 - load settings now to report config errors
    except ConfigError as exc:
        # One line naming the variable, not a traceback.
        print(f"configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
