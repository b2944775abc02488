from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

# Reachable without signing in, each for a reason: the sign-in page itself, the load
# balancer's probe, and machine-to-machine endpoints that authenticate by signature.
PUBLIC_PREFIXES = ("login/", "admin/login/", "healthz", "webhooks/", "sandbox/")


def _walk(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern)


def _concrete(route: str) -> str:
    route = route.lstrip("^").rstrip("$").replace("\\Z", "").replace("\\", "")
    route = re.sub(r"<(?:(\w+):)?(\w+)>", "x1", route)  # path converters
    route = re.sub(r"\(\?P<\w+>[^)]*\)", "x1", route)  # admin regexes
    route = re.sub(r"[()?*+^$]", "", route)
    return "/" + route


def all_routes() -> list[str]:
    return sorted({_concrete(r) for r in _walk(get_resolver().url_patterns)})


@pytest.mark.django_db
def test_it_requires_login_on_every_route_but_the_public_ones():
    client = Client()
    routes = all_routes()
    assert len(routes) > 10
    checked = 0
    for path in routes:
        if path.lstrip("/").startswith(PUBLIC_PREFIXES):
            continue
        for method in ("get", "post"):
            response = getattr(client, method)(path)
            assert response.status_code in (302, 404, 405), (method, path, response.status_code)
            if response.status_code == 302:
                assert "login" in response["Location"], (method, path, response["Location"])
            checked += 1
    assert checked > 10


@pytest.mark.django_db
def test_it_serves_the_login_page_and_healthz_anonymously():
    client = Client()
    assert client.get("/login/").status_code == 200
    assert client.get("/healthz").status_code in (200, 503)


@pytest.mark.django_db
def test_it_refuses_a_post_without_a_csrf_token(approver):
    client = Client(enforce_csrf_checks=True)
    client.force_login(approver)
    response = client.post("/logout/")
    assert response.status_code == 403
    # The same POST with the token goes through.
    client.get("/")
    token = client.cookies["csrftoken"].value
    response = client.post("/logout/", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 302


@pytest.mark.django_db
def test_it_never_tells_a_person_who_signed_out_that_signing_out_was_not_done(acme, operator):
    client = Client()  # the session is gone; the page with its Sign out button is still open
    answer = client.post("/logout/", HTTP_REFERER="http://testserver/operations/", follow=True)
    html = answer.content.decode()
    assert answer.status_code == 200
    # They are signed out, as they asked: being told it was "not done" and to sign in and
    # "do it again" sends them to sign in only to sign out.
    assert "what you just sent was not done" not in html, answer.redirect_chain
    assert answer.redirect_chain == [("/login/", 302)]


@pytest.mark.django_db
def test_it_points_the_username_field_at_a_refused_sign_in(approver):
    html = Client().post("/login/", {"username": "approver", "password": "wrong"}).content.decode()
    assert '<p class="error" id="login-error">' in html
    field = re.search(r'<input type="text" name="username"[^>]*>', html).group(0)
    assert 'aria-invalid="true"' in field and 'aria-describedby="login-error"' in field
    fresh = Client().get("/login/").content.decode()
    assert "aria-invalid" not in fresh


@pytest.mark.django_db
def test_it_answers_a_missing_page_inside_the_console_layout(approver):
    client = Client()
    client.force_login(approver)
    response = client.get("/operations/op_missing/")
    html = response.content.decode()
    assert response.status_code == 404
    assert '<nav aria-label="Main"' in html and "Back to the dashboard" in html


@pytest.mark.django_db
def test_it_refuses_a_login_post_without_a_csrf_token(approver):
    client = Client(enforce_csrf_checks=True)
    response = client.post("/login/", {"username": "approver", "password": "x"})
    assert response.status_code == 403


@pytest.mark.django_db
def test_it_sends_a_csp_without_inline_scripts(approver):
    client = Client()
    client.force_login(approver)
    response = client.get("/")
    policy = response["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";") if d.strip())
    assert directives["script-src"] == "'self'"
    assert "unsafe-inline" not in policy
    assert "unsafe-eval" not in policy
    html = response.content.decode()
    assert "<script>" not in html and "<style" not in html and " style=" not in html
    assert 'hx-headers=\'{"X-CSRFToken": "' in html


@pytest.mark.django_db
def test_it_signs_in_a_demo_style_user_and_shows_their_roles(approver):
    client = Client()
    response = client.post(
        "/login/", {"username": "approver", "password": "correct horse battery staple"}
    )
    assert response.status_code == 302
    page = client.get("/").content.decode()
    assert "approver" in page and "Approver" in page


@pytest.fixture
def both_tenants(acme, globex):
    """In each tenant: an unknown payment to a long account number, in a run, with a pending
    approval request beside it."""
    from operations.engine import operation_prepare
    from operations.models import Run
    from tests.operations.engine_helpers import make_unknown

    made = {}
    for tenant in (acme, globex):
        run = Run.objects.create(conversation_id=f"conv_{tenant.slug}", tenant=tenant,
                                 workflow_name="pay_invoices", workflow_version=1,
                                 state_schema_version=1)
        payload = {"invoice_id": f"inv_{tenant.slug}", "amount_minor": 1_250_000,
                   "currency": "KZT", "beneficiary_id": f"acct_4081781009991000{tenant.id:04d}"}
        unknown = make_unknown(operation_prepare(
            tenant=tenant, action="payments.create", payload=payload, run=run))
        waiting = operation_prepare(tenant=tenant, action="payments.create",
                                    payload={**payload, "invoice_id": f"inv_{tenant.slug}_2"})
        made[tenant.slug] = {"run": run, "unknown": unknown, "waiting": waiting,
                             "account": payload["beneficiary_id"]}
    return made


LISTS = ["/", "/operations/", "/operations/unknown/", "/approvals/", "/runs/",
         "/operations/?status=unknown"]


@pytest.mark.django_db
def test_it_names_nothing_of_another_tenant_on_any_list(both_tenants, operator, approver):
    theirs = both_tenants["globex"]
    mine = both_tenants["acme"]
    for user in (operator, approver):
        client = Client()
        client.force_login(user)
        for url in [*LISTS, f"/runs/{mine['run'].id}/"]:
            response = client.get(url)
            html = response.content.decode()
            assert response.status_code == 200, url
            # Not its rows, nor its name in a filter or a count.
            assert "globex" not in html.lower(), (user.username, url)
            for obj in (theirs["run"], theirs["unknown"], theirs["waiting"]):
                assert obj.id not in html, (user.username, url)


@pytest.mark.django_db
def test_it_masks_the_intent_on_every_list_even_for_those_who_may_unmask(
    both_tenants, admin_user
):
    from operations.models import AuditEvent

    mine = both_tenants["acme"]
    client = Client()
    client.force_login(admin_user)
    pages = [*LISTS, f"/runs/{mine['run'].id}/"]
    for url in pages + [f"{url}{'&' if '?' in url else '?'}unmasked=1" for url in pages]:
        html = client.get(url).content.decode()
        assert mine["account"] not in html, url
    # The pages that do list the intents show them, masked.
    for url in ("/operations/", "/operations/unknown/", "/approvals/",
                f"/runs/{mine['run'].id}/"):
        html = client.get(url).content.decode()
        assert "••••" + mine["account"][-4:] in html, url
    assert not AuditEvent.objects.filter(action__endswith="view_unmasked").exists()


@pytest.mark.django_db
def test_it_grants_nothing_through_a_permission_given_on_the_model_not_a_tenant(
    both_tenants, stranger
):
    from django.contrib.auth.models import Permission

    # Given in /admin/ on the user, not per tenant: roles are per tenant, so this is none.
    stranger.user_permissions.add(*Permission.objects.filter(
        content_type__app_label="operations", codename__in=["view_tenant", "view_audit"]))
    client = Client()
    client.force_login(stranger)
    for url in LISTS:
        html = client.get(url).content.decode()
        for made in both_tenants.values():
            assert made["unknown"].id not in html and made["waiting"].id not in html, url
    assert client.get("/audit/").status_code == 403
    assert client.get(f"/operations/{both_tenants['acme']['unknown'].id}/").status_code == 404


@pytest.mark.django_db
def test_it_names_no_role_in_the_header_that_only_a_group_gives(acme, globex, stranger):
    from django.contrib.auth.models import Group

    from console.roles import role_grant, roles_setup
    from tests.helpers import signed_in

    # Put into the Admin group in /admin/: that gives nothing on any tenant (README).
    roles_setup()
    stranger.groups.add(Group.objects.get(name="Admin"))
    html = signed_in(stranger).get("/").content.decode()
    assert "You are not granted on any tenant yet" in html
    assert '<span class="role">Admin</span>' not in html
    assert '<span class="role muted">no role</span>' in html

    for role, tenant in (("Operator", acme), ("Approver", globex), ("Approver", acme)):
        role_grant(user=stranger, role=role, tenant=tenant)
    html = signed_in(stranger).get("/").content.decode()
    assert re.findall(r'<span class="role">(\w+)</span>', html) == ["Approver", "Operator"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", [
    "/operations/%00/", "/operations/op_%00x/resolve", "/approvals/%00/", "/runs/%00/",
    "/runs/conversations/%00/", "/operations/" + "x" * 41 + "/",
])
def test_it_answers_404_not_500_to_an_id_no_record_can_have(admin_user, path):
    # PostgreSQL refuses a NUL byte in a text value: asked for one, it raised (a 500).
    from tests.helpers import signed_in

    assert signed_in(admin_user).get(path).status_code == 404


@pytest.mark.django_db
def test_it_marks_where_a_person_is_in_the_navigation(acme, operator):
    from tests.helpers import signed_in
    from tests.operations.engine_helpers import prepared_payment

    op = prepared_payment(acme)
    client = signed_in(operator)

    def current(path: str) -> list[tuple[str, str]]:
        html = client.get(path).content.decode()
        nav = html[html.index('<nav aria-label="Main"'):html.index("</nav>")]
        return re.findall(r'aria-current="(\w+)">([^<]+)</a>', nav)

    assert current("/") == [("page", "Dashboard")]
    assert current("/operations/") == [("page", "Operations")]
    # Inside a section: its item is marked as the current one of the set, not as this page.
    assert current("/operations/unknown/") == [("true", "Operations")]
    assert current(f"/operations/{op.id}/") == [("true", "Operations")]
    assert current("/runs/") == [("page", "Runs")]


@pytest.mark.django_db
def test_it_gives_a_superuser_only_what_their_tenant_grants_give(
    both_tenants, django_user_model, monkeypatch
):
    """README's deploy makes a superuser for /admin/. Django's and guardian's shortcut would
    answer yes to its every permission on every tenant: approvals, operator actions and
    unmasked data, none of it granted or on the audit trail. Only a grant counts."""
    from approvals.models import Approval, ApprovalStatus
    from console.roles import role_grant, roles_setup
    from operations.models import AuditEvent, OperationStatus
    from tests.helpers import signed_in

    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)
    root = django_user_model.objects.create_superuser("root", "root@example.com", "x")
    mine, theirs = both_tenants["acme"], both_tenants["globex"]
    client = signed_in(root)
    for url in LISTS:
        html = client.get(url).content.decode()
        for made in (mine, theirs):
            assert made["unknown"].id not in html and made["waiting"].id not in html, url
    unknown_page = f"/operations/{mine['unknown'].id}/"
    assert client.get(unknown_page).status_code == 404
    assert client.get(unknown_page + "?unmasked=1").status_code == 404
    assert client.get("/audit/").status_code == 403
    approval = Approval.objects.get(operation=mine["waiting"], status=ApprovalStatus.PENDING)
    assert client.post(f"/approvals/{approval.id}/approve", {"comment": ""}).status_code == 404
    assert client.post(f"/operations/{mine['unknown'].id}/resolve", {
        "outcome": "succeeded", "reason": "checked", "evidence": "seen in the bank statement",
    }).status_code == 404

    # Granted Approver on acme: approves there, and still may neither operate nor unmask.
    roles_setup()
    role_grant(user=root, role="Approver", tenant=mine["run"].tenant)
    html = client.get(unknown_page + "?unmasked=1").content.decode()
    assert mine["account"] not in html and "••••" + mine["account"][-4:] in html
    assert client.post(f"/operations/{mine['unknown'].id}/resolve", {
        "outcome": "succeeded", "reason": "checked", "evidence": "seen in the bank statement",
    }).status_code == 403
    assert client.post(f"/approvals/{approval.id}/approve", {"comment": ""}).status_code == 302
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.APPROVED
    assert client.get(f"/operations/{theirs['unknown'].id}/").status_code == 404
    mine["unknown"].refresh_from_db()
    assert mine["unknown"].status == OperationStatus.UNKNOWN
    assert not AuditEvent.objects.filter(action__endswith="view_unmasked").exists()


@pytest.mark.django_db
def test_it_logs_a_refused_request_in_one_line_without_a_traceback(approver, caplog):
    """A 403 is the console working, not a crash: its line stays, the traceback goes."""
    from tests.helpers import signed_in

    with caplog.at_level("WARNING", logger="django.request"):
        assert signed_in(approver).get("/audit/").status_code == 403
    refused = [r for r in caplog.records if r.name == "django.request"]
    assert [r.getMessage() for r in refused] == ["Forbidden (Permission denied): /audit/"]
    assert refused[0].exc_info is None and "Traceback" not in caplog.text
