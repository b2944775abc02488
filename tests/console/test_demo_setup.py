from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from approvals.models import Approval
from operations.models import AuditEvent, Operation


@pytest.mark.django_db
def test_it_creates_demo_tenants_users_and_intents_once(settings, capsys):
    settings.DEBUG = True
    settings.DEMO_PASSWORD = ""
    call_command("demo_setup")
    out = capsys.readouterr().out
    assert "demo password (shown once" in out
    assert Operation.objects.count() == 4
    superseded = Operation.objects.get(supersedes__isnull=False)
    assert superseded.supersedes.status == "cancelled"
    assert Approval.objects.filter(status="pending").count() == 3
    assert Approval.objects.filter(status="superseded").count() == 1
    call_command("demo_setup")
    out = capsys.readouterr().out
    assert "already exist" in out and "password" not in out
    assert Operation.objects.count() == 4


@pytest.mark.django_db
def test_it_never_creates_demo_users_with_debug_off(settings):
    settings.DEBUG = False
    with pytest.raises(CommandError, match="DEBUG is off"):
        call_command("demo_setup")


@pytest.mark.django_db
def test_it_names_the_shell_user_on_what_it_records(settings, capsys):
    # README: a command's actions are on the audit trail under the shell's user, as grant's
    # and `operations prepare`'s are; demo_setup's tenants, grants and intents named no one.
    settings.DEBUG = True
    settings.DEMO_PASSWORD = ""
    call_command("demo_setup")
    rows = AuditEvent.objects.filter(
        action__in=["tenant.create", "role.grant", "operation.prepare"])
    assert {row.action for row in rows} == {"tenant.create", "role.grant", "operation.prepare"}
    assert rows.count() == 2 + 5 + 4
    assert all(row.actor is None and row.actor_username.startswith("shell:") for row in rows)
    assert not AuditEvent.objects.filter(actor__isnull=True, actor_username="").exists()
