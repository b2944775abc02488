"""What an intent may be: its schema, strict validation, canonical JSON + hash, its key."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import regex
import rfc8785

from operations.currencies import currency_known
from operations.models import Action


class IntentError(ValueError):
    """The intent is malformed or carries something that must never be journaled."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: type | tuple[type, ...]
    label: str
    mask: str = ""  # "", "email", "reference", "params", "patch", "person_text"
    minimum: int | None = None


# An id as providers and the workflow runtime write them (deal_…, cmd_…): safe as one segment
# of a URL and shown as it is. Bounded by the caller: a deal id to 120, a command id by its
# column.
IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
# An intent names an effect and its references, never a document: past this, a person could
# not review it on an approval card, and scanning it for card data would cost seconds.
MAX_INTENT_BYTES = 32 * 1024
EMAIL_ADDRESS = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# Control characters: a line break in an invoice id forges a line in `operations list`, an
# escape sequence rewrites an operator's terminal. Text inside params may hold tabs and line
# breaks (a message's lines); a field shown on one line (an id, a name) holds none.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_LINE_BREAK = re.compile(r"[\t\n\r]")  # CR too: mail's own line end is CRLF
# Deeper than this, an intent is no reference a person reviews, and encoding it ran out of
# Python's stack at the insert (a traceback, not a refusal).
MAX_INTENT_DEPTH = 32
# Unicode's format characters (category Cf, as of Unicode 15): soft hyphens, zero-width spaces
# and joiners, direction marks, byte order marks. Invisible where text is shown, they can join
# the groups of a number unseen. Listed, not computed: `re` has no \p{Cf}, and scanning every
# code point at import costs a tenth of a second (a test holds this list to the running
# Python's Unicode data).
FORMAT_CHARACTERS = (
    r"\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    r"\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    r"\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
)
# What stands between the groups of a number as people write it ("4111 1111 …", "4111-1111…",
# "4111.1111…", "4111/1111…", "4111_1111…") and as text pasted from elsewhere carries it: tabs,
# non-breaking or repeated spaces, line breaks, typographic dashes, invisible format characters.
NUMBER_SEPARATORS = r"\s.\-_/\u2010-\u2015\u2212\ufe63\uff0d" + FORMAT_CHARACTERS
# Unseen too, though not format characters: the rest of Unicode's default-ignorable code
# points (the combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian
# and other variation selectors) and the blank braille pattern. "ven\u034fdor_77" reads as
# vendor_77. And the code points Unicode reserves as default-ignorable (U+2065, U+FFF0-FFF8,
# the rest of U+E0000-E0FFF): a text engine draws nothing for them, assigned or not.
_UNSEEN_NOT_FORMAT = (
    r"\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180d\u180f\u2065\u2800\u3164\ufe00-\ufe0f"
    r"\uffa0\ufff0-\ufff8\U000e0000-\U000e0fff"
)
# In a field an approver compares (a payee, an id, a name), an invisible character makes two
# different values read alike: "vendor_7\u200b7" shows as vendor_77, and a direction mark
# reorders what is shown. Refused there; a message's own text (params) may hold them.
_INVISIBLE = re.compile(f"[{FORMAT_CHARACTERS}{_UNSEEN_NOT_FORMAT}]")
# A deal's name is written in its language: Persian spells words with the zero-width
# non-joiner, an emoji sequence is held together by the joiner and shown as an emoji by its
# variation selector ("\u2764\ufe0f"), and Mongolian letters and Han characters take the
# variation selectors that choose their shapes. Allowed in names only.
_INVISIBLE_IN_NAMES = re.compile(
    "(?![\u200c\u200d\u180b-\u180d\u180f\ufe00-\ufe0f\U000e0100-\U000e01ef])"
    f"[{FORMAT_CHARACTERS}{_UNSEEN_NOT_FORMAT}]"
)
_NAMES = {"name", "patch.name"}
# Any space but U+0020 (a no-break space, a narrow or an ideographic one, a line separator)
# is shown as an ordinary one on the approval card and in a diff, and a space at either end
# is seen by no one: "vendor 77" and "vendor\u00a077" would be two payees that read alike.
_ODD_SPACE = re.compile(r"[^\S ]")
# A page shows ordinary spaces in a row as one (HTML collapses them, on the card and in a
# diff alike): "Acme  Corp" would be paid as another payee than the "Acme Corp" it reads as.
_SPACES_IN_A_ROW = "  "
# Scripts share letters that look alike (a, e, o, p, c, x in Latin, Cyrillic and Greek; o in
# Armenian and Coptic; A, E in Cherokee): one word mixing them reads as a word it is not,
# "v\u0435ndor_77" (a Cyrillic ie) as the payee vendor_77, "ex\u0430mple.com" as the domain
# example.com. A word in one script is written, not disguised (a Cyrillic domain,
# "TOO_Rakhat" with TOO in Cyrillic): only a mix inside a word is refused, but for the mixes
# East Asian writing is made of (Unicode TR39's highly restrictive profile).
_WORD = re.compile(r"[^\W\d_]+")
# Named here so a refusal can name them; a letter of a script not listed is named by the
# first word of its Unicode name, which for a script's letters is the script.
_SCRIPT_NAMES = (
    "Latin", "Cyrillic", "Greek", "Armenian", "Georgian", "Coptic", "Cherokee", "Hebrew",
    "Arabic", "Syriac", "Thaana", "Devanagari", "Bengali", "Gurmukhi", "Gujarati", "Oriya",
    "Tamil", "Telugu", "Kannada", "Malayalam", "Sinhala", "Thai", "Lao", "Tibetan", "Myanmar",
    "Khmer", "Mongolian", "Ethiopic", "Canadian_Aboriginal", "Tifinagh", "Lisu", "Vai",
    "Osage", "Glagolitic", "Han", "Hiragana", "Katakana", "Hangul", "Bopomofo", "Yi",
)
_SCRIPT_OF = regex.compile("|".join(rf"(?P<{name}>\p{{Script={name}}})" for name in _SCRIPT_NAMES))
# Characters of every script (digits, µ, the mathematical letters) or of the one beside them
# (combining marks): no script of their own. Disguises among them are _ascii_disguised's.
_NO_SCRIPT = regex.compile(r"[\p{Script=Common}\p{Script=Inherited}]")
_EAST_ASIAN_MIXES = (
    frozenset({"Latin", "Han", "Hiragana", "Katakana"}),
    frozenset({"Latin", "Han", "Bopomofo"}),
    frozenset({"Latin", "Han", "Hangul"}),
)


def _script_of(ch: str) -> str:
    if _NO_SCRIPT.match(ch):
        return ""
    found = _SCRIPT_OF.match(ch)
    if found:
        return str(found.lastgroup).replace("_", " ")
    return unicodedata.name(ch, "").partition(" ")[0].title()


def _scripts_mixed(value: str) -> str:
    """The scripts one word of `value` mixes and its first letter of another script than
    the word's first ("Latin and Cyrillic (U+0435 is Cyrillic)"), or ""."""
    if value.isascii():
        return ""
    # Marks and format characters part no word on the page (the joiners a name may hold,
    # a combining grapheme joiner or a variation selector are seen by no one): left in, they
    # would cut "A\u200c\u0441\u200cme" into words of one script each.
    shown = "".join(ch for ch in value if unicodedata.category(ch)[0] != "M"
                    and unicodedata.category(ch) != "Cf")
    for word in _WORD.finditer(shown):
        letters: dict[str, list[str]] = {}  # script: its letters in the word, in order
        for ch in word.group():
            letters.setdefault(_script_of(ch), []).append(ch)
        letters.pop("", None)
        if len(letters) < 2 or any(set(letters) <= allowed for allowed in _EAST_ASIAN_MIXES):
            continue
        # Latin first: it is what a disguise in another script passes for. The letter named
        # is of the script the word has fewest of, the one that is likely the odd one.
        named = sorted(letters, key=lambda script: script != "Latin")
        odd = min(named, key=lambda script: len(letters[script]))
        return (f"{' and '.join(named)} letters in one word "
                f"(U+{ord(letters[odd][0]):04X} is {odd})")
    return ""


# Letters and digits other than ASCII ones that mean one (Unicode's compatibility forms):
# the mathematical ones ("vend\U0001d428r_77" with a bold o), the fullwidth ones, the Roman
# numerals (a small roman five for a v), the circled and superscript ones. Each reads as the
# ASCII it stands for. Not the ordinal indicators, which write "N\u00ba" on invoices.
_ORDINALS = "\u00aa\u00ba"


def _ascii_disguised(value: str) -> str:
    """The first character of `value` that is a compatibility form of ASCII letters or
    digits ("U+1D428"), or ""."""
    for ch in value:
        if ch.isascii() or ch in _ORDINALS or unicodedata.category(ch)[0] not in "LN":
            continue
        meant = unicodedata.normalize("NFKC", ch)
        if meant.isascii() and meant.isalnum():
            return f"U+{ord(ch):04X}"
    return ""


def _invisible_named(value: str, *, field: str = "") -> str:
    found = (_INVISIBLE_IN_NAMES if field in _NAMES else _INVISIBLE).search(value)
    return f"U+{ord(found.group()):04X}" if found else ""

SCHEMAS: dict[str, tuple[Field, ...]] = {
    Action.PAYMENTS_CREATE: (
        Field("invoice_id", str, "Invoice"),
        Field("beneficiary_id", str, "Beneficiary", mask="reference"),
        Field("amount_minor", int, "Amount", minimum=1),
        Field("currency", str, "Currency"),
    ),
    Action.CRM_CREATE_DEAL: (
        # Named by a person, and read as a person's words are: a date in it stays readable.
        Field("name", str, "Deal name", mask="person_text"),
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

# Names that only ever hold secrets or card data: "secret" or "secrets" as any word of a
# field name (`client_secret`, `secretKey`, `secrets`), the others as its last words
# (`apiKey`, `private_key`, `card-number`, `cvv2`), never inside a word (`timespan`,
# `secretary`).
_SECRET_NAMES = re.compile(
    r"(?:^|_)secrets?(?:_|$)"
    r"|(?:^|_)(password|passwd|passphrase|pwd|token|api_?key|private_?key|card_?number|pan"
    r"|cvv2?|cvc2?|iban_full)$"
)
# A header written as JSON writes headers is its name as the key and its value alone
# ("Basic dXNl…", "bearer …"): the value is checked as the header line it stands for, since
# the credential patterns know a lowercase bearer or a basic one only after its header.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy_authorization"})
_SECRET_VALUES = (
    (re.compile(r"\b(sk|rk)_(live|test)_[0-9A-Za-z]{8,}"), "an API secret key"),
    (re.compile(r"\bwhsec_[0-9A-Za-z]{8,}"), "a webhook secret"),
    # A PaymentIntent's or SetupIntent's client secret: whoever holds it can confirm the payment.
    (re.compile(r"\b(pi|seti)_[0-9A-Za-z]{8,}_secret_[0-9A-Za-z]{8,}"), "a payment client secret"),
    # LLM providers' keys (`sk-proj-…`, `sk-ant-api03-…`, `sk-` and 48 letters and digits).
    (
        re.compile(r"\bsk-(?:(?:proj|ant|svcacct|admin)-[A-Za-z0-9_-]{20,}|[A-Za-z0-9]{20,})"),
        "an API secret key",
    ),
    # PEM's "-----BEGIN RSA PRIVATE KEY-----" and OpenPGP's "… PRIVATE KEY BLOCK-----".
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----"), "a private key"),
    (re.compile(r"\bBearer\s+[A-Za-z0-9\-._~+/]{16,}"), "a bearer token"),
    # The scheme is any case (RFC 9110 11.1), as curl commands and logs write it; in any case
    # but its own, only after its header: "payable to bearer CHQ-2024-00012345" is a cheque.
    (
        re.compile(r"(?i:\bauthorization\s*:\s*bearer)\s+[A-Za-z0-9\-._~+/]{16,}"),
        "a bearer token",
    ),
    # A user and password in base64; named by its header, since "basic" alone is a word.
    (
        re.compile(
            r"(?i:\bauthorization\s*:\s*basic)\s+"
            r"(?:[A-Za-z0-9+/]{4}){2,}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?(?![\w+/=])"
        ),
        "basic credentials",
    ),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "a JWT"),
    # GitHub's tokens, of every kind: personal (ghp_, github_pat_), OAuth (gho_), an app's
    # user-to-server and server-to-server ones (ghu_, ghs_), and a refresh token (ghr_).
    (re.compile(r"\b(gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"), "an access token"),
    (re.compile(r"\bxox[abpr]-[A-Za-z0-9-]{10,}"), "an access token"),
    # A long-term key id (AKIA…) or a temporary one (ASIA…, from STS).
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "a cloud access key"),
    # scheme://user:password@host: a URL with a password in it ("https://host/a@b" and
    # "mailto:a@b" have none). The user may be left out ("redis://:password@host", as Redis
    # takes a password alone); the password may not, or "https://:@host" would be one. The
    # scheme is bounded: unbounded, it is scanned again from every word boundary of a long
    # "a.a.a…" (a third of a second for one intent's size).
    (
        re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s/?#:@]*:[^\s/?#@]+@"),
        "a URL with a password",
    ),
)
# Digits in groups: "4111 1111 1111 1111", "4111 - 1111 - …", and "4111,1111,1111,1111" as
# a CSV writes a card's groups. A comma joins groups only there, bare between two groups of
# four: "Orders 100234, 100235" is a list of numbers. (Shown, a comma parts a sum's
# thousands, and "1,250,000" stays whole.)
_CARD_COMMA = r"(?<=(?<!\d)\d{4}),(?=\d{4}(?!\d))"
_DIGIT_GROUPS = re.compile(rf"\d+(?:(?:[{NUMBER_SEPARATORS}]+|{_CARD_COMMA})\d+)*")
_DIGITS = re.compile(r"\d+")
_GROUP_SEPARATOR = re.compile(rf"[{NUMBER_SEPARATORS},]+")
# Spacing is typography, not a separator of its own: "4111 1111\u00a01111  1111" is parted
# by spaces throughout, as a PDF or a spreadsheet pastes it.
_SPACES = re.compile(r"\s+")
# The groups card numbers are printed in, by the digits in each: 4-4-4-4 and the rest of
# 4-4-4-1 to 4-4-4-7 (13 to 19 digits), 4-4-4-4-1 to 4-4-4-4-3 (a 19 digit UnionPay or
# Maestro), 4-6-5 (American Express) and 4-6-4 (Diners Club).
_CARD_GROUPINGS = frozenset(
    {(4, 4, 4, last) for last in range(1, 8)}
    | {(4, 4, 4, 4, last) for last in range(1, 4)}
    | {(4, 6, 5), (4, 6, 4)}
)
_MOST_CARD_GROUPS = max(len(grouping) for grouping in _CARD_GROUPINGS)
# An IBAN as banks print it: whole, or in groups of four with one space between (and a
# shorter last one), so a sum or a word after it is not taken in. Its digits pass Luhn one
# time in ten, as any number's do; its own check (ISO 13616, mod 97) tells it from a card.
IBAN_PATTERN = r"[A-Z]{2}\d{2}(?:[A-Z0-9]{11,30}|(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?)"
_IBAN = re.compile(rf"(?<!\w){IBAN_PATTERN}(?!\w)")
_IBAN_SHORTEST = 15  # Norway's
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
    """`userPassword`, `user-password`, `user.password` → `user_password`; an acronym ends
    where a capitalised word begins: `DBPassword`, `APIToken` → `db_password`, `api_token`."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return re.sub(r"[^a-z0-9]+", "_", words.lower())


def _iban_spans(text: str) -> list[tuple[int, int]]:
    """Where the text holds an IBAN whose check digits hold. Its groups of four take in a
    number after it ("BE68 5390 0754 7034 2026"): one that fails is tried again without its
    last groups, down to the shortest IBAN."""
    found = []
    for match in _IBAN.finditer(text):
        candidate = match.group()
        while len(candidate.replace(" ", "")) >= _IBAN_SHORTEST:
            if _iban_checks(candidate):
                found.append((match.start(), match.start() + len(candidate)))
                break
            if " " not in candidate:
                break
            candidate = candidate.rpartition(" ")[0]
    return found


def _iban_checks(iban: str) -> bool:
    """ISO 13616's check: the country and check digits moved to the end, letters read as
    10 to 35, the number is 1 modulo 97."""
    compact = iban.replace(" ", "")
    return int("".join(str(int(ch, 36)) for ch in compact[4:] + compact[:4])) % 97 == 1


def _holds_card_number(text: str) -> bool:
    """A Luhn-valid card number written as cards are: 13 to 19 digits in one piece, or a
    card's groups (_CARD_GROUPINGS) parted by one separator throughout; an IBAN whose own
    check holds is set aside first. Any digit groups joined by any separators pass Luhn one
    time in ten: every tenth invoice id ("INV-2025-0301-0007-1234"), date before a reference
    or list of order numbers was refused as a card. Card data is still caught after a year
    ("paid 2024 4111 1111 1111 1111"), but no longer, since no card is printed so: groups
    parted by different separators ("4111 1111-1111 1111", "4111.1111 1111 1111"), groups
    other than a card's (4-4-8), or groups held to a word by a separator with no space in it
    ("INV-4111-1111-1111-1111", "ref_4111_1111_1111_1111"), which makes them an id's parts."""
    done = 0
    for start, end in _iban_spans(text):
        if _card_number_written(text[done:start]):
            return True
        done = end
    return _card_number_written(text[done:])


def _card_number_written(text: str) -> bool:
    """_holds_card_number's rule, on text holding no IBAN."""
    for run in _DIGIT_GROUPS.finditer(text):
        spans = [m.span() for m in _DIGITS.finditer(text, run.start(), run.end())]
        if any(13 <= end - start <= 19 and _luhn_ok(text[start:end]) for start, end in spans):
            return True
        separators = [
            _SPACES.sub(" ", text[spans[i][1] : spans[i + 1][0]]) for i in range(len(spans) - 1)
        ]
        first = 0
        while first < len(separators):
            # The stretch of groups first..last, each parted from the next by the same
            # separator.
            separator, last = separators[first], first + 1
            while last < len(separators) and separators[last] == separator:
                last += 1
            if _card_in_stretch(text, spans[first : last + 1], separator):
                return True
            first = last
    return False


def _card_in_stretch(text: str, spans: list[tuple[int, int]], separator: str) -> bool:
    """Whether groups at `spans` of `text`, parted by `separator`, hold a card number. Parted
    by spaces, any of their stretches may be one: a sentence sets numbers side by side
    ("paid 2024 4111 1111 1111 1111"). Parted by a mark with no space in it, all of them
    are one string, a card only whole and standing apart from any word."""
    widths = [end - start for start, end in spans]
    if " " in separator:
        stretches = [
            (first, last)
            for first in range(len(spans))
            for last in range(first + 2, min(first + _MOST_CARD_GROUPS, len(spans)) + 1)
        ]
    elif _held_to_a_word(text, spans[0][0], spans[-1][1], separator):
        return False
    else:
        stretches = [(0, len(spans))]
    for first, last in stretches:
        if tuple(widths[first:last]) in _CARD_GROUPINGS and _luhn_ok(
            "".join(text[start:end] for start, end in spans[first:last])
        ):
            return True
    return False


def _held_to_a_word(text: str, start: int, end: int, separator: str) -> bool:
    """Whether text[start:end] is part of a longer id: a letter or digit against it, or the
    same separator before or after it and a letter or digit beyond. Indexed, not sliced:
    a slice of the text per stretch is quadratic in a long run of "1-1 1-1 …"."""
    if text.endswith(separator, 0, start):
        start -= len(separator)
    if text.startswith(separator, end):
        end += len(separator)
    return text[start - 1 : start].isalnum() or text[end : end + 1].isalnum()


def _digits_join_into_card_number(text: str) -> bool:
    """Whether whole digit groups of the text, however parted, join into a Luhn-valid 13 to
    19 digit number. Too wide to refuse by (_holds_card_number says why), it decides what a
    refusal may repeat, where holding back costs nothing: a path joins keys each clean alone
    ("4111" and "1111 1111 1111" read as "4111.1111 1111 1111")."""
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
TYPED_NUMBERS = frozenset({"amount_minor", "expected_version"})
# Where they stand in an intent: a key of the same name inside free parameters is not one.
_TYPED_NUMBER_PATHS = frozenset(
    {"payload.amount_minor", "payload.expected_version", "payload.patch.amount_minor"}
)


_CARD_NUMBER = "a full card number"


def _looks_like(text: str) -> str:
    """The card data or secret the text holds ("a full card number", "a JWT"), or ""."""
    if _holds_card_number(text):
        return _CARD_NUMBER
    for pattern, what in _SECRET_VALUES:
        if pattern.search(text):
            return what
    return ""


def _named(name: str) -> str:
    """A key or a path as a refusal may repeat it. Refusals are printed into shells, CI logs
    and pages, so one holding card data or a secret is described, never repeated. A whole
    path is checked, not only its last key: keys clean alone can join into a card number
    ("4111.1111 1111 1111"). Any other is escaped as repr escapes it (without the quotes): a
    key refused before its characters are checked (an unexpected field) could otherwise put
    a line break into a script's log, an escape sequence into a terminal, or a direction mark
    that reorders the message."""
    what = _looks_like(name) or (_CARD_NUMBER if _digits_join_into_card_number(name) else "")
    if what:
        return f"a field whose name looks like {what}"
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in name
    )


def _refuse_secrets(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            # A key is journaled and shown like a value: a card or a secret there is refused
            # too, before any refusal could repeat it.
            what = _looks_like(str(key))
            if what:
                raise IntentError(f"{_named(path)}: a key looks like {what}")
            if _SECRET_NAMES.search(_field_words(str(key))):
                raise IntentError(
                    f"{_named(f'{path}.{key}')}: a field named like a secret is not allowed"
                )
            if _field_words(str(key)) in _CREDENTIAL_HEADERS and isinstance(inner, str):
                what = _looks_like(f"authorization: {inner}")
                if what:
                    raise IntentError(
                        f"{_named(f'{path}.{key}')}: looks like {what}; secrets never enter "
                        "the journal"
                    )
            if f"{path}.{key}" in _TYPED_NUMBER_PATHS and isinstance(inner, int):
                continue
            _refuse_secrets(inner, f"{path}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            _refuse_secrets(inner, f"{path}[{i}]")
    elif isinstance(value, (int, str)) and not isinstance(value, bool):
        if _holds_card_number(value if isinstance(value, str) else str(abs(value))):
            raise IntentError(
                f"{_named(path)}: looks like a full card number; intents carry references, "
                "never card data"
            )
    if isinstance(value, str):
        for pattern, what in _SECRET_VALUES:
            if pattern.search(value):
                raise IntentError(
                    f"{_named(path)}: looks like {what}; secrets never enter the journal"
                )


def secret_in_text(text: str) -> str:
    """What a person's own words (a reason, evidence, a comment) must not carry into the
    journal and the audit trail, which every viewer reads: "" when clean."""
    what = _looks_like(text)
    if what == _CARD_NUMBER:
        return f"{what}; write only its last four digits"
    return f"{what}; secrets never enter the journal" if what else ""


def secret_may_be_in(text: str) -> bool:
    """Whether text that is repeated or kept rather than typed by a person (a refusal
    repeating what was passed, a provider's error) might hold card data or a secret: the
    card rule at its widest (_digits_join_into_card_number), since holding such text back
    only costs the words, where refusing a person's by it refused every tenth invoice id."""
    return bool(_looks_like(text)) or _digits_join_into_card_number(text)


def secrets_marked(text: str, mark: str) -> str:
    """Text not of a person's own words (a provider's answer, a library's error), with each
    secret secret_in_text would find replaced by `mark` where it stands: the rest of it
    still says what went wrong."""
    for pattern, _ in _SECRET_VALUES:
        text = pattern.sub(mark, text)
    return text


def _unicode_text(text: str) -> bool:
    """JSON text that has a UTF-8 form: json.loads lets an unpaired surrogate ("\\ud800")
    through, and the canonical form (RFC 8785), the size check and the hash cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _plain_json(value: Any, path: str, depth: int = 0) -> None:
    if depth > MAX_INTENT_DEPTH:
        raise IntentError(f"{_named(path)}: nested more than {MAX_INTENT_DEPTH} levels deep")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_SAFE_INTEGER:
        raise IntentError(f"{_named(path)}: integers must be within ±{_MAX_SAFE_INTEGER}")
    if isinstance(value, str) and not _unicode_text(value):
        raise IntentError(f"{_named(path)}: text holds an unpaired surrogate (not Unicode)")
    if isinstance(value, str) and _CONTROL.search(value):
        raise IntentError(f"{_named(path)}: text holds a control character")
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        raise IntentError(f"{_named(path)}: floats are not allowed; money is integer minor units")
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise IntentError(f"{_named(path)}: keys must be strings")
            if not _unicode_text(key):
                # Not named: the key itself could not be printed.
                raise IntentError(
                    f"{_named(path)}: a key holds an unpaired surrogate (not Unicode)"
                )
            if _CONTROL.search(key) or _LINE_BREAK.search(key):
                raise IntentError(f"{_named(path)}: a key holds a control character")
            _plain_json(inner, f"{path}.{key}", depth + 1)
        return
    if isinstance(value, list):
        for i, inner in enumerate(value):
            _plain_json(inner, f"{path}[{i}]", depth + 1)
        return
    raise IntentError(f"{_named(path)}: {type(value).__name__} is not a JSON value")


def intent_validate(*, action: str, payload: Any) -> dict[str, Any]:
    """Return the payload if it is a valid intent for `action`, else raise IntentError."""
    if action not in SCHEMAS:
        # Repeated, as any name in a refusal, only when it holds no card data or secret.
        named = "" if secret_may_be_in(action) else f" {action!r}"
        raise IntentError(f"unknown action{named}; known: {', '.join(sorted(SCHEMAS))}")
    if not isinstance(payload, Mapping):
        raise IntentError("payload must be a JSON object")
    fields = {f.name: f for f in SCHEMAS[action]}
    missing = sorted(set(fields) - set(payload))
    if missing:
        raise IntentError(f"{action}: missing field(s): {', '.join(missing)}")
    extra = sorted(set(payload) - set(fields))
    if extra:
        raise IntentError(
            f"{action}: unexpected field(s): {', '.join(_named(str(key)) for key in extra)}"
        )
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
        if isinstance(value, str) and _LINE_BREAK.search(value):
            raise IntentError(f"{action}: {name} must be one line (no tabs or line breaks)")
        _plain_json(value, name)
    # A code is checked against ISO 4217 itself, not its shape: "ZZZ" would be approved and
    # shown with no exponent, and refused by the provider only after a person approved it.
    if "currency" in fields and not currency_known(payload["currency"]):
        raise IntentError(f"{action}: currency must be an ISO 4217 code such as KZT or EUR")
    if action == Action.MAIL_SEND and not EMAIL_ADDRESS.match(payload["to"]):
        raise IntentError(f"{action}: to must be an email address")
    # Both are shown as they are on every masked page: an address in one would be too.
    if action == Action.MAIL_SEND and (
        len(payload["template"]) > 100 or not IDENTIFIER.fullmatch(payload["template"])
    ):
        raise IntentError(
            f"{action}: template must be the template's name (letters, digits and _ . : - only)"
        )
    if action == Action.PAYMENTS_CREATE and "@" in payload["invoice_id"]:
        raise IntentError(f"{action}: invoice_id must be the invoice's reference, not an address")
    if action == Action.CRM_UPDATE_DEAL:
        if len(payload["target"]) > 120 or not IDENTIFIER.fullmatch(payload["target"]):
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
    # After the secrets check: a card number joined by zero-width spaces is refused as one.
    one_line = [(name, payload[name]) for name in fields]
    if action == Action.CRM_UPDATE_DEAL:
        one_line += [(f"patch.{name}", value) for name, value in payload["patch"].items()]
    for name, value in one_line:
        if not isinstance(value, str):
            continue
        invisible = _invisible_named(value, field=name)
        if invisible:
            raise IntentError(
                f"{action}: {name} holds an invisible character ({invisible}) "
                "that would make two different values read alike"
            )
        odd_space = _ODD_SPACE.search(value)
        if odd_space:
            raise IntentError(
                f"{action}: {name} holds a space other than an ordinary one "
                f"(U+{ord(odd_space.group()):04X}) that would make two different values read "
                "alike"
            )
        # Not in a deal's name either (below): typed text has them, and it routes nothing.
        if _SPACES_IN_A_ROW in value and name not in _NAMES:
            raise IntentError(
                f"{action}: {name} holds spaces in a row, which a page shows as one and "
                "would make two different values read alike"
            )
        if value != value.strip(" "):
            raise IntentError(
                f"{action}: {name} begins or ends with a space that would make two different "
                "values read alike"
            )
        # Not in a deal's name: words there are a company's or a product's, written as
        # people type them ("10kΩ cable" with a Greek omega, a Kazakh company name with a
        # Latin i for the Cyrillic one), and a name routes no money and no message.
        mixed = "" if name in _NAMES else _scripts_mixed(value)
        if mixed:
            raise IntentError(
                f"{action}: {name} mixes {mixed}, which would make two "
                "different values read alike"
            )
        disguised = "" if name in _NAMES else _ascii_disguised(value)
        if disguised:
            raise IntentError(
                f"{action}: {name} holds a letter or digit in another form than the ASCII one "
                f"it reads as ({disguised}), which would make two different values read alike"
            )
        # "José" with its accent composed or written apart reads the same on the card, but
        # hashes, and names a payee at the provider, differently: one form only, the usual.
        if not unicodedata.is_normalized("NFC", value):
            raise IntentError(
                f"{action}: {name} is not in Unicode NFC form (a letter and its accent written "
                "apart), which would make two different values read alike"
            )
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
            f"{action}: patch cannot change {', '.join(_named(str(key)) for key in unknown)}; "
            f"it may change {', '.join(DEAL_PATCH_FIELDS)}"
        )
    for name, value in patch.items():
        kind = DEAL_PATCH_FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise IntentError(f"{action}: patch.{name} must be {_kind_word(kind.__name__)}")
        if name == "amount_minor" and value < 0:
            raise IntentError(f"{action}: patch.amount_minor must be at least 0")
        if name == "currency" and not currency_known(value):
            raise IntentError(f"{action}: patch.currency must be an ISO 4217 code such as EUR")
        if name in ("name", "stage") and not value.strip():
            raise IntentError(f"{action}: patch.{name} must not be empty")
        if isinstance(value, str) and _LINE_BREAK.search(value):
            raise IntentError(f"{action}: patch.{name} must be one line (no tabs or line breaks)")


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
