"""What a person typed, as the masked views show it."""

from __future__ import annotations

from typing import Any

from django import template

from operations.intents import mask_person_text

register = template.Library()


@register.filter
def masked_unless(value: Any, unmasked: Any) -> Any:
    """`{{ reason|masked_unless:unmasked }}`: masked (email addresses, account and phone
    numbers) except on the audited unmasked view; a page without `unmasked` is masked."""
    if unmasked or not value:
        return value
    return mask_person_text(str(value))
