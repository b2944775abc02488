from __future__ import annotations

import json
import re
import sys
import time
import unicodedata

import pytest
from django.core.management import CommandError, call_command

from operations.intents import (
    IntentError,
    deal_found_rows,
    intent_canonical,
    intent_diff,
    intent_rows,
    intent_summary,
    intent_validate,
    mask_email,
    mask_inline,
    mask_person_text,
    money_format,
    secret_in_text,
)
from operations.intents.validation import FORMAT_CHARACTERS
from operations.models import Operation
from operations.policy import policy_for
from tests.helpers import iban_valid, luhn_valid

PAYMENT = {"invoice_id": "inv_9182", "beneficiary_id": "vendor_778812345",
           "amount_minor": 1250000, "currency": "KZT"}


def test_it_hashes_the_same_intent_the_same_whatever_the_key_order():
    reordered = dict(reversed(list(PAYMENT.items())))
    a = intent_canonical(action="payments.create", tenant="acme", payload=PAYMENT,
                         policy_version="payments-v3")
    b = intent_canonical(action="payments.create", tenant="acme", payload=reordered,
                         policy_version="payments-v3")
    assert a == b
    assert a[1].startswith("sha256:") and len(a[1]) == 71
    assert " " not in a[0] and a[0].index('"action"') < a[0].index('"payload"')


@pytest.mark.parametrize("field,value", [("amount_minor", 1250001), ("currency", "EUR"),
                                         ("beneficiary_id", "vendor_78")])
def test_it_hashes_any_change_differently(field, value):
    changed = {**PAYMENT, field: value}
    base = intent_canonical(action="payments.create", tenant="acme", payload=PAYMENT,
                            policy_version="payments-v3")[1]
    other = intent_canonical(action="payments.create", tenant="acme", payload=changed,
                             policy_version="payments-v3")[1]
    assert base != other


def test_it_binds_the_policy_version_into_the_hash():
    v3 = intent_canonical(action="payments.create", tenant="acme", payload=PAYMENT,
                          policy_version="payments-v3")[1]
    v4 = intent_canonical(action="payments.create", tenant="acme", payload=PAYMENT,
                          policy_version="payments-v4")[1]
    assert v3 != v4


@pytest.mark.parametrize(
    "payload,message",
    [
        ({k: v for k, v in PAYMENT.items() if k != "currency"}, "missing field"),
        ({**PAYMENT, "note": "x"}, "unexpected field"),
        ({**PAYMENT, "amount_minor": "12500"}, "amount_minor must be an integer"),
        ({**PAYMENT, "amount_minor": 125.5}, "amount_minor must be an integer"),
        ({**PAYMENT, "amount_minor": True}, "amount_minor must be an integer"),
        ({**PAYMENT, "amount_minor": 0}, "at least 1"),
        ({**PAYMENT, "currency": "kzt"}, "ISO 4217"),
        ({**PAYMENT, "beneficiary_id": "4111 1111 1111 1111"}, "card number"),
        ({**PAYMENT, "invoice_id": "inv for 4242424242424242"}, "card number"),
        ({**PAYMENT, "invoice_id": "sk_live_abcdefgh12345678"}, "secret key"),
        # A card after another number, or written with dots, is still a card.
        ({**PAYMENT, "invoice_id": "paid 2024 4111 1111 1111 1111"}, "card number"),
        ({**PAYMENT, "invoice_id": "order 12345 4111 1111 1111 1111"}, "card number"),
        ({**PAYMENT, "invoice_id": "4111.1111.1111.1111"}, "card number"),
        ({**PAYMENT, "amount_minor": 2**53}, "integers must be within"),
        # Shown as it is on every masked page: an address there would be shown whole.
        ({**PAYMENT, "invoice_id": "bob.smith@example.com"}, "the invoice's reference"),
    ],
)
def test_it_refuses_a_bad_payment_intent_with_a_clear_error(payload, message):
    with pytest.raises(IntentError, match=message):
        intent_validate(action="payments.create", payload=payload)


@pytest.mark.parametrize(
    ("key", "named"),
    [
        ("note\nCommandError: forged", "note\\nCommandError: forged"),  # a forged log line
        ("\x1b[2J\x1b[Hcleared", "\\x1b[2J\\x1b[Hcleared"),  # clears the operator's terminal
        ("\u202eevil", "\\u202eevil"),  # reverses what follows it on screen
        ("a\u2028b", "a\\u2028b"),  # a line break to Python's splitlines
    ],
)
def test_it_names_an_unexpected_field_escaped_never_as_it_is(key, named):
    # An unexpected key is refused before its characters are checked: the refusal is what
    # shells, logs and pages print.
    with pytest.raises(IntentError) as refused:
        intent_validate(action="payments.create", payload={**PAYMENT, key: 1})
    message = str(refused.value)
    assert message == f"payments.create: unexpected field(s): {named}"
    assert message.isprintable()


DEAL_CHANGE = {"target": "deal_1", "expected_version": 2, "patch": {"stage": "won"}}


@pytest.mark.parametrize("code", [
    "ZZZ", "ABC", "QQQ",  # three capitals, no currency
    "XAU", "XDR", "XTS", "XXX",  # in ISO 4217, but gold, a unit of account, test, none
    "HRK",  # withdrawn (replaced by EUR in 2023)
])
def test_it_refuses_a_currency_that_is_no_iso_4217_currency(code):
    # It would be approved, shown with a guessed exponent, and refused by the provider only
    # after a person approved it.
    with pytest.raises(IntentError) as refused:
        intent_validate(action="payments.create", payload={**PAYMENT, "currency": code})
    assert str(refused.value) == (
        "payments.create: currency must be an ISO 4217 code such as KZT or EUR")
    with pytest.raises(IntentError, match=r"patch\.currency must be an ISO 4217 code"):
        intent_validate(action="crm.update_deal",
                        payload={**DEAL_CHANGE, "patch": {"currency": code}})
    for currency in ("XOF", "IQD", "UGX", "KZT"):
        intent_validate(action="payments.create", payload={**PAYMENT, "currency": currency})
        intent_validate(action="crm.update_deal",
                        payload={**DEAL_CHANGE, "patch": {"currency": currency}})


@pytest.mark.parametrize(
    "patch,message",
    [
        ({}, "must change at least one field"),
        ({"version": 3}, "cannot change version"),
        ({"amount_minor": "ten"}, "patch.amount_minor must be an integer"),
        ({"amount_minor": -1}, "at least 0"),
        ({"stage": 7}, "patch.stage must be a string"),
        ({"stage": " "}, "patch.stage must not be empty"),
        ({"currency": "eur"}, "ISO 4217"),
    ],
)
def test_it_refuses_a_deal_change_the_crm_could_not_apply(patch, message):
    with pytest.raises(IntentError, match=message):
        intent_validate(action="crm.update_deal", payload={**DEAL_CHANGE, "patch": patch})
    intent_validate(action="crm.update_deal", payload=DEAL_CHANGE)


@pytest.mark.parametrize(
    "target", ["../../payments/v1/payment_intents", "deal_1/../deal_2", "deal_1?expected_version=9",
               "deal_1#x", "..", " deal_1", ""],
)
def test_it_refuses_a_deal_target_that_is_not_one_deals_id(target):
    # The target becomes a segment of the CRM's URL: anything else would address another
    # object or endpoint than the one the approver read.
    with pytest.raises(IntentError, match="target"):
        intent_validate(action="crm.update_deal", payload={**DEAL_CHANGE, "target": target})
    intent_validate(action="crm.update_deal",
                    payload={**DEAL_CHANGE, "target": "deal_01J8Z3K2M4.v2:eu-1"})


@pytest.mark.parametrize(
    ("params", "refused"),
    [
        ({"ref": 4111111111111111}, True),  # a card as a number
        ({"clientSecret": "x"}, True),
        ({"user-password": "x"}, True),
        ({"timespan": "3 days"}, False),  # ends like "pan", is not one
        ({"tokenizer": "x"}, False),
        ({"secretary": "x"}, False),  # begins like "secret", is not one
        ({"sku": "sk-winter-sale-2026-blue-large"}, False),  # begins like a key, is not one
        ({"APIVersion": "2026-01", "SKUToken_count": 3}, False),  # an acronym, then no secret
    ],
)
def test_it_tells_secret_fields_from_words_that_end_alike(params, refused):
    payload = {"to": "anna@example.com", "template": "offer", "params": params}
    if refused:
        with pytest.raises(IntentError):
            intent_validate(action="mail.send", payload=payload)
    else:
        intent_validate(action="mail.send", payload=payload)


def test_it_refuses_secrets_nested_in_mail_params():
    with pytest.raises(IntentError, match="secret"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer",
            "params": {"api_key": "abc"}})
    with pytest.raises(IntentError, match="unknown action"):
        intent_validate(action="payments.refund", payload={})


def test_it_accepts_long_ids_that_are_not_card_numbers():
    intent_validate(action="payments.create",
                    payload={**PAYMENT, "invoice_id": "inv_1234567890123"})


def test_it_masks_by_default_and_formats_money():
    rows = {r.name: r.value for r in intent_rows(action="payments.create", payload=PAYMENT)}
    assert rows["amount_minor"] == "12,500.00 KZT"
    assert rows["beneficiary_id"] == "••••2345"
    assert "vendor_778812345" not in intent_summary(action="payments.create", payload=PAYMENT)
    unmasked = {r.name: r.value for r in intent_rows(action="payments.create", payload=PAYMENT,
                                                     unmasked=True)}
    assert unmasked["beneficiary_id"] == "vendor_778812345"
    assert mask_email("anna.smith@example.com") == "a***@example.com"
    assert money_format(500, "JPY") == "500 JPY"
    assert money_format(1234, "KWD") == "1.234 KWD"


@pytest.mark.parametrize(("currency", "shown"), [
    # ISO 4217 exponent 0 (and in Stripe's zero-decimal list): amount=1250000 pays 1,250,000.
    ("XOF", "1,250,000 XOF"), ("XAF", "1,250,000 XAF"), ("UGX", "1,250,000 UGX"),
    ("RWF", "1,250,000 RWF"), ("PYG", "1,250,000 PYG"), ("XPF", "1,250,000 XPF"),
    # Exponent 3.
    ("IQD", "1,250.000 IQD"), ("LYD", "1,250.000 LYD"),
])
def test_it_shows_money_in_the_currencys_own_iso_4217_exponent(currency, shown):
    # The approver approves the sum shown: a zero-decimal sum read with cents is 100 times
    # smaller on screen than the payment made.
    assert money_format(1250000, currency) == shown
    payment = {**PAYMENT, "currency": currency}
    assert {r.name: r.value for r in intent_rows(action="payments.create", payload=payment)}[
        "amount_minor"] == shown
    assert intent_summary(action="payments.create", payload=payment).startswith(f"Pay {shown} ")


def test_it_counts_a_deals_approval_threshold_in_its_currencys_own_units():
    deal = {"name": "Renewal", "amount_minor": 50_000, "owner": "sam@acme.test"}
    needs_approval = policy_for("crm.create_deal").requires_approval
    assert needs_approval({**deal, "currency": "XOF"})  # 50,000 XOF
    assert not needs_approval({**deal, "currency": "EUR"})  # 500.00 EUR
    assert not needs_approval({**deal, "currency": "LYD", "amount_minor": 49_999_999})
    # A journaled intent from before codes were checked: no exponent is guessed for it.
    assert needs_approval({**deal, "currency": "ZZZ"})
    assert money_format(1250000, "ZZZ") == "1250000 minor units of ZZZ"


def test_it_masks_what_is_personal_inside_a_deal_change_and_nested_mail_params():
    change = {"target": "deal_77", "expected_version": 3,
              "patch": {"owner": "jane.doe@acme.test", "stage": "won", "name": "Renewal"}}
    rows = {r.name: r.value for r in intent_rows(action="crm.update_deal", payload=change)}
    summary = intent_summary(action="crm.update_deal", payload=change)
    for shown in (rows["patch"], summary):
        assert "jane.doe@acme.test" not in shown
        # What moves stays readable for the approver.
        assert "owner → j***@acme.test" in shown and "stage → won" in shown
    unmasked = {r.name: r.value for r in intent_rows(action="crm.update_deal", payload=change,
                                                     unmasked=True)}
    assert "jane.doe@acme.test" in unmasked["patch"]

    mail = {"to": "cfo@acme.test", "template": "invoice_paid",
            "params": {"contact": {"email": "anna.smith@example.com", "phone": "+7 701 555 0199"},
                       "lines": ["Dear Anna"]}}
    shown = {r.name: r.value for r in intent_rows(action="mail.send", payload=mail)}["params"]
    for secret in ("anna.smith@example.com", "701 555 0199", "Dear Anna"):
        assert secret not in shown
    assert "a***@example.com" in shown and "••••0199" in shown


def test_it_masks_numbers_email_keys_and_addresses_inside_text():
    mail = {"to": "cfo@acme.test", "template": "welcome",
            "params": {"account": 40817810099911, "phone": 77011234567, "count": 3,
                       "jane.doe@example.com": "hi"}}
    shown = {r.name: r.value for r in intent_rows(action="mail.send", payload=mail)}["params"]
    for secret in ("40817810099911", "77011234567", "jane.doe@example.com"):
        assert secret not in shown
    assert "account: ••••9911" in shown and "count: 3" in shown and "j***@example.com" in shown

    deal = {"name": "Renewal for jane.doe@example.com, acct 40817810099911 (Q3 2026)",
            "amount_minor": 1500000, "currency": "EUR", "owner": "sam@acme.test"}
    expected = "Renewal for j***@example.com, acct ••••9911 (Q3 2026)"
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    assert rows["name"] == expected
    assert expected in intent_summary(action="crm.create_deal", payload=deal)

    change = {"target": "deal_77", "expected_version": 3,
              "patch": {"amount_minor": 2500000, "name": "Call jane.doe@example.com"}}
    summary = intent_summary(action="crm.update_deal", payload=change)
    # The amount that moves stays whole for the approver; the address in the name does not.
    assert "amount_minor → 2500000 in minor units of the deal's currency" in summary
    assert "name → Call j***@example.com" in summary
    change["patch"]["currency"] = "EUR"
    for unmasked in (False, True):
        shown = intent_summary(action="crm.update_deal", payload=change, unmasked=unmasked)
        assert "amount_minor → 25,000.00 EUR" in shown
    assert "name → Call jane.doe@example.com" in intent_summary(
        action="crm.update_deal", payload=change, unmasked=True)
    unmasked_params = {r.name: r.value for r in intent_rows(
        action="mail.send", payload=mail, unmasked=True)}["params"]
    assert "account: 40817810099911" in unmasked_params  # laid out as the masked form


def test_it_names_direction_controls_in_a_messages_parameters_where_they_stand():
    """A message's parameters may hold direction controls (Arabic or Hebrew text). Shown
    raw, an override left open in one reversed every parameter after it, all on one line of
    the card ("b: hello" read backwards), and a key could read as another ("\u202eeman" as
    "name"). Each is named where it stands, masked or not, and in a diff."""
    mail = {"to": "anna@example.com", "template": "offer",
            "params": {"\u202eeman": "Anna", "a": "\u202eX", "b": "hello",
                       "c": "\u2067\u05e9\u05dc\u05d5\u05dd\u2069"}}
    assert intent_validate(action="mail.send", payload=mail) == mail
    controls = re.compile("[\u202a-\u202e\u2066-\u2069]")
    for unmasked in (False, True):
        shown = {r.name: r.value for r in intent_rows(
            action="mail.send", payload=mail, unmasked=unmasked)}["params"]
        assert not controls.search(shown)
        assert "⟨U+202E⟩eman: " in shown
        assert "⟨U+2067⟩" in shown and "⟨U+2069⟩" in shown
    unmasked_shown = {r.name: r.value for r in intent_rows(
        action="mail.send", payload=mail, unmasked=True)}["params"]
    assert "a: ⟨U+202E⟩X, b: hello" in unmasked_shown
    changed = {**mail, "params": {**mail["params"], "a": "\u202eY"}}
    for unmasked in (False, True):
        diff = intent_diff(action="mail.send", old_payload=mail, new_payload=changed,
                           unmasked=unmasked)
        assert diff and all(
            not controls.search(part) for row in diff for part in (row.label, row.old, row.new)
        )
    rows = intent_diff(action="mail.send", old_payload=mail, new_payload={
        **mail, "params": {"\u202ebus": "Offer"}}, unmasked=True)
    assert "Template parameters: ⟨U+202E⟩bus" in [row.label for row in rows]


def test_it_flags_a_change_hidden_by_the_mask():
    new = {**PAYMENT, "beneficiary_id": "vendor_990012345"}  # same last four as the old one
    diff = intent_diff(action="payments.create", old_payload=PAYMENT, new_payload=new)
    assert [(d.label, d.old, d.new) for d in diff] == [
        ("Beneficiary", "••••2345", "••••2345 (changed in the masked part)"),
    ]


def test_it_diffs_field_by_field_masked():
    new = {**PAYMENT, "amount_minor": 1350000, "beneficiary_id": "vendor_778899999"}
    diff = intent_diff(action="payments.create", old_payload=PAYMENT, new_payload=new,
                       old_policy="payments-v3", new_policy="payments-v3")
    assert [(d.label, d.old, d.new) for d in diff] == [
        ("Beneficiary", "••••2345", "••••9999"),
        ("Amount", "12,500.00 KZT", "13,500.00 KZT"),
    ]


def test_it_diffs_a_deal_change_and_message_parameters_field_by_field():
    # The owner is handed over while the stage moves: both are rows, and the owner's change,
    # which the mask hides, says so, though the stage's beside it visibly changed.
    old = {"target": "deal_1", "expected_version": 3,
           "patch": {"stage": "won", "owner": "anna@example.com"}}
    new = {**old, "patch": {"stage": "lost", "owner": "alex@example.com",
                            "amount_minor": 500_000, "currency": "EUR"}}
    diff = intent_diff(action="crm.update_deal", old_payload=old, new_payload=new)
    assert [(d.label, d.old, d.new) for d in diff] == [
        ("Change: amount_minor", "—", "5,000.00 EUR"),
        ("Change: currency", "—", "EUR"),
        ("Change: owner", "a***@example.com", "a***@example.com (changed in the masked part)"),
        ("Change: stage", "won", "lost"),
    ]
    # The same amount in a change that now names another currency is another sum.
    again = {**new, "patch": {**new["patch"], "currency": "JPY"}}
    diff = intent_diff(action="crm.update_deal", old_payload=new, new_payload=again)
    assert [(d.label, d.old, d.new) for d in diff] == [
        ("Change: amount_minor", "5,000.00 EUR", "500,000 JPY"),
        ("Change: currency", "EUR", "JPY"),
    ]
    mail = {"to": "anna@example.com", "template": "contract",
            "params": {"contact": "Anna", "amount": 100}}
    diff = intent_diff(action="mail.send", old_payload=mail, new_payload={
        **mail, "params": {"contact": "Alma", "amount": 200}})
    assert [(d.label, d.old, d.new) for d in diff] == [
        ("Template parameters: amount", "100", "200"),
        ("Template parameters: contact", "A***a", "A***a (changed in the masked part)"),
    ]


def test_it_shows_the_deal_a_version_conflict_found_beside_the_change_masked_as_it():
    update = {"target": "deal_1", "expected_version": 1,
              "patch": {"stage": "won", "owner": "anna@example.com"}}
    conflict = {"current_version": 2, "current": {
        "id": "deal_1", "name": "Renewal for alex@example.com", "amount_minor": 500_000,
        "currency": "EUR", "owner": "alex@example.com", "stage": "churn_review", "version": 2}}
    rows = deal_found_rows(action="crm.update_deal", payload=update, result=conflict)
    assert [(r.label, r.found, r.change) for r in rows] == [
        ("Version", "2", "expects 1"),
        ("Deal name", "Renewal for a***@example.com", ""),
        ("Amount", "5,000.00 EUR", ""),
        ("Currency", "EUR", ""),
        ("Owner", "a***@example.com", "a***@example.com"),
        ("Stage", "churn_review", "won"),
    ]
    unmasked = deal_found_rows(action="crm.update_deal", payload=update, result=conflict,
                               unmasked=True)
    assert [(r.found, r.change) for r in unmasked if r.label == "Owner"] == [
        ("alex@example.com", "anna@example.com")]
    # Nothing to show where no conflict recorded a deal.
    for action, result in [("crm.update_deal", {"id": "deal_1", "stage": "won"}),
                           ("crm.update_deal", None), ("payments.create", conflict)]:
        assert deal_found_rows(action=action, payload=update, result=result) == []


@pytest.mark.parametrize(
    "params",
    [
        {"4111111111111111": "paid"},
        {"card": {"4111 1111 1111 1111": "x"}},
        {"sk_live_abcdefgh12345678": "x"},
    ],
)
def test_it_refuses_a_card_number_or_a_secret_written_as_a_key(params):
    # A key is stored in the journal and shown to approvers just as a value is.
    with pytest.raises(IntentError) as refused:
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer", "params": params})
    # The refusal never repeats what it refused.
    assert "4111" not in str(refused.value) and "abcdefgh" not in str(refused.value)


def test_it_masks_an_account_or_phone_number_written_as_a_key():
    mail = {"to": "cfo@acme.test", "template": "welcome",
            "params": {"77011234567": "call back", "contact": {"40817810099911": "main"}}}
    shown = {r.name: r.value for r in intent_rows(action="mail.send", payload=mail)}["params"]
    summary_rows = intent_diff(action="mail.send", old_payload={**mail, "params": {}},
                               new_payload=mail)
    for text in (shown, *(row.new for row in summary_rows)):
        assert "77011234567" not in text and "40817810099911" not in text
    assert "••••4567" in shown and "••••9911" in shown
    unmasked = {r.name: r.value for r in intent_rows(
        action="mail.send", payload=mail, unmasked=True)}["params"]
    assert "77011234567" in unmasked and "40817810099911" in unmasked


@pytest.mark.parametrize(
    "params",
    [
        {"amount_minor": 4111111111111111},
        {"order": {"expected_version": 4111111111111111}},
    ],
)
def test_it_refuses_a_card_number_under_a_key_named_like_the_schemas_numbers(params):
    # Only the schema's own amount and version are exempt, not any key of the same name.
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer", "params": params})
    # The schema's own numbers stay exempt, however long.
    intent_validate(action="payments.create", payload={**PAYMENT, "amount_minor": 4111111111111111})
    intent_validate(action="crm.update_deal", payload={
        **DEAL_CHANGE, "expected_version": 4111111111111111,
        "patch": {"amount_minor": 4111111111111111}})


@pytest.mark.parametrize(
    "card",
    [
        "4111\t1111\t1111\t1111",  # pasted from a spreadsheet
        "4111\u00a01111\u00a01111\u00a01111",  # non-breaking spaces, as a PDF copies them
        "4111  1111  1111  1111",
        "4111 - 1111 - 1111 - 1111",
        "4111\u20131111\u20131111\u20131111",  # en dashes
        "4111\n1111\n1111\n1111",
    ],
)
def test_it_refuses_a_card_number_whatever_whitespace_or_dashes_separate_its_groups(card):
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer", "params": {"note": card}})
    # A person's words are held to the same rule.
    assert "card number" in secret_in_text(f"refunded to {card}")


@pytest.mark.parametrize("card", ["4222222222222", "4222 2222 2222 2"])
def test_it_refuses_a_thirteen_digit_card_number(card):
    # Card numbers run from 13 digits (old Visa) to 19; the shortest is card data too.
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer", "params": {"note": card}})
    assert "card number" in secret_in_text(f"refunded to {card}")
    # One digit short of any card length is a reference, not card data.
    assert secret_in_text("ref 422222222222") == ""


def test_it_masks_a_phone_number_in_a_deal_name_whatever_separates_its_groups():
    deal = {"name": "Call back +7\u00a0701\u00a0123\u00a04567", "amount_minor": 1500000,
            "currency": "EUR", "owner": "sam@acme.test"}
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    assert rows["name"] == "Call back +••••4567"


def test_it_refuses_an_intent_too_large_to_review_before_scanning_it():
    # A run of digit groups this long took seconds of CPU to scan for card numbers.
    params = {"note": "1 " * 20000}
    with pytest.raises(IntentError, match=r"mail.send: the intent is \d+ bytes, more than 32768"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": "offer", "params": params})
    # Just under the limit is an ordinary intent.
    intent_validate(action="mail.send", payload={
        "to": "anna@example.com", "template": "offer", "params": {"note": "x" * 30000}})


@pytest.mark.parametrize(
    ("action", "payload"),
    [
        ("mail.send", {"to": "anna@example.com", "template": "offer",
                       "params": {"note": "\ud800"}}),
        ("mail.send", {"to": "anna@example.com", "template": "offer",
                       "params": {"\udfff": "x"}}),
        ("payments.create", {**PAYMENT, "invoice_id": "inv_\ud83d"}),
    ],
)
def test_it_refuses_text_with_an_unpaired_surrogate_as_an_intent_error(action, payload):
    # json.loads('"\\ud800"') gives such a string; the canonical form cannot hold it, and
    # callers (the operations command) turn an IntentError, not a codec error, into one line.
    with pytest.raises(IntentError, match="unpaired surrogate") as refused:
        intent_validate(action=action, payload=payload)
    str(refused.value).encode("utf-8")  # the refusal itself can be printed


DEAL = {"name": "Renewal", "amount_minor": 1500000, "currency": "EUR", "owner": "sam@acme.test"}
MAIL = {"to": "anna@example.com", "template": "offer", "params": {}}


@pytest.mark.parametrize(
    ("action", "payload", "message"),
    [
        ("crm.create_deal", {**DEAL, "amount_minor": -1}, "amount_minor must be at least 0"),
        ("crm.update_deal", {**DEAL_CHANGE, "expected_version": -1},
         "expected_version must be at least 0"),
        ("payments.create", {**PAYMENT, "currency": "EURO"}, "ISO 4217"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"currency": "EURO"}}, "ISO 4217"),
        ("payments.create", {**PAYMENT, "invoice_id": " \t"}, "invoice_id must not be empty"),
        ("mail.send", {**MAIL, "template": ""}, "template must not be empty"),
        ("mail.send", {**MAIL, "to": "anna"}, "to must be an email address"),
        ("mail.send", {**MAIL, "to": "anna@localhost"}, "to must be an email address"),
        ("crm.update_deal", {**DEAL_CHANGE, "expected_version": False},
         "expected_version must be an integer"),
        ("mail.send", {**MAIL, "params": {"n": -(2**53)}}, "integers must be within"),
        ("mail.send", {**MAIL, "params": {"n": 0.5}}, "floats are not allowed"),
    ],
)
def test_it_refuses_an_intent_outside_its_schema(action, payload, message):
    with pytest.raises(IntentError, match=message):
        intent_validate(action=action, payload=payload)


@pytest.mark.parametrize(
    "name",
    ["password", "passwd", "secret", "token", "api_key", "apikey", "card_number", "cardNumber",
     "pan", "cvv", "cvc", "iban_full", "card.cvv", "Card-CVC",
     # "secret" as any word of the name, not only the last one.
     "secret_key", "secretKey", "client_secret", "secret_token_id", "private_key", "privateKey",
     # Led by an acronym, as dbPassword and db_password are refused.
     "DBPassword", "SMTPPassword", "APIToken", "JWTToken", "APISecret", "RSAPrivateKey",
     "AWSSecretKey"],
)
def test_it_refuses_every_field_named_like_a_secret_or_card_data(name):
    with pytest.raises(IntentError, match="a field named like a secret"):
        intent_validate(action="mail.send", payload={**MAIL, "params": {name: "x"}})


@pytest.mark.parametrize(
    ("params", "said"),
    [
        # As JSON writes a header, its name is the key: the value alone carries the scheme.
        ({"headers": {"Authorization": "Basic dXNlcjpwYXNzd29yZA=="}}, "basic credentials"),
        ({"headers": {"authorization": "bearer abcdefghijklmnopqrstuvwx"}}, "a bearer token"),
        ({"headers": {"Proxy-Authorization": "Basic dXNlcjpwYXNzd29yZA=="}},
         "basic credentials"),
        # Names that only ever hold a secret or card data.
        ({"secrets": {"db": "hunter2hunter2"}}, "a field named like a secret"),
        ({"passphrase": "correct horse battery staple"}, "a field named like a secret"),
        ({"pwd": "hunter2hunter2"}, "a field named like a secret"),
        ({"card": {"cvv2": "123"}}, "a field named like a secret"),
    ],
    ids=["authorization-basic", "authorization-bearer", "proxy-authorization", "secrets",
         "passphrase", "pwd", "cvv2"],
)
def test_it_refuses_credentials_under_a_headers_or_a_secrets_name(params, said):
    with pytest.raises(IntentError, match=said) as refused:
        intent_validate(action="mail.send", payload={**MAIL, "params": params})
    message = str(refused.value)
    assert "hunter2" not in message and "dXNlcj" not in message and "abcdefgh" not in message


@pytest.mark.django_db
def test_it_never_journals_a_headers_credentials_prepared_from_the_command_line(acme):
    from operations.models import AuditEvent

    payload = {**MAIL, "params": {"headers": {"Authorization": "Basic dXNlcjpwYXNzd29yZA=="}}}
    with pytest.raises(CommandError) as refused:
        call_command("operations", "prepare", "--tenant", "acme", "--action", "mail.send",
                     "--payload", json.dumps(payload))
    assert "basic credentials" in str(refused.value) and "dXNlcj" not in str(refused.value)
    assert not Operation.objects.exists()
    assert not AuditEvent.objects.filter(action="operation.prepare").exists()


@pytest.mark.parametrize("params", [
    {"headers": {"Authorization": "none: this vendor takes no credentials"}},
    {"headers": {"X-Authorization-Mode": "Basic dXNlcjpwYXNzd29yZA=="}},
    {"pwds_reset": 3, "passphrase_hint": "the usual", "secretsanta": "Anna"},
])
def test_it_accepts_what_only_names_credentials_without_holding_them(params):
    intent_validate(action="mail.send", payload={**MAIL, "params": params})


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ("rk_test_abcdefgh1234", "an API secret key"),
        ("whsec_abcdefgh1234", "a webhook secret"),
        ("-----BEGIN RSA PRIVATE KEY-----", "a private key"),
        ("Bearer abcdefghijklmnop1234", "a bearer token"),
        ("eyJhbGciOiJI.eyJzdWIiOiIx.c2lnbmF0dXJl", "a JWT"),
        ("ghp_" + "a" * 20, "an access token"),
        # GitHub's other kinds: user-to-server, server-to-server (an app's installation) and
        # refresh tokens, each as good as a password to the account or app it was issued for.
        ("gho_" + "a" * 36, "an access token"),
        ("ghu_" + "a" * 36, "an access token"),
        ("ghs_" + "a" * 36, "an access token"),
        ("ghr_" + "a" * 76, "an access token"),
        ("github_pat_" + "a" * 82, "an access token"),
        ("xoxb-1234567890", "an access token"),
        ("AKIAABCDEFGHIJKLMNOP", "a cloud access key"),
        # Stripe's PaymentIntent client secret: whoever holds it can confirm the payment.
        ("pi_3MtwBwLkdIwHu7ix28a3tqPa_secret_YrKJUKribcBjcG8HVhfZluoGH",
         "a payment client secret"),
        # LLM providers' keys, in a console for AI agents.
        ("sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z" * 2, "an API secret key"),
        ("sk-ant-api03-" + "Ab3dEf6hIj9kLm2n_Op5qRs8tUv1wXy4z-" * 3, "an API secret key"),
        ("sk-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "an API secret key"),
        ("-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF...", "a private key"),
        # An authentication scheme is any case (RFC 9110 11.1).
        ("Authorization: bearer 3f9a8c7d6e5b4a39281716151413", "a bearer token"),
        ("authorization: BEARER 3f9a8c7d6e5b4a39281716151413", "a bearer token"),
        ("Authorization: Basic YWRtaW46aHVudGVyMmh1bnRlcjI=", "basic credentials"),
        ("ASIAIOSFODNN7EXAMPLE", "a cloud access key"),  # a temporary key id, from STS
        ("https://admin:hunter2hunter2@db.example.com/prod", "a URL with a password"),
        ("postgres://app:s3cr3t@10.0.0.5:5432/prod", "a URL with a password"),
        # A password with no user (Redis's AUTH takes one alone) is still a password.
        ("https://:s3cret@db.example.com/prod", "a URL with a password"),
        ("redis://:hunter2@cache.internal:6379/0", "a URL with a password"),
    ],
)
def test_it_refuses_every_kind_of_secret_in_a_value(value, what):
    with pytest.raises(IntentError, match=f"looks like {what}"):
        intent_validate(action="mail.send", payload={**MAIL, "params": {"note": f"x {value}"}})
    assert what in secret_in_text(f"see {value}")


@pytest.mark.parametrize(
    "text",
    [
        "a bearer of good news", "the bearer responsibilities.", "Bearer bonds of 2026",
        "Cheque payable to bearer CHQ-2024-00012345 cleared on 3 Dec",
        "Authorization: basic auth is off for this vendor",
        "see https://example.com/a@b", "mailto:anna@example.com", "https://anna@example.com/x",
        "http://example.com:8080/files@2026", "https://example.com?from=a:b@c",
        "ASIA trip 2026", "-----BEGIN PGP PUBLIC KEY BLOCK-----",
        "https://:@example.com/x",  # an empty password is none
        "ghost_writer_assigned_to_the_account", "ghs-2026-winter",
    ],
)
def test_it_accepts_words_and_links_that_only_begin_like_a_secret(text):
    assert secret_in_text(text) == ""
    intent_validate(action="mail.send", payload={**MAIL, "params": {"note": text}})


@pytest.mark.parametrize("dash", ["\u2010", "\u2015", "\u2212", "\ufe63", "\uff0d"])
def test_it_refuses_a_card_number_whatever_dash_separates_its_groups(dash):
    card = dash.join(["4111", "1111", "1111", "1111"])
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send", payload={**MAIL, "params": {"note": card}})


def test_it_refuses_a_nineteen_digit_card_number():
    # Card numbers run to 19 digits; one of that length is card data too.
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send",
                        payload={**MAIL, "params": {"note": "6221260000000000001"}})


def test_it_masks_the_recipient_in_a_mail_summary():
    payload = {**MAIL, "to": "anna.smith@example.com"}
    assert intent_summary(action="mail.send", payload=payload) == (
        "Email “offer” to a***@example.com")
    assert intent_summary(action="mail.send", payload=payload, unmasked=True).endswith(
        "anna.smith@example.com")


CARD = "4111111111111111"  # a Luhn-valid test Visa


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


@pytest.mark.parametrize(
    ("action", "payload"),
    [
        pytest.param("payments.create", {**PAYMENT, CARD: "x"}, id="unexpected-field"),
        pytest.param("payments.create", {**PAYMENT, "sk_live_abcdefgh12345678": "x"},
                     id="unexpected-field-named-like-a-secret-key"),
        pytest.param("crm.update_deal", {**DEAL_CHANGE, "patch": {"4111 1111 1111 1111": "x"}},
                     id="deal-patch-field"),
        # The JSON check runs before the card check, and names the path to what it refuses.
        pytest.param("mail.send", {**MAIL, "params": {CARD: 1.5}}, id="float-under-card-key"),
        pytest.param("mail.send", {**MAIL, "params": {"4111": {"1111 1111 1111": 1.5}}},
                     id="card-across-nested-keys"),
        pytest.param("mail.send", {**MAIL, "params": {f"{CARD}_token": "x"}},
                     id="card-key-named-like-a-secret"),
        pytest.param(f"payments.{CARD}", PAYMENT, id="unknown-action"),
    ],
)
def test_it_never_repeats_a_card_number_or_a_secret_in_a_refusal(action, payload):
    # Refusals are printed into shells, CI logs and pages: not even a key or a path may
    # carry what the intent must not.
    with pytest.raises(IntentError) as refused:
        intent_validate(action=action, payload=payload)
    message = str(refused.value)
    assert CARD not in _digits(message) and "abcdefgh" not in message, message


@pytest.mark.django_db
def test_it_never_repeats_a_card_number_in_the_clis_refusal_line(acme):
    # `operations prepare` prints "intent refused: …" on stderr, into shells and CI logs.
    with pytest.raises(CommandError) as refused:
        call_command("operations", "prepare", "--tenant", "acme", "--action", "payments.create",
                     "--payload", json.dumps({**PAYMENT, CARD: "paid"}))
    assert not Operation.objects.exists()
    assert "intent refused" in str(refused.value)
    assert CARD not in _digits(str(refused.value)), str(refused.value)


@pytest.mark.parametrize(
    "separator",
    [
        pytest.param("\u00ad", id="soft-hyphen"),  # invisible when shown; PDFs and web copy
        pytest.param("\u200b", id="zero-width-space"),  # invisible; chat and web copy
        pytest.param("\u200d", id="zero-width-joiner"),
        pytest.param("\u2060", id="word-joiner"),
        pytest.param("\ufeff", id="byte-order-mark"),
        pytest.param("_", id="underscore"),
        pytest.param("/", id="slash"),
        pytest.param(" \u200b", id="space-and-zero-width-space"),
        pytest.param(",", id="comma"),  # as a list or a CSV writes it
    ],
)
def test_it_refuses_a_card_number_whatever_joins_its_groups(separator):
    card = separator.join(["4111", "1111", "1111", "1111"])
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="mail.send", payload={**MAIL, "params": {"note": card}})
    # A person's words (reasons, evidence, comments) are held to the same check.
    assert "card number" in secret_in_text(f"refunded to {card}")


def test_it_joins_a_numbers_groups_by_every_unicode_format_character():
    # The list is written out (`re` has no \p{Cf}); it must not fall behind Python's Unicode.
    joiner = re.compile(f"[{FORMAT_CHARACTERS}]")
    missing = [
        f"U+{code:04X}" for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) == "Cf" and not joiner.fullmatch(chr(code))
    ]
    assert not missing


@pytest.mark.parametrize(
    "text",
    [
        "due 2026/12/01",
        "inv_2026_0001",
        "inv_2026_0001 due 2026/12/01",
        # Joined, these run to card lengths (13 to 16 digits), and fail Luhn.
        "inv_2026_0001_2026_12_01",
        "2026/12/01/000123",
        "batch_2026_12_01_00017",
        "12,500.00 KZT",
        "1 250 000",
        "call 701/555/0199",
        "order 12345/67",
        "ref\u00ad2026\u00ad0001",
    ],
)
def test_it_accepts_dates_ids_amounts_and_short_numbers_whatever_joins_them(text):
    # Only a 13 to 19 digit number that passes Luhn is card data, whatever joins its groups.
    # (An invisible joiner is refused in an id all the same, as one that reads alike.)
    if "\u00ad" not in text:
        intent_validate(action="payments.create", payload={**PAYMENT, "invoice_id": text})
    intent_validate(action="mail.send", payload={**MAIL, "params": {"note": text}})
    assert secret_in_text(f"paid {text}") == ""


@pytest.mark.parametrize(
    "orders",
    [
        # Joined, each passes Luhn: refused as a card while a comma joined any groups.
        "Orders 100234, 100235, 100249",
        "orders 100234,100235,100249",
        "tickets 1001, 1002, 1003, 1006",
    ],
)
@pytest.mark.django_db
def test_it_accepts_a_list_of_numbers_parted_by_commas(orders, acme):
    from operations.engine import operation_prepare

    # An email about several orders lists them; only a card's own four-digit groups, a bare
    # comma between them, are joined into a card number ("4111,1111,1111,1111").
    payload = {**MAIL, "params": {"orders": orders}}
    assert intent_validate(action="mail.send", payload=payload)["params"] == {"orders": orders}
    assert secret_in_text(f"sent about {orders}") == ""
    op = operation_prepare(tenant=acme, action="mail.send", payload=payload)
    assert Operation.objects.get(id=op.id).payload["params"] == {"orders": orders}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Refund to card 4111\u00ad1111\u00ad1111\u00ad1111", id="soft-hyphens"),
        pytest.param("Refund to card 4111\u200b1111\u200b1111\u200b1111", id="zero-width"),
        pytest.param("Refund to card 4111_1111_1111_1111", id="underscores"),
        pytest.param("Refund to card 4111/1111/1111/1111", id="slashes"),
    ],
)
def test_it_masks_a_card_number_in_a_deal_name_whatever_joins_its_groups(name):
    # Refused in a new intent; masked in one journaled before the check knew these joiners.
    deal = {**DEAL, "name": name}
    with pytest.raises(IntentError, match="card number"):
        intent_validate(action="crm.create_deal", payload=deal)
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    for shown in (rows["name"], intent_summary(action="crm.create_deal", payload=deal)):
        assert CARD not in _digits(shown), shown
        assert "Refund to card ••••1111" in shown


def test_it_masks_a_beneficiary_named_by_email_and_cuts_an_account_to_its_last_four():
    # A payee named by email (as payouts to a person often are) is personal data.
    payment = {**PAYMENT, "beneficiary_id": "jane.doe@example.com"}
    rows = {r.name: r.value for r in intent_rows(action="payments.create", payload=payment)}
    assert rows["beneficiary_id"] == "j***@example.com"
    assert intent_summary(action="payments.create", payload=payment) == (
        "Pay 12,500.00 KZT to j***@example.com for invoice inv_9182")
    changed = {**payment, "beneficiary_id": "john.doe@example.com"}
    diff = intent_diff(action="payments.create", old_payload=payment, new_payload=changed)
    assert [(d.old, d.new) for d in diff] == [
        ("j***@example.com", "j***@example.com (changed in the masked part)")]
    unmasked = {r.name: r.value for r in intent_rows(action="payments.create", payload=payment,
                                                     unmasked=True)}
    assert unmasked["beneficiary_id"] == "jane.doe@example.com"
    # An account is cut to its last four, as before; a short id is no account number.
    for beneficiary, shown in (("40817810099914321", "••••4321"), ("vendor_77", "vendor_77")):
        rows = {r.name: r.value for r in intent_rows(
            action="payments.create", payload={**PAYMENT, "beneficiary_id": beneficiary})}
        assert rows["beneficiary_id"] == shown


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("Renewal for ivan.petrov@пример.рф", "Renewal for i***@пример.рф"),
        ("Renewal for li.wei@例子.中国", "Renewal for l***@例子.中国"),
        ("Renewal for jane.doe@example.com", "Renewal for j***@example.com"),
        # The next address begins where the last one's domain ends, with nothing between.
        ("jane@example.com/bob@example.org", "j***@example.com/***@example.org"),
    ],
)
def test_it_masks_an_email_address_whatever_letters_its_top_level_domain_is_in(text, masked):
    assert mask_inline(text) == masked


def test_it_masks_a_deal_name_in_time_linear_in_its_length():
    # Letters, an "@", then "a." pairs: a valid name, under the size limit, that the address
    # pattern retried from every position of and took seconds to mask per render.
    deal = {**DEAL, "name": "a" * 16000 + "@" + "a." * 7900 + "1"}
    intent_validate(action="crm.create_deal", payload=deal)
    started = time.monotonic()
    summary = intent_summary(action="crm.create_deal", payload=deal)
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    assert time.monotonic() - started < 1.0
    # No address in it (no letters after its last dot): shown as it is.
    assert rows["name"] == deal["name"] and f"“{deal['name']}”" in summary


@pytest.mark.parametrize(
    ("action", "payload", "said"),
    [
        # A line break in an id forges a line of `operations list`; an escape sequence
        # rewrites the operator's terminal.
        ("payments.create", {**PAYMENT, "invoice_id": "inv_1\nop_x\tsucceeded"},
         "invoice_id must be one line"),
        ("payments.create", {**PAYMENT, "invoice_id": "inv_1\x1b[2J"},
         "invoice_id: text holds a control character"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"name": "Big\ndeal"}},
         "patch.name must be one line"),
        ("mail.send", {"to": "anna@example.com", "template": "offer",
                       "params": {"note": "hi\x07"}}, "params.note: text holds a control"),
        ("mail.send", {"to": "anna@example.com", "template": "offer",
                       "params": {"no\nte": "hi"}}, "params: a key holds a control character"),
        # Invisible, they make a changed payee read as the one it replaced: vendor_77.
        ("payments.create", {**PAYMENT, "beneficiary_id": "vendor_7\u200b7"},
         "beneficiary_id holds an invisible character (U+200B)"),
        ("payments.create", {**PAYMENT, "beneficiary_id": "vendor_\u202e77"},
         "beneficiary_id holds an invisible character (U+202E)"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"owner": "anna\u2060@example.com"}},
         "patch.owner holds an invisible character (U+2060)"),
        ("crm.create_deal", {**DEAL, "name": "Renewal\u200b"},
         "name holds an invisible character (U+200B)"),
        # Composed and decomposed "José" read alike, and hash and pay differently.
        ("payments.create",
         {**PAYMENT, "beneficiary_id": unicodedata.normalize("NFD", "vendor_José")},
         "beneficiary_id is not in Unicode NFC form"),
        ("crm.update_deal",
         {**DEAL_CHANGE, "patch": {"owner": unicodedata.normalize("NFD", "josé@example.com")}},
         "patch.owner is not in Unicode NFC form"),
    ],
)
def test_it_refuses_control_characters_in_an_intent(action, payload, said):
    with pytest.raises(IntentError, match=re.escape(said)):
        intent_validate(action=action, payload=payload)


@pytest.mark.parametrize(
    ("action", "payload", "said"),
    [
        # Shown as "vendor 77" on the approval card and in a diff, paid as another payee.
        ("payments.create", {**PAYMENT, "beneficiary_id": "vendor\u00a077"},
         "beneficiary_id holds a space other than an ordinary one (U+00A0)"),
        ("payments.create", {**PAYMENT, "beneficiary_id": "vendor\u202f77"},
         "beneficiary_id holds a space other than an ordinary one (U+202F)"),
        ("payments.create", {**PAYMENT, "invoice_id": "inv\u2028 9182"},
         "invoice_id holds a space other than an ordinary one (U+2028)"),
        # A space at either end is seen by no one.
        ("payments.create", {**PAYMENT, "beneficiary_id": "vendor_77 "},
         "beneficiary_id begins or ends with a space"),
        ("payments.create", {**PAYMENT, "invoice_id": " inv_9182"},
         "invoice_id begins or ends with a space"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"owner": "sam@acme.test "}},
         "patch.owner begins or ends with a space"),
        ("crm.create_deal", {**DEAL, "name": "Renewal\u30002026"},
         "name holds a space other than an ordinary one (U+3000)"),
        # A page shows spaces in a row as one: "Acme  Corp" reads as the payee "Acme Corp".
        ("payments.create", {**PAYMENT, "beneficiary_id": "Acme  Corp"},
         "beneficiary_id holds spaces in a row"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"stage": "closed   won"}},
         "patch.stage holds spaces in a row"),
        # One word in letters of two scripts that share shapes: "v\u0435ndor_77" with a
        # Cyrillic e reads as the payee vendor_77, "ex\u0430mple.com" as another domain.
        ("payments.create", {**PAYMENT, "beneficiary_id": "v\u0435ndor_77"},
         "beneficiary_id mixes Latin and Cyrillic letters in one word"),
        ("payments.create", {**PAYMENT, "invoice_id": "\u0399\u039dV_9182"},
         "invoice_id mixes Latin and Greek letters in one word"),
        ("mail.send", {**MAIL, "to": "anna@ex\u0430mple.com"},
         "to mixes Latin and Cyrillic letters in one word"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"owner": "s\u0430m@acme.test"}},
         "patch.owner mixes Latin and Cyrillic letters in one word"),
        # Not only those three: Armenian, Coptic and Cherokee hold Latin lookalikes too.
        ("payments.create", {**PAYMENT, "beneficiary_id": "vend\u0585r_77"},
         "beneficiary_id mixes Latin and Armenian letters in one word (U+0585 is Armenian)"),
        ("payments.create", {**PAYMENT, "beneficiary_id": "vend\u2c9fr_77"},
         "beneficiary_id mixes Latin and Coptic letters in one word (U+2C9F is Coptic)"),
        ("payments.create", {**PAYMENT, "beneficiary_id": "\u13a0cme_77"},
         "beneficiary_id mixes Latin and Cherokee letters in one word (U+13A0 is Cherokee)"),
        # The letter named is the odd one out: a Latin i among Cyrillic letters.
        ("payments.create", {**PAYMENT, "invoice_id": "\u0411i\u0440\u043bi\u043a-0042"},
         "invoice_id mixes Latin and Cyrillic letters in one word (U+0069 is Latin)"),
        # Letters and digits in a form of their own that reads as the ASCII one.
        ("payments.create", {**PAYMENT, "beneficiary_id": "vend\U0001d428r_77"},
         "beneficiary_id holds a letter or digit in another form than the ASCII one it reads "
         "as (U+1D428)"),
        ("payments.create", {**PAYMENT, "beneficiary_id": "\u2174endor_77"},
         "beneficiary_id holds a letter or digit in another form than the ASCII one it reads "
         "as (U+2174)"),
        ("payments.create", {**PAYMENT, "invoice_id": "inv_\uff19\uff11\uff18\uff12"},
         "invoice_id holds a letter or digit in another form than the ASCII one it reads as "
         "(U+FF19)"),
        # A combining mark on the Cyrillic letter still leaves one word on the page.
        ("payments.create", {**PAYMENT, "beneficiary_id": "v\u0435\u0301ndor_77"},
         "beneficiary_id mixes Latin and Cyrillic letters in one word"),
        ("mail.send", {**MAIL, "to": "ann\u200d\u0430@example.com"},
         "to holds an invisible character"),
        # Unseen, though not format characters: "ven\u034fdor_77" reads as vendor_77.
        ("payments.create", {**PAYMENT, "beneficiary_id": "ven\u034fdor_77"},
         "beneficiary_id holds an invisible character (U+034F)"),
        ("payments.create", {**PAYMENT, "invoice_id": "INV\ufe0f_9182"},
         "invoice_id holds an invisible character (U+FE0F)"),
        ("crm.create_deal", {**DEAL, "name": "Acme\u3164renewal"},
         "name holds an invisible character (U+3164)"),
        ("crm.update_deal", {**DEAL_CHANGE, "patch": {"owner": "sam\u2800@acme.test"}},
         "patch.owner holds an invisible character (U+2800)"),
    ],
    ids=["nbsp", "narrow-nbsp", "line-separator", "trailing", "leading", "patch-owner",
         "ideographic-space", "spaces-in-a-row", "patch-spaces-in-a-row", "cyrillic-e",
         "greek-iota-nu", "cyrillic-a-in-domain", "patch-cyrillic-a", "armenian-o",
         "coptic-o", "cherokee-a", "latin-i-among-cyrillic", "mathematical-o", "roman-five",
         "fullwidth-digits", "mark-on-the-letter",
         "joiner-in-an-address", "grapheme-joiner", "variation-selector", "hangul-filler",
         "braille-blank"],
)
def test_it_refuses_a_one_line_field_that_reads_like_another(action, payload, said):
    with pytest.raises(IntentError, match=re.escape(said)):
        intent_validate(action=action, payload=payload)


@pytest.mark.parametrize("unseen", ["\u2065", "\ufff0", "\ufff8", "\U000e0000", "\U000e0002",
                                    "\U000e0080", "\U000e01f0", "\U000e0fff"])
def test_it_refuses_a_reserved_default_ignorable_code_point_in_a_compared_field(unseen):
    """Unicode reserves these as default-ignorable (DerivedCoreProperties.txt): a text
    engine draws nothing for them, assigned or not (HarfBuzz, so Chrome and Firefox), and
    "vendor_7\u20657" reads as vendor_77 on the card as U+034F did."""
    said = f"invisible character (U+{ord(unseen):04X})"
    for field in ("beneficiary_id", "invoice_id"):
        with pytest.raises(IntentError, match=re.escape(said)):
            intent_validate(
                action="payments.create", payload={**PAYMENT, field: f"vendor_7{unseen}7"}
            )
    with pytest.raises(IntentError, match=re.escape(said)):
        intent_validate(
            action="crm.create_deal", payload={**DEAL, "name": f"Acme{unseen} renewal"}
        )


def test_it_keeps_ordinary_spaces_inside_a_one_line_field():
    payload = {**PAYMENT, "beneficiary_id": "Acme Corp LLP", "invoice_id": "INV 2026 0001"}
    assert intent_validate(action="payments.create", payload=payload) == payload


@pytest.mark.parametrize(("action", "payload"), [
    # East Asian writing mixes its scripts, and Latin, in one word; "N\u00ba" is how many
    # invoices are numbered, and the micro sign is no disguise of an ASCII letter.
    ("payments.create", {**PAYMENT, "beneficiary_id": "\u6771\u4eac\u30bf\u30ef\u30fc_77"}),
    ("payments.create", {**PAYMENT, "beneficiary_id": "\uc11c\uc6b8Bank"}),
    ("payments.create", {**PAYMENT, "invoice_id": "N\u00ba 2025-12"}),
    ("payments.create", {**PAYMENT, "invoice_id": "batch-5\u00b5m"}),
    # A word in one script is written, not disguised: Cyrillic, or Latin beside it.
    ("payments.create", {**PAYMENT, "beneficiary_id": "\u0422\u041e\u041e_Rakhat_77"}),
    ("mail.send", {**MAIL, "to": "anna@\u043f\u043e\u0447\u0442\u0430.\u0440\u0444"}),
    ("crm.create_deal", {**DEAL, "name": "\u0421\u0434\u0435\u043b\u043a\u0430 CRM-"
                         "\u0441\u0438\u0441\u0442\u0435\u043c\u0430 5\u00b5m"}),
])
def test_it_keeps_words_each_in_one_script(action, payload):
    assert intent_validate(action=action, payload=payload) == payload


@pytest.mark.parametrize("name", [
    "10k\u03a9 cable supply",  # a Greek omega, as a keyboard types the ohm
    "\u0394T sensors",
    "\u0411i\u0440\u043bi\u043a renewal",  # Kazakh, a Latin i for the Cyrillic one
    "A\u200c\u0441\u200cme renewal",
    "Acme  renewal 2026",  # spaces in a row, as people type them
])
def test_it_keeps_a_deal_name_whose_words_mix_scripts(name):
    """A deal's name routes no money and no message: its words are a company's or a
    product's, as people type them. The same word is refused where it names a payee."""
    intent_validate(action="crm.create_deal", payload={**DEAL, "name": name})
    intent_validate(action="crm.update_deal", payload={**DEAL_CHANGE, "patch": {"name": name}})
    with pytest.raises(
        IntentError, match=r"letters in one word|invisible character|spaces in a row"
    ):
        intent_validate(action="payments.create", payload={**PAYMENT, "beneficiary_id": name})


@pytest.mark.django_db
def test_it_prepares_nothing_for_a_payee_that_reads_like_another(acme):
    from operations.engine import operation_prepare
    from operations.models import AuditEvent

    with pytest.raises(IntentError, match="U\\+00A0"):
        operation_prepare(tenant=acme, action="payments.create",
                          payload={**PAYMENT, "beneficiary_id": "vendor\u00a077"})
    assert not Operation.objects.exists()
    assert not AuditEvent.objects.filter(action="operation.prepare").exists()


@pytest.mark.parametrize("name", [
    "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",  # Persian, spelled with a ZWNJ
    "Launch \U0001f468\u200d\U0001f4bb",  # an emoji held together by a ZWJ
    "Customers \u2764\ufe0f renewal",  # an emoji shown as one by its variation selector
    "\u8fbb\U000e0100 Holdings",  # a Han character in the shape a variation selector picks
    "\u1820\u180b\u1828",  # Mongolian, a free variation selector choosing a letter's form
])
def test_it_keeps_a_deal_name_as_its_language_spells_it(name):
    intent_validate(action="crm.create_deal", payload={**DEAL, "name": name})
    intent_validate(action="crm.update_deal", payload={**DEAL_CHANGE, "patch": {"name": name}})
    with pytest.raises(IntentError, match="invisible character"):
        intent_validate(action="payments.create", payload={**PAYMENT, "beneficiary_id": name})


@pytest.mark.parametrize("body", [
    "Dear Anna,\n\tthe invoice is paid.\n",
    "Dear Anna,\r\nthe invoice is paid.\r\n",  # as mail software writes lines (RFC 5322)
    "مرحبا 👋\u2028",
])
def test_it_keeps_the_lines_of_a_message_parameter(body):
    intent_validate(action="mail.send", payload={
        "to": "anna@example.com", "template": "note", "params": {"body": body}})
    with pytest.raises(IntentError, match="invoice_id must be one line"):
        intent_validate(action="payments.create", payload={**PAYMENT, "invoice_id": "inv\r1"})


def test_it_refuses_an_intent_nested_deeper_than_a_person_reviews():
    def nested(depth: int) -> list:
        value: list = []
        for _ in range(depth):
            value = [value]
        return value

    intent_validate(action="mail.send", payload={
        "to": "anna@example.com", "template": "offer", "params": {"a": nested(31)}})
    # ~970 levels passed validation and then ran out of Python's stack at the insert.
    for depth in (32, 970):
        with pytest.raises(IntentError, match="nested more than 32 levels deep"):
            intent_validate(action="mail.send", payload={
                "to": "anna@example.com", "template": "offer", "params": {"a": nested(depth)}})


@pytest.mark.parametrize(("typed", "shown"), [
    ("paid to 40817810099910004312 on 2026-12-03 at 10:00",
     "paid to ••••4312 on 2026-12-03 at 10:00"),
    ("acct 4081 7810 0999 1000 4312.", "acct ••••4312."),
    ("call +7 701 123 45 67 or jane.doe@example.com", "call +••••5 67 or j***@example.com"),
    # A date with its time is not one long number; ids, hashes and amounts stay whole.
    ("see 2026-12-03 10:00:00 and 03.12.2026 9:15", "see 2026-12-03 10:00:00 and 03.12.2026 9:15"),
    ("ref pi_3NkXY1234567890123abc, op_01KBX1234567890ABC", "ref pi_3NkXY1234567890123abc, "
     "op_01KBX1234567890ABC"),
    ("sha256:0123456789012345abcdef, 150000000 KZT", "sha256:0123456789012345abcdef, "
     "150000000 KZT"),
    # Sums are read, not hidden: with their currency, or written with their cents.
    ("is for 1600000000 KZT, the approved intent for 1500000000 KZT",
     "is for 1600000000 KZT, the approved intent for 1500000000 KZT"),
    ("12 500 000.00 came back", "12 500 000.00 came back"),
    ("account 40817810099910004312 USD", "account ••••4312 USD"),  # too long for a sum
    # Only a currency's code makes a sum of what stands before it, not any three capitals.
    ("Customer confirmed via 87012345678 SMS", "Customer confirmed via ••••5678 SMS"),
    ("Direct line 87012345678 CEO office", "Direct line ••••5678 CEO office"),
    ("call 8 (701) 234-56-78 VIP client", "call ••••6-78 VIP client"),
    ("settled 1250000000 XOF", "settled 1250000000 XOF"),
    # A label before a number is no currency, however it is written.
    ("PHONE 87015550199, ACCT 4081781009991000", "PHONE ••••0199, ACCT ••••1000"),
    # Phone numbers as people write them, and IBANs as banks print them, whole or grouped
    # (with a bank code in letters); what follows one is not taken in.
    ("call +7 (701) 123-45-67", "call +••••5-67"),
    ("IBAN KZ86125KZT5004100100 paid", "IBAN ••••0100 paid"),
    ("IBAN GB29 NWBK 6016 1331 9268 19", "IBAN ••••8 19"),
    ("to IBAN DE89 3704 0044 0532 0130 00 12500 EUR", "to IBAN ••••0 00 12500 EUR"),
    ("SWIFT MT103 of 2026-12-03, FY2026 Q1, ticket AB12 3456",
     "SWIFT MT103 of 2026-12-03, FY2026 Q1, ticket AB12 3456"),
])
def test_it_masks_addresses_and_long_numbers_in_what_a_person_typed(typed, shown):
    assert mask_person_text(typed) == shown


@pytest.mark.parametrize("template", [
    "reset for anna.k@example.com", "invoice paid", "x" * 101,
])
def test_it_refuses_a_mail_template_that_is_not_a_templates_name(template):
    """The template is shown as it is on every masked page, the approval card's summary
    first: an address written there was shown whole to everyone."""
    with pytest.raises(IntentError, match="template must be the template's name"):
        intent_validate(action="mail.send", payload={
            "to": "anna@example.com", "template": template, "params": {}})


def test_it_takes_a_name_in_its_composed_form_as_it_was_sent():
    """NFC, the form nearly every keyboard and system writes, passes unchanged."""
    payload = {**PAYMENT, "beneficiary_id": unicodedata.normalize("NFC", "vendor_José")}
    assert intent_validate(action="payments.create", payload=payload) == payload


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        # An invoice id in groups of four, held together with its prefix by one separator.
        ("INV-2025-0301-0007-1236", "2025030100071236"),
        ("PO-2025-000123-4567-14", "2025000123456714"),
        # A date, then a reference.
        ("2025-12-03 123456786", "20251203123456786"),
        ("paid 2025-03-01 0007 1234 5676", "01000712345676"),
        # A list of orders.
        ("orders 100234 100235 100249", "100234100235100249"),
    ],
)
def test_it_accepts_references_whose_digit_groups_join_into_a_luhn_valid_number(text, joined):
    # Any digit groups joined by any separators pass Luhn about one time in ten: every tenth
    # invoice id, date or list was refused as "a full card number".
    assert luhn_valid(joined)
    assert secret_in_text(text) == ""
    intent_validate(action="payments.create", payload={**PAYMENT, "invoice_id": text})
    intent_validate(action="mail.send", payload={**MAIL, "params": {"note": text}})


@pytest.mark.parametrize(
    "card",
    [
        "4111 1111 1111 1111",  # 4-4-4-4
        "4111-1111-1111-1111",
        "3782 822463 10005",  # 4-6-5, American Express
        "3782-822463-10005",
        "3056 930902 5904",  # 4-6-4, Diners Club
        "6221 2600 0000 0000 001",  # 4-4-4-4-3, a 19 digit UnionPay
        "4222 2222 2222 2",  # 4-4-4-1, a 13 digit Visa
        "6759 6498 2643 8453 3",  # 4-4-4-4-1, a 17 digit Maestro
        "5019717010103742",  # contiguous
    ],
)
def test_it_refuses_a_card_number_in_each_grouping_cards_are_written_in(card):
    assert luhn_valid(_digits(card))
    for text in (card, f"refund to {card}", f"paid 2024 {card}", f"card {card}, exp 12/27"):
        assert "card number" in secret_in_text(text), text
        with pytest.raises(IntentError, match="card number"):
            intent_validate(action="mail.send", payload={**MAIL, "params": {"note": text}})


@pytest.mark.parametrize(
    ("iban", "written"),
    [
        # Valid IBANs (ISO 13616 mod-97) whose digits, read as a card's groups, pass Luhn:
        # grouped as banks print them, and whole.
        ("DE55 3704 0044 6792 9081 00", "pay to IBAN {} by Friday"),
        ("GB83WEST16761222029729", "pay to IBAN {} by Friday"),
        # Followed by a number that its groups of four take in.
        ("BE70 8843 7037 4244", "IBAN {} 2026 invoices"),
    ],
)
def test_it_accepts_an_iban_whose_digits_happen_to_pass_luhn(iban, written):
    assert iban_valid(iban)
    assert secret_in_text(written.format(iban)) == ""
    intent_validate(action="payments.create", payload={**PAYMENT, "beneficiary_id": iban})
    intent_validate(action="mail.send", payload={**MAIL, "params": {"note": written.format(iban)}})
    # Set aside for its check digits, not its shape: the same digits under check digits that
    # fail are card data as before.
    broken = f"{iban[:2]}{(int(iban[2:4]) + 1) % 100:02d}{iban[4:]}"
    assert not iban_valid(broken)
    assert "card number" in secret_in_text(written.format(broken))


def test_it_masks_a_deal_name_by_the_rule_for_a_persons_words():
    # A date stays readable and a short reference whole; a phone number written with
    # brackets, ten digits or more, and an address are masked, wherever the name is shown.
    name = "Renewal 2026-12-03 for PO 450012, call +7 (701) 234-56-78 or anna@example.com"
    shown = "Renewal 2026-12-03 for PO 450012, call +••••6-78 or a***@example.com"
    deal = {**DEAL, "name": name}
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    assert rows["name"] == shown
    assert f"“{shown}”" in intent_summary(action="crm.create_deal", payload=deal)
    change = {**DEAL_CHANGE, "patch": {"name": name}}
    assert f"name → {shown}" in intent_summary(action="crm.update_deal", payload=change)
    diff = intent_diff(action="crm.create_deal", old_payload=DEAL, new_payload=deal)
    assert [(d.label, d.old, d.new) for d in diff] == [("Deal name", "Renewal", shown)]
    unmasked = {r.name: r.value for r in intent_rows(
        action="crm.create_deal", payload=deal, unmasked=True)}
    assert unmasked["name"] == name
    # An IBAN, as in a person's words, is cut to its last four whole.
    deal = {**DEAL, "name": "Payout to GB83WEST16761222029729"}
    rows = {r.name: r.value for r in intent_rows(action="crm.create_deal", payload=deal)}
    assert rows["name"] == "Payout to ••••9729"
