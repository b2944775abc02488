"""What every management command checks of the arguments it was given, before using them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError


def text_arguments_check(options: dict[str, Any]) -> None:
    """An argument that is not UTF-8 (a stray byte in a pasted id or name) reached the
    database driver as a lone surrogate and raised there, a traceback."""
    for name, value in options.items():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise CommandError(f"{name.replace('_', ' ')} is not UTF-8 text") from None
