from __future__ import annotations

from django import forms

from operations.selectors import AuditFilters


class AuditFilterForm(forms.Form):
    actor = forms.CharField(required=False, max_length=150)
    action = forms.CharField(required=False, max_length=100)
    object = forms.CharField(required=False, max_length=64, label="Object id")
    since = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    until = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    before = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)

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
