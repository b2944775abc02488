from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from operations.models import AuditEvent
from tests.factories import UserFactory


@pytest.mark.django_db
def test_it_grants_a_role_on_one_tenant_only(acme, globex):
    call_command("setup_roles")
    call_command("setup_roles")  # idempotent
    user = UserFactory(username="dana")
    call_command("grant", "dana", "approver", "acme")
    assert user.has_perm("operations.approve_intents", acme)
    assert not user.has_perm("operations.approve_intents", globex)
    assert not user.has_perm("operations.operate_operations", acme)
    assert list(user.groups.values_list("name", flat=True)) == ["Approver"]
    event = AuditEvent.objects.get(action="role.grant", object_id="dana")
    assert event.tenant == acme and event.after["role"] == "Approver"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nobody", "approver", "acme"), "no user named"),
        (("dana", "approver", "initech"), "no tenant"),
        (("dana", "boss", "acme"), "unknown role"),
    ],
)
def test_it_refuses_bad_input_with_a_clear_message(acme, args, message):
    UserFactory(username="dana")
    with pytest.raises(CommandError, match=message):
        call_command("grant", *args)
