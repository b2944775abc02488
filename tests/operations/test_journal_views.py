from __future__ import annotations

import hashlib
import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from ulid import ULID

from operations.engine import operation_prepare
from operations.intents import intent_canonical, payload_fingerprint
from operations.models import AuditEvent, Evidence, EvidenceKind, Operation
from tests.factories import CallAttemptFactory
from tests.helpers import plan_rows_read, queries_run, signed_in
from tests.operations.engine_helpers import (
    PAYMENT,
    ids_made_at,
    make_unknown,
    prepared_payment,
)


@pytest.fixture
def journal(acme, globex):
    return {
        "acme": prepared_payment(acme, invoice_id="inv_acme"),
        "globex": prepared_payment(globex, invoice_id="inv_globex"),
    }



def _version_conflict(tenant) -> Operation:
    """An operation whose one call the provider refused for a version conflict."""
    conflict = prepared_payment(tenant, invoice_id="inv_c")
    Operation.objects.filter(id=conflict.id).update(
        status="failed", error_code="version_conflict", provider_calls=1)
    CallAttemptFactory(operation=conflict, outcome="failed", http_status=409,
                       error_class="version_conflict")
    return conflict

@pytest.mark.django_db
def test_it_lists_only_operations_of_granted_tenants(
    journal, approver, other_tenant_user, stranger
):
    acme_id, globex_id = journal["acme"].id, journal["globex"].id
    html = signed_in(approver).get("/operations/").content.decode()
    assert acme_id in html and globex_id not in html
    assert "Pay 12,500.00 KZT to vendor_77 for invoice inv_acme" in html
    html = signed_in(other_tenant_user).get("/operations/").content.decode()
    assert globex_id in html and acme_id not in html
    html = signed_in(stranger).get("/operations/").content.decode()
    assert acme_id not in html and globex_id not in html
    assert "No operations match." in html


@pytest.mark.django_db
def test_it_answers_404_on_the_detail_for_other_tenants_and_strangers(
    journal, approver, other_tenant_user, stranger
):
    url = f"/operations/{journal['acme'].id}/"
    assert signed_in(approver).get(url).status_code == 200
    assert signed_in(other_tenant_user).get(url).status_code == 404
    assert signed_in(stranger).get(url).status_code == 404
    assert signed_in(approver).get("/operations/op_doesnotexist/").status_code == 404


@pytest.mark.django_db
def test_it_shows_the_operations_link_in_the_navigation(approver):
    html = signed_in(approver).get("/").content.decode()
    assert 'href="/operations/"' in html


@pytest.mark.django_db
def test_it_filters_by_status_tenant_action_run_and_age(acme, globex, admin_user):
    from console.roles import role_grant

    role_grant(user=admin_user, role="Admin", tenant=globex)
    fresh = prepared_payment(acme, invoice_id="inv_fresh")
    three_hours_ago = timezone.now() - timedelta(hours=3)
    with ids_made_at(three_hours_ago):
        old = prepared_payment(acme, invoice_id="inv_old")
    Operation.objects.filter(id=old.id).update(created_at=three_hours_ago)
    unknown = make_unknown(prepared_payment(acme, invoice_id="inv_unk"))
    mail = operation_prepare(
        tenant=globex,
        action="mail.send",
        payload={"to": "jane@example.com", "template": "receipt", "params": {}},
    )
    client = signed_in(admin_user)

    def ids(**params) -> set[str]:
        html = client.get("/operations/", params).content.decode()
        return {op for op in (fresh.id, old.id, unknown.id, mail.id) if op in html}

    assert ids() == {fresh.id, old.id, unknown.id, mail.id}
    assert ids(status="unknown") == {unknown.id}
    assert ids(tenant="globex") == {mail.id}
    assert ids(action="payments.create") == {fresh.id, old.id, unknown.id}
    assert ids(age="1h") == {old.id}
    assert ids(run="run_nothing") == set()


@pytest.mark.django_db
def test_it_refuses_a_tenant_filter_outside_the_users_tenants(journal, approver):
    response = signed_in(approver).get("/operations/", {"tenant": "globex"})
    html = response.content.decode()
    assert response.status_code == 200
    assert journal["globex"].id not in html and journal["acme"].id not in html
    # The refused field points at the reason, and the reason is on the page under that id.
    assert 'aria-describedby="id_tenant_error"' in html
    assert '<span id="id_tenant_error" hidden>' in html


@pytest.mark.django_db
def test_it_filters_by_run_id(acme, approver):
    from operations.models import Run

    run = Run.objects.create(
        conversation_id="conv_1",
        tenant=acme,
        workflow_name="pay",
        workflow_version=1,
        state_schema_version=1,
    )
    in_run = operation_prepare(
        tenant=acme,
        action="payments.create",
        run=run,
        command_id="cmd_1",
        payload={
            "invoice_id": "inv_r",
            "beneficiary_id": "vendor_77",
            "amount_minor": 5,
            "currency": "KZT",
        },
    )
    outside = prepared_payment(acme)
    html = signed_in(approver).get("/operations/", {"run": run.id}).content.decode()
    assert in_run.id in html and outside.id not in html
    detail = signed_in(approver).get(f"/operations/{in_run.id}/").content.decode()
    assert f"/operations/?run={run.id}" in detail and "cmd_1" in detail


@pytest.mark.django_db
def test_it_pages_by_key_and_returns_only_the_rows_partial_for_htmx(acme, approver, monkeypatch):
    monkeypatch.setattr("operations.views.PAGE_SIZE", 2)
    ops = [prepared_payment(acme, invoice_id=f"inv_{i}") for i in range(5)]
    client = signed_in(approver)
    first = client.get("/operations/", {"action": "payments.create"}).content.decode()
    assert ops[4].id in first and ops[3].id in first and ops[2].id not in first
    assert "Older operations" in first
    assert f"before={ops[3].id}" in first
    response = client.get(
        "/operations/",
        {"action": "payments.create", "before": ops[3].id},
        HTTP_HX_REQUEST="true",
    )
    body = response.content.decode()
    assert "<html" not in body and "<form" not in body
    assert ops[2].id in body and ops[1].id in body
    assert ops[3].id not in body and ops[0].id not in body
    last = client.get(
        "/operations/", {"before": ops[1].id}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert ops[0].id in last and "Older operations" not in last


def _every_id_paged(client, params: dict) -> list[str]:
    """Every operation id the list shows, page by page, following its own "Older" links."""
    seen: list[str] = []
    before = None
    for _ in range(50):
        html = client.get("/operations/", {**params, **({"before": before} if before else {})}
                          ).content.decode()
        assert "the page link is not valid" not in html
        seen += re.findall(r'href="/operations/(op_[0-9A-Z]{26})/"', html)
        cursor = re.search(r"before=(op_[0-9A-Z]{26})", html)
        if not cursor:
            return seen
        before = cursor.group(1)
    pytest.fail("the pages did not end")


@pytest.mark.django_db
def test_it_pages_rows_created_in_one_instant_without_skipping_or_repeating_any(
    acme, globex, operator, monkeypatch
):
    from console.roles import role_grant

    monkeypatch.setattr("operations.views.PAGE_SIZE", 3)
    role_grant(user=operator, role="Operator", tenant=globex)
    two_hours_ago = timezone.now() - timedelta(hours=2)
    with ids_made_at(two_hours_ago):
        ops = [prepared_payment(acme if i % 3 else globex, invoice_id=f"inv_{i}")
               for i in range(11)]
    Operation.objects.update(created_at=two_hours_ago)
    for op in ops[::2]:
        make_unknown(op)
    client = signed_in(operator)

    assert _every_id_paged(client, {}) == sorted((op.id for op in ops), reverse=True)
    unknown_at_acme = _every_id_paged(client, {"status": "unknown", "tenant": "acme",
                                               "age": "1h"})
    assert unknown_at_acme == sorted(
        (op.id for op in ops[::2] if op.tenant_id == acme.id), reverse=True)


def _journal_rows(tenant, moments) -> list[str]:
    """Operations of `tenant` created at `moments`, written in one statement, with the ids
    prepare gives (time-sortable ULIDs of their creation time)."""
    ids = [f"op_{ULID.from_datetime(moment)}" for moment in moments]
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO operations_operation (id, action, tool_name, payload, canonical_intent,
                payload_hash, policy_version, idempotency_key, command_id, requires_approval,
                created_at, authorized_hash, authorized_policy_version, status,
                status_changed_at, lease_owner, external_id, provider_request_id, error_code,
                error_message, resolved_manually, provider_calls, tenant_id)
            SELECT r.id, 'payments.create', 'pay', %s::jsonb, '', 'sha256:x', 'v1',
                   'bulk-' || r.id, '', true, r.at, '', '', 'succeeded', r.at, '', '', '',
                   '', '', false, 1, %s
            FROM unnest(%s::text[], %s::timestamptz[]) AS r(id, at)
            """,
            [json.dumps(PAYMENT), tenant.id, ids, list(moments)],
        )
    return ids


@pytest.mark.django_db
def test_it_reads_a_page_not_every_newer_operation_for_the_age_filter(acme, operator):
    """"Older than 1 hour" on a busy tenant: created_at has no index, so the filter alone
    walked back through every operation of the last hour (720,000 at 200 ops/s) before the
    first row of the page. A page costs what any page costs, at any traffic."""
    now = timezone.now()
    recent = _journal_rows(acme, [now - timedelta(milliseconds=3 * i) for i in range(20_000)])
    old = _journal_rows(acme, [now - timedelta(hours=2, seconds=i) for i in range(60)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE operations_operation")

    with queries_run() as seen:
        html = signed_in(operator).get("/operations/", {"age": "1h"}).content.decode()

    shown = re.findall(r'href="/operations/(op_[0-9A-Z]{26})/"', html)
    assert shown == old[:50] and not set(shown) & set(recent)
    assert f"before={old[49]}" in html
    (page_sql, params), = [(sql, params) for sql, params in seen
                           if 'FROM "operations_operation"' in sql and "LIMIT" in sql]
    read = plan_rows_read(page_sql, params, "operations_operation")
    # 51 rows answer the page; 20,060 operations exist, 20,000 of them newer than an hour.
    assert read <= 500, f"{read} operations read for one page of the age filter"


def _page_cost(client, params: dict) -> tuple[list[str], int]:
    """The ids a journal page shows, and the operations its page query read to find them."""
    with queries_run() as seen:
        html = client.get("/operations/", params).content.decode()
    (page_sql, sql_params), = [(sql, p) for sql, p in seen
                               if 'FROM "operations_operation"' in sql and "LIMIT" in sql]
    shown = re.findall(r'href="/operations/(op_[0-9A-Z]{26})/"', html)
    return shown, plan_rows_read(page_sql, sql_params, "operations_operation")


@pytest.fixture
def busy_neighbour(db):
    """A tenant writing 200 operations a second for the last 60 s."""
    from tests.factories import TenantFactory

    initech = TenantFactory(slug="initech")
    now = timezone.now()
    _journal_rows(initech, [now - timedelta(milliseconds=3 * i) for i in range(20_000)])
    return initech


@pytest.mark.django_db
def test_it_reads_a_page_not_every_newer_operation_of_a_tenant_the_user_may_not_see(
    acme, operator, busy_neighbour
):
    """The planner prices the primary key read backwards as if acme's rows were spread
    evenly through time; they are two hours old, behind 20,000 of another tenant's."""
    now = timezone.now()
    mine = _journal_rows(acme, [now - timedelta(hours=2, seconds=i) for i in range(2_000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE operations_operation")

    shown, read = _page_cost(signed_in(operator), {})

    assert shown == mine[:50]
    assert read <= 500, f"{read} operations read for one page of acme's journal"


@pytest.mark.django_db
def test_it_reads_a_page_not_every_newer_operation_of_the_others_for_the_tenant_filter(
    acme, operator, busy_neighbour
):
    """A slug joined into the page's query hid which tenant it is from the planner."""
    from console.roles import role_grant

    role_grant(user=operator, role="Operator", tenant=busy_neighbour)
    now = timezone.now()
    quiet = _journal_rows(acme, [now - timedelta(hours=2, seconds=i) for i in range(60)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE operations_operation")

    shown, read = _page_cost(signed_in(operator), {"tenant": "acme"})

    assert shown == quiet[:50]
    assert read <= 500, f"{read} operations read for one page of the tenant filter"


@pytest.mark.django_db
def test_it_merges_the_pages_of_each_visible_tenant_newest_first_at_the_cost_of_a_page_each(
    acme, globex, operator, busy_neighbour
):
    from console.roles import role_grant

    role_grant(user=operator, role="Operator", tenant=globex)
    now = timezone.now()
    acme_rows = _journal_rows(acme, [now - timedelta(hours=2, seconds=2 * i) for i in range(900)])
    globex_rows = _journal_rows(
        globex, [now - timedelta(hours=2, seconds=2 * i + 1) for i in range(900)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE operations_operation")
    client = signed_in(operator)

    shown, read = _page_cost(client, {})
    older, read_older = _page_cost(client, {"before": shown[-1]})

    both = sorted(acme_rows + globex_rows, reverse=True)
    assert shown == both[:50] and older == both[50:100]
    assert shown[::2] == acme_rows[:25] and shown[1::2] == globex_rows[:25]
    # Each tenant's 51 newest through its own index: 102, never busy_neighbour's 20,000.
    assert read <= 500 and read_older <= 500, (read, read_older)


@pytest.mark.django_db
def test_it_shows_nothing_of_another_tenants_run_through_the_run_filter(
    acme, globex, operator
):
    from operations.models import Run

    mine = prepared_payment(acme)
    theirs = Run.objects.create(conversation_id="conv_g", tenant=globex, workflow_name="pay",
                                workflow_version=1, state_schema_version=1)
    in_their_run = operation_prepare(tenant=globex, action="payments.create", payload=PAYMENT,
                                     run=theirs, command_id="cmd_1")
    client = signed_in(operator)
    html = client.get("/operations/", {"run": theirs.id}).content.decode()
    assert in_their_run.id not in html and "No operations match." in html
    # Their operation's id as the page cursor: acme's older rows, nothing of theirs.
    html = client.get("/operations/", {"before": in_their_run.id}).content.decode()
    assert mine.id in html and in_their_run.id not in html


@pytest.mark.django_db
@pytest.mark.parametrize(
    "params",
    [
        {"status": "bogus"},
        {"status": ["unknown", "bogus"]},
        {"age": "1y"},
        {"age": "-5m"},
        {"action": "payments.refund"},
        {"tenant": "acme\x00"},
        {"run": "run_\x00"},
        {"run": "r" * 41},
        {"run": "   "},
        {"run": "run_🙂" * 8},
        {"before": "op_" + "Z" * 26 + "\n"},
        {"before": "op_" + "z" * 26},
        {"before": "\x00"},
        {"before": "op_%00"},
        {"before": "x" * 500},
        {"status": "unknown", "tenant": "", "action": "", "run": "", "age": "", "before": ""},
    ],
)
def test_it_answers_any_filter_value_with_the_page_never_an_error(acme, operator, params):
    make_unknown(prepared_payment(acme))
    client = signed_in(operator)
    assert client.get("/operations/", params).status_code == 200
    assert client.get("/operations/", params, HTTP_HX_REQUEST="true").status_code == 200


@pytest.mark.django_db
def test_it_keeps_the_list_query_count_flat_as_rows_grow(
    acme, globex, approver, django_assert_max_num_queries
):
    prepared_payment(acme, invoice_id="inv_first")
    client = signed_in(approver)
    client.get("/operations/")  # warm the session and the content types
    with CaptureQueriesContext(connection) as few:
        client.get("/operations/")
    for i in range(15):
        prepared_payment(acme, invoice_id=f"inv_more_{i}")
        prepared_payment(globex, invoice_id=f"inv_g_{i}")
    with django_assert_max_num_queries(len(few)):
        html = client.get("/operations/").content.decode()
    assert html.count("/operations/op_") == 16
    sql = " ".join(q["sql"] for q in few.captured_queries).upper()
    assert "OFFSET" not in sql and "COUNT(" not in sql


@pytest.fixture
def private_ops(acme):
    pay = prepared_payment(acme, beneficiary_id="acct_40817810099910004312")
    mail = operation_prepare(
        tenant=acme,
        action="mail.send",
        payload={
            "to": "jane.doe@example.com",
            "template": "receipt",
            "params": {"phone": "+77011234567"},
        },
    )
    return pay, mail


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["approver", "operator"])
def test_it_masks_the_beneficiary_and_email_on_the_detail(private_ops, who, request):
    user = request.getfixturevalue(who)
    pay, mail = private_ops
    client = signed_in(user)
    html = client.get(f"/operations/{pay.id}/").content.decode()
    assert "40817810099910004312" not in html and "••••4312" in html
    asked = client.get(f"/operations/{pay.id}/?unmasked=1").content.decode()
    assert "40817810099910004312" not in asked and "Show unmasked" not in asked
    # The hash of the masked intent gives its masked values back: its keyed fingerprint.
    assert pay.payload_hash not in html and pay.idempotency_key in html
    assert payload_fingerprint(pay.payload_hash) in html and "Payload fingerprint" in html
    html = client.get(f"/operations/{mail.id}/").content.decode()
    assert "jane.doe@example.com" not in html and "j***@example.com" in html
    assert "77011234567" not in html
    listing = client.get("/operations/").content.decode()
    assert "40817810099910004312" not in listing and "jane.doe@example.com" not in listing
    assert not AuditEvent.objects.filter(action="operation.view_unmasked").exists()


@pytest.mark.django_db
def test_it_shows_unmasked_values_to_admin_and_audits_the_view(private_ops, admin_user):
    pay, mail = private_ops
    client = signed_in(admin_user)
    # Masked by default, even for those who may unmask.
    html = client.get(f"/operations/{pay.id}/").content.decode()
    assert "40817810099910004312" not in html and "Show unmasked values" in html
    assert not AuditEvent.objects.filter(action="operation.view_unmasked").exists()
    assert pay.payload_hash not in html
    unmasked = client.get(f"/operations/{pay.id}/?unmasked=1")
    assert "40817810099910004312" in unmasked.content.decode()
    assert pay.payload_hash in unmasked.content.decode()  # the audited view: the hash itself
    # Shown once, audited once: not kept for Back or a proxy to show again.
    assert "no-store" in unmasked["Cache-Control"] and "private" in unmasked["Cache-Control"]
    assert "jane.doe@example.com" in client.get(
        f"/operations/{mail.id}/?unmasked=1").content.decode()
    events = AuditEvent.objects.filter(action="operation.view_unmasked").order_by("id")
    assert [(e.object_id, e.actor_username, e.tenant.slug) for e in events] == [
        (pay.id, "admin", "acme"),
        (mail.id, "admin", "acme"),
    ]


@pytest.mark.django_db
def test_it_merges_evidence_and_audit_into_one_timeline_with_lineage(acme, approver):
    old = prepared_payment(acme, invoice_id="inv_v1")
    new = operation_prepare(
        tenant=acme,
        action="payments.create",
        supersedes=old,
        payload={
            "invoice_id": "inv_v1",
            "beneficiary_id": "vendor_77",
            "amount_minor": 1300000,
            "currency": "KZT",
        },
    )
    html = signed_in(approver).get(f"/operations/{old.id}/").content.decode()
    assert f'href="/operations/{new.id}/"' in html  # superseded by
    # In a person's words, with the code the audit trail is filtered by beside it.
    assert 'Intent recorded</strong> <code class="muted">operation.prepare</code>' in html
    assert f"superseded by {new.id}" in html
    assert html.index("Intent recorded") < html.index(f"superseded by {new.id}")
    html = signed_in(approver).get(f"/operations/{new.id}/").content.decode()
    assert f'href="/operations/{old.id}/"' in html  # supersedes
    assert Evidence.objects.filter(operation=old, kind=EvidenceKind.TRANSITION).exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("closed_by", "outcome"),
    [("rejection", "rejected by approver"), ("supersede", "superseded"), ("expiry", "expired")],
)
def test_it_says_awaiting_approval_only_while_a_decision_can_still_be_made(
    acme, approver, operator, closed_by, outcome
):
    """A rejected, replaced or expired intent is cancelled and will never be approved; its
    page said "awaiting approval" beside the status Cancelled, telling an auditor or an
    operator that a decision was still pending."""
    from approvals.models import Approval
    from approvals.services import approval_expire, approval_reject

    op = prepared_payment(acme, invoice_id="inv_closed")
    approval = Approval.objects.get(operation=op)
    client = signed_in(operator)
    assert '<span class="muted">awaiting approval</span>' in client.get(
        f"/operations/{op.id}/").content.decode()

    if closed_by == "rejection":
        approval_reject(approval_id=approval.id, actor=approver, reason="wrong vendor")
    elif closed_by == "supersede":
        operation_prepare(tenant=acme, action="payments.create", supersedes=op,
                          payload={**PAYMENT, "invoice_id": "inv_closed", "amount_minor": 1})
    else:
        Approval.objects.filter(id=approval.id).update(
            expires_at=timezone.now() - timedelta(seconds=1))
        # Past its time before the sweep closes it: a decision sent now is refused.
        unswept = client.get(f"/operations/{op.id}/").content.decode()
        assert "awaiting approval" not in unswept
        assert '<span class="muted">expired</span>' in unswept
        assert approval_expire(approval_id=approval.id)
    op.refresh_from_db()
    assert op.status == "cancelled" and op.provider_calls == 0

    html = client.get(f"/operations/{op.id}/").content.decode()

    assert "awaiting approval" not in html
    assert f'<dt>Authorization</dt>\n      <dd><span class="muted">{outcome}</span>' in html


@pytest.mark.django_db
def test_it_queues_unknowns_oldest_first_with_the_last_evidence(acme, globex, operator):
    newer = make_unknown(prepared_payment(acme, invoice_id="inv_newer"), ago=timedelta(minutes=2))
    older = make_unknown(prepared_payment(acme, invoice_id="inv_older"), ago=timedelta(hours=2))
    Evidence.objects.create(
        operation=older,
        kind=EvidenceKind.LOOKUP,
        from_status="unknown",
        to_status="unknown",
        summary="lookup inconclusive: search lag",
    )
    hidden = make_unknown(prepared_payment(globex, invoice_id="inv_globex"))
    settled = prepared_payment(acme, invoice_id="inv_settled")
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert html.index(older.id) < html.index(newer.id)
    assert "lookup inconclusive: search lag" in html
    assert "2\xa0hours" in html
    assert hidden.id not in html and settled.id not in html
    listing = signed_in(operator).get("/operations/").content.decode()
    assert 'href="/operations/unknown/"' in listing
    assert "Showing the oldest" not in html


@pytest.mark.django_db
def test_it_queues_disputed_operations_for_a_person_and_counts_them_on_the_dashboard(
    acme, globex, operator, other_tenant_user
):
    from operations.engine import operation_dispute

    disputed = operation_dispute(
        operation_id=make_unknown(prepared_payment(acme, invoice_id="inv_disputed")).id,
        actor=operator, reason="the customer says it was paid twice",
    )
    hidden = operation_dispute(
        operation_id=make_unknown(prepared_payment(globex, invoice_id="inv_globex")).id,
        actor=other_tenant_user, reason="not ours to see",
    )

    html = signed_in(operator).get("/operations/unknown/").content.decode()

    assert 'id="disputed"' in html and disputed.id in html
    assert "marked disputed by operator: the customer says it was paid twice" in html
    assert hidden.id not in html
    # Nothing unknown, but something waits for a person: the page must not say otherwise.
    assert "No unknown operations." in html and "Nothing waits for a person." not in html
    dashboard = signed_in(operator).get("/").content.decode()
    assert 'aria-label="1 disputed, on hold until a person resolves them"' in dashboard
    assert 'href="/operations/unknown/#disputed"' in dashboard


@pytest.mark.django_db
def test_it_says_how_many_unknowns_wait_beyond_the_queue_page(acme, operator, monkeypatch):
    monkeypatch.setattr("operations.views.UNKNOWN_QUEUE_SIZE", 2)
    ops = [make_unknown(prepared_payment(acme, invoice_id=f"inv_{i}"),
                        ago=timedelta(minutes=10 - i)) for i in range(3)]
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert ops[0].id in html and ops[1].id in html and ops[2].id not in html
    assert "Showing the oldest 2 of 3 unknown operations" in html
    assert 'href="/operations/?status=unknown">Browse them all' in html


@pytest.mark.django_db
def test_it_says_how_many_held_stuck_and_disputed_wait_beyond_the_queue_page(
    acme, globex, operator, monkeypatch
):
    """The held, stuck and disputed lists stop at a page, as the unknown list does, but
    only the unknown list said that more wait: an operator who settled every row shown was
    left to think nothing else did."""
    from operations.models import WebhookEvent

    monkeypatch.setattr("operations.views.UNKNOWN_QUEUE_SIZE", 2)
    now = timezone.now()

    def waiting(tenant, name: str, **fields) -> list[Operation]:
        ops = [prepared_payment(tenant, invoice_id=f"inv_{name}_{i}") for i in range(3)]
        for i, op in enumerate(ops):
            Operation.objects.filter(id=op.id).update(
                status_changed_at=now - timedelta(minutes=10 - i), provider_calls=1,
                **{k: v(i) if callable(v) else v for k, v in fields.items()})
        return ops

    disputed = waiting(acme, "disputed", status="disputed")
    stuck = waiting(acme, "stuck", status="in_progress", lease_owner="w-dead",
                    lease_expires_at=lambda i: now - timedelta(minutes=10 - i))
    held_ops = waiting(acme, "held", status="succeeded")
    for i, op in enumerate(held_ops):
        WebhookEvent.objects.create(
            provider="payments", event_id=f"evt_{i}", event_type="payment_intent.succeeded",
            operation=op, external_id=f"pi_other_{i}", needs_review=True,
            received_at=now - timedelta(minutes=10 - i))
        CallAttemptFactory(operation=op, outcome="succeeded", external_id=f"pi_late_{i}",
                           needs_review=True, finished_at=now - timedelta(minutes=10 - i))
    # Another tenant's are neither listed nor counted.
    waiting(globex, "theirs", status="disputed")

    html = signed_in(operator).get("/operations/unknown/").content.decode()

    assert disputed[0].id in html and disputed[1].id in html and disputed[2].id not in html
    assert stuck[0].id in html and stuck[1].id in html and stuck[2].id not in html
    assert held_ops[0].id not in html and held_ops[2].id in html  # newest first
    assert "Showing the newest 2 of 3 provider events held for review" in html
    assert "Showing the newest 2 of 3 call answers held for review" in html
    assert "Showing the 2 stuck longest of 3 operations stuck in progress" in html
    assert "Showing the 2 longest on hold of 3 disputed operations" in html
    assert 'href="/operations/?status=disputed">Browse them all' in html
    # A page that is not full says nothing of more.
    monkeypatch.setattr("operations.views.UNKNOWN_QUEUE_SIZE", 3)
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert "Showing the" not in html


@pytest.mark.django_db
def test_it_links_the_dashboard_numbers_to_the_filtered_journal(acme_unknown, operator):
    html = signed_in(operator).get("/").content.decode()
    assert "oldest waiting 5\xa0minutes" in html  # make_unknown: unknown since 5 minutes ago
    assert 'href="/operations/unknown/"' in html
    assert 'href="/operations/?status=unknown"' in html
    assert 'href="/operations/?status=succeeded"' in html


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/operations/", "/approvals/", "/runs/", "/audit/"])
def test_it_answers_htmx_history_restore_with_the_whole_page(acme, admin_user, url):
    """Both headers choose between the fragment and the page, so a cache must key on both:
    on HX-Request alone it handed the cached fragment to Back, or the page into a table."""
    from django.utils.cache import cc_delim_re

    prepared_payment(acme)
    client = signed_in(admin_user)

    swap = client.get(url, HTTP_HX_REQUEST="true")
    restore = client.get(url, HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")

    assert "<html" not in swap.content.decode()
    assert "<html" in restore.content.decode()
    for response in (swap, restore):
        vary = {h.strip().lower() for h in cc_delim_re.split(response["Vary"])}
        assert {"hx-request", "hx-history-restore-request"} <= vary


@pytest.mark.django_db
def test_it_measures_reconcile_time_and_resolutions_over_findings_of_visible_tenants(
    acme, globex, operator, other_tenant_user
):
    from operations.engine import operation_dispute, operation_resolve

    resolved = make_unknown(prepared_payment(acme, invoice_id="inv_a"), ago=timedelta(minutes=10))
    operation_resolve(operation_id=resolved.id, actor=operator, outcome="succeeded",
                      evidence_text="seen at the bank", reason="treasury checked")
    held = make_unknown(prepared_payment(acme, invoice_id="inv_b"), ago=timedelta(hours=5))
    operation_dispute(operation_id=held.id, actor=operator, reason="customer disputes")
    elsewhere = make_unknown(prepared_payment(globex, invoice_id="inv_g"), ago=timedelta(hours=9))
    operation_resolve(operation_id=elsewhere.id, actor=other_tenant_user, outcome="failed",
                      evidence_text="refused", reason="checked")
    conflict = _version_conflict(acme)
    # A person settles it later; the conflict still counts.
    operation_dispute(operation_id=conflict.id, actor=operator, reason="checking the deal")
    operation_resolve(operation_id=conflict.id, actor=operator, outcome="succeeded",
                      evidence_text="the CRM shows our change", reason="checked")

    metrics = signed_in(operator).get("/").context["metrics"]

    # The acme resolutions only: the dispute is a hold, globex is not visible.
    assert 590 < metrics["reconcile_p50"] < 620 and 590 < metrics["reconcile_p95"] < 620
    assert metrics["manual_resolutions"] == 2
    assert metrics["version_conflicts"] == 1
    assert metrics["unknown_count"] == 0 and metrics["total"] == 3


@pytest.mark.django_db
def test_it_counts_as_re_approvals_only_changed_intents_that_went_to_a_person(acme, operator):
    old_payment = prepared_payment(acme, invoice_id="inv_r")
    operation_prepare(tenant=acme, action="payments.create", supersedes=old_payment,
                      payload={**old_payment.payload, "amount_minor": 1_350_000})
    # A small deal changed to another small one: the policy authorizes both, nobody approves.
    deal = {"name": "Renewal", "amount_minor": 100_000, "currency": "USD",
            "owner": "owner@example.com"}
    old_deal = operation_prepare(tenant=acme, action="crm.create_deal", payload=deal)
    changed = operation_prepare(tenant=acme, action="crm.create_deal", supersedes=old_deal,
                                payload={**deal, "amount_minor": 120_000})
    assert not changed.requires_approval

    metrics = signed_in(operator).get("/").context["metrics"]

    assert metrics["reapprovals"] == 1


@pytest.mark.django_db
def test_it_says_a_bad_filter_or_page_link_shows_nothing(acme, operator):
    op = prepared_payment(acme)
    client = signed_in(operator)
    html = client.get("/operations/", {"status": "succeeded", "tenant": "nope"}).content.decode()
    assert "Nothing is shown: Tenant — Select a valid choice" in html
    assert "No operations match" not in html and op.id not in html
    html = client.get("/operations/", {"before": "garbage"}).content.decode()
    assert "the page link is not valid" in html and op.id not in html
    assert op.id in client.get("/operations/", {"before": "op_" + "Z" * 26}).content.decode()


@pytest.mark.django_db
def test_it_tells_how_long_an_outcome_has_been_unknown_once(acme, operator):
    op = make_unknown(prepared_payment(acme), ago=timedelta(minutes=5))
    html = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    # Unknown since the status changed: one line says both.
    since = op.unknown_since.strftime("%Y-%m-%d %H:%M:%S")
    assert f"since {since} UTC (5\xa0minutes without a known outcome)" in html
    assert "Unknown since" not in html


@pytest.mark.django_db
def test_it_shows_how_the_provider_dedups_and_is_asked(acme, operator, settings):
    # What an operator weighs before settling an unknown outcome by hand: whether a repeat
    # could make a second effect, and how the provider finds what it did.
    settings.PAYMENTS_SEARCH_LAG_SECONDS = 60
    client = signed_in(operator)
    payment = client.get(f"/operations/{make_unknown(prepared_payment(acme)).id}/")
    html = payment.content.decode()
    assert "How the provider dedups and is asked" in html
    for fact in (
        "<dt>Deduplication</dt><dd>Idempotency-Key header + search by "
        "metadata[&#x27;operation_id&#x27;]</dd>",
        "<dt>Keys kept</dt><dd>24 hours from first use</dd>",
        "<dt>Final result</dt><dd>may come later, by webhook or lookup</dd>",
        "<dt>Search lag</dt><dd>up to 1 minute: an empty search younger than that proves "
        "nothing</dd>",
    ):
        assert fact in html
    deal = operation_prepare(tenant=acme, action="crm.create_deal", payload={
        "name": "Renewal", "amount_minor": 100, "currency": "EUR", "owner": "sam@acme.test"})
    html = client.get(f"/operations/{deal.id}/").content.decode()
    assert "<dt>Keys kept</dt><dd>takes no idempotency key</dd>" in html
    assert ("<dt>Same-key retry</dt><dd>not safe: never sent again without a lookup</dd>"
            in html)
    assert "Search lag" not in html


@pytest.mark.django_db
def test_it_says_a_status_stayed_rather_than_naming_it_alone_in_the_timeline(
    acme_unknown, operator
):
    """"Webhook: failed" read as if the webhook had failed; the event left the status as it
    was (a person's decision held, a lookup that settled nothing)."""
    Evidence.objects.create(
        operation=acme_unknown, kind=EvidenceKind.WEBHOOK, from_status="unknown",
        to_status="unknown", summary="webhook payment_intent.succeeded held for review",
    )
    html = signed_in(operator).get(f"/operations/{acme_unknown.id}/").content.decode()
    assert "Webhook: stays unknown" in html
    assert "Webhook: unknown<" not in html


@pytest.mark.django_db
def test_it_counts_on_the_dashboard_only_what_happened_in_visible_tenants(
    acme, globex, operator, other_tenant_user
):
    from operations.engine import operation_dispute, operation_resolve

    # Everything the dashboard counts, in globex only.
    conflict = _version_conflict(globex)
    operation_dispute(operation_id=conflict.id, actor=other_tenant_user, reason="checking")
    operation_resolve(operation_id=conflict.id, actor=other_tenant_user, outcome="succeeded",
                      evidence_text="the CRM shows our change", reason="checked")
    make_unknown(prepared_payment(globex, invoice_id="inv_u"))
    theirs = signed_in(other_tenant_user).get("/").context["metrics"]
    assert theirs["version_conflicts"] == 1 and theirs["manual_resolutions"] == 1
    assert theirs["unknown_count"] == 1 and theirs["total"] == 2

    mine = signed_in(operator).get("/").context["metrics"]

    assert mine["version_conflicts"] == 0 and mine["manual_resolutions"] == 0
    assert mine["unknown_count"] == 0 and mine["total"] == 0
    assert mine["unknown_oldest_since"] is None and mine["reconcile_p50"] is None


@pytest.mark.django_db
def test_it_counts_the_unknowns_beyond_the_queue_page_in_visible_tenants_only(
    acme, globex, operator, monkeypatch
):
    monkeypatch.setattr("operations.views.UNKNOWN_QUEUE_SIZE", 1)
    for i in range(2):
        make_unknown(prepared_payment(acme, invoice_id=f"inv_a{i}"))
    for i in range(3):
        make_unknown(prepared_payment(globex, invoice_id=f"inv_g{i}"))
    html = signed_in(operator).get("/operations/unknown/").content.decode()
    assert "Showing the oldest 1 of 2 unknown operations" in html


@pytest.mark.django_db
def test_it_tells_only_operators_to_settle_the_queued_unknowns(acme, operator, auditor):
    make_unknown(prepared_payment(acme))
    operating = signed_in(operator).get("/operations/unknown/").content.decode()
    auditing = signed_in(auditor).get("/operations/unknown/").content.decode()
    assert "open one to reconcile, resolve or dispute it." in operating
    assert "reconcile, resolve or dispute" not in auditing
    assert "open one to see what is known about it (operators settle it)." in auditing


def _overdue_unknown(tenant, invoice_id: str) -> Operation:
    op = make_unknown(prepared_payment(tenant, invoice_id=invoice_id), ago=timedelta(hours=2))
    Operation.objects.filter(id=op.id).update(
        next_reconcile_at=timezone.now() - timedelta(hours=1))
    return op


def _queue_row(html: str, op: Operation) -> str:
    row = re.search(rf'<tr>\s*<td[^>]*><a href="/operations/{op.id}/".*?</tr>', html, re.S)
    assert row, f"{op.id} is not in the queue"
    return row.group(0)


@pytest.mark.django_db
def test_it_tells_to_reconcile_only_those_who_may_operate_the_operations_tenant(
    acme, globex, auditor, settings
):
    """An auditor on acme who operates globex's effects was told, on acme's rows, to use a
    Reconcile now that acme's page does not offer them and the server refuses (403)."""
    from console.roles import role_grant

    role_grant(user=auditor, role="Operator", tenant=globex)
    overdue = _overdue_unknown(acme, "inv_overdue")
    settings.ACCEPTED_LOOKUP_FAILING_SECONDS = 3600
    failing = prepared_payment(acme, invoice_id="inv_failing")
    Operation.objects.filter(id=failing.id).update(
        status="accepted", external_id="pi_failing", provider_calls=1,
        lookups_failing_since=timezone.now() - timedelta(days=1))
    client = signed_in(auditor)
    assert "Reconcile now</button>" not in client.get(f"/operations/{overdue.id}/").content.decode()
    assert client.post(f"/operations/{overdue.id}/reconcile",
                       {"reconcile-reason": "beat is down"}).status_code == 403

    queue = client.get("/operations/unknown/").content.decode()
    assert overdue.id in queue and failing.id in queue and "overdue" in queue
    assert "use <em>Reconcile now</em> on its page" not in queue
    assert "open one to reconcile, resolve or dispute it" not in queue
    assert "open one to see what is known about it (operators settle it)." in queue
    assert "resolves the operation with its reference" not in queue

    # Once a globex row is listed too, that row (and the page) tells them what they may do.
    theirs = _overdue_unknown(globex, "inv_theirs")
    queue = client.get("/operations/unknown/").content.decode()
    assert "use <em>Reconcile now</em> on its page" in _queue_row(queue, theirs)
    assert "use <em>Reconcile now</em> on its page" not in _queue_row(queue, overdue)
    assert "open one to reconcile, resolve or dispute it" in queue
    assert "resolves the operation with its reference" not in queue  # acme's alone


def _stuck(tenant) -> Operation:
    op = prepared_payment(tenant, invoice_id="inv_stuck")
    Operation.objects.filter(id=op.id).update(
        status="in_progress", lease_owner="worker-gone",
        lease_expires_at=timezone.now() - timedelta(minutes=10),
        status_changed_at=timezone.now() - timedelta(minutes=11),
    )
    return op


@pytest.mark.django_db
def test_it_tells_only_those_who_may_operate_to_reconcile_stuck_operations_by_hand(
    acme, operator, auditor
):
    op = _stuck(acme)
    operating = signed_in(operator).get("/operations/unknown/").content.decode()
    assert op.id in operating and "reconcile them by hand" in operating
    assert "settles this" not in _queue_row(operating, op)
    auditing = signed_in(auditor).get("/operations/unknown/")
    html = auditing.content.decode()
    assert op.id in html
    # The auditor's page offers no Reconcile now, and the server refuses them one (403).
    assert "Reconcile now</button>" not in signed_in(auditor).get(
        f"/operations/{op.id}/").content.decode()
    assert signed_in(auditor).post(f"/operations/{op.id}/reconcile",
                                   {"reconcile-reason": "beat is down"}).status_code == 403
    # So the queue must not tell them to do it, as its other sections no longer do.
    assert "reconcile them by hand" not in html
    assert "an operator on Acme Corp settles this" in _queue_row(html, op)


@pytest.mark.django_db
def test_it_tells_only_those_who_may_operate_to_dispute_and_resolve_a_held_report(
    acme, operator, auditor
):
    from operations.models import WebhookEvent

    op = prepared_payment(acme, invoice_id="inv_held")
    Operation.objects.filter(id=op.id).update(status="succeeded", provider_calls=1,
                                              external_id="pi_ours")
    WebhookEvent.objects.create(
        provider="payments", event_id="evt_second", event_type="payment_intent.succeeded",
        operation=op, external_id="pi_second", needs_review=True, received_at=timezone.now())
    operating = signed_in(operator).get(f"/operations/{op.id}/").content.decode()
    assert "Mark disputed</button>" in operating
    assert "mark the operation disputed and resolve it" in operating
    auditing = signed_in(auditor).get(f"/operations/{op.id}/").content.decode()
    assert "The provider disagrees with the journal" in auditing
    assert "Mark disputed</button>" not in auditing  # not theirs to do (403 if they tried)
    assert "mark the operation disputed and resolve it" not in auditing
    assert "An operator on Acme Corp checks at the provider and settles this" in auditing


@pytest.mark.django_db
def test_it_puts_the_status_beside_the_id_in_the_journal_and_a_runs_effects(acme, operator):
    from operations.models import Run

    run = Run.objects.create(conversation_id="conv_1", tenant=acme, workflow_name="pay",
                             workflow_version=1, state_schema_version=1)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run)
    client = signed_in(operator)
    # On a narrow screen the table scrolls sideways: what is read first is the id and status.
    for page in (client.get("/operations/"), client.get(f"/runs/{run.id}/")):
        html = page.content.decode()
        assert "<th>Operation</th><th>Status</th>" in html
        row = html[html.index(f"<code>{op.id}</code></a></td>"):]
        assert row.split("<td>", 2)[1].startswith('<span class="status status-not_started">')


@pytest.mark.parametrize("who", ["approver", "auditor"])
def test_it_tells_a_person_who_may_not_operate_who_settles_an_unknown(
    request, who, acme_unknown
):
    """An Unknown pill and nothing to do, where a non-operator lands from a link; the
    operators' queue says "(operators settle it)", the page said nothing."""
    html = signed_in(request.getfixturevalue(who)).get(
        f"/operations/{acme_unknown.id}/").content.decode()
    assert "An operator on Acme Corp settles this" in html
    assert "Reconcile now</button>" not in html


@pytest.mark.django_db
def test_it_masks_what_people_typed_on_every_page_but_the_audited_unmasked_one(
    acme, operator, approver, auditor, admin_user
):
    email, account = "anna.smith@example.com", "40817810099910004312"
    resolved = make_unknown(prepared_payment(acme))
    disputed = make_unknown(prepared_payment(acme, invoice_id="inv_dispute"))
    client = signed_in(operator)
    assert client.post(f"/operations/{resolved.id}/resolve", {
        "resolve-outcome": "failed", "resolve-provider_reference": "",
        "resolve-evidence": f"bank statement: account {account} got nothing, said {email}",
        "resolve-reason": f"confirmed by {email}",
    }).status_code == 302
    assert client.post(f"/operations/{disputed.id}/dispute", {
        "dispute-reason": f"beneficiary {email} says account {account} got nothing",
    }).status_code == 302
    pages = [
        (approver, f"/operations/{resolved.id}/"),  # its error, evidence and audit rows
        (approver, f"/operations/{disputed.id}/"),
        (operator, "/operations/unknown/"),  # the disputed queue's last evidence
        (auditor, "/audit/"),
        (auditor, "/audit.csv"),
    ]
    for user, url in pages:
        response = signed_in(user).get(url)
        body = (b"".join(response.streaming_content) if response.streaming
                else response.content).decode()
        assert email not in body and account not in body, url
        assert "a***@example.com" in body and "••••4312" in body, url
    # The audited unmasked view shows what was typed, as it shows the intent.
    unmasked = signed_in(admin_user).get(f"/operations/{resolved.id}/?unmasked=1")
    assert email in unmasked.content.decode() and account in unmasked.content.decode()


@pytest.mark.django_db(transaction=True)
def test_it_shows_whole_the_sums_an_operator_compares(acme, operator, sandbox):
    from operations.engine import operation_reconcile
    from operations.sandbox.services import sandbox_payment_create

    # A payment of another sum than the approved one carries the operation: the lookup's
    # evidence names both, and the operator decides by comparing them. Ten digits, as an
    # account number's, in ISO minor units: MGA's, which Stripe counts in whole ariary.
    op = make_unknown(prepared_payment(acme, amount_minor=1_500_000_000, currency="MGA"))
    sandbox_payment_create(amount=16_000_000, currency="mga", confirm=True,
                           metadata={"operation_id": op.id, "tenant": acme.slug})
    assert operation_reconcile(operation_id=op.id).outcome == "inconclusive"
    assert "is for 1600000000 MGA, the approved intent for 1500000000 MGA" in (
        op.evidence.last().summary)
    for url in ("/operations/unknown/", f"/operations/{op.id}/"):
        html = signed_in(operator).get(url).content.decode()
        assert "1600000000 MGA" in html and "1500000000 MGA" in html, url


@pytest.mark.django_db
def test_it_does_not_let_the_masked_operation_page_reveal_the_masked_account(acme, auditor):
    account = "8701234567"  # a beneficiary's 10-digit account (or phone) number
    op = prepared_payment(acme, beneficiary_id=account)
    page = signed_in(auditor).get(f"/operations/{op.id}/").content.decode()
    assert "Show unmasked values" not in page  # an auditor may not unmask
    assert account not in page and "••••4567" in page  # masked, as it should be

    for shown in (op.action, acme.slug, op.payload["invoice_id"], "12,500.00 KZT",
                  op.policy_version):
        assert shown in page
    # Everything else in the intent is on the same page: action, tenant, invoice, amount,
    # currency and policy version. Only the six hidden digits are unknown: an unkeyed hash of
    # the intent beside them gives them back in a second.
    template, _ = intent_canonical(
        action=op.action, tenant=acme.slug, policy_version=op.policy_version,
        payload={**op.payload, "beneficiary_id": "@@@@@@4567"},
    )
    head, tail = template.encode().split(b"@@@@@@")
    for shown_hash in set(re.findall(r"sha256:[0-9a-f]{64}", page)):
        recovered = None
        for n in range(1_000_000):
            guess = b"%06d" % n
            if "sha256:" + hashlib.sha256(head + guess + tail).hexdigest() == shown_hash:
                recovered = guess.decode() + "4567"
                break
        assert recovered is None, (
            f"the masked page's payload hash gives the masked account back in full: {recovered}"
        )
    assert op.payload_hash[7:19] not in page
    assert payload_fingerprint(op.payload_hash) in page
