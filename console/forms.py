from __future__ import annotations

from django import forms
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError

from operations.forms import FilterForm, UtcDateTimeField
from operations.selectors import AuditFilters


class LoginForm(AuthenticationForm):
    def clean(self):
        try:
            return super().clean()
        except ValidationError:
            # The refusal is the form's, not a field's, so Django marks no field invalid;
            # the username field, which gets the focus again, points at the message.
            self.fields["username"].widget.attrs.update(
                {"aria-invalid": "true", "aria-describedby": "login-error"}
            )
            raise


class AuditFilterForm(FilterForm):
    actor = forms.CharField(required=False, max_length=150)
    action = forms.CharField(
        required=False, max_length=100,
        widget=forms.TextInput(attrs={"list": "audit-actions", "autocomplete": "off"}),
    )
    object = forms.CharField(required=False, max_length=150, label="Object id")
    since = UtcDateTimeField(
        required=False, label="Since (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )
    until = UtcDateTimeField(
        required=False, label="Until (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )
    before = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)

    def clean(self) -> dict:
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            # Said, rather than an empty trail that looks like "nothing happened".
            raise forms.ValidationError("Until (UTC) must be later than Since (UTC).")
        return data

    def filters(self) -> AuditFilters:
        """Only for a valid form: the caller shows nothing for one that is not."""
        data = self.cleaned_data
        return AuditFilters(
            actor=data.get("actor") or "",
            action=data.get("action") or "",
            object=data.get("object") or "",
            since=data.get("since"),
            until=data.get("until"),
        )
