from __future__ import annotations

import io
import threading
from collections.abc import Callable

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from guardian.shortcuts import get_user_perms, remove_perm

from console import roles
from console.roles import role_grant, role_revoke
from operations.models import AuditEvent, TenantRole
from operations.services import audit_event_record
from tests.factories import UserFactory
from tests.helpers import Background, a_statement_waits_on_a_lock, migrated_back_to, wait_for


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
def test_it_grants_a_role_to_a_user_whose_username_is_as_long_as_django_allows(acme, auditor):
    # Usernames may be 150 characters (an email address often is one); the grant's audit
    # row names the user as its object, and an auditor finds it by that name.
    username = "maximilian.mustermann-schmidt@operations." + "x" * 97 + ".example.com"
    assert len(username) == 150
    user = UserFactory(username=username)
    call_command("grant", username, "approver", "acme")
    assert user.has_perm("operations.approve_intents", acme)
    event = AuditEvent.objects.get(action="role.grant", object_id=username)
    assert event.object_type == "user"
    client = Client()
    client.force_login(auditor)
    html = client.get("/audit/", {"object": username}).content.decode()
    assert "Nothing is shown" not in html and "role.grant" in html


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


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "named"),
    [
        # What Python makes of a byte that is not UTF-8 in argv (surrogateescape).
        (("dana\udcff", "approver", "acme"), "username"),
        (("dana", "approver", "acme\udcff"), "tenant"),
        (("dana", "approver", "acme", "--reason", "on call\udcff"), "reason"),
        (("--revoke", "dana\udcff", "approver", "acme"), "username"),
    ],
)
def test_it_refuses_an_argument_that_is_not_utf8_with_one_error(acme, args, named):
    # It reached the database driver and raised there: a traceback.
    UserFactory(username="dana")
    with pytest.raises(CommandError) as refused:
        call_command("grant", *args)
    assert str(refused.value) == f"{named} is not UTF-8 text"
    assert not AuditEvent.objects.filter(action__in=["role.grant", "role.revoke"]).exists()


@pytest.mark.django_db
def test_it_revokes_one_role_and_keeps_what_another_role_on_the_tenant_gives(acme, globex):
    call_command("setup_roles")
    user = UserFactory(username="dana")
    call_command("grant", "dana", "approver", "acme")
    call_command("grant", "dana", "operator", "acme")
    call_command("grant", "dana", "approver", "globex")

    call_command("grant", "--revoke", "dana", "approver", "acme", "--reason", "left the team")

    user = type(user).objects.get(pk=user.pk)  # fresh permission caches
    assert not user.has_perm("operations.approve_intents", acme)
    assert user.has_perm("operations.view_tenant", acme)  # Operator gives it too
    assert user.has_perm("operations.operate_operations", acme)
    assert user.has_perm("operations.approve_intents", globex)
    assert sorted(user.groups.values_list("name", flat=True)) == ["Approver", "Operator"]
    assert list(TenantRole.objects.filter(user=user, tenant=acme).values_list(
        "role", flat=True)) == ["Operator"]
    event = AuditEvent.objects.get(action="role.revoke", object_id="dana")
    assert event.tenant == acme and event.reason == "left the team"
    assert event.after == {"removed_permissions": ["approve_intents"]}

    call_command("grant", "--revoke", "dana", "approver", "globex")
    call_command("grant", "--revoke", "dana", "operator", "acme")
    user = type(user).objects.get(pk=user.pk)
    assert not user.groups.exists()  # no role held anywhere: no role badge either
    assert not user.has_perm("operations.view_tenant", acme)
    with pytest.raises(CommandError, match="does not hold Operator on acme"):
        call_command("grant", "--revoke", "dana", "operator", "acme")


@pytest.mark.django_db(transaction=True)
def test_it_replays_the_audited_grants_made_before_roles_were_recorded_per_tenant():
    # Migrating operations back to 0005 also unapplies what depends on 0006 (approvals 0002).
    with migrated_back_to([("operations", "0005_unknown_since_constraint")]) as forward:
        # Seeded with today's models: none of these tables changes in 0006.
        from guardian.shortcuts import assign_perm

        from operations.models import Tenant

        tenant = Tenant.objects.create(slug="acme", name="Acme")
        other = Tenant.objects.create(slug="globex", name="Globex")
        user = UserFactory(username="dana")

        def granted(role: str, on: Tenant, codenames: tuple[str, ...]) -> None:
            for codename in codenames:
                assign_perm(f"operations.{codename}", user, on)
            audit_event_record(actor=None, action="role.grant", tenant=on, object_type="user",
                               object_id="dana", after={"role": role})

        granted("Operator", tenant, ("view_tenant", "operate_operations", "replay_runs"))
        granted("Admin", other, ("view_tenant",))  # its permissions were taken away since
        granted("Auditor", tenant, ("view_audit", "export_audit"))
        audit_event_record(actor=None, action="role.revoke", tenant=tenant, object_type="user",
                           object_id="dana", before={"role": "Auditor"})

        new = forward([("operations", "0006_tenant_role")])

        roles = new.get_model("operations", "TenantRole").objects.values_list(
            "user__username", "tenant__slug", "role")
        assert list(roles) == [("dana", "acme", "Operator")]


@pytest.mark.django_db
def test_it_gives_each_role_exactly_its_permissions_on_the_tenant(acme):
    from guardian.shortcuts import get_perms

    call_command("setup_roles")
    expected = {
        # The auditor only reads; redelivery and unmasking are the admin's alone.
        "auditor": {"view_tenant", "view_audit", "export_audit"},
        "approver": {"view_tenant", "approve_intents"},
        "operator": {"view_tenant", "operate_operations", "replay_runs"},
        "admin": {"view_tenant", "approve_intents", "operate_operations", "replay_runs",
                  "view_audit", "export_audit", "redeliver_effects",
                  "replay_live_irreversible", "view_unmasked"},
    }
    for role, perms in expected.items():
        user = UserFactory(username=f"the_{role}")
        call_command("grant", user.username, role, "acme", "--reason", "onboarding")
        assert set(get_perms(user, acme)) == perms, role
        event = AuditEvent.objects.get(action="role.grant", object_id=user.username)
        assert event.reason == "onboarding" and set(event.after["permissions"]) == perms

    call_command("grant", "--revoke", "the_auditor", "auditor", "acme", "--reason", "moved")
    event = AuditEvent.objects.get(action="role.revoke", object_id="the_auditor")
    assert event.before == {"role": "Auditor"} and event.reason == "moved"
    auditor = type(UserFactory.build()).objects.get(username="the_auditor")
    assert get_perms(auditor, acme) == []


@pytest.mark.django_db
def test_it_names_the_shell_user_who_granted_and_revoked(acme):
    UserFactory(username="dana")
    call_command("grant", "dana", "admin", "acme", "--reason", "on call", stdout=io.StringIO())
    call_command("grant", "dana", "admin", "acme", "--revoke", stdout=io.StringIO())
    events = AuditEvent.objects.filter(object_id="dana").order_by("id")
    # It read "system": nothing said who gave someone Admin.
    assert [(e.action, e.actor_username.startswith("shell:")) for e in events] == [
        ("role.grant", True), ("role.revoke", True)]


@pytest.mark.django_db
@pytest.mark.parametrize("revoke", [(), ("--revoke",)])
def test_it_refuses_card_data_in_a_grant_reason(acme, revoke):
    dana = UserFactory(username="dana")
    call_command("grant", "dana", "approver", "acme", stdout=io.StringIO())
    before = AuditEvent.objects.count()
    with pytest.raises(CommandError, match="card number"):
        call_command("grant", "dana", "approver", "acme", *revoke, "--reason",
                     "card 4111 1111 1111 1111")
    assert AuditEvent.objects.count() == before
    assert TenantRole.objects.filter(user=dana, tenant=acme).count() == 1


@pytest.mark.django_db
def test_it_records_a_role_already_held_once(acme):
    dana = UserFactory(username="dana")
    call_command("grant", "dana", "approver", "acme", stdout=io.StringIO())
    out = io.StringIO()
    call_command("grant", "dana", "approver", "acme", stdout=out)
    assert out.getvalue() == "dana already holds approver on acme: nothing recorded\n"
    # Two grants with no revoke between them told an auditor something that never happened.
    assert AuditEvent.objects.filter(action="role.grant", object_id="dana").count() == 1
    assert dana.has_perm("operations.approve_intents", acme)


@pytest.mark.django_db
def test_it_records_permissions_a_second_grant_gives_back(acme):
    dana = UserFactory(username="dana")
    call_command("grant", "dana", "approver", "acme", stdout=io.StringIO())
    remove_perm("operations.approve_intents", dana, acme)  # taken another way meanwhile
    out = io.StringIO()
    call_command("grant", "dana", "approver", "acme", stdout=out)
    assert out.getvalue() == (
        "dana already holds approver on acme: gave back approve_intents (recorded)\n"
    )
    assert type(dana).objects.get(pk=dana.pk).has_perm("operations.approve_intents", acme)
    restored = AuditEvent.objects.filter(action="role.grant", object_id="dana").order_by("id")
    assert [event.after.get("restored") for event in restored] == [None, ["approve_intents"]]


def _paused_at(monkeypatch, name: str) -> tuple[threading.Event, threading.Event]:
    """console.roles.<name> stops the first background thread that calls it, just after the
    call and with its transaction open, until released. Returns (paused, release)."""
    paused, release = threading.Event(), threading.Event()
    original = getattr(roles, name)

    def stopping(*args, **kwargs):
        result = original(*args, **kwargs)
        if hasattr(result, "model"):
            result = list(result)  # a lazy queryset: read now, as the caller does next
        if threading.current_thread() is not threading.main_thread() and not paused.is_set():
            paused.set()
            release.wait(timeout=20)
        return result

    monkeypatch.setattr(roles, name, stopping)
    return paused, release


def _beside(call: Callable[[], object]) -> Background:
    """`call` in a second thread, as another admin at the same moment; returns once it has
    finished or is waiting on a lock, whichever the code under test makes it do."""
    done = threading.Event()

    def run() -> object:
        try:
            return call()
        finally:
            done.set()

    second = Background(run)
    wait_for(lambda: done.is_set() or a_statement_waits_on_a_lock(),
             what="the second call to block or end")
    return second


@pytest.mark.django_db(transaction=True)
def test_it_leaves_nothing_on_the_tenant_after_two_revokes_at_once(acme, monkeypatch):
    dana = UserFactory(username="dana")
    role_grant(user=dana, role="Approver", tenant=acme)
    role_grant(user=dana, role="Operator", tenant=acme)
    # The first revoke has worked out what Operator keeps and is removing the rest.
    paused, release = _paused_at(monkeypatch, "remove_perm")
    first = Background(lambda: role_revoke(user=dana, role="Approver", tenant=acme))
    assert paused.wait(timeout=10)

    second = _beside(lambda: role_revoke(user=dana, role="Operator", tenant=acme))
    release.set()
    removed = first.join(), second.join()

    # Each kept view_tenant for the role the other was taking away: no role held, and the
    # tenant still visible to them.
    assert not TenantRole.objects.filter(user=dana, tenant=acme).exists()
    assert list(get_user_perms(dana, acme)) == []
    assert removed == (["approve_intents"], ["view_tenant", "operate_operations", "replay_runs"])
    assert not dana.groups.exists()
    assert AuditEvent.objects.filter(action="role.revoke", object_id="dana").count() == 2


@pytest.mark.django_db(transaction=True)
def test_it_gives_a_role_granted_beside_a_revoke_all_its_permissions(acme, monkeypatch):
    dana = UserFactory(username="dana")
    role_grant(user=dana, role="Operator", tenant=acme)
    # The grant has read what dana holds on acme (view_tenant, from Operator).
    paused, release = _paused_at(monkeypatch, "get_user_perms")
    grant = Background(lambda: role_grant(user=dana, role="Approver", tenant=acme))
    assert paused.wait(timeout=10)

    revoke = _beside(lambda: role_revoke(user=dana, role="Operator", tenant=acme))
    release.set()
    granted, removed = grant.join(), revoke.join()

    # The grant left view_tenant out as held while the revoke took it away with Operator.
    assert list(TenantRole.objects.filter(user=dana, tenant=acme).values_list(
        "role", flat=True)) == ["Approver"]
    assert set(get_user_perms(dana, acme)) == {"view_tenant", "approve_intents"}
    assert (granted.restored, removed) == ([], ["operate_operations", "replay_runs"])
    assert list(dana.groups.values_list("name", flat=True)) == ["Approver"]
