from __future__ import annotations

import re
from html import unescape

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from operations.engine import operation_prepare
from operations.intents import state_fingerprint
from operations.models import Checkpoint, Operation, Run, RunMode, RunStatus
from replays.views import PAGE_SIZE
from tests.factories import CheckpointFactory, RunFactory
from tests.helpers import signed_in, triggers_off
from tests.operations.engine_helpers import PAYMENT


@pytest.fixture
def lineage(acme, operator):
    original = Run.objects.create(
        conversation_id="conv_01TEST", tenant=acme, workflow_name="pay_invoices",
        workflow_version=7, state_schema_version=4,
    )
    cp = Checkpoint.objects.create(
        run=original, sequence=1, node="prepare_payment",
        state={"invoice": "inv_9182", "beneficiary_account": "KZ12345678901234"},
        state_hash="sha256:" + "a" * 64,
    )
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                           run=original, checkpoint=cp, command_id="cmd_pay_01")
    branch = Run.objects.create(
        conversation_id="conv_01TEST", tenant=acme, workflow_name="pay_invoices",
        workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH, parent_run=original,
        parent_checkpoint=cp, launch_reason="debug_after_tool_timeout", launched_by=operator,
    )
    return original, branch, cp, op


@pytest.mark.django_db
def test_it_shows_a_run_with_its_checkpoints_effects_and_derived_runs(lineage, auditor):
    original, branch, cp, op = lineage
    html = signed_in(auditor).get(f"/runs/{original.id}/").content.decode()
    assert cp.id in html and "prepare_payment" in html and op.id in html
    assert branch.id in html and "debug_after_tool_timeout" in html
    # State values can hold personal data: only the field names are on the page.
    assert "beneficiary_account" in html and "KZ12345678901234" not in html
    # A run nothing came before is not presented as derived from something.
    assert "this one started afresh, not as a replay or a branch" in html
    branch_html = signed_in(auditor).get(f"/runs/{branch.id}/").content.decode()
    assert original.id in branch_html and cp.id in branch_html
    assert "started afresh" not in branch_html


@pytest.mark.django_db
def test_it_shows_a_checkpoints_state_only_as_a_keyed_fingerprint(acme, auditor, settings):
    """The page shows a checkpoint's field names and, masked, the intent it led to: the
    unkeyed sha256 of its state beside them (even cut short) lets a guess of the masked
    values be checked offline. A keyed fingerprint still tells equal states apart from
    different ones, and changes with SECRET_KEY."""
    state_hash = "sha256:" + "0f1e2d3c4b5a6978" * 4
    cp = CheckpointFactory(run=RunFactory(tenant=acme), state_hash=state_hash)
    client = signed_in(auditor)

    html = client.get(f"/runs/{cp.run_id}/").content.decode()

    fingerprint = state_fingerprint(state_hash)
    assert fingerprint.startswith("fp:") and fingerprint[:23] in html
    assert state_hash[7:15] not in html and "sha256:0f1e" not in html
    settings.SECRET_KEY = "another-" + "k" * 50
    assert state_fingerprint(state_hash) != fingerprint
    assert state_fingerprint(state_hash) == state_fingerprint(state_hash)


@pytest.mark.django_db
def test_it_never_says_the_agent_launched_a_replay_that_names_no_launcher(acme, auditor):
    """A replay or a branch is a person's decision: one whose launcher is not recorded (a
    row from before it was kept, or written by a script) reads as the approval card and the
    engine word it, "no one named". An original run is the agent's own."""
    original = RunFactory(tenant=acme)
    replay = RunFactory(derived_from=CheckpointFactory(run=original), mode=RunMode.LIVE,
                        launched_by=None, launch_reason="reproduce the lost answer")
    client = signed_in(auditor)

    own = client.get(f"/runs/{replay.id}/").content.decode()
    parent = client.get(f"/runs/{original.id}/").content.decode()
    listed = client.get("/runs/").content.decode()

    assert re.search(r"<dt>Launched by</dt><dd>no one named at ", own)
    assert re.search(rf"<code>{replay.id}</code></a>[^\n]*?by no one named</span>", parent)
    rows = {
        run_id: re.search(r"<td>([^<]*)</td>\s*<td class=\"num\">", row).group(1)
        for run_id, row in re.findall(r"<code>(run_\w+)</code>.*?(</td>.*?)</tr>", listed,
                                      re.S)
    }
    assert rows == {replay.id: "no one named", original.id: "agent"}
    assert re.search(r"<dt>Launched by</dt><dd>agent at ", parent)


@pytest.mark.django_db
def test_it_reads_a_runs_whole_ancestry_in_one_query(lineage, auditor):
    """The chain of ancestors was read one query per generation, up to fifty."""
    original, branch, _cp, _op = lineage
    client = signed_in(auditor)

    def run_page(run: Run) -> tuple[int, str]:
        with CaptureQueriesContext(connection) as queries:
            html = client.get(f"/runs/{run.id}/").content.decode()
        return len(queries), html

    run_page(branch)  # per-process caches
    near, _html = run_page(branch)
    chain = [branch]
    for _ in range(4):
        chain.append(RunFactory(derived_from=CheckpointFactory(run=chain[-1])))
    far, html = run_page(chain[-1])
    assert far == near
    # Still every generation, nearest first.
    ancestors = re.search(r"<dt>Ancestors</dt>\s*<dd>(.*?)</dd>", html, re.S).group(1)
    assert re.findall(r"<code>(\w+)</code>", ancestors) == [
        *(run.id for run in reversed(chain[:-1])), original.id]


@pytest.mark.django_db
def test_it_lists_runs_of_visible_tenants_only(lineage, other_tenant_user, stranger, approver):
    original, *_ = lineage
    assert original.id in signed_in(approver).get("/runs/").content.decode()
    for user in (other_tenant_user, stranger):
        client = signed_in(user)
        assert original.id not in client.get("/runs/").content.decode()
        assert client.get(f"/runs/{original.id}/").status_code == 404
        assert client.get("/runs/conversations/conv_01TEST/").status_code == 404
    # Another tenant's slug as a filter shows nothing rather than everything.
    html = signed_in(other_tenant_user).get("/runs/", {"tenant": "acme"}).content.decode()
    assert original.id not in html


@pytest.mark.django_db
def test_it_pages_runs_by_key_and_answers_htmx_with_rows_only(lineage, approver, monkeypatch):
    monkeypatch.setattr("replays.views.PAGE_SIZE", 1)
    original, branch, _, _ = lineage
    client = signed_in(approver)
    first = client.get("/runs/").content.decode()
    # One row (the newest, the branch); the original appears only as its parent link.
    assert first.count('<td class="nowrap">') == 1
    assert f"<code>{branch.id}</code>" in first and f"before={branch.id}" in first
    rows = client.get("/runs/", {"before": branch.id}, HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in rows and rows.count('<td class="nowrap">') == 1
    assert f"<code>{original.id}</code>" in rows and branch.id not in rows
    assert "Older runs" not in rows


@pytest.mark.django_db
def test_it_gives_every_htmx_control_on_the_run_list_a_plain_link_or_form(
    lineage, approver, monkeypatch
):
    monkeypatch.setattr("replays.views.PAGE_SIZE", 1)
    html = signed_in(approver).get("/runs/").content.decode()
    form = re.search(r"<form[^>]*hx-get[^>]*>", html).group()
    assert 'method="get"' in form and 'action="/runs/"' in form
    links = re.findall(r"<a [^>]*hx-get[^>]*>", html)
    assert links
    for tag in links:
        assert re.search(r'href="/runs/\?[^"]*before=run_', tag), tag


@pytest.mark.django_db
def test_it_groups_runs_by_conversation(lineage, approver):
    original, branch, _, _ = lineage
    client = signed_in(approver)
    html = client.get("/runs/conversations/conv_01TEST/").content.decode()
    assert original.id in html and branch.id in html
    runs = {run.id: run.operation_count for run in client.get("/runs/").context["runs"]}
    assert runs == {original.id: 1, branch.id: 0}
    assert client.get("/runs/conversations/conv_NOPE/").status_code == 404


@pytest.mark.django_db
@pytest.mark.parametrize("conversation_id", [
    "slack/C024BE91L/1355517523", "..", "a/../b?c=1#d e", " padded ",
])
def test_it_leads_to_a_conversation_whatever_its_id_holds(acme, approver, conversation_id):
    """The agent's runtime writes a conversation id unchecked. One a path segment cannot
    carry (a Slack thread's "team/channel/ts") made its run's page answer 500, and with it
    the whole approval queue of its tenant, for everyone who sees that tenant."""
    run = Run.objects.create(conversation_id=conversation_id, tenant=acme,
                             workflow_name="pay_invoices", workflow_version=1,
                             state_schema_version=1)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=run,
                           command_id="cmd_pay")
    client = signed_in(approver, raise_request_exception=False)
    links = set()
    for url in ("/approvals/", "/runs/", f"/runs/{run.id}/"):
        response = client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert op.id in html or run.id in html, url
        links.update(re.findall(r'href="(/runs/conversations/[^"]*)"', html))
    # The queue's card and the run's page link the same conversation, and it is this one.
    assert len(links) == 1, links
    page = client.get(unescape(links.pop()))
    assert page.status_code == 200
    assert page.context["conversation_id"] == conversation_id
    assert [r.id for r in page.context["runs"]] == [run.id]


@pytest.mark.django_db
def test_it_refuses_a_run_without_a_conversation(acme, approver):
    for blank in ("", "  \n"):
        with pytest.raises(IntegrityError, match="run_conversation_named"), \
                transaction.atomic():
            RunFactory(tenant=acme, conversation_id=blank)
    assert not Run.objects.exists()
    # Nor is there a conversation page for none (nor for an id no run can have).
    client = signed_in(approver)
    for query in ({}, {"id": ""}, {"id": "\x00"}, {"id": "c" * 41}):
        assert client.get("/runs/conversations/", query).status_code == 404, query


@pytest.mark.django_db
def test_it_refuses_posts_on_the_read_only_pages(lineage, approver):
    original, *_ = lineage
    assert signed_in(approver).post(f"/runs/{original.id}/").status_code == 405


@pytest.mark.django_db
def test_it_refuses_lineage_across_tenants_and_never_lists_another_tenants_effect(
    lineage, globex, auditor
):
    from operations.intents import IntentError

    original, branch, cp, op = lineage
    with pytest.raises(IntentError, match="another tenant"):
        operation_prepare(tenant=globex, action="payments.create", payload=PAYMENT,
                          run=original, command_id="cmd_pay_g")
    with pytest.raises(IntentError, match="not a checkpoint of the given run"):
        operation_prepare(tenant=op.tenant, action="payments.create", payload=PAYMENT,
                          run=branch, checkpoint=cp, command_id="cmd_pay_b")
    # A row that got there anyway stays off the run's page. By hand the database refuses it
    # now (operations 0016); one written before that migration is still there.
    stray = operation_prepare(tenant=globex, action="payments.create",
                              payload={**PAYMENT, "invoice_id": "inv_GLOBEX"})
    stray.pk, stray.idempotency_key, stray.run = "op_STRAY", "ik_stray", original
    with pytest.raises(IntegrityError, match="not a run of its tenant"), transaction.atomic():
        stray.save(force_insert=True)
    with triggers_off(Operation):
        stray.save(force_insert=True)
    client = signed_in(auditor)
    html = client.get(f"/runs/{original.id}/").content.decode()
    assert op.id in html and stray.id not in html and "inv_GLOBEX" not in html
    runs = client.get("/runs/").context["runs"]
    assert {run.id: run.operation_count for run in runs}[original.id] == 1


@pytest.mark.django_db
def test_it_names_an_effects_lineage_as_its_own_page_does(lineage, globex, auditor):
    """The run page's effects named each one's checkpoint and the intent it replaces straight
    from the row's ids, where the operation's own page leaves out another tenant's intent and
    another run's checkpoint (operation_lineage): a row from before operations 0016 showed an
    acme auditor a globex operation's id, as a link, and a globex checkpoint."""
    original, _branch, cp, op = lineage
    theirs_run = Run.objects.create(conversation_id="conv_01GLOBEX", tenant=globex,
                                    workflow_name="pay_invoices", workflow_version=1,
                                    state_schema_version=1)
    theirs_cp = Checkpoint.objects.create(run=theirs_run, sequence=1, node="globex_node",
                                          state={}, state_hash="sha256:" + "b" * 64)
    theirs = operation_prepare(tenant=globex, action="payments.create",
                               payload={**PAYMENT, "invoice_id": "inv_GLOBEX"})
    client = signed_in(auditor)

    def run_page() -> tuple[str, int]:
        with CaptureQueriesContext(connection) as queries:
            html = client.get(f"/runs/{original.id}/").content.decode()
        return html, len(queries)

    run_page()  # the first request fills per-process caches (content types)
    # Within the tenant, the intent an effect replaces and its checkpoint are named.
    replacing = operation_prepare(tenant=op.tenant, action="payments.create", run=original,
                                  checkpoint=cp, supersedes=op, command_id="cmd_pay_01",
                                  payload={**PAYMENT, "amount_minor": 1_000_000})
    html, queries = run_page()
    assert html.count(f'href="/operations/{op.id}/"') == 2  # its own row; the one replacing it
    # In the checkpoints, where its branch came from, and as both effects' checkpoint.
    assert html.count(f"<code>{cp.id}</code>") == 4

    # A copy of it by hand, as a row from before operations 0016 is: it names globex's intent
    # as the one it replaces and globex's checkpoint as its own.
    replacing.pk, replacing.idempotency_key = "op_STRAYLINEAGE", "ik_stray_lineage"
    replacing.supersedes, replacing.checkpoint = theirs, theirs_cp
    with triggers_off(Operation):
        replacing.save(force_insert=True)
    html, more_queries = run_page()
    assert "op_STRAYLINEAGE" in html and more_queries == queries  # read with the page's rows
    for private in (theirs.id, theirs_cp.id, "globex_node"):
        assert private not in html, private
    # As the operation's own page leaves them out.
    op_html = client.get("/operations/op_STRAYLINEAGE/").content.decode()
    assert theirs.id not in op_html and theirs_cp.id not in op_html


@pytest.mark.django_db
def test_it_refuses_a_run_lineage_across_tenants_or_from_another_runs_checkpoint(
    lineage, globex
):
    original, branch, cp, _ = lineage
    theirs = Run.objects.create(conversation_id="conv_01G", tenant=globex,
                                workflow_name="pay_invoices", workflow_version=7,
                                state_schema_version=4)
    derived = {"conversation_id": "conv_01G", "workflow_name": "pay_invoices",
               "workflow_version": 7, "state_schema_version": 4, "mode": RunMode.SIMULATION,
               "launch_reason": "replay"}
    with pytest.raises(IntegrityError, match="is not a run of its tenant"), transaction.atomic():
        Run.objects.create(tenant=globex, parent_run=original, parent_checkpoint=cp, **derived)
    # Its own tenant's run, but a checkpoint of another run than the one it names.
    other_cp = Checkpoint.objects.create(run=branch, sequence=1, node="n", state={},
                                         state_hash="sha256:" + "c" * 64)
    with pytest.raises(IntegrityError, match="not a checkpoint of its parent run"), \
            transaction.atomic():
        Run.objects.create(tenant=original.tenant, parent_run=original,
                           parent_checkpoint=other_cp, **derived)
    # Nor moved across afterwards, with its operations and checkpoints.
    for run in (branch, original):
        with pytest.raises(IntegrityError, match="its tenant never changes"), \
                transaction.atomic():
            Run.objects.filter(id=run.id).update(tenant=globex)
    assert Run.objects.filter(tenant=globex).get() == theirs


@pytest.mark.django_db
def test_it_keeps_a_runs_lineage_all_or_nothing_in_the_database(lineage):
    original, _branch, cp, _ = lineage
    derived_without_checkpoint = {"mode": RunMode.EVIDENCE, "parent_run": original,
                                  "parent_checkpoint": None, "launch_reason": "reproduce"}
    for lineage_fields, refusal in (
        (derived_without_checkpoint, "run_lineage_complete"),
        ({"parent_checkpoint": cp}, "not a checkpoint of its parent run"),
        ({"mode": RunMode.ORIGINAL, "parent_run": original, "parent_checkpoint": cp},
         "run_lineage_complete"),
    ):
        with pytest.raises(IntegrityError, match=refusal), transaction.atomic():
            RunFactory(tenant=original.tenant, **lineage_fields)
    assert Run.objects.filter(tenant=original.tenant).count() == 2


@pytest.mark.django_db
def test_it_refuses_any_change_to_a_checkpoint(acme):
    cp = CheckpointFactory(run=RunFactory(tenant=acme))
    # Raw SQL: Django's PROTECT of a checkpoint a run or an operation names would refuse a
    # delete first and hide the trigger.
    for statement in ("UPDATE operations_checkpoint SET state = '{}' WHERE id = %s",
                      "DELETE FROM operations_checkpoint WHERE id = %s"):
        with pytest.raises(IntegrityError, match="operations_checkpoint is refused"), \
                transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, [cp.id])
    assert Checkpoint.objects.get(id=cp.id).state == {"invoice": "inv_9182"}


@pytest.mark.django_db
def test_it_refuses_any_change_to_a_runs_lineage(lineage, approver):
    """Where a run came from, how, by whom and why is the auditor's record: a data fix
    cannot relabel an evidence replay live, erase a branch's reason, swap its launcher
    (approvals exclude whoever launched the run) or loop the lineage."""
    original, branch, _cp, _ = lineage
    later = Checkpoint.objects.create(run=branch, sequence=1, node="prepare_payment",
                                      state={}, state_hash="sha256:" + "d" * 64)
    grandchild = RunFactory(derived_from=later)
    grandchild_cp = Checkpoint.objects.create(run=grandchild, sequence=1, node="n", state={},
                                              state_hash="sha256:" + "e" * 64)
    before = Run.objects.filter(id=branch.id).values().get()
    for change in (
        {"parent_run": grandchild, "parent_checkpoint": grandchild_cp},
        {"mode": RunMode.LIVE}, {"launch_reason": "something else"},
        {"launched_by": approver}, {"conversation_id": "conv_other"},
        {"workflow_version": 8},
    ):
        with pytest.raises(IntegrityError, match=r"its lineage .* never changes"), \
                transaction.atomic():
            Run.objects.filter(id=branch.id).update(**change)
    assert Run.objects.filter(id=branch.id).values().get() == before
    # Its status moves on as the run does.
    assert Run.objects.filter(id=original.id).update(status=RunStatus.SUCCEEDED) == 1


@pytest.mark.django_db
def test_it_refuses_to_delete_any_run(acme, operator, auditor):
    """Refusing to rewrite a run's lineage kept nothing if the row could go: a derived run's
    origin, launcher and reason vanished with a DELETE (launching one writes no audit
    event), and an original run's with it once nothing pointed at it yet. Raw SQL, as a data
    fix would: Django's PROTECT of a run a checkpoint names would refuse first."""
    original = RunFactory(tenant=acme)
    replay = RunFactory(derived_from=CheckpointFactory(run=original), mode=RunMode.EVIDENCE,
                        launched_by=operator, launch_reason="why was inv_9182 paid twice?")
    bare = RunFactory(tenant=acme)
    for run in (replay, bare):
        with pytest.raises(IntegrityError, match="DELETE on operations_run is refused"), \
                transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("DELETE FROM operations_run WHERE id = %s", [run.id])
    with pytest.raises(IntegrityError, match="DELETE on operations_run is refused"), \
            transaction.atomic():
        Run.objects.filter(id=bare.id).delete()
    assert set(Run.objects.filter(tenant=acme).values_list("id", "launched_by")) == {
        (original.id, None), (replay.id, operator.id), (bare.id, None)}
    assert replay.id in signed_in(auditor).get(f"/runs/{original.id}/").content.decode()


@pytest.mark.django_db
def test_it_refuses_a_derived_run_without_a_reason(lineage):
    original, _branch, cp, _ = lineage
    for reason in ("", "  \n"):
        with pytest.raises(IntegrityError, match="run_derived_has_reason"), \
                transaction.atomic():
            RunFactory(derived_from=cp, launch_reason=reason)
    assert Run.objects.filter(parent_run=original).count() == 1


@pytest.mark.django_db
def test_it_shows_a_long_conversation_a_page_at_a_time(acme, auditor):
    """An agent that loops can leave thousands of runs in one conversation: the page showed
    every one of them."""
    runs = RunFactory.create_batch(PAGE_SIZE + 1, tenant=acme, conversation_id="conv_01LONG")
    client = signed_in(auditor)

    page = client.get("/runs/conversations/conv_01LONG/").content.decode()

    shown = set(re.findall(r'href="/runs/(run_\w+)/"', page))
    assert shown == {run.id for run in runs[1:]}
    older = re.search(r'href="(/runs/\?conversation=conv_01LONG&amp;before=run_\w+)"', page)
    assert older and "Older runs of this conversation" in page
    rest = client.get(older.group(1).replace("&amp;", "&")).content.decode()
    assert runs[0].id in rest and runs[1].id not in rest


@pytest.mark.django_db
def test_it_leads_older_runs_of_a_padded_conversation_to_that_conversation(
    acme, auditor, monkeypatch
):
    """The runtime writes conversation ids unchecked, spaces included (" conv_A " has its
    own page). That page's "Older runs of this conversation" link goes to the run list,
    whose filter stripped the id: it listed another conversation's runs ("conv_A"), or "No
    runs match" while older runs of this one exist."""
    monkeypatch.setattr("replays.views.PAGE_SIZE", 1)
    older, newer = RunFactory.create_batch(2, tenant=acme, conversation_id=" conv_A ")
    other = RunFactory(tenant=acme, conversation_id="conv_A")
    client = signed_in(auditor)

    page = client.get("/runs/conversations/", {"id": " conv_A "}).content.decode()
    assert newer.id in page and older.id not in page and other.id not in page
    link = re.search(r'href="(/runs/\?conversation=[^"]*)"', page)
    assert link and "Older runs of this conversation" in page

    rest = client.get(unescape(link.group(1)))

    assert rest.status_code == 200
    shown = set(re.findall(r'href="/runs/(run_\w+)/"', rest.content.decode()))
    assert shown == {older.id}


@pytest.mark.django_db
def test_it_shows_a_long_run_a_page_at_a_time(acme, auditor, monkeypatch):
    """An agent that loops leaves thousands of checkpoints in one run: its page listed every
    one, loading each one's whole state to show the names of its fields, with every effect
    and every derived run beside them."""
    size = 2
    monkeypatch.setattr("replays.views.PAGE_SIZE", size)
    run = RunFactory(tenant=acme)
    Checkpoint.objects.bulk_create(
        Checkpoint(run=run, sequence=n, node=f"loop_{n}",
                   state={"history": ["x" * 100] * 10, "n": n},
                   recorded_inputs=[{"class": "recorded_fact", "output": "y" * 100}] * 3,
                   state_hash="sha256:" + "a" * 64)
        for n in range(1, 2 * size + 2)
    )
    first_cp = Checkpoint.objects.get(run=run, sequence=1)
    effects = [operation_prepare(tenant=acme, action="payments.create", run=run,
                                 payload={**PAYMENT, "invoice_id": f"inv_{n}"},
                                 command_id=f"cmd_{n}") for n in range(size + 1)]
    children = [RunFactory(derived_from=first_cp) for _ in range(size + 1)]
    client = signed_in(auditor)

    def checkpoint_rows(html: str) -> list[int]:
        return [int(n) for n in re.findall(r"<td>loop_(\d+)</td>", html)]

    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/runs/{run.id}/")
    html = response.content.decode()
    assert checkpoint_rows(html) == [5, 4]  # the newest first
    assert "n, history" in html and "<td>3</td>" in html  # jsonb's order; inputs counted
    # Neither the states nor the recorded inputs leave PostgreSQL for this page.
    shown = response.context["checkpoints"]
    assert all({"state", "recorded_inputs"} <= cp.get_deferred_fields() for cp in shown)
    pages = [q["sql"] for q in queries if 'FROM "operations_checkpoint"' in q["sql"]]
    assert pages and not any("OFFSET" in sql or "COUNT(" in sql for sql in pages)

    older = re.search(rf'href="(/runs/{run.id}/\?before=4)"', html)
    assert older and "Older checkpoints" in html
    assert checkpoint_rows(client.get(older.group(1)).content.decode()) == [3, 2]
    rows = client.get(older.group(1), HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in rows and checkpoint_rows(rows) == [3, 2]
    assert effects[0].id not in rows and children[0].id not in rows
    last = client.get(f"/runs/{run.id}/", {"before": 2}, HTTP_HX_REQUEST="true")
    assert checkpoint_rows(last.content.decode()) == [1]
    assert "Older checkpoints" not in last.content.decode()
    for cursor in ("x", "0", "-1", "9" * 12):
        assert client.get(f"/runs/{run.id}/", {"before": cursor}).status_code == 404, cursor

    # The newest effects and derived runs; the journal and the run list page through the rest.
    for newer in (*effects[1:], *children[1:]):
        assert newer.id in html
    assert effects[0].id not in html and children[0].id not in html
    journal = re.search(rf'href="(/operations/\?run={run.id}&amp;before=op_\w+)"', html)
    assert journal and "Older effects of this run" in html
    rest = client.get(unescape(journal.group(1))).content.decode()
    assert effects[0].id in rest and effects[1].id not in rest
    derived = re.search(rf'href="(/runs/\?parent={run.id}&amp;before=run_\w+)"', html)
    assert derived and "Older derived runs" in html
    rest = client.get(unescape(derived.group(1))).content.decode()
    assert children[0].id in rest and children[1].id not in rest


@pytest.mark.django_db
def test_it_says_the_time_zone_of_every_time_it_shows(lineage, auditor):
    """Every other page says UTC; a bare time on these read as the viewer's local time."""
    original, *_ = lineage
    client = signed_in(auditor)
    for url in ("/runs/", "/runs/conversations/conv_01TEST/", f"/runs/{original.id}/"):
        html = client.get(url).content.decode()
        assert "<th>Created (UTC)</th>" in html, url
        assert "<th>Created</th>" not in html, url


@pytest.mark.django_db
def test_it_never_shows_another_tenants_run_in_a_lineage(lineage, globex, auditor,
                                                          other_tenant_user):
    original, branch, cp, _op = lineage
    # Rows that got there anyway (before operations 0025 refused them): a globex run derived
    # from acme's, and an acme run derived from globex's.
    with triggers_off(Run):
        theirs = Run.objects.create(
            conversation_id="conv_01GLOBEX", tenant=globex, workflow_name="pay_invoices",
            workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH,
            parent_run=original, parent_checkpoint=cp, launch_reason="globex_private_reason",
        )
    their_cp = Checkpoint.objects.create(run=theirs, sequence=1, node="prepare_payment",
                                         state={}, state_hash="sha256:" + "b" * 64)
    with triggers_off(Run):
        adopted = Run.objects.create(
            conversation_id="conv_01TEST", tenant=original.tenant, workflow_name="pay_invoices",
            workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH, parent_run=theirs,
            parent_checkpoint=their_cp, launch_reason="retry",
        )
    html = signed_in(auditor).get(f"/runs/{original.id}/").content.decode()
    assert branch.id in html and theirs.id not in html
    assert "globex_private_reason" not in html
    html = signed_in(auditor).get(f"/runs/{adopted.id}/").content.decode()
    assert theirs.id not in html and their_cp.id not in html and original.id not in html
    assert "a run of another tenant" in html
    html = signed_in(other_tenant_user).get(f"/runs/{theirs.id}/").content.decode()
    assert original.id not in html and adopted.id not in html


@pytest.mark.django_db
def test_it_never_names_another_tenants_checkpoint_as_where_a_run_came_from(
    lineage, globex, auditor
):
    original, _branch, _cp, _op = lineage
    theirs = Run.objects.create(conversation_id="conv_01GLOBEX", tenant=globex,
                                workflow_name="pay_invoices", workflow_version=7,
                                state_schema_version=4)
    their_cp = Checkpoint.objects.create(run=theirs, sequence=1, node="globex_private_node",
                                         state={}, state_hash="sha256:" + "b" * 64)
    # An acme branch of acme's run that names globex's checkpoint as where it came from: a
    # row from before operations 0025 (or written with its trigger off).
    with triggers_off(Run):
        stray = Run.objects.create(
            conversation_id="conv_01TEST", tenant=original.tenant, workflow_name="pay_invoices",
            workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH,
            parent_run=original, parent_checkpoint=their_cp, launch_reason="retry",
        )
    client = signed_in(auditor)
    for run in (stray, original):
        html = client.get(f"/runs/{run.id}/").content.decode()
        assert stray.id in html, run.id
        assert their_cp.id not in html, run.id
    # Its parent is still named, as a run of its own tenant.
    assert f'href="/runs/{original.id}/"' in client.get(f"/runs/{stray.id}/").content.decode()


@pytest.mark.django_db
def test_it_never_names_another_tenants_run_as_a_parent_on_the_lists(
    lineage, globex, auditor, other_tenant_user
):
    original, _branch, cp, _op = lineage
    # As above, from before 0025: a globex run derived from acme's, and an acme run from
    # globex's.
    with triggers_off(Run):
        theirs = Run.objects.create(
            conversation_id="conv_01GLOBEX", tenant=globex, workflow_name="pay_invoices",
            workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH,
            parent_run=original, parent_checkpoint=cp, launch_reason="debug",
        )
    their_cp = Checkpoint.objects.create(run=theirs, sequence=1, node="prepare_payment",
                                         state={}, state_hash="sha256:" + "b" * 64)
    with triggers_off(Run):
        adopted = Run.objects.create(
            conversation_id="conv_01TEST", tenant=original.tenant, workflow_name="pay_invoices",
            workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH, parent_run=theirs,
            parent_checkpoint=their_cp, launch_reason="retry",
        )
    for user, mine, conversation, not_theirs in (
        (auditor, adopted, "conv_01TEST", theirs),
        (other_tenant_user, theirs, "conv_01GLOBEX", original),
    ):
        client = signed_in(user)
        for html in (
            client.get("/runs/").content.decode(),
            client.get("/runs/", HTTP_HX_REQUEST="true").content.decode(),
            client.get(f"/runs/conversations/{conversation}/").content.decode(),
        ):
            assert mine.id in html and not_theirs.id not in html, user.username
            assert "a run of another tenant" in html
        # Nor found by the run of another tenant it names as its parent.
        html = client.get("/runs/", {"parent": not_theirs.id}).content.decode()
        assert mine.id not in html and "No runs match." in html, user.username


@pytest.mark.django_db
def test_it_shows_the_names_of_state_fields_never_their_values(acme, approver):
    run = Run.objects.create(conversation_id="conv_keys", tenant=acme,
                             workflow_name="send_reminders", workflow_version=1,
                             state_schema_version=1)
    # "keys" (what the agent looked recipients up by) is a natural name for a state field.
    Checkpoint.objects.create(
        run=run, sequence=1, node="collect_recipients",
        state={"keys": ["jane.doe@example.com", "ivan@example.org"], "step": "send"},
        state_hash="sha256:" + "a" * 64,
    )
    Checkpoint.objects.create(run=run, sequence=2, node="a_list_state",
                              state=["jane.doe@example.com"], state_hash="sha256:" + "b" * 64)
    # A state keyed by recipient or account: its names are masked as an intent's keys are.
    Checkpoint.objects.create(
        run=run, sequence=3, node="by_recipient",
        state={"jane.doe@example.com": "reminded", "40817810099910004312": "paid"},
        state_hash="sha256:" + "c" * 64,
    )
    html = signed_in(approver).get(f"/runs/{run.id}/").content.decode()
    assert "jane.doe@example.com" not in html and "ivan@example.org" not in html
    assert "40817810099910004312" not in html
    assert "keys, step" in html and "••••4312, j***@example.com" in html  # jsonb's order


@pytest.mark.django_db
def test_it_masks_an_address_or_account_in_a_launch_reason(lineage, auditor):
    original, _branch, cp, _op = lineage
    reason = "anna.smith@example.com asked to pay account 40817810099910004312 instead"
    branch = Run.objects.create(
        conversation_id="conv_01TEST", tenant=original.tenant, workflow_name="pay_invoices",
        workflow_version=7, state_schema_version=4, mode=RunMode.BRANCH, parent_run=original,
        parent_checkpoint=cp, launch_reason=reason)
    for url in (f"/runs/{branch.id}/", f"/runs/{original.id}/"):  # its page; its parent's list
        html = signed_in(auditor).get(url).content.decode()
        assert "anna.smith@example.com" not in html and "40817810099910004312" not in html
        assert "a***@example.com asked to pay account ••••4312 instead" in html, url


def _runs_at(tenant, moments) -> list[str]:
    """Runs of `tenant` started at `moments`, with the time-sortable ids the runtime gives."""
    from ulid import ULID

    runs = [
        Run(id=f"run_{ULID.from_datetime(moment)}", conversation_id="conv_01LOAD",
            tenant=tenant, workflow_name="pay_invoices", workflow_version=1,
            state_schema_version=1)
        for moment in moments
    ]
    Run.objects.bulk_create(runs, batch_size=5_000)
    return [run.id for run in runs]


@pytest.mark.django_db
def test_it_reads_a_page_of_runs_not_every_newer_run_of_another_tenant(
    acme, globex, operator
):
    """acme's runs are two hours old; globex, which the operator may not see, started a
    run every 3 ms since. Ordered by id alone, the page was read off the primary key back
    through every globex run first; each tenant's page now comes off (tenant, -id)."""
    from datetime import timedelta

    from django.utils import timezone

    from tests.helpers import plan_rows_read, queries_run

    now = timezone.now()
    _runs_at(globex, [now - timedelta(milliseconds=3 * i) for i in range(20_000)])
    mine = _runs_at(acme, [now - timedelta(hours=2, seconds=i) for i in range(2_000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE operations_run")
    client = signed_in(operator)

    for params in ({}, {"tenant": "acme"}):
        with queries_run() as seen:
            html = client.get("/runs/", params).content.decode()
        shown = re.findall(r'<code>(run_\w+)</code>', html)
        assert shown == mine[:PAGE_SIZE], params
        read = sum(plan_rows_read(sql, sql_params, "operations_run")
                   for sql, sql_params in seen if '"operations_run"' in sql)
        # 51 runs answer the page, and each shown run's parent is looked up: not 20,000.
        assert read <= 500, f"{read} runs read for one page ({params})"
