"""The canonical intent: validation, canonical JSON + hash, masking and diffs for people.

An intent is what a person approves. It is validated strictly (a missing, extra or wrongly
typed field is refused), it must never carry a card number or a secret (so none reaches the
journal), and its hash is taken over RFC 8785 canonical JSON so the same intent always hashes
the same, whatever key order or whitespace it arrived with.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import rfc8785

from operations.models import Action


class IntentError(ValueError):
    """The intent is malformed or carries something that must never be journaled."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: type | tuple[type, ...]
    label: str
    mask: str = ""  # "", "email", "digits", "params", "patch", "inline"
    minimum: int | None = None


_CURRENCY = re.compile(r"^[A-Z]{3}$")
# A provider's id (deal_…): it becomes one segment of the provider's URL.
_PROVIDER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,119}")
# An intent names an effect and its references, never a document: past this, a person could
# not review it on an approval card, and scanning it for card data would cost seconds.
MAX_INTENT_BYTES = 32 * 1024
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# An address inside longer text ("Renewal for jane.doe@example.com"), and a long run of
# digits there (an account or phone number): masked where they stand.
_EMBEDDED_EMAIL = re.compile(r"[^@\s,;:<>()\[\]\"']+@[^@\s,;:<>()\[\]\"']+\.[A-Za-z]{2,}")
# What stands between the groups of a number as people write it ("4111 1111 …", "4111-1111…",
# "4111.1111…") and as text pasted from elsewhere carries it: tabs, non-breaking or repeated
# spaces, line breaks, typographic dashes.
_NUMBER_SEPARATORS = r"\s.\-\u2010-\u2015\u2212\ufe63\uff0d"
_EMBEDDED_DIGITS = re.compile(rf"\d(?:[\d{_NUMBER_SEPARATORS}]*\d)?")

SCHEMAS: dict[str, tuple[Field, ...]] = {
    Action.PAYMENTS_CREATE: (
        Field("invoice_id", str, "Invoice"),
        Field("beneficiary_id", str, "Beneficiary", mask="digits"),
        Field("amount_minor", int, "Amount", minimum=1),
        Field("currency", str, "Currency"),
    ),
    Action.CRM_CREATE_DEAL: (
        Field("name", str, "Deal name", mask="inline"),
        Field("amount_minor", int, "Amount", minimum=0),
        Field("currency", str, "Currency"),
        Field("owner", str, "Owner", mask="email"),
    ),
    Action.CRM_UPDATE_DEAL: (
        Field("target", str, "Deal"),
        Field("expected_version", int, "Expected version", minimum=0),
        Field("patch", dict, "Change", mask="patch"),
    ),
    Action.MAIL_SEND: (
        Field("to", str, "Recipient", mask="email"),
        Field("template", str, "Template"),
        Field("params", dict, "Template parameters", mask="params"),
    ),
}

# Minor-unit exponents (ISO 4217) for the currencies that are not 2.
_EXPONENT = {
    "JPY": 0,
    "KRW": 0,
    "VND": 0,
    "CLP": 0,
    "ISK": 0,
    "BHD": 3,
    "KWD": 3,
    "OMR": 3,
    "JOD": 3,
    "TND": 3,
}

# Names that only ever hold secrets or card data, as the last word of a field name
# (`client_secret`, `apiKey`, `card-number`), never inside a word (`timespan`).
_SECRET_NAMES = re.compile(
    r"(?:^|_)(password|passwd|secret|token|api_?key|card_?number|pan|cvv|cvc|iban_full)$"
)
_SECRET_VALUES = (
    (re.compile(r"\b(sk|rk)_(live|test)_[0-9A-Za-z]{8,}"), "an API secret key"),
    (re.compile(r"\bwhsec_[0-9A-Za-z]{8,}"), "a webhook secret"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\bBearer\s+[A-Za-z0-9\-._~+/]{16,}"), "a bearer token"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "a JWT"),
    (re.compile(r"\b(ghp|gho|github_pat)_[A-Za-z0-9_]{20,}"), "an access token"),
    (re.compile(r"\bxox[abpr]-[A-Za-z0-9-]{10,}"), "an access token"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "a cloud access key"),
)
# Digits in groups, however they are separated: "4111 1111 1111 1111", "4111 - 1111 - …".
_DIGIT_GROUPS = re.compile(rf"\d+(?:[{_NUMBER_SEPARATORS}]+\d+)*")
_GROUP_SEPARATOR = re.compile(rf"[{_NUMBER_SEPARATORS}]+")
# JSON's safe integers: beyond them a number is not the same number everywhere (RFC 8785).
_MAX_SAFE_INTEGER = 2**53 - 1


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2 == 1:
            n *= 2
            if n > 9:
                n -= 9
        total += n
    return total % 10 == 0


def _field_words(name: str) -> str:
    """`userPassword`, `user-password`, `user.password` → `user_password`."""
    return re.sub(r"[^a-z0-9]+", "_", re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower())


def _holds_card_number(text: str) -> bool:
    """A Luhn-valid 13 to 19 digit number made of whole digit groups anywhere in the text: the
    card in "paid 2024 4111 1111 1111 1111" is found though a year stands before it."""
    for match in _DIGIT_GROUPS.finditer(text):
        groups = _GROUP_SEPARATOR.split(match.group())
        for start in range(len(groups)):
            digits = ""
            # Indexed, not sliced: a slice per start copies the rest of the groups, which a
            # long run of "1 1 1 …" turns into seconds of CPU per intent.
            for index in range(start, len(groups)):
                digits += groups[index]
                if len(digits) > 19:
                    break
                if len(digits) >= 13 and _luhn_ok(digits):
                    return True
    return False


# The schemas' own numbers: an amount or a version is never card data, however long.
_TYPED_NUMBERS = frozenset({"amount_minor", "expected_version"})
# Where they stand in an intent: a key of the same name inside free parameters is not one.
_TYPED_NUMBER_PATHS = frozenset(
    {"payload.amount_minor", "payload.expected_version", "payload.patch.amount_minor"}
)


def _refuse_secrets(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if _SECRET_NAMES.search(_field_words(str(key))):
                raise IntentError(f"{path}.{key}: a field named like a secret is not allowed")
            # A key is journaled and shown like a value: a card or a secret there is refused
            # too, and the refusal does not repeat it.
            problem = secret_in_text(str(key))
            if problem:
                raise IntentError(f"{path}: a key looks like {problem}")
            if f"{path}.{key}" in _TYPED_NUMBER_PATHS and isinstance(inner, int):
                continue
            _refuse_secrets(inner, f"{path}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            _refuse_secrets(inner, f"{path}[{i}]")
    elif isinstance(value, (int, str)) and not isinstance(value, bool):
        if _holds_card_number(value if isinstance(value, str) else str(abs(value))):
            raise IntentError(
                f"{path}: looks like a full card number; intents carry references, "
                "never card data"
            )
    if isinstance(value, str):
        for pattern, what in _SECRET_VALUES:
            if pattern.search(value):
                raise IntentError(f"{path}: looks like {what}; secrets never enter the journal")


def secret_in_text(text: str) -> str:
    """What a person's own words (a reason, evidence, a comment) must not carry into the
    journal and the audit trail, which every viewer reads: "" when clean."""
    if _holds_card_number(text):
        return "a full card number; write only its last four digits"
    for pattern, what in _SECRET_VALUES:
        if pattern.search(text):
            return f"{what}; secrets never enter the journal"
    return ""


def _plain_json(value: Any, path: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_SAFE_INTEGER:
        raise IntentError(f"{path}: integers must be within ±{_MAX_SAFE_INTEGER}")
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        raise IntentError(f"{path}: floats are not allowed; money is integer minor units")
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise IntentError(f"{path}: keys must be strings")
            _plain_json(inner, f"{path}.{key}")
        return
    if isinstance(value, list):
        for i, inner in enumerate(value):
            _plain_json(inner, f"{path}[{i}]")
        return
    raise IntentError(f"{path}: {type(value).__name__} is not a JSON value")


def intent_validate(*, action: str, payload: Any) -> dict[str, Any]:
    """Return the payload if it is a valid intent for `action`, else raise IntentError."""
    if action not in SCHEMAS:
        raise IntentError(f"unknown action {action!r}; known: {', '.join(sorted(SCHEMAS))}")
    if not isinstance(payload, Mapping):
        raise IntentError("payload must be a JSON object")
    fields = {f.name: f for f in SCHEMAS[action]}
    missing = sorted(set(fields) - set(payload))
    if missing:
        raise IntentError(f"{action}: missing field(s): {', '.join(missing)}")
    extra = sorted(set(payload) - set(fields))
    if extra:
        raise IntentError(f"{action}: unexpected field(s): {', '.join(extra)}")
    for name, spec in fields.items():
        value = payload[name]
        # bool is an int in Python; an amount of `true` is a mistake, not a number.
        if isinstance(value, bool) or not isinstance(value, spec.kind):
            expected = spec.kind.__name__ if isinstance(spec.kind, type) else "value"
            raise IntentError(f"{action}: {name} must be {_kind_word(expected)}")
        if isinstance(value, str) and not value.strip():
            raise IntentError(f"{action}: {name} must not be empty")
        if spec.minimum is not None and value < spec.minimum:
            raise IntentError(f"{action}: {name} must be at least {spec.minimum}")
        _plain_json(value, name)
    if "currency" in fields and not _CURRENCY.match(payload["currency"]):
        raise IntentError(f"{action}: currency must be an ISO 4217 code such as KZT or EUR")
    if action == Action.MAIL_SEND and not _EMAIL.match(payload["to"]):
        raise IntentError(f"{action}: to must be an email address")
    if action == Action.CRM_UPDATE_DEAL:
        if not _PROVIDER_ID.fullmatch(payload["target"]):
            raise IntentError(
                f"{action}: target must be the deal's id (letters, digits and _ . : - only)"
            )
        _deal_patch_validate(payload["patch"], action=action)
    size = len(rfc8785.dumps(dict(payload)))
    if size > MAX_INTENT_BYTES:
        raise IntentError(
            f"{action}: the intent is {size} bytes, more than {MAX_INTENT_BYTES}; an intent "
            "carries references, not documents"
        )
    _refuse_secrets(dict(payload), "payload")
    return dict(payload)


# What a deal change may set, and of which type (the fields of crm.create_deal, and stage).
DEAL_PATCH_FIELDS: dict[str, type] = {
    "name": str, "amount_minor": int, "currency": str, "owner": str, "stage": str,
}


def _deal_patch_validate(patch: Mapping[str, Any], *, action: str) -> None:
    if not patch:
        raise IntentError(f"{action}: patch must change at least one field")
    unknown = sorted(set(patch) - set(DEAL_PATCH_FIELDS))
    if unknown:
        raise IntentError(
            f"{action}: patch cannot change {', '.join(unknown)}; "
            f"it may change {', '.join(DEAL_PATCH_FIELDS)}"
        )
    for name, value in patch.items():
        kind = DEAL_PATCH_FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise IntentError(f"{action}: patch.{name} must be {_kind_word(kind.__name__)}")
        if name == "amount_minor" and value < 0:
            raise IntentError(f"{action}: patch.amount_minor must be at least 0")
        if name == "currency" and not _CURRENCY.match(value):
            raise IntentError(f"{action}: patch.currency must be an ISO 4217 code such as EUR")
        if name in ("name", "stage") and not value.strip():
            raise IntentError(f"{action}: patch.{name} must not be empty")


def _kind_word(name: str) -> str:
    return {"int": "an integer", "str": "a string", "dict": "an object"}.get(name, name)


def intent_canonical(
    *, action: str, tenant: str, payload: Mapping[str, Any], policy_version: str
) -> tuple[str, str]:
    """Canonical JSON (RFC 8785) of the whole intent, and its `sha256:` hash."""
    document = {
        "action": action,
        "tenant": tenant,
        "payload": dict(payload),
        "policy_version": policy_version,
    }
    canonical = rfc8785.dumps(document)
    return canonical.decode(), "sha256:" + hashlib.sha256(canonical).hexdigest()


def idempotency_key_for(*, operation_id: str, action: str, run_id: str, command_id: str) -> str:
    """Derived from the operation, never per attempt: every retry of it sends this key."""
    raw = f"{run_id or '-'}:{action}:{command_id or '-'}:{operation_id}".encode()
    return "ik_" + hashlib.sha256(raw).hexdigest()[:40]


# --- what a person sees ---------------------------------------------------------------


def major_units(amount_minor: int, currency: str) -> Decimal:
    """An amount in the currency's own units (ISO 4217 exponent): 1250000 KZT → 12500."""
    return Decimal(amount_minor).scaleb(-_EXPONENT.get(currency.upper(), 2))


def money_format(amount_minor: int, currency: str) -> str:
    return f"{major_units(amount_minor, currency):,f} {currency}"


def mask_email(value: str) -> str:
    local, _, domain = value.partition("@")
    if not domain:
        return mask_text(value)
    return f"{local[:1]}***@{domain}"


def mask_digits(value: str) -> str:
    """Keep the last four characters of anything holding a long run of digits."""
    if sum(ch.isdigit() for ch in value) < 6:
        return value
    return "••••" + value[-4:]


def mask_text(value: str) -> str:
    if len(value) <= 2:
        return "***"
    return value[:1] + "***" + value[-1:]


def mask_inline(text: str) -> str:
    """Text a person must read (a deal's name), with what is personal in it masked."""
    text = _EMBEDDED_EMAIL.sub(lambda m: mask_email(m.group()), text)
    return _EMBEDDED_DIGITS.sub(
        lambda m: mask_digits(m.group()) if sum(c.isdigit() for c in m.group()) >= 6
        else m.group(),
        text,
    )


def _mask_value(value: Any, how: str) -> str:
    if how == "inline":
        return mask_inline(str(value))
    if how == "email":
        return mask_email(str(value)) if _EMAIL.match(str(value)) else mask_text(str(value))
    if how == "digits":
        return mask_digits(str(value))
    if how == "params":
        if isinstance(value, Mapping):
            return _params(value, masked=True)
        return mask_text(str(value))
    if how == "patch":
        return _patch(value, masked=True)
    return _display(value)


def _nested(value: Any, *, masked: bool, mask_plain_text: bool = False) -> str:
    """Nested values laid out one way, masked or not. Masked, emails and account-like
    numbers are masked at any depth; other text is masked too where it is free text about a
    person (template parameters), and kept where it is what the approver must read (the
    fields a deal change moves)."""
    if isinstance(value, Mapping):
        inner = (
            f"{_key(k, masked=masked)}: "
            f"{_nested(v, masked=masked, mask_plain_text=mask_plain_text)}"
            for k, v in sorted(value.items())
        )
        return "{" + ", ".join(inner) + "}"
    if isinstance(value, list):
        inner = (_nested(v, masked=masked, mask_plain_text=mask_plain_text) for v in value)
        return "[" + ", ".join(inner) + "]"
    if not masked:
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        # An account or phone number sent as a JSON number is still one.
        return mask_digits(str(value))
    if isinstance(value, str):
        if _EMAIL.match(value):
            return mask_email(value)
        if sum(ch.isdigit() for ch in value) >= 6:
            return mask_digits(value)
        if mask_plain_text:
            return mask_text(value)
        return mask_inline(value)
    return str(value)


def _key(key: str, *, masked: bool) -> str:
    """A key can hold what a value can (an address, an account or phone number): masked
    where it stands, as inside a deal's name."""
    return mask_inline(key) if masked else key


def _params(value: Mapping[str, Any], *, masked: bool) -> str:
    """Template parameters: free text about a person, masked whole unless asked."""
    return ", ".join(
        f"{_key(k, masked=masked)}: {_nested(v, masked=masked, mask_plain_text=True)}"
        for k, v in sorted(value.items())
    )


def _patch(value: Mapping[str, Any], *, masked: bool) -> str:
    """A deal change stays readable (the approver must see what moves). Masked, except what
    is personal: a field the deal schema masks (the owner's email), and anything that looks
    like an email address or an account number wherever it sits."""
    masks = {f.name: f.mask for f in SCHEMAS[Action.CRM_CREATE_DEAL]}

    def shown(name: str, moved: Any) -> str:
        if name in _TYPED_NUMBERS and isinstance(moved, int):
            return _patch_amount(value, moved)  # what the approver must see move
        if masked and masks.get(name):
            return _mask_value(moved, masks[name])
        return _nested(moved, masked=masked)

    return ", ".join(
        f"{_key(k, masked=masked)} → {shown(k, v)}" for k, v in sorted(value.items())
    )


def _patch_amount(patch: Mapping[str, Any], amount_minor: int) -> str:
    currency = patch.get("currency")
    if isinstance(currency, str) and _CURRENCY.match(currency):
        return money_format(amount_minor, currency)
    # The deal keeps its own currency, which the change does not name.
    return f"{amount_minor} in minor units of the deal's currency"


def _display(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} → {_display(v)}" for k, v in sorted(value.items()))
    return str(value)


@dataclass(frozen=True)
class IntentRow:
    name: str
    label: str
    value: str


def intent_rows(
    *, action: str, payload: Mapping[str, Any], unmasked: bool = False
) -> list[IntentRow]:
    """The intent as a person reads it: labelled, money formatted, masked by default."""
    rows: list[IntentRow] = []
    for spec in SCHEMAS.get(action, ()):
        if spec.name not in payload:
            continue
        value = payload[spec.name]
        if spec.name == "currency":
            continue  # shown with the amount
        if spec.name == "amount_minor":
            shown = money_format(value, payload.get("currency", ""))
        elif unmasked and spec.mask == "patch" and isinstance(value, Mapping):
            shown = _patch(value, masked=False)
        elif unmasked and spec.mask == "params" and isinstance(value, Mapping):
            shown = _params(value, masked=False)
        elif unmasked:
            shown = _display(value)
        else:
            shown = _mask_value(value, spec.mask)
        rows.append(IntentRow(spec.name, spec.label, shown))
    return rows


def intent_summary(*, action: str, payload: Mapping[str, Any], unmasked: bool = False) -> str:
    """One line, masked unless asked: 'Pay 12,500.00 KZT to ••••r_77 for invoice inv_9182'."""
    p = payload

    def shown(value: str, mask: Any) -> str:
        return value if unmasked else mask(value)

    if action == Action.PAYMENTS_CREATE:
        return (
            f"Pay {money_format(p['amount_minor'], p['currency'])} to "
            f"{shown(p['beneficiary_id'], mask_digits)} for invoice {p['invoice_id']}"
        )
    if action == Action.CRM_CREATE_DEAL:
        return (
            f"Create deal “{shown(p['name'], mask_inline)}” worth "
            f"{money_format(p['amount_minor'], p['currency'])}"
        )
    if action == Action.CRM_UPDATE_DEAL:
        return (
            f"Change deal {p['target']} (version {p['expected_version']}): "
            f"{_patch(p['patch'], masked=not unmasked)}"
        )
    if action == Action.MAIL_SEND:
        return f"Email “{p['template']}” to {shown(p['to'], mask_email)}"
    return action


@dataclass(frozen=True)
class DiffRow:
    label: str
    old: str
    new: str


def intent_diff(
    *,
    action: str,
    old_payload: Mapping[str, Any],
    new_payload: Mapping[str, Any],
    old_policy: str = "",
    new_policy: str = "",
    unmasked: bool = False,
) -> list[DiffRow]:
    """Field-by-field changes between two intents, masked the same way as the intent."""
    old_rows = {
        r.name: r for r in intent_rows(action=action, payload=old_payload, unmasked=unmasked)
    }
    new_rows = {
        r.name: r for r in intent_rows(action=action, payload=new_payload, unmasked=unmasked)
    }
    diff = []
    for spec in SCHEMAS.get(action, ()):
        if spec.name == "currency":
            if old_payload.get("currency") != new_payload.get("currency"):
                diff.append(
                    DiffRow(
                        "Currency",
                        str(old_payload.get("currency")),
                        str(new_payload.get("currency")),
                    )
                )
            continue
        old = old_rows.get(spec.name)
        new = new_rows.get(spec.name)
        old_shown, new_shown = old.value if old else "—", new.value if new else "—"
        if old_payload.get(spec.name) == new_payload.get(spec.name):
            # Unchanged, unless it reads differently: the same minor units in a currency
            # of another exponent are another amount (1,250,000 minor units: KZT → JPY).
            if old_shown != new_shown:
                diff.append(DiffRow(spec.label, old_shown, new_shown))
            continue
        if old_shown == new_shown:
            # Different values that mask alike (same last four): say so, or the approver
            # would see a change row that shows no change.
            new_shown += " (changed in the masked part)"
        diff.append(DiffRow(spec.label, old_shown, new_shown))
    if old_policy != new_policy:
        diff.append(DiffRow("Policy version", old_policy, new_policy))
    return diff
