from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from console.roles import role_grant, roles_setup
from operations.models import AuditEvent, Tenant, TenantRole
from tests.factories import UserFactory


@pytest.fixture
def superuser_client(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "x"))
    return client


def _change_page(user) -> dict:
    """A person's change form in /admin/ as the browser sends it back untouched."""
    page = {"username": user.username, "date_joined_0": "2024-01-01",
            "date_joined_1": "00:00:00",
            "groups": [str(pk) for pk in user.groups.values_list("pk", flat=True)],
            "user_permissions": [
                str(pk) for pk in user.user_permissions.values_list("pk", flat=True)]}
    for flag in ("is_active", "is_staff", "is_superuser"):
        if getattr(user, flag):
            page[flag] = "on"
    return page


@pytest.mark.django_db
def test_it_audits_a_tenant_added_and_changed_in_the_admin(superuser_client):
    added = superuser_client.post("/admin/operations/tenant/add/", {
        "slug": "initech", "name": "Initech", "legal_entity": "Initech LLP"})
    assert added.status_code == 302
    tenant = Tenant.objects.get(slug="initech")
    created = AuditEvent.objects.get(action="tenant.create", object_id="initech")
    assert (created.actor_username, created.after) == (
        "root", {"name": "Initech", "legal_entity": "Initech LLP"})

    # The legal entity is what approvers read on every card: its change is on the trail.
    changed = superuser_client.post(f"/admin/operations/tenant/{tenant.pk}/change/", {
        "slug": "renamed", "name": "Initech", "legal_entity": "Initech Holdings LLP"})
    assert changed.status_code == 302
    tenant.refresh_from_db()
    assert (tenant.slug, tenant.legal_entity) == ("initech", "Initech Holdings LLP")
    update = AuditEvent.objects.get(action="tenant.update", object_id="initech")
    assert update.actor_username == "root"
    assert update.before == {"name": "Initech", "legal_entity": "Initech LLP"}
    assert update.after == {"name": "Initech", "legal_entity": "Initech Holdings LLP"}

    # Saved unchanged: nothing to put on the trail.
    superuser_client.post(f"/admin/operations/tenant/{tenant.pk}/change/", {
        "name": "Initech", "legal_entity": "Initech Holdings LLP"})
    assert AuditEvent.objects.filter(action="tenant.update").count() == 1


@pytest.mark.django_db
def test_it_grants_nothing_and_deletes_nothing_from_the_tenant_admin(superuser_client, acme):
    # Object permissions are granted with `manage.py grant` (roles and permissions in step,
    # audited), never from a page beside it; and a tenant's journal is kept for good.
    assert superuser_client.get(
        f"/admin/operations/tenant/{acme.pk}/permissions/").status_code in (302, 404)
    assert superuser_client.post(
        f"/admin/operations/tenant/{acme.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Tenant.objects.filter(pk=acme.pk).exists()


@pytest.mark.django_db
def test_it_puts_the_roles_a_user_deletion_takes_away_on_the_tenants_audit_trail(
    superuser_client, acme, globex
):
    roles_setup()
    leaver = UserFactory(username="leaver")
    role_grant(user=leaver, role="Approver", tenant=acme, reason="joined the AP team")
    role_grant(user=leaver, role="Operator", tenant=globex)

    deleted = superuser_client.post(f"/admin/auth/user/{leaver.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert not get_user_model().objects.filter(pk=leaver.pk).exists()
    assert not TenantRole.objects.exists()

    # Each tenant's trail says who took the role away, and why it went.
    for tenant, role in ((acme, "Approver"), (globex, "Operator")):
        revoke, delete = AuditEvent.objects.filter(
            tenant=tenant, object_id="leaver").exclude(action="role.grant").order_by("id")
        assert (revoke.action, revoke.actor_username, revoke.before) == (
            "role.revoke", "root", {"role": role})
        assert (delete.action, delete.actor_username) == ("user.delete", "root")
        assert delete.reason == revoke.reason == "user deleted in /admin/"


@pytest.mark.django_db
def test_it_audits_users_deleted_together_with_the_admins_bulk_action(superuser_client, acme):
    roles_setup()
    first, second = UserFactory(username="first"), UserFactory(username="second")
    role_grant(user=first, role="Approver", tenant=acme)

    changelist = superuser_client.post("/admin/auth/user/", {
        "action": "delete_selected", "_selected_action": [first.pk, second.pk], "post": "yes"})
    assert changelist.status_code == 302
    assert not get_user_model().objects.filter(pk__in=[first.pk, second.pk]).exists()

    assert list(AuditEvent.objects.filter(tenant=acme).exclude(action="role.grant")
                .order_by("id").values_list("action", "object_id", "actor_username")) == [
        ("role.revoke", "first", "root"), ("user.delete", "first", "root")]
    # One who held no role is on no tenant's trail, but still on the trail.
    assert AuditEvent.objects.get(object_id="second").tenant is None


@pytest.mark.django_db
def test_it_audits_a_password_reset_of_an_approver_in_the_admin(superuser_client, approver, acme):
    assert superuser_client.get(f"/admin/auth/user/{approver.pk}/password/").status_code == 200
    assert superuser_client.get("/admin/auth/user/999999/password/").status_code == 404
    # Whoever sets a person's password can sign in as them and approve in their name.
    changed = superuser_client.post(f"/admin/auth/user/{approver.pk}/password/", {
        "password1": "N3w-pass-phrase-1234", "password2": "N3w-pass-phrase-1234",
        "usable_password": "true"})
    assert changed.status_code == 302
    approver.refresh_from_db()
    assert approver.check_password("N3w-pass-phrase-1234")
    event = AuditEvent.objects.get(tenant=acme, object_id="approver", action="user.password_set")
    assert (event.actor_username, event.after) == ("root", {"usable_password": True})
    assert "N3w" not in str(event.after)

    superuser_client.post(f"/admin/auth/user/{approver.pk}/password/", {
        "usable_password": "false", "unset-password": "1"})
    approver.refresh_from_db()
    assert not approver.has_usable_password()
    assert AuditEvent.objects.filter(action="user.password_set").first().after == {
        "usable_password": False}

    # Refused (the two differ): nothing was set, nothing is on the trail.
    superuser_client.post(f"/admin/auth/user/{approver.pk}/password/", {
        "password1": "N3w-pass-phrase-1234", "password2": "other", "usable_password": "true"})
    assert AuditEvent.objects.filter(action="user.password_set").count() == 2


@pytest.mark.django_db
def test_it_audits_an_approver_deactivated_or_made_staff_in_the_admin(
    superuser_client, approver, acme
):
    page = _change_page(approver)
    del page["is_active"]  # the box unticked
    changed = superuser_client.post(f"/admin/auth/user/{approver.pk}/change/",
                                    {**page, "is_staff": "on"})
    assert changed.status_code == 302
    approver.refresh_from_db()
    assert (approver.is_active, approver.is_staff) == (False, True)
    event = AuditEvent.objects.get(tenant=acme, object_id="approver", action="user.update")
    assert event.actor_username == "root"
    assert (event.before, event.after) == (
        {"is_active": True, "is_staff": False}, {"is_active": False, "is_staff": True})

    # Saved with no access flag changed: nothing to put on the trail.
    superuser_client.post(f"/admin/auth/user/{approver.pk}/change/",
                          {**page, "is_staff": "on", "first_name": "Ann"})
    approver.refresh_from_db()
    assert approver.first_name == "Ann"
    assert AuditEvent.objects.filter(action="user.update").count() == 1


@pytest.mark.django_db
def test_it_audits_an_approver_renamed_in_the_admin_under_both_names(
    superuser_client, approver, acme
):
    page = {**_change_page(approver), "username": "approver-ann"}
    changed = superuser_client.post(f"/admin/auth/user/{approver.pk}/change/", page)
    assert changed.status_code == 302
    approver.refresh_from_db()
    assert approver.username == "approver-ann"
    event = AuditEvent.objects.get(tenant=acme, action="user.update")
    assert (event.object_id, event.actor_username) == ("approver-ann", "root")
    assert (event.before, event.after) == (
        {"username": "approver"}, {"username": "approver-ann"})


@pytest.mark.django_db
def test_it_shows_the_superuser_only_the_events_on_no_tenants_trail(
    superuser_client, approver, acme, django_user_model
):
    loner = UserFactory(username="loner")
    superuser_client.post(f"/admin/auth/user/{loner.pk}/password/",
                          {"password1": "Gq7-long-enough-pw", "password2": "Gq7-long-enough-pw",
                           "usable_password": "true"})
    superuser_client.post(f"/admin/auth/user/{approver.pk}/password/",
                          {"password1": "Gq7-long-enough-pw", "password2": "Gq7-long-enough-pw",
                           "usable_password": "true"})
    on_no_tenant = AuditEvent.objects.get(tenant=None, action="user.password_set")
    on_acme = AuditEvent.objects.get(tenant=acme, action="user.password_set")
    assert (on_no_tenant.object_id, on_acme.object_id) == ("loner", "approver")

    page = superuser_client.get("/admin/operations/auditevent/")
    assert page.status_code == 200
    listed = set(page.context["cl"].result_list)
    assert on_no_tenant in listed and on_acme not in listed
    assert superuser_client.get(
        f"/admin/operations/auditevent/{on_acme.pk}/change/").status_code == 302
    shown = superuser_client.get(f"/admin/operations/auditevent/{on_no_tenant.pk}/change/")
    assert shown.status_code == 200 and b'name="_save"' not in shown.content
    assert superuser_client.post(
        f"/admin/operations/auditevent/{on_no_tenant.pk}/delete/", {"post": "yes"}
    ).status_code == 403
    assert AuditEvent.objects.filter(pk=on_no_tenant.pk).exists()

    staff = Client()
    staff.force_login(django_user_model.objects.create_user("staff", is_staff=True))
    assert staff.get("/admin/operations/auditevent/").status_code == 403


@pytest.mark.django_db
def test_it_audits_groups_and_permissions_given_in_the_admin_with_the_save_s_other_changes(
    superuser_client, approver, acme
):
    """A staff member given the user admin's permissions may change other people's accounts
    and passwords; who gave them that was on no trail."""
    from django.contrib.auth.models import Group, Permission

    editors = Group.objects.create(name="account editors")
    change_user = Permission.objects.get(codename="change_user")
    groups_before = sorted(approver.groups.values_list("name", flat=True))
    page = _change_page(approver)
    changed = superuser_client.post(f"/admin/auth/user/{approver.pk}/change/", {
        **page, "is_staff": "on", "groups": [*page["groups"], str(editors.pk)],
        "user_permissions": [str(change_user.pk)]})
    assert changed.status_code == 302
    assert approver.user_permissions.get() == change_user
    event = AuditEvent.objects.get(tenant=acme, object_id="approver", action="user.update")
    assert event.actor_username == "root"
    assert event.before == {"is_staff": False, "groups": groups_before,
                            "user_permissions": []}
    assert event.after == {"is_staff": True,
                           "groups": sorted([*groups_before, "account editors"]),
                           "user_permissions": ["auth.change_user"]}

    # Taken away again, alone.
    approver.refresh_from_db()
    superuser_client.post(f"/admin/auth/user/{approver.pk}/change/",
                          {**_change_page(approver), "user_permissions": []})
    taken = AuditEvent.objects.filter(action="user.update").latest("id")
    assert (taken.before, taken.after) == (
        {"user_permissions": ["auth.change_user"]}, {"user_permissions": []})
    # Saved untouched: nothing on the trail.
    superuser_client.post(f"/admin/auth/user/{approver.pk}/change/", _change_page(approver))
    assert AuditEvent.objects.filter(action="user.update").count() == 2


@pytest.mark.django_db
def test_it_audits_an_account_made_in_the_admin_on_no_tenant_s_trail(superuser_client):
    made = superuser_client.post("/admin/auth/user/add/", {
        "username": "newcomer", "usable_password": "true",
        "password1": "Gq7-long-enough-pw", "password2": "Gq7-long-enough-pw"})
    assert made.status_code == 302
    event = AuditEvent.objects.get(action="user.create")
    assert (event.tenant, event.object_id, event.actor_username) == (None, "newcomer", "root")
    assert event.after == {"is_active": True, "is_staff": False, "is_superuser": False,
                           "username": "newcomer"}
    assert "Gq7" not in str(event.after)


@pytest.mark.django_db
def test_it_audits_a_group_s_permissions_on_the_trails_its_members_act_on(
    superuser_client, approver, acme, globex
):
    """Every member holds what a group gives: the user admin's permissions given to a group
    an approver is in let them change other people's accounts, and that was on no trail."""
    from django.contrib.auth.models import Group, Permission

    made = superuser_client.post("/admin/auth/group/add/", {"name": "account editors"})
    assert made.status_code == 302
    editors = Group.objects.get(name="account editors")
    created = AuditEvent.objects.get(action="group.create")
    assert (created.tenant, created.object_id, created.actor_username) == (
        None, "account editors", "root")
    assert created.after == {"name": "account editors", "permissions": []}

    approver.groups.add(editors)
    change_user = Permission.objects.get(codename="change_user")
    changed = superuser_client.post(f"/admin/auth/group/{editors.pk}/change/", {
        "name": "account editors", "permissions": [str(change_user.pk)]})
    assert changed.status_code == 302
    update = AuditEvent.objects.get(action="group.update")
    # On the trail of the tenant its member acts on, not on another's.
    assert (update.tenant, update.object_id, update.actor_username) == (
        acme, "account editors", "root")
    assert (update.before, update.after) == (
        {"permissions": []}, {"permissions": ["auth.change_user"]})
    # Saved untouched: nothing more.
    superuser_client.post(f"/admin/auth/group/{editors.pk}/change/", {
        "name": "account editors", "permissions": [str(change_user.pk)]})
    assert AuditEvent.objects.filter(action="group.update").count() == 1

    superuser_client.post(f"/admin/auth/group/{editors.pk}/delete/", {"post": "yes"})
    assert not Group.objects.filter(pk=editors.pk).exists()
    deleted = AuditEvent.objects.get(action="group.delete")
    assert (deleted.tenant, deleted.before) == (
        acme, {"name": "account editors", "permissions": ["auth.change_user"]})
    assert not AuditEvent.objects.filter(tenant=globex, object_type="group").exists()
