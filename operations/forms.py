from __future__ import annotations

from datetime import UTC, timedelta

from django import forms
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator

from operations.intents import secret_in_text
from operations.models import Action, OperationStatus
from operations.selectors import OperationFilters

AGES: dict[str, tuple[str, timedelta]] = {
    "5m": ("older than 5 minutes", timedelta(minutes=5)),
    "15m": ("older than 15 minutes", timedelta(minutes=15)),
    "1h": ("older than 1 hour", timedelta(hours=1)),
    "6h": ("older than 6 hours", timedelta(hours=6)),
    "24h": ("older than 24 hours", timedelta(hours=24)),
    "7d": ("older than 7 days", timedelta(days=7)),
}


class UtcDateTimeField(forms.DateTimeField):
    """A moment, in UTC. Python reads offsets up to ±23:59, PostgreSQL holds ±15:59 only:
    any other offset reached the query and raised (a 500). A moment outside the years 1 to
    9999 in UTC is no moment the journal holds: refused, said at the field."""

    default_error_messages = {"out_of_range": "Enter a time between the years 1 and 9999 UTC."}

    def to_python(self, value):
        moment = super().to_python(value)
        if moment is None:
            return None
        try:
            return moment.astimezone(UTC)
        except OverflowError:
            raise ValidationError(
                self.error_messages["out_of_range"], code="out_of_range"
            ) from None


class TypedTextField(forms.CharField):
    """Text a person types into a textarea. The browser's maxlength counts a line break as
    one character, but its form submission sends each as CRLF (HTML's form-data rules):
    counted as sent, a multi-line text the browser allowed was refused as too long. Line
    ends are read as the browser counted them, LF, before the length is checked."""

    def to_python(self, value):
        text = super().to_python(value)
        return text.replace("\r\n", "\n").replace("\r", "\n") if text else text


class FilterForm(forms.Form):
    """A list's filters: a filter that does not parse shows nothing (never everything), and
    the page says why in the words on the form."""

    def problems(self) -> list[str]:
        return [text for _, text in self.problem_items()]

    def problem_items(self) -> list[tuple[str, str]]:
        """(id, text): the id is the one Django's aria-describedby on the field names."""
        items = [
            (f"{field.auto_id}_error",
             "the page link is not valid; start again from the first page" if field.is_hidden
             else f"{field.label} — {' '.join(field.errors)}")
            for field in self
            if field.errors
        ] + [("", error) for error in self.non_field_errors()]
        return [(id_, text.rstrip(".")) for id_, text in items]  # the page ends the sentence


# A page cursor is an id the page itself wrote: anything else is refused, not searched for.
ID_CURSOR = RegexValidator(r"^[a-z]{2,4}_[0-9A-Z]{26}$", "not a page link this console wrote")


class OperationFilterForm(FilterForm):
    status = forms.ChoiceField(required=False, choices=[("", "any"), *OperationStatus.choices])
    tenant = forms.ChoiceField(required=False)
    action = forms.ChoiceField(required=False, choices=[("", "any"), *Action.choices])
    run = forms.CharField(required=False, max_length=40, label="Run id")
    age = forms.ChoiceField(
        required=False, choices=[("", "any age"), *((k, v[0]) for k, v in AGES.items())]
    )
    before = forms.CharField(required=False, max_length=40, widget=forms.HiddenInput,
                             validators=[ID_CURSOR])

    def __init__(self, *args, tenant_slugs: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Only the user's own tenants can be chosen; any other slug is a form error.
        self.fields["tenant"].choices = [("", "any"), *((s, s) for s in tenant_slugs)]

    def filters(self) -> OperationFilters:
        data = self.cleaned_data if self.is_valid() else {}
        age = data.get("age") or ""
        return OperationFilters(
            status=data.get("status") or "",
            tenant=data.get("tenant") or "",
            action=data.get("action") or "",
            run=(data.get("run") or "").strip(),
            older_than=AGES[age][1] if age else None,
        )


def refuse_secrets_in_text(value: str) -> None:
    """For every field a person types into the journal: no card numbers, no secrets."""
    problem = secret_in_text(value)
    if problem:
        raise forms.ValidationError(f"This looks like {problem}.")


class ReasonForm(forms.Form):
    # hx-preserve: another action's answer re-renders the panel; what was typed here stays.
    reason = TypedTextField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2, "hx-preserve": "true"}),
        help_text="Why; written to the audit trail.",
        validators=[refuse_secrets_in_text],
    )

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise forms.ValidationError("A reason is required.")
        return reason


class DecisionForm(ReasonForm):
    """A person's decision on an operation (dispute, resolve): it applies to the status the
    page showed, and answers the provider events and call answers held for review that the
    page showed, and only those. One that arrived while the person was deciding stays in the
    queue for them to see."""

    # autocomplete off: a browser restoring form state on reload would send an old list.
    # No length of its own: the page names every held event it showed, however many (capped
    # at 2,000 characters, two hundred ten-digit ids refused every decision from the page).
    # The request's size is bounded (DATA_UPLOAD_MAX_MEMORY_SIZE), each id by _ids_shown.
    held_shown = forms.CharField(
        required=False,
        widget=forms.HiddenInput(attrs={"autocomplete": "off"}),
    )

    # The same for the call answers held for review (attempt ids).
    held_answers_shown = forms.CharField(
        required=False,
        widget=forms.HiddenInput(attrs={"autocomplete": "off"}),
    )

    # When the status the page showed was set: the decision applies to that status only,
    # never to one the engine moved the operation to after the person looked.
    # autocomplete off: a browser restoring form state on reload would send the old moment.
    seen = UtcDateTimeField(
        required=False, widget=forms.HiddenInput(attrs={"autocomplete": "off"})
    )

    def clean_held_shown(self) -> list[int]:
        return _ids_shown(self.cleaned_data["held_shown"])

    def clean_held_answers_shown(self) -> list[int]:
        return _ids_shown(self.cleaned_data["held_answers_shown"])


# More held reports than any page could name in one decision: each becomes a parameter of
# the decision's queries, and the request's size alone let 300,000 through.
HELD_SHOWN_MAX = 10_000


def _ids_shown(value: str) -> list[int]:
    words = set(value.split())
    # ASCII digits only: "²" is a digit to isdigit() and no number to int() (a 500), and
    # int() reads other scripts' digits ("١٢" as 12), which the page never writes.
    if len(words) > HELD_SHOWN_MAX or not all(
        word.isascii() and word.isdigit() and len(word) < 19 for word in words
    ):
        raise forms.ValidationError("The page is out of date; reload it.")
    return sorted(int(word) for word in words)


class ResolveForm(DecisionForm):
    outcome = forms.ChoiceField(
        choices=[
            (OperationStatus.SUCCEEDED, "Succeeded"),
            (OperationStatus.FAILED, "Failed"),
        ]
    )
    # Either one is evidence (clean): operation_resolve takes a reference the provider
    # confirms as proof enough, and the page must not ask for more than the engine does.
    evidence = TypedTextField(
        required=False, max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2, "hx-preserve": "true"}),
        label="Evidence",
        help_text="What you verified at the provider, and where. Give this, a provider "
        "reference, or both.",
        validators=[refuse_secrets_in_text],
    )
    provider_reference = forms.CharField(
        required=False, max_length=120, label="Provider reference",
        help_text="The provider's id (pi_…, deal_…, msg_…); checked at the provider before "
        "anything is recorded. Enough on its own as evidence once the provider confirms it.",
        validators=[refuse_secrets_in_text],
        widget=forms.TextInput(attrs={"hx-preserve": "true"}),
    )

    field_order = ["outcome", "evidence", "provider_reference", "reason"]

    def clean(self) -> dict:
        cleaned = super().clean()
        if "evidence" in cleaned and "provider_reference" in cleaned and not (
            cleaned["evidence"] or cleaned["provider_reference"]
        ):
            self.add_error("evidence", "Give evidence text or a provider reference (or both).")
        return cleaned


def form_problem(form: forms.Form, *, incomplete: str = "") -> str:
    """A refused form's errors as one line, naming each field as the person sees it.

    With `incomplete`: that line instead of the errors of fields left blank, said only when
    nothing typed is wrong too (a card number in a reason is not a missing reason)."""
    problems = []
    for name, errors in form.errors.items():
        if name not in form.fields:
            problems.append(" ".join(errors))
        elif str(form[name].value() or "").strip():
            problems.append(f"{form[name].label}: {' '.join(errors)}")
        elif not incomplete:
            problems.append(" ".join(errors))
    return " ".join(problems) or incomplete
