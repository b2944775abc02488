"""The canonical intent: validation, canonical JSON + hash, masking and diffs for people.

An intent is what a person approves. It is validated strictly (a missing, extra or wrongly
typed field is refused), it must never carry a card number or a secret (so none reaches the
journal), and its hash is taken over RFC 8785 canonical JSON so the same intent always hashes
the same, whatever key order or whitespace it arrived with.
"""

from __future__ import annotations

from operations.intents.display import (
    DealFoundRow,
    DiffRow,
    IntentRow,
    deal_found_rows,
    intent_diff,
    intent_rows,
    intent_summary,
    major_units,
    mask_digits,
    mask_email,
    mask_inline,
    mask_person_text,
    mask_reference,
    mask_text,
    money_format,
    payload_fingerprint,
    payload_hashes_fingerprinted,
    state_fingerprint,
    words_given_back,
)
from operations.intents.validation import (
    DEAL_PATCH_FIELDS,
    IDENTIFIER,
    MAX_INTENT_BYTES,
    SCHEMAS,
    Field,
    IntentError,
    idempotency_key_for,
    intent_canonical,
    intent_validate,
    secret_in_text,
    secret_may_be_in,
    secrets_marked,
)

__all__ = [
    "DEAL_PATCH_FIELDS",
    "IDENTIFIER",
    "MAX_INTENT_BYTES",
    "SCHEMAS",
    "DealFoundRow",
    "DiffRow",
    "Field",
    "IntentError",
    "IntentRow",
    "deal_found_rows",
    "idempotency_key_for",
    "intent_canonical",
    "intent_diff",
    "intent_rows",
    "intent_summary",
    "intent_validate",
    "major_units",
    "mask_digits",
    "mask_email",
    "mask_inline",
    "mask_person_text",
    "mask_reference",
    "mask_text",
    "money_format",
    "payload_fingerprint",
    "payload_hashes_fingerprinted",
    "secret_in_text",
    "secret_may_be_in",
    "secrets_marked",
    "state_fingerprint",
    "words_given_back",
]
