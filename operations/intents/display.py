"""What a person sees of an intent: money in its units, masked values, rows, a summary, a diff."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.utils.crypto import salted_hmac

from operations.currencies import currency_exponent, currency_known
from operations.intents.validation import (
    DEAL_PATCH_FIELDS,
    EMAIL_ADDRESS,
    IBAN_PATTERN,
    NUMBER_SEPARATORS,
    SCHEMAS,
    TYPED_NUMBERS,
    secret_in_text,
)
from operations.models import Action

# An address inside longer text ("Renewal for jane.doe@example.com"), and a long run of
# digits there (an account or phone number): masked where they stand. A top-level domain is
# any letters, not only Latin ones (.рф, .中国).
_EMAIL_CHAR = r"[^@\s,;:<>()\[\]\"']"
_EMAIL_HERE = re.compile(rf"{_EMAIL_CHAR}++@{_EMAIL_CHAR}+\.[^\W\d_]{{2,}}")
# Tried only where a run of address characters begins: from inside a run the address would
# reach the same "@" and the same domain, so it fails where the run's start failed. Tried
# from every one, a valid deal name ("aaaa…@a.a.a.…") cost seconds per render, quadratic.
_EMBEDDED_EMAIL = re.compile(rf"(?<!{_EMAIL_CHAR}){_EMAIL_HERE.pattern}")
_EMBEDDED_DIGITS = re.compile(rf"\d(?:[\d{NUMBER_SEPARATORS}]*\d)?")

# Where the journal's rows name an intent's hash (an audit event's before and after).
PAYLOAD_HASH_FIELDS = frozenset({"payload_hash", "approved_hash", "authorized_hash"})


def payload_fingerprint(payload_hash: str) -> str:
    """A payload hash as shown to a person who may not see the intent unmasked: keyed
    (HMAC-SHA256 under SECRET_KEY), so an approval and its operation still compare equal.
    The hash itself is an unkeyed sha256 over the canonical intent, every other field of
    which the masked page shows: an account cut to its last four digits is back within a
    million guesses of its hidden ones."""
    return _keyed_fingerprint("operations.payload_fingerprint", payload_hash)


def state_fingerprint(state_hash: str) -> str:
    """A checkpoint's state hash as the run page shows it: keyed as `payload_fingerprint`
    is, under a key of its own. The state is what the agent held at that node (the
    invoice, the payee it was about to pay), which the same page shows masked in the intent
    it led to: its unkeyed sha256 gives the hidden digits back to whoever guesses them."""
    return _keyed_fingerprint("operations.state_fingerprint", state_hash)


def _keyed_fingerprint(key_salt: str, value: str) -> str:
    if not value:
        return ""
    return f"fp:{salted_hmac(key_salt, value, algorithm='sha256').hexdigest()}"


def payload_hashes_fingerprinted(value: Any) -> Any:
    """A journaled before/after with each payload hash in it (PAYLOAD_HASH_FIELDS) shown as
    its payload_fingerprint, at any depth."""
    if isinstance(value, Mapping):
        return {
            key: payload_fingerprint(inner)
            if key in PAYLOAD_HASH_FIELDS and isinstance(inner, str)
            else payload_hashes_fingerprinted(inner)
            for key, inner in value.items()
        }
    if isinstance(value, list):
        return [payload_hashes_fingerprinted(inner) for inner in value]
    return value


def major_units(amount_minor: int, currency: str) -> Decimal:
    """An amount in the currency's own units (ISO 4217 exponent): 1250000 KZT → 12500.
    A code that is no currency (a journaled intent from before codes were checked) counts
    its minor units whole: a policy's threshold in major units is then never passed under
    by a guessed exponent."""
    return Decimal(amount_minor).scaleb(-(currency_exponent(currency.upper()) or 0))


def money_format(amount_minor: int, currency: str) -> str:
    if currency_exponent(currency.upper()) is None:
        # Not shown as a sum: any exponent guessed would show the approver another amount.
        return f"{amount_minor} minor units of {currency or 'no named currency'}"
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


def mask_reference(value: str) -> str:
    """A reference to a payee or an account: cut to its last four where it holds an account
    number, as mask_digits does; else what is personal in it (an email address) masked where
    it stands. A payee is often named by its address alone."""
    if sum(ch.isdigit() for ch in value) >= 6:
        return mask_digits(value)
    return mask_inline(value)


def mask_text(value: str) -> str:
    if len(value) <= 2:
        return "***"
    return value[:1] + "***" + value[-1:]


def _emails_masked(text: str) -> str:
    parts: list[str] = []
    done = 0
    while True:
        # Right after an address the next may begin inside the same run
        # ("a@x.com/b@y.org"), where _EMBEDDED_EMAIL does not look: tried there once.
        found = (_EMAIL_HERE.match(text, done) if done else None) or _EMBEDDED_EMAIL.search(
            text, done
        )
        if found is None:
            parts.append(text[done:])
            return "".join(parts)
        parts += [text[done : found.start()], mask_email(found.group())]
        done = found.end()


def mask_inline(text: str) -> str:
    """Text that names something (a key, a payee, a state's field), with what is personal
    in it masked where it stands: an address, and any run of six digits or more. A deal's
    name is read as a person's words are (mask_person_text)."""
    return _EMBEDDED_DIGITS.sub(
        lambda m: mask_digits(m.group()) if sum(c.isdigit() for c in m.group()) >= 6
        else m.group(),
        _emails_masked(text),
    )


# A run of digits standing on its own (not inside an id such as pi_3Nk123… or a hash) that
# is long enough to be an account or phone number: ten digits or more, brackets allowed
# between groups as phone numbers are written. Matched first and kept: a date, with or
# without its time, so "2026-12-03 10:00" is not read as one number. An IBAN is masked
# however long, whether its check digits hold or not.
_DATE = r"\d{4}-\d{2}-\d{2}|\d{1,2}[./]\d{1,2}[./]\d{4}"
_PERSON_TEXT_NUMBERS = re.compile(
    rf"(?P<date>(?<!\w)(?:{_DATE})(?:[ T]\d{{1,2}}:\d{{2}}(?::\d{{2}})?)?)"
    rf"|(?P<iban>(?<!\w){IBAN_PATTERN}(?!\w))"
    rf"|(?P<digits>(?<!\w)\d(?:[\d{NUMBER_SEPARATORS}()]*\d)?(?!\w))"
)
_PERSON_TEXT_DIGITS = 10
# An amount is read, not hidden: a sum followed by its currency code ("1500000000 KZT", as
# the engine writes them), or written with its cents ("12 500 000.00"). Not a code before
# it: a label ("ACCT 4081…", "PHONE 8701…") reads just like one. Only a currency's code
# counts after it: any three capitals let "87012345678 SMS" or "… CEO" pass for a sum.
_CURRENCY_AFTER = re.compile(r" ?(?P<code>[A-Z]{3})(?![A-Za-z])")
_CENTS = re.compile(r"[.,]\d{2}$")
# Minor units of any sum an intent may hold (±2^53) have at most 16 digits; a longer run is
# an account however it is labelled.
_AMOUNT_DIGITS = 16


def _person_text_number(match: re.Match[str]) -> str:
    if match.group("iban"):
        return "••••" + match.group("iban")[-4:]
    digits = match.group("digits")
    if not digits or sum(c.isdigit() for c in digits) < _PERSON_TEXT_DIGITS:
        return match.group()
    text, end = match.string, match.end()
    currency = _CURRENCY_AFTER.match(text, end)
    amount_like = sum(c.isdigit() for c in digits) <= _AMOUNT_DIGITS and bool(
        (currency and currency_known(currency.group("code"))) or _CENTS.search(digits)
    )
    if amount_like:
        return digits
    return "••••" + digits[-4:]


def mask_person_text(text: str) -> str:
    """What a person typed (a reason, evidence, a comment), as a masked view shows it:
    email addresses and account or phone numbers in it masked where they stand. Their
    words are checked for card numbers and secrets when written; this is for what is only
    personal."""
    return _PERSON_TEXT_NUMBERS.sub(_person_text_number, _emails_masked(text))


def words_given_back(text: str) -> str:
    """What a person typed, refused for a card number or a secret, as the page may give it
    back to correct: the number cut to its last four digits as a masked view shows people's
    words; nothing, when that would still show card data or a secret. Given back whole, it
    would sit in the page htmx keeps in the browser's history store."""
    if not secret_in_text(text):
        return text
    masked = mask_person_text(text)
    return "" if secret_in_text(masked) else masked


def _mask_value(value: Any, how: str) -> str:
    if how == "person_text":
        return mask_person_text(str(value))
    if how == "email":
        return mask_email(str(value)) if EMAIL_ADDRESS.match(str(value)) else mask_text(str(value))
    if how == "reference":
        return mask_reference(str(value))
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
        if EMAIL_ADDRESS.match(value):
            return mask_email(value)
        if sum(ch.isdigit() for ch in value) >= 6:
            return mask_digits(value)
        if mask_plain_text:
            return mask_text(value)
        return mask_inline(value)
    return str(value)


# Direction embeddings, overrides and isolates: a message's parameters may hold them (text
# in Arabic or Hebrew), unlike the fields an approver compares. Shown as they are, one left
# open in a key or a value reorders every parameter after it on the card, all of them one
# line of text ("b: hello" read backwards); so the card names them where they stand.
_DIRECTION_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def _directions_named(text: str) -> str:
    return _DIRECTION_CONTROLS.sub(lambda found: f"⟨U+{ord(found.group()):04X}⟩", text)


def _key(key: str, *, masked: bool) -> str:
    """A key can hold what a value can (an address, an account or phone number): masked
    where it stands, its direction controls named."""
    return _directions_named(mask_inline(key) if masked else key)


def _params(value: Mapping[str, Any], *, masked: bool) -> str:
    """Template parameters: free text about a person, masked whole unless asked."""
    return ", ".join(
        f"{_key(k, masked=masked)}: {_param_value(value, k, masked=masked)}" for k in sorted(value)
    )


def _patch(value: Mapping[str, Any], *, masked: bool) -> str:
    """A deal change stays readable (the approver must see what moves). Masked, except what
    is personal: a field the deal schema masks (the owner's email), and anything that looks
    like an email address or an account number wherever it sits."""
    return ", ".join(
        f"{_key(k, masked=masked)} → {_patch_value(value, k, masked=masked)}"
        for k in sorted(value)
    )


def _patch_value(patch: Mapping[str, Any], name: str, *, masked: bool) -> str:
    """What one field of a deal change sets it to, as _patch shows it."""
    moved = patch[name]
    if name in TYPED_NUMBERS and isinstance(moved, int):
        return _patch_amount(patch, moved)  # what the approver must see move
    mask = _DEAL_FIELD_MASKS.get(name)
    if masked and mask:
        return _mask_value(moved, mask)
    return _nested(moved, masked=masked)


# How a deal change masks a field: as the deal's own schema does (the owner's email).
_DEAL_FIELD_MASKS = {f.name: f.mask for f in SCHEMAS[Action.CRM_CREATE_DEAL]}


def _param_value(params: Mapping[str, Any], name: str, *, masked: bool) -> str:
    """One template parameter, as _params shows it."""
    return _directions_named(_nested(params[name], masked=masked, mask_plain_text=True))


# One field of a deal change or of a message's parameters, as a person sees it.
FieldShown = Callable[..., str]
# The fields that are objects of their own fields (a deal change, a message's parameters):
# diffed field by field, so one that changed is a row of its own, and one whose change the
# mask hides says so even when another beside it visibly changed.
_KEYED_FIELDS: dict[str, FieldShown] = {"patch": _patch_value, "params": _param_value}


def _patch_amount(patch: Mapping[str, Any], amount_minor: int) -> str:
    currency = patch.get("currency")
    if isinstance(currency, str) and currency_known(currency):
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
            f"{shown(p['beneficiary_id'], mask_reference)} for invoice {p['invoice_id']}"
        )
    if action == Action.CRM_CREATE_DEAL:
        return (
            f"Create deal “{shown(p['name'], mask_person_text)}” worth "
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
class DealFoundRow:
    label: str
    found: str  # as the CRM held it when the conflict was met
    change: str  # what the intent sets it to; "" where it leaves the field as it is


# A deal's fields as a person reads them: its name, amount and owner as a new deal's intent
# labels them, and the stage a change may move.
_DEAL_LABELS = {
    **{f.name: f.label for f in SCHEMAS[Action.CRM_CREATE_DEAL]}, "stage": "Stage",
}


def deal_found_rows(
    *, action: str, payload: Mapping[str, Any], result: Mapping[str, Any] | None,
    unmasked: bool = False,
) -> list[DealFoundRow]:
    """The deal as a version conflict recorded it (`result["current"]`), field by field
    beside what a deal update intent (`payload`) sets, each masked as the intent's change
    is: what a person decides a new intent on. Empty when no conflict recorded a deal."""
    found = result.get("current") if isinstance(result, Mapping) else None
    if action != Action.CRM_UPDATE_DEAL or not isinstance(found, Mapping) or not found:
        return []
    patch = payload.get("patch")
    patch = patch if isinstance(patch, Mapping) else {}
    masked = not unmasked
    rows = [DealFoundRow(
        "Version", _nested(found.get("version", "—"), masked=masked),
        f"expects {_nested(payload.get('expected_version', '—'), masked=masked)}",
    )]
    for name in DEAL_PATCH_FIELDS:
        rows.append(DealFoundRow(
            _DEAL_LABELS.get(name, name),
            _patch_value(found, name, masked=masked) if found.get(name) is not None else "—",
            _patch_value(patch, name, masked=masked) if name in patch else "",
        ))
    return rows


@dataclass(frozen=True)
class DiffRow:
    label: str
    old: str
    new: str

    @property
    def name(self) -> str:
        """What changed, in a word: a deal change's "Change: owner" is its owner."""
        return self.label.rpartition(": ")[2]


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
        keyed = _KEYED_FIELDS.get(spec.name)
        old_value, new_value = old_payload.get(spec.name), new_payload.get(spec.name)
        if keyed and isinstance(old_value, Mapping) and isinstance(new_value, Mapping):
            diff.extend(_keyed_diff(spec.label, keyed, old_value, new_value, unmasked))
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


def _keyed_diff(
    label: str, shown: FieldShown, old: Mapping[str, Any], new: Mapping[str, Any],
    unmasked: bool,
) -> list[DiffRow]:
    rows = []
    for name in sorted(set(old) | set(new)):
        old_shown = shown(old, name, masked=not unmasked) if name in old else "—"
        new_shown = shown(new, name, masked=not unmasked) if name in new else "—"
        row_label = f"{label}: {_key(name, masked=not unmasked)}"
        if old.get(name, _ABSENT) == new.get(name, _ABSENT):
            # Unchanged, unless it reads otherwise: the same amount in a change that now
            # names another currency is another sum.
            if old_shown != new_shown:
                rows.append(DiffRow(row_label, old_shown, new_shown))
            continue
        if old_shown == new_shown:
            new_shown += " (changed in the masked part)"
        rows.append(DiffRow(row_label, old_shown, new_shown))
    return rows


_ABSENT = object()
