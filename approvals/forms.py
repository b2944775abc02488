from __future__ import annotations

from django import forms

from approvals.selectors import QueueFilters
from operations.forms import FilterForm, TypedTextField, refuse_secrets_in_text
from operations.models import Action


class QueueFilterForm(FilterForm):
    tenant = forms.ChoiceField(required=False)
    action = forms.ChoiceField(
        required=False, choices=[("", "All actions"), *Action.choices]
    )
    cursor = forms.CharField(required=False, widget=forms.HiddenInput, max_length=200)

    def __init__(self, data, *, tenants, **kwargs):
        super().__init__(data, **kwargs)
        # Only the user's own tenants can be chosen; any other slug is a form error.
        self.fields["tenant"].choices = [("", "All tenants")] + [
            (t.slug, t.name) for t in tenants
        ]

    def filters(self) -> QueueFilters:
        data = self.cleaned_data
        return QueueFilters(tenant=data.get("tenant") or "", action=data.get("action") or "")


class ApproveForm(forms.Form):
    comment = TypedTextField(required=False, widget=forms.Textarea, max_length=2000,
                             validators=[refuse_secrets_in_text])


class RejectForm(forms.Form):
    reason = TypedTextField(
        required=True, widget=forms.Textarea, max_length=2000,
        error_messages={"required": "A rejection needs a reason."},
        validators=[refuse_secrets_in_text],
    )
