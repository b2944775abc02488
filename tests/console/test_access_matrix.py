"""Every object URL (pages, htmx fragments, POST actions) for each kind of user: 404 for
those outside the tenant, 200 to read and 403 to act without the role, 405 for a wrong
method."""

from __future__ import annotations

import pytest

from approvals.models import Approval
from operations.engine import operation_prepare
from operations.models import Checkpoint, Run
from tests.helpers import signed_in
from tests.operations.engine_helpers import PAYMENT, make_unknown

HX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def acme_objects(acme):
    run = Run.objects.create(conversation_id="conv_01MATRIX", tenant=acme,
                             workflow_name="pay", workflow_version=1, state_schema_version=1)
    cp = Checkpoint.objects.create(run=run, sequence=1, node="n", state={"a": 1},
                                   state_hash="sha256:" + "a" * 64)
    unknown = make_unknown(operation_prepare(
        tenant=acme, action="payments.create", payload={**PAYMENT, "invoice_id": "inv_u"},
        run=run, checkpoint=cp, command_id="cmd_1"))
    waiting = operation_prepare(tenant=acme, action="payments.create",
                                payload={**PAYMENT, "invoice_id": "inv_w"})
    approval = Approval.objects.get(operation=waiting)
    return {"run": run, "cp": cp, "unknown": unknown, "waiting": waiting,
            "approval": approval}


def _gets(o):
    op, ap, run = o["unknown"].id, o["approval"].id, o["run"].id
    return [
        (f"/operations/{op}/", {}),
        (f"/operations/{op}/?unmasked=1", {}),
        (f"/operations/{op}/?seen=x", HX),
        (f"/approvals/{ap}/", {}),
        (f"/approvals/{ap}/", HX),
        (f"/approvals/{ap}/?unmasked=1", {}),
        (f"/runs/{run}/", {}),
        ("/runs/conversations/conv_01MATRIX/", {}),
    ]


def _posts(o):
    op, ap = o["unknown"].id, o["approval"].id
    resolve = {"resolve-outcome": "succeeded", "resolve-evidence": "bank statement",
               "resolve-reason": "checked", "resolve-provider_reference": ""}
    return [
        (f"/operations/{op}/reconcile", {"reconcile-reason": "why"}, "operate_operations"),
        (f"/operations/{op}/resolve", resolve, "operate_operations"),
        (f"/operations/{op}/dispute", {"dispute-reason": "why"}, "operate_operations"),
        (f"/approvals/{ap}/approve", {"comment": ""}, "approve_intents"),
        (f"/approvals/{ap}/reject", {"reason": "no"}, "approve_intents"),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["stranger", "other_tenant_user"])
def test_it_answers_404_to_outsiders_on_every_object_url(request, who, acme_objects,
                                                      monkeypatch):
    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)
    client = signed_in(request.getfixturevalue(who))
    wrong = []
    for url, headers in _gets(acme_objects):
        status = client.get(url, **headers).status_code
        if status != 404:
            wrong.append(("GET", url, bool(headers), status))
    for url, data, _ in _posts(acme_objects):
        for headers in ({}, HX):
            status = client.post(url, data, **headers).status_code
            if status != 404:
                wrong.append(("POST", url, bool(headers), status))
    assert wrong == []


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["auditor", "approver", "operator"])
def test_it_lets_granted_users_read_everything_and_act_only_as_their_role_allows(
    request, who, acme_objects, monkeypatch
):
    monkeypatch.setattr("approvals.services.execute_on_commit", lambda operation_id: None)
    monkeypatch.setattr("operations.views.execute_on_commit", lambda operation_id: None)
    # No provider is reached here: a reconcile that got through would ask one.
    monkeypatch.setattr("operations.views.operation_reconcile",
                        lambda **kw: pytest.fail("reconcile reached the engine"))
    user = request.getfixturevalue(who)
    client = signed_in(user)
    held = {"auditor": set(), "approver": {"approve_intents"},
            "operator": {"operate_operations"}}[who]
    wrong = []
    for url, headers in _gets(acme_objects):
        status = client.get(url, **headers).status_code
        if status != 200:
            wrong.append(("GET", url, bool(headers), status))
    for url, data, perm in _posts(acme_objects):
        if perm in held:
            continue
        for headers in ({}, HX):
            status = client.post(url, data, **headers).status_code
            if status != 403:
                wrong.append(("POST", url, bool(headers), status))
    assert wrong == []


@pytest.mark.django_db
def test_it_answers_405_to_a_wrong_method(acme_objects, admin_user):
    client = signed_in(admin_user)
    wrong = []
    for url, _ in _gets(acme_objects):
        for method in ("post", "put", "delete"):
            status = getattr(client, method)(url).status_code
            if status != 405:
                wrong.append((method, url, status))
    for url, _, _ in _posts(acme_objects):
        for method in ("get", "put", "delete"):
            status = getattr(client, method)(url).status_code
            if status != 405:
                wrong.append((method, url, status))
    for url in ("/", "/operations/", "/operations/unknown/", "/approvals/", "/runs/",
                "/audit/", "/audit.csv", "/healthz"):
        status = client.post(url).status_code
        if status != 405:
            wrong.append(("post", url, status))
    assert wrong == []
