from __future__ import annotations

import pytest
from django.test import Client

from operations.models import AuditEvent, Tenant


@pytest.fixture
def superuser_client(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "x"))
    return client


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
