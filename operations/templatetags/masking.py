"""What a person typed, and the hash of an intent, as the masked views show them."""

from __future__ import annotations

from typing import Any

from django import template

from operations.intents import mask_person_text, payload_fingerprint, state_fingerprint

register = template.Library()


@register.filter
def masked_unless(value: Any, unmasked: Any) -> Any:
    """`{{ reason|masked_unless:unmasked }}`: masked (email addresses, account and phone
    numbers) except on the audited unmasked view; a page without `unmasked` is masked."""
    if unmasked or not value:
        return value
    return mask_person_text(str(value))


@register.filter
def payload_hash_shown(value: Any, unmasked: Any) -> str:
    """`{{ op.payload_hash|payload_hash_shown:unmasked }}`: the hash itself on the audited
    unmasked view only; elsewhere its keyed fingerprint, from which the masked values of the
    intent cannot be guessed back."""
    if unmasked or not value:
        return value or ""
    return payload_fingerprint(str(value))


@register.filter
def state_hash_shown(value: Any) -> str:
    """`{{ cp.state_hash|state_hash_shown }}`: a checkpoint's state hash as its keyed
    fingerprint, the only form any page shows (none shows a state unmasked)."""
    return state_fingerprint(str(value)) if value else ""
