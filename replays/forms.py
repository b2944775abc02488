from __future__ import annotations

from django import forms

from operations.forms import ID_CURSOR, FilterForm
from operations.models import RunStatus
from replays.selectors import RunFilters


class ConversationForm(forms.Form):
    # As the runtime wrote it: spaces are part of an id, not a typing slip.
    id = forms.CharField(max_length=40, strip=False)


class CheckpointPageForm(forms.Form):
    # A checkpoint's sequence, as the page's link wrote it (PositiveIntegerField's range).
    before = forms.IntegerField(required=False, min_value=1, max_value=2**31 - 1)


class RunFilterForm(FilterForm):
    tenant = forms.ChoiceField(required=False)
    workflow = forms.CharField(required=False, max_length=100)
    status = forms.ChoiceField(required=False, choices=[("", "any"), *RunStatus.choices])
    # As ConversationForm: the conversation page's link to its older runs carries the id
    # as the runtime wrote it, spaces included.
    conversation = forms.CharField(required=False, max_length=40, strip=False,
                                   label="Conversation id")
    parent = forms.CharField(required=False, max_length=40, label="Derived from run")
    before = forms.CharField(required=False, max_length=40, widget=forms.HiddenInput,
                             validators=[ID_CURSOR])

    def __init__(self, *args, tenant_slugs: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Only the user's own tenants can be chosen; any other slug is a form error.
        self.fields["tenant"].choices = [("", "any"), *((s, s) for s in tenant_slugs)]

    def filters(self) -> RunFilters:
        data = self.cleaned_data
        return RunFilters(
            tenant=data.get("tenant") or "",
            workflow=(data.get("workflow") or "").strip(),
            status=data.get("status") or "",
            conversation=data.get("conversation") or "",
            parent=(data.get("parent") or "").strip(),
        )
