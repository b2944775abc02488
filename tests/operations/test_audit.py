from __future__ import annotations

import csv
import io
import re

import pytest
from django.db import IntegrityError, InternalError, connection, transaction
from django.test import Client

from operations.intents import payload_fingerprint
from operations.models import AuditEvent, Evidence, EvidenceKind
from operations.services import audit_event_record
from tests.helpers import plan_rows_read, queries_run


def _exported(response) -> list[list[str]]:
    """The CSV's rows as a spreadsheet reads them: UTF-8 after its byte order mark."""
    text = b"".join(response.streaming_content).decode("utf-8-sig")
    return list(csv.reader(io.StringIO(text)))


@pytest.mark.django_db
def test_it_refuses_update_and_delete_of_audit_events(acme):
    event = audit_event_record(actor=None, action="test.event", tenant=acme, reason="why")
    for sql in (
        "UPDATE operations_auditevent SET reason = 'rewritten' WHERE id = %s",
        "DELETE FROM operations_auditevent WHERE id = %s",
    ):
        with pytest.raises((InternalError, IntegrityError)) as excinfo:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql, [event.id])
        assert "append-only" in str(excinfo.value)
    event.refresh_from_db()
    assert event.reason == "why"
    assert AuditEvent.objects.filter(id=event.id).exists()


@pytest.mark.django_db
def test_it_refuses_an_orm_update_too(acme):
    event = audit_event_record(actor=None, action="test.event", tenant=acme)
    with pytest.raises((InternalError, IntegrityError)), transaction.atomic():
        AuditEvent.objects.filter(id=event.id).update(action="forged")


@pytest.mark.django_db
def test_it_refuses_update_and_delete_of_evidence(acme):
    from tests.operations.engine_helpers import prepared_payment

    op = prepared_payment(acme)
    proof = Evidence.objects.create(
        operation=op, kind=EvidenceKind.MANUAL, summary="bank says paid"
    )
    for change in (
        lambda: Evidence.objects.filter(id=proof.id).update(summary="bank says nothing"),
        lambda: Evidence.objects.filter(id=proof.id).delete(),
    ):
        with pytest.raises((InternalError, IntegrityError)) as excinfo, transaction.atomic():
            change()
        assert "append-only" in str(excinfo.value)
    proof.refresh_from_db()
    assert proof.summary == "bank says paid"


@pytest.mark.django_db
def test_it_keeps_a_calls_record_and_writes_its_answer_once(acme):
    from django.utils import timezone

    from operations.engine.core import unanswered_call_lands_by
    from operations.models import Attempt, AttemptOutcome
    from tests.operations.engine_helpers import died_mid_call, prepared_payment

    op = died_mid_call(prepared_payment(acme), claimed=timezone.now())
    call = op.attempts.get()
    refused = (InternalError, IntegrityError)
    # What keeps a lookup from calling again while this call may still land.
    with pytest.raises(refused, match="every call and lookup is kept"), transaction.atomic():
        Attempt.objects.filter(id=call.id).delete()
    with pytest.raises(refused, match="what was sent is immutable"), transaction.atomic():
        Attempt.objects.filter(id=call.id).update(idempotency_key="ik_other")
    assert unanswered_call_lands_by(op) is not None
    # Its answer is written once (as the engine does), then never rewritten.
    Attempt.objects.filter(id=call.id).update(
        outcome=AttemptOutcome.SUCCEEDED, finished_at=timezone.now(), external_id="pi_1",
        http_status=200)
    with pytest.raises(refused, match="recorded once"), transaction.atomic():
        Attempt.objects.filter(id=call.id).update(
            outcome=AttemptOutcome.FAILED, external_id="", http_status=402)
    # A person's review marks it, later.
    Attempt.objects.filter(id=call.id).update(needs_review=True, review_note="a second object")
    call.refresh_from_db()
    assert (call.outcome, call.external_id, call.needs_review) == ("succeeded", "pi_1", True)


@pytest.mark.django_db
def test_it_keeps_a_provider_event_and_what_it_said(acme):
    from operations.models import WebhookEvent
    from tests.operations.engine_helpers import prepared_payment

    op = prepared_payment(acme)
    event = WebhookEvent.objects.create(provider="payments", event_id="evt_1",
                                        event_type="payment_intent.succeeded",
                                        external_id="pi_1", data={"id": "pi_1"})
    refused = (InternalError, IntegrityError)
    # Deleted, the provider's redelivery would be a first delivery, applied again.
    with pytest.raises(refused, match="redelivered"), transaction.atomic():
        WebhookEvent.objects.filter(id=event.id).delete()
    with pytest.raises(refused, match="immutable"), transaction.atomic():
        WebhookEvent.objects.filter(id=event.id).update(data={"id": "pi_2"})
    # Linked once, and decided: what the engine writes.
    WebhookEvent.objects.filter(id=event.id).update(operation=op, applied=True, outcome="applied")
    with pytest.raises(refused, match="immutable"), transaction.atomic():
        WebhookEvent.objects.filter(id=event.id).update(
            operation=prepared_payment(acme, invoice_id="inv_other"))
    event.refresh_from_db()
    assert (event.operation_id, event.data, event.applied) == (op.id, {"id": "pi_1"}, True)


@pytest.fixture
def trail(acme, globex, approver):
    for i in range(7):
        audit_event_record(
            actor=approver, action="intent.approve" if i % 2 else "intent.reject",
            tenant=acme, object_type="approval", object_id=f"apr_{i}", reason=f"r{i}",
        )
    audit_event_record(actor=None, action="intent.approve", tenant=globex, object_id="apr_g")


@pytest.mark.django_db
def test_it_lists_newest_first_only_for_granted_tenants(trail, auditor):
    client = Client()
    client.force_login(auditor)
    html = client.get("/audit/").content.decode()
    assert html.index("apr_6") < html.index("apr_5") < html.index("apr_0")
    assert "apr_g" not in html
    assert 'href="/audit/" aria-current="page">Audit</a>' in html


@pytest.mark.django_db
def test_it_shows_each_changed_field_as_old_to_new_and_links_the_object(acme, auditor):
    audit_event_record(
        actor=None, action="approval.approve", tenant=acme, object_type="approval",
        object_id="apr_x", before={"status": "pending"},
        after={"status": "approved", "operation": "op_x", "supersedes": None,
               "permissions": ["view_tenant", "view_audit"]},
    )
    audit_event_record(actor=None, action="operation.prepare", tenant=acme,
                       object_type="operation", object_id="op_x", after={"amount": 1250})
    client = Client()
    client.force_login(auditor)
    html = re.sub(r"\s+", " ", client.get("/audit/").content.decode())
    assert '<del class="old">pending</del> → <ins class="new">approved</ins>' in html
    assert '<span class="muted">operation</span> <ins class="new">op_x</ins>' in html
    assert '<ins class="new">—</ins>' in html  # None, not Python's repr
    assert '<ins class="new">view_tenant, view_audit</ins>' in html
    assert '<ins class="new">1250</ins>' in html
    assert "{&#x27;" not in html and "None" not in html
    assert '<a href="/approvals/apr_x/"><code>apr_x</code></a>' in html
    assert '<a href="/operations/op_x/"><code>op_x</code></a>' in html


@pytest.mark.django_db
def test_it_filters_by_actor_action_and_object(trail, auditor):
    client = Client()
    client.force_login(auditor)
    html = client.get("/audit/", {"action": "intent.reject", "actor": "approver"}).content.decode()
    assert "apr_0" in html and "apr_2" in html and "apr_1" not in html
    html = client.get("/audit/", {"object": "apr_3"}).content.decode()
    assert "apr_3" in html and "apr_4" not in html


@pytest.mark.django_db
def test_it_helps_an_auditor_filter_by_name_case_and_time(trail, auditor, acme):
    client = Client()
    client.force_login(auditor)
    html = client.get("/audit/", {"actor": "APPROVER", "action": "intent.reject"}).content.decode()
    assert "apr_0" in html and "apr_1" not in html  # any case of the name
    html = client.get("/audit/", {"actor": "System", "action": "INTENT.APPROVE"}).content.decode()
    assert "apr_g" not in html  # another tenant's, though by the system too
    audit_event_record(actor=None, action="intent.approve", tenant=acme, object_id="apr_sys")
    html = client.get("/audit/", {"actor": "system", "action": "INTENT.APPROVE"}).content.decode()
    assert "apr_sys" in html and "apr_1" not in html  # the engine's own events, by name
    # The action names on the trail are offered as suggestions.
    assert '<option value="intent.approve"></option>' in html
    assert '<option value="intent.reject"></option>' in html
    backwards = client.get("/audit/", {"since": "2026-11-30T12:00", "until": "2026-11-30T11:00"})
    html = backwards.content.decode()
    assert "Nothing is shown" in html and "must be later than Since" in html
    assert "apr_" not in html and "No audit events match" not in html
    assert "Time (UTC)" in html and "Since (UTC)" in html
    assert "Download CSV" not in html  # it would export nothing but an error
    export = client.get("/audit.csv", {"since": "2026-11-30T12:00", "until": "2026-11-30T11:00"})
    assert export.status_code == 400 and "__all__" not in export.content.decode()
    assert "Until (UTC) must be later than Since (UTC)" in export.content.decode()


@pytest.mark.django_db
def test_it_suggests_only_the_action_names_on_the_trail_the_user_reads(
    trail, globex, auditor, other_tenant_user
):
    # Only globex's trail names these: suggesting them to acme's auditor would tell them
    # that someone there unmasked an approval and had a resolution refused.
    for action in ("approval.view_unmasked", "operation.resolve_failed_refused"):
        audit_event_record(actor=other_tenant_user, action=action, tenant=globex,
                           object_type="operation", object_id="op_globex")
    client = Client()
    client.force_login(auditor)
    html = client.get("/audit/").content.decode()
    suggestions = html[html.index('<datalist id="audit-actions">'):]
    suggestions = suggestions[:suggestions.index("</datalist>")]
    assert '"intent.approve"' in suggestions and '"intent.reject"' in suggestions
    assert "approval.view_unmasked" not in html
    assert "operation.resolve_failed_refused" not in html


@pytest.mark.django_db
def test_it_pages_by_key_and_renders_the_rows_partial_for_htmx(trail, auditor, monkeypatch):
    monkeypatch.setattr("console.views.AUDIT_PAGE_SIZE", 2)
    client = Client()
    client.force_login(auditor)
    first = client.get("/audit/", {"action": "intent.approve"}).content.decode()
    assert "Older events" in first
    assert "apr_5" in first and "apr_3" in first and "apr_1" not in first
    cursor = AuditEvent.objects.filter(object_id="apr_3").get()
    assert f"before={cursor.id}" in first
    response = client.get(
        "/audit/", {"action": "intent.approve", "before": cursor.id}, HTTP_HX_REQUEST="true"
    )
    body = response.content.decode()
    assert "<html" not in body
    assert "apr_1" in body and "apr_3" not in body and "apr_5" not in body
    assert "Older events" not in body


@pytest.mark.django_db
def test_it_downloads_the_filtered_csv_for_auditors_only(trail, auditor, approver):
    client = Client()
    client.force_login(auditor)
    response = client.get("/audit.csv", {"action": "intent.reject"})
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    rows = _exported(response)
    assert rows[0][:5] == ["id", "time", "actor", "tenant", "action"]
    assert {r[6] for r in rows[1:]} == {"apr_0", "apr_2", "apr_4", "apr_6"}
    client.force_login(approver)
    assert client.get("/audit.csv").status_code == 403


def _busy_trail(tenant, n: int) -> None:
    """`n` engine events on the tenant's trail from the last hour, as a busy journal leaves
    (several per operation: prepare, authorize, execute, …)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO operations_auditevent (actor_id, actor_username, tenant_id, action,
                object_type, object_id, reason, before, after, created_at)
            SELECT NULL, '', %s, 'operation.prepare', 'operation',
                   'op_' || lpad(g::text, 26, '0'), '', NULL, '{}'::jsonb,
                   now() - make_interval(secs => (%s - g) * 0.1)
            FROM generate_series(1, %s) g
            """,
            [tenant.id, n, n],
        )
        cursor.execute("ANALYZE operations_auditevent")


@pytest.mark.django_db
@pytest.mark.parametrize("which", ["object", "actor"])
def test_it_reads_a_page_not_the_whole_trail_when_filtered_by_object_or_person(
    acme, auditor, operator, which
):
    """An auditor looks up one operation's events, or one person's, on a trail of 20,000.
    Neither filter had an index it could use (audit_object leads with object_type, which the
    filter does not name; a name is matched in any case), so each page, and the CSV, read
    the tenant's whole trail, which grows by several events per operation."""
    _busy_trail(acme, 20_000)
    audit_event_record(actor=operator, action="operation.resolve_failed", tenant=acme,
                       object_type="operation", object_id="op_01TARGET0000000000000000000",
                       reason="checked")
    query = {"object": {"object": "op_01TARGET0000000000000000000"},
             "actor": {"actor": "Operator"}}[which]
    client = Client()
    client.force_login(auditor)

    with queries_run() as seen:
        html = client.get("/audit/", query).content.decode()
        exported = _exported(client.get("/audit.csv", query))

    assert html.count("operation.resolve_failed") >= 1 and "op_000" not in html
    assert [(row[2], row[4], row[6]) for row in exported[1:]] == [
        ("operator", "operation.resolve_failed", "op_01TARGET0000000000000000000")]
    reads = [(sql, params) for sql, params in seen
             if sql.startswith("SELECT") and 'FROM "operations_auditevent"' in sql
             and "DISTINCT" not in sql]
    assert len(reads) == 2  # the page, and the export
    for sql, params in reads:
        read = plan_rows_read(sql, params, "operations_auditevent")
        # At most a page (51 rows) answers each; 20,001 events are on the trail.
        assert read <= 500, f"{read} audit events read filtered by {which}: {sql[:80]}"


@pytest.mark.django_db
def test_it_reads_a_page_not_every_newer_event_of_a_tenant_the_auditor_may_not_see(
    acme, globex, auditor
):
    """acme's trail is quiet; globex's, which the auditor may not read, has 20,000 newer
    events. The journal's and the run list's pages were read off the primary key back
    through every one of those in this case; the trail's must keep to its (tenant, -id)
    index."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO operations_auditevent (actor_id, actor_username, tenant_id, action,
                object_type, object_id, reason, before, after, created_at)
            SELECT NULL, '', %s, 'operation.prepare', 'operation', 'op_acme_' || g, '',
                   NULL, '{}'::jsonb, now() - interval '2 hours'
            FROM generate_series(1, 2000) g
            """,
            [acme.id],
        )
    _busy_trail(globex, 20_000)
    client = Client()
    client.force_login(auditor)

    with queries_run() as seen:
        html = client.get("/audit/").content.decode()

    assert all(f"op_acme_{g}<" in html for g in range(1951, 2001)) and "op_000" not in html
    assert "op_acme_1950<" not in html
    read = sum(plan_rows_read(sql, params, "operations_auditevent") for sql, params in seen
               if sql.startswith("SELECT") and 'FROM "operations_auditevent"' in sql
               and "DISTINCT" not in sql)
    assert read <= 500, f"{read} audit events read for one page of acme's trail"


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["stranger", "approver", "operator"])
def test_it_refuses_the_trail_to_those_without_the_audit_role(trail, who, request):
    client = Client()
    client.force_login(request.getfixturevalue(who))
    response = client.get("/audit/")
    assert response.status_code == 403 and b"apr_" not in response.content
    assert 'href="/audit/"' not in client.get("/").content.decode()  # not offered either


@pytest.mark.django_db
def test_it_shows_and_exports_nothing_for_a_filter_that_does_not_parse(trail, auditor):
    client = Client()
    client.force_login(auditor)
    query = {"action": "intent.approve", "since": "not-a-date"}

    page = client.get("/audit/", query).content.decode()
    rows = client.get("/audit/", query, HTTP_HX_REQUEST="true").content.decode()
    export = client.get("/audit.csv", query)

    for html in (page, rows):
        assert "Nothing is shown: Since (UTC) — Enter a valid date/time. " in html
        assert "apr_" not in html
    assert export.status_code == 400
    assert "nothing was exported" in export.content.decode()
    assert b"apr_" not in export.content


@pytest.mark.django_db
def test_it_reads_a_time_with_any_offset_and_refuses_one_outside_the_calendar(trail, auditor):
    # Python reads offsets up to ±23:59; PostgreSQL holds ±15:59 only: the page and the
    # export raised (a 500), the export after it was already on the trail.
    client = Client()
    client.force_login(auditor)
    for moment in ("2024-01-01T00:00:00+23:59", "2024-01-01T00:00:00-16:00"):
        for field in ("since", "until"):
            query = {field: moment}
            expect_rows = field == "since"  # the trail was written after 2024
            page = client.get("/audit/", query)
            rows = client.get("/audit/", query, HTTP_HX_REQUEST="true")
            export = client.get("/audit.csv", query)
            for response in (page, rows, export):
                assert response.status_code == 200, (field, moment)
            body = b"".join(export.streaming_content).decode("utf-8-sig")
            for html in (page.content.decode(), rows.content.decode(), body):
                assert ("apr_6" in html) == expect_rows, (field, moment)
    exports = AuditEvent.objects.filter(action="audit.export").count()

    # In UTC before year 1: no moment the trail holds, and said so.
    query = {"since": "0001-01-01T00:00:00+05:00"}
    page = client.get("/audit/", query).content.decode()
    assert "Nothing is shown: Since (UTC)" in page and "apr_" not in page
    assert client.get("/audit.csv", query).status_code == 400
    assert AuditEvent.objects.filter(action="audit.export").count() == exports


@pytest.mark.django_db
def test_it_exports_text_that_spreadsheets_will_not_run_and_json_they_can_read(acme, auditor):
    import json

    audit_event_record(actor=auditor, action="intent.reject", tenant=acme,
                       object_type="approval", object_id="apr_x",
                       reason='=HYPERLINK("http://evil.test","open")',
                       before={"status": "pending"}, after={"status": "rejected"})
    client = Client()
    client.force_login(auditor)

    response = client.get("/audit.csv", {"object": "apr_x"})

    (header, row) = _exported(response)
    cells = dict(zip(header, row, strict=True))
    assert cells["reason"] == '\'=HYPERLINK("http://evil.test","open")'
    assert cells["actor"] == auditor.username
    assert json.loads(cells["before"]) == {"status": "pending"}
    assert json.loads(cells["after"]) == {"status": "rejected"}


@pytest.mark.django_db
def test_it_says_why_a_page_is_not_permitted_and_leads_back(trail, approver):
    client = Client()
    client.force_login(approver)
    response = client.get("/audit/")
    html = response.content.decode()
    assert response.status_code == 403
    assert "the audit trail needs the auditor or admin role" in html
    assert 'href="/">Back to the dashboard</a>' in html and 'aria-label="Main"' in html


@pytest.mark.django_db
def test_it_shows_and_exports_only_the_tenants_where_the_user_holds_the_audit_role(
    trail, acme, globex
):
    from console.roles import role_grant
    from tests.factories import UserFactory

    # Audits acme; on globex only approves, which shows globex's queue, not its trail.
    dana = UserFactory(username="dana")
    role_grant(user=dana, role="Auditor", tenant=acme)
    role_grant(user=dana, role="Approver", tenant=globex)
    client = Client()
    client.force_login(dana)

    html = client.get("/audit/").content.decode()
    assert "apr_6" in html and "apr_g" not in html
    response = client.get("/audit.csv")
    rows = _exported(response)
    assert response.status_code == 200 and len(rows) > 1
    assert "apr_g" not in {row[6] for row in rows}
    assert {row[3] for row in rows[1:]} == {"acme"}


@pytest.mark.django_db
def test_it_names_the_system_as_the_actor_of_its_own_events_in_the_csv(acme, auditor):
    audit_event_record(actor=None, action="approval.expire", tenant=acme,
                       object_type="approval", object_id="apr_sys")
    client = Client()
    client.force_login(auditor)

    response = client.get("/audit.csv", {"object": "apr_sys"})
    page = client.get("/audit/", {"object": "apr_sys"}).content.decode()

    (header, row) = _exported(response)
    assert dict(zip(header, row, strict=True))["actor"] == "system"
    assert "<td>system</td>" in page


@pytest.mark.django_db
def test_it_records_each_export_on_the_trail_of_every_tenant_it_covers(
    trail, acme, globex, auditor, other_tenant_user
):
    from console.roles import role_grant

    role_grant(user=auditor, role="Auditor", tenant=globex)
    client = Client()
    client.force_login(auditor)

    response = client.get("/audit.csv", {"action": "intent.reject", "since": "2026-01-01T00:00"})
    b"".join(response.streaming_content)

    exports = AuditEvent.objects.filter(action="audit.export").order_by("tenant__slug")
    assert [(e.tenant.slug, e.actor_username, e.object_id) for e in exports] == [
        ("acme", "auditor", "acme"), ("globex", "auditor", "globex")]
    assert exports[0].after == {"filters": {"action": "intent.reject",
                                            "since": "2026-01-01T00:00:00+00:00"}}
    # Each tenant's own auditors see that its trail left the console; a tenant the export
    # did not cover sees nothing of it.
    role_grant(user=other_tenant_user, role="Auditor", tenant=globex)
    client.force_login(other_tenant_user)
    page = client.get("/audit/", {"action": "audit.export"}).content.decode()
    assert "<td>auditor</td>" in page and "acme" not in page


@pytest.mark.django_db
def test_it_records_an_export_only_on_the_trails_it_carried(trail, globex, auditor):
    from console.roles import role_grant

    # The auditor of acme also approves on globex: a tenant they may see but not export.
    # Globex's trail did not leave the console, and its own trail must not say it did.
    role_grant(user=auditor, role="Approver", tenant=globex)
    client = Client()
    client.force_login(auditor)

    b"".join(client.get("/audit.csv").streaming_content)

    exports = AuditEvent.objects.filter(action="audit.export")
    assert list(exports.values_list("tenant__slug", flat=True)) == ["acme"]


@pytest.mark.django_db
def test_it_records_no_export_that_was_refused(trail, auditor, approver):
    client = Client()
    client.force_login(approver)
    assert client.get("/audit.csv").status_code == 403
    client.force_login(auditor)
    assert client.get("/audit.csv", {"since": "not-a-date"}).status_code == 400

    assert not AuditEvent.objects.filter(action="audit.export").exists()


FORMULA_STARTS = ("=", "+", "@", "\t", "\r")


def _spreadsheet_cells(line: str, delimiter: str) -> list[str]:
    """How Excel or LibreOffice cut a line: a double quote opens or closes a quoted run
    (two inside one are a literal quote), and the delimiter splits only outside one."""
    cells, cell, quoted, i = [], [], False, 0
    while i < len(line):
        char = line[i]
        if char == '"':
            if quoted and line[i + 1:i + 2] == '"':
                cell.append('"')
                i += 2
                continue
            quoted = not quoted
        elif char == delimiter and not quoted:
            cells.append("".join(cell))
            cell = []
        else:
            cell.append(char)
        i += 1
    cells.append("".join(cell))
    return cells


def _export(auditor, **query) -> bytes:
    client = Client()
    client.force_login(auditor)
    response = client.get("/audit.csv", query)
    assert response.status_code == 200
    return b"".join(response.streaming_content)


@pytest.mark.django_db
def test_it_keeps_formulas_out_of_every_cell_a_semicolon_locale_spreadsheet_reads(
    acme, auditor
):
    # Excel opens a .csv with the system's list separator: ";" in Russian (the seeds'
    # language), German, French. The quote before "=" guards a comma-separated cell's start
    # only; unquoted, a reason written with ";=" would start a cell, and a formula, there.
    audit_event_record(actor=auditor, action="intent.reject", tenant=acme,
                       object_type="approval", object_id="apr_semi",
                       reason="see ticket 4411;=HYPERLINK(A1);",
                       before={"status": "pending"}, after={"status": "rejected"})

    text = _export(auditor, object="apr_semi").decode("utf-8-sig")

    formulas = [cell for line in text.split("\r\n") for cell in _spreadsheet_cells(line, ";")
                if cell.startswith(FORMULA_STARTS)]
    assert formulas == [], f"cells a spreadsheet runs as formulas: {formulas}"


@pytest.mark.django_db
def test_it_marks_the_export_as_utf8_inside_the_file_a_spreadsheet_opens(acme, auditor):
    # The Content-Type's charset is gone once the file is saved; Excel on Windows reads a
    # file without a byte order mark in the system code page (cp1251 in Russia), and every
    # reason, name and evidence text in Cyrillic is garbled in the auditor's copy.
    audit_event_record(actor=auditor, action="operation.resolve_succeeded", tenant=acme,
                       object_type="operation", object_id="op_ru",
                       reason="Сверено с выпиской банка")  # noqa: RUF001

    body = _export(auditor, object="op_ru")

    assert body.startswith(b"\xef\xbb\xbf"), body[:40]
    assert "Сверено с выпиской банка" in body.decode("utf-8-sig")  # noqa: RUF001


@pytest.mark.django_db
def test_it_masks_an_address_of_any_script_in_the_export_as_on_the_page(acme, operator, auditor):
    import csv
    import io
    import json

    from tests.helpers import signed_in
    from tests.operations.engine_helpers import make_unknown, prepared_payment

    email = "anna@почта.рф"
    op = make_unknown(prepared_payment(acme))
    assert signed_in(operator).post(f"/operations/{op.id}/resolve", {
        "resolve-outcome": "failed", "resolve-provider_reference": "",
        "resolve-evidence": f"the beneficiary {email} says nothing came",
        "resolve-reason": "checked with the beneficiary",
    }).status_code == 302
    page = signed_in(auditor).get("/audit/").content.decode()
    assert email not in page and "a***@почта.рф" in page
    response = signed_in(auditor).get("/audit.csv")
    body = b"".join(response.streaming_content).decode("utf-8-sig")
    # JSON's escapes (\u043f…) would have hidden the address from the mask, not the reader.
    resolved = next(row for row in csv.DictReader(io.StringIO(body))
                    if row["action"] == "operation.resolve_failed")
    said = json.loads(resolved["after"])["evidence"]
    assert said == "the beneficiary a***@почта.рф says nothing came"


@pytest.mark.django_db
def test_it_masks_and_reads_a_nested_value_on_the_page_as_the_export_does(acme, auditor):
    from tests.helpers import signed_in

    # An export of one person's trail (a username may be an address, in Cyrillic) records
    # the filter it was given, nested in its "after".
    assert _export(auditor, actor="anna.petrova@почта.рф")
    export = AuditEvent.objects.get(action="audit.export")
    assert export.after == {"filters": {"actor": "anna.petrova@почта.рф"}}

    client = signed_in(auditor)
    page = client.get("/audit/", {"action": "audit.export"}).content.decode()
    # JSON's escapes (\u043f…) hid the address from the page's mask, and left its domain
    # unreadable.
    assert "anna.petrova@" not in page and "\\u043f" not in page
    assert "a***@почта.рф" in page
    (header, *rows) = _exported(client.get("/audit.csv", {"action": "audit.export"}))
    row = next(dict(zip(header, r, strict=True)) for r in rows if r[0] == str(export.id))
    assert row["after"] == '{"filters": {"actor": "a***@почта.рф"}}'


@pytest.mark.django_db
def test_it_keeps_a_formula_out_of_the_tenant_cell_of_the_export(auditor):
    from console.roles import role_grant
    from tests.factories import TenantFactory

    # A SlugField takes "-1-1" (an admin can name a tenant so in /admin/); a spreadsheet
    # runs that cell as =-1-1.
    tenant = TenantFactory(slug="-1-1")
    role_grant(user=auditor, role="Auditor", tenant=tenant)
    audit_event_record(actor=auditor, action="intent.reject", tenant=tenant,
                       object_type="approval", object_id="apr_dash")

    text = _export(auditor, object="apr_dash").decode("utf-8-sig")

    (header, row) = csv.reader(io.StringIO(text))
    cells = dict(zip(header, row, strict=True))
    assert cells["tenant"] == "'-1-1"
    assert [cell for cell in row if cell.startswith(("-", *FORMULA_STARTS))] == []


@pytest.mark.django_db
@pytest.mark.parametrize("joint", ["\n", "\t", "\r\n"])
def test_it_masks_a_phone_number_typed_on_a_new_line_in_the_export_as_on_the_page(
    acme, auditor, joint
):
    import json

    from tests.helpers import signed_in

    # Evidence is typed in a textarea. Written as JSON before its mask, the line break
    # became "\n", whose "n" joined the number after it to a word: exported whole.
    typed = f"Called the client{joint}87012345678 and she confirmed"
    audit_event_record(actor=auditor, action="operation.resolve_failed_refused", tenant=acme,
                       object_type="operation", object_id="op_typed", reason=typed,
                       after={"outcome": "failed", "evidence": typed, "call": {"notes": [typed]}})
    client = signed_in(auditor)

    (header, row) = _exported(client.get("/audit.csv", {"object": "op_typed"}))
    cells = dict(zip(header, row, strict=True))
    masked = f"Called the client{joint}••••5678 and she confirmed"
    assert cells["reason"] == masked
    assert json.loads(cells["after"]) == {
        "outcome": "failed", "evidence": masked, "call": {"notes": [masked]},
    }
    page = client.get("/audit/", {"object": "op_typed"}).content.decode()
    assert "87012345678" not in page and "••••5678" in page


def test_it_shows_a_change_between_two_nested_values_masked_alike():
    from console.views import audit_changes

    (change,) = audit_changes({"to": {"account": "40817810099910004312"}},
                              {"to": {"account": "40817810099920004312"}})
    assert change.before == change.after == '{"account": "••••4312"}'


@pytest.mark.django_db
def test_it_shows_and_exports_an_intents_hash_as_its_keyed_fingerprint(
    acme, approver, auditor
):
    from approvals.models import Approval
    from approvals.services import approval_approve
    from tests.helpers import signed_in
    from tests.operations.engine_helpers import prepared_payment

    # Beside the masked intent the trail shows, the unkeyed hash would give the masked
    # account back to a brute force; the fingerprints still match approval to operation.
    op = prepared_payment(acme, beneficiary_id="8701234567")
    approval_approve(approval_id=Approval.objects.get(operation=op).id, actor=approver)
    fingerprint = payload_fingerprint(op.payload_hash)
    client = signed_in(auditor)
    page = client.get("/audit/").content.decode()
    exported = b"".join(client.get("/audit.csv").streaming_content).decode("utf-8-sig")
    for shown in (page, exported):
        assert op.payload_hash[7:] not in shown
        # Recorded, approved and authorized: each under the same fingerprint.
        assert shown.count(fingerprint) >= 3, shown
    assert AuditEvent.objects.get(action="operation.prepare").after["payload_hash"] == (
        op.payload_hash)  # kept whole: only what pages show changes
