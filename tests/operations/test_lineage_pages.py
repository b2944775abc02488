"""An operation's lineage (its run, checkpoint, the intent it replaces and the one that
replaced it) on its page and its approval card: only within its tenant. Prepare and, since
operations 0016, a trigger keep it there; a row from before that stays, being immutable."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.services import approvals_supersede_for
from operations.engine import operation_prepare
from operations.models import Checkpoint, Operation, Run, RunMode
from tests.helpers import signed_in, triggers_off

pytestmark = pytest.mark.django_db

ACME_PAYMENT = {"invoice_id": "inv_ACME_1", "beneficiary_id": "acct_4081781009991000777",
                "amount_minor": 7_777_700, "currency": "KZT"}
GLOBEX_PAYMENT = {"invoice_id": "inv_GLOBEX_1", "beneficiary_id": "acct_4081781009991000999",
                  "amount_minor": 1_250_000, "currency": "KZT"}


def globex_row_by_hand(globex, op_id: str, **lineage) -> tuple[Operation, Approval]:
    """A globex payment whose lineage names acme's objects, with its approval request."""
    op = operation_prepare(tenant=globex, action="payments.create",
                           payload={**GLOBEX_PAYMENT, "invoice_id": f"inv_{op_id}"})
    op.pk, op.idempotency_key = op_id, f"ik_{op_id}"  # a copy of it, by hand
    for name, value in lineage.items():
        setattr(op, name, value)
    # As a row from before operations 0016 (or written with its trigger off) is.
    with triggers_off(Operation):
        op.save(force_insert=True)
    approval = Approval.objects.create(
        operation=op, payload_hash=op.payload_hash, policy_version=op.policy_version,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    return op, approval


def test_it_never_shows_another_tenants_replaced_intent_or_its_requests(
    acme, globex, approver, other_tenant_user
):
    mine = operation_prepare(tenant=acme, action="payments.create", payload=ACME_PAYMENT)
    mine_approval = Approval.objects.get(operation=mine)
    Approval.objects.filter(id=mine_approval.id).update(
        status=ApprovalStatus.REJECTED, decided_by=approver, decided_at=timezone.now(),
        comment="acme_private_rejection_reason",
    )
    stray, stray_approval = globex_row_by_hand(globex, "op_STRAY1", supersedes=mine)
    client = signed_in(other_tenant_user)
    for url in (f"/approvals/{stray_approval.id}/", "/approvals/", f"/operations/{stray.id}/"):
        html = client.get(url).content.decode()
        assert stray.id in html or stray_approval.id in html, url
        assert mine.id not in html and mine_approval.id not in html, url
        assert "acme_private_rejection_reason" not in html, url
        assert "77,777.00" not in html, url  # acme's amount, in a diff
    # Nor the other way: acme's people are not told which globex intent replaced theirs.
    html = signed_in(approver).get(f"/operations/{mine.id}/").content.decode()
    assert mine.id in html and stray.id not in html


def test_it_never_names_another_tenants_run_or_checkpoint(acme, globex, other_tenant_user):
    acme_run = Run.objects.create(conversation_id="conv_01ACMEPRIVATE", tenant=acme,
                                  workflow_name="pay_invoices", workflow_version=1,
                                  state_schema_version=1)
    acme_cp = Checkpoint.objects.create(run=acme_run, sequence=1, node="acme_private_node",
                                        state={}, state_hash="sha256:" + "c" * 64)
    stray, stray_approval = globex_row_by_hand(globex, "op_STRAY2", run=acme_run,
                                               checkpoint=acme_cp)
    client = signed_in(other_tenant_user)
    for url in (f"/operations/{stray.id}/", f"/approvals/{stray_approval.id}/", "/approvals/"):
        html = client.get(url).content.decode()
        assert stray.id in html or stray_approval.id in html, url
        for private in (acme_run.id, acme_cp.id, "conv_01ACMEPRIVATE", "acme_private_node"):
            assert private not in html, (url, private)


def test_it_never_names_on_an_approval_card_the_other_tenants_intent_that_replaced_it(
    acme, globex, approver
):
    mine = operation_prepare(tenant=acme, action="payments.create", payload=ACME_PAYMENT)
    mine_approval = Approval.objects.get(operation=mine)
    # A globex intent written as replacing acme's; acme's request was closed as superseded
    # by it, needing no approval of its own.
    stray, _ = globex_row_by_hand(globex, "op_STRAY9", supersedes=mine)
    approvals_supersede_for(operation=mine, new_approval=None)
    client = signed_in(approver)
    assert stray.id not in client.get(f"/operations/{mine.id}/").content.decode()
    for url in (f"/approvals/{mine_approval.id}/", "/approvals/"):
        html = client.get(url).content.decode()
        assert mine_approval.id in html, url
        assert stray.id not in html, url
        assert "this approval can no longer be used" in html, url


def test_it_never_links_an_approval_card_to_another_tenants_approval_request(
    acme, globex, approver
):
    mine = operation_prepare(tenant=acme, action="payments.create", payload=ACME_PAYMENT)
    mine_approval = Approval.objects.get(operation=mine)
    _, stray_approval = globex_row_by_hand(globex, "op_STRAY8", supersedes=mine)
    approvals_supersede_for(operation=mine, new_approval=stray_approval)
    client = signed_in(approver)
    for url in (f"/approvals/{mine_approval.id}/", "/approvals/"):
        html = client.get(url).content.decode()
        assert mine_approval.id in html, url
        assert stray_approval.id not in html, url


def test_it_shows_a_lineage_within_the_tenant(acme, approver):
    run = Run.objects.create(conversation_id="conv_01ACME", tenant=acme,
                             workflow_name="pay_invoices", workflow_version=1,
                             state_schema_version=1)
    cp = Checkpoint.objects.create(run=run, sequence=1, node="prepare_payment", state={},
                                   state_hash="sha256:" + "d" * 64)
    old = operation_prepare(tenant=acme, action="payments.create", payload=ACME_PAYMENT,
                            run=run, checkpoint=cp, command_id="cmd_pay")
    new = operation_prepare(tenant=acme, action="payments.create",
                            payload={**ACME_PAYMENT, "amount_minor": 7_000_000},
                            run=run, checkpoint=cp, command_id="cmd_pay", supersedes=old)
    client = signed_in(approver)
    html = client.get(f"/operations/{new.id}/").content.decode()
    assert run.id in html and cp.id in html and "prepare_payment" in html and old.id in html
    assert new.id in client.get(f"/operations/{old.id}/").content.decode()  # superseded by
    approval = Approval.objects.get(operation=new)
    html = client.get(f"/approvals/{approval.id}/").content.decode()
    assert run.id in html and "conv_01ACME" in html and "77,777.00" in html  # the diff
    assert Approval.objects.get(operation=old).id in html  # the replaced intent's request


def test_it_leads_from_an_operation_to_its_runs_page_and_where_that_run_came_from(
    acme, globex, auditor, operator
):
    """The page linked its run only to the journal filtered by it, which shows no run: an
    auditor following an effect back could not reach the run's checkpoints, parent and
    derived runs from it, nor learn that the run was a replay or a branch."""
    original = Run.objects.create(conversation_id="conv_01ACME", tenant=acme,
                                  workflow_name="pay_invoices", workflow_version=1,
                                  state_schema_version=1)
    cp = Checkpoint.objects.create(run=original, sequence=1, node="prepare_payment",
                                   state={}, state_hash="sha256:" + "d" * 64)
    branch = Run.objects.create(conversation_id="conv_01ACME", tenant=acme,
                                workflow_name="pay_invoices", workflow_version=1,
                                state_schema_version=1, mode=RunMode.BRANCH,
                                parent_run=original, parent_checkpoint=cp,
                                launch_reason="changed amount", launched_by=operator)
    op = operation_prepare(tenant=acme, action="payments.create", payload=ACME_PAYMENT,
                           run=branch, command_id="cmd_pay")
    client = signed_in(auditor)
    html = client.get(f"/operations/{op.id}/").content.decode()
    assert f'href="/runs/{branch.id}/"' in html
    assert f'href="/operations/?run={branch.id}"' in html  # the journal beside it
    assert "Branch with change" in html and f'href="/runs/{original.id}/"' in html
    first = operation_prepare(tenant=acme, action="payments.create", run=original,
                              payload={**ACME_PAYMENT, "invoice_id": "inv_first"},
                              command_id="cmd_pay")
    html = client.get(f"/operations/{first.id}/").content.decode()
    assert f'href="/runs/{original.id}/"' in html and "Run derived from" not in html

    # A run derived from another tenant's (a row from before operations 0025) names it not.
    theirs = Run.objects.create(conversation_id="conv_01GLOBEX", tenant=globex,
                                workflow_name="pay_invoices", workflow_version=1,
                                state_schema_version=1)
    their_cp = Checkpoint.objects.create(run=theirs, sequence=1, node="globex_node",
                                         state={}, state_hash="sha256:" + "b" * 64)
    with triggers_off(Run):
        adopted = Run.objects.create(
            conversation_id="conv_01ACME", tenant=acme, workflow_name="pay_invoices",
            workflow_version=1, state_schema_version=1, mode=RunMode.BRANCH,
            parent_run=theirs, parent_checkpoint=their_cp, launch_reason="retry")
    stray = operation_prepare(tenant=acme, action="payments.create", run=adopted,
                              payload={**ACME_PAYMENT, "invoice_id": "inv_adopted"},
                              command_id="cmd_pay")
    html = client.get(f"/operations/{stray.id}/").content.decode()
    assert f'href="/runs/{adopted.id}/"' in html and "a run of another tenant" in html
    assert theirs.id not in html and their_cp.id not in html


def test_it_reads_the_lineage_of_every_card_on_the_queue_in_the_same_queries(
    acme, approver
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queue_queries() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get("/approvals/").status_code == 200
        return len(queries)

    client = signed_in(approver)
    queue_queries()  # the first request fills per-process caches (content types)
    counts = []
    for n in range(3):
        run = Run.objects.create(conversation_id=f"conv_{n}", tenant=acme,
                                 workflow_name="pay_invoices", workflow_version=1,
                                 state_schema_version=1)
        cp = Checkpoint.objects.create(run=run, sequence=1, node="prepare_payment", state={},
                                       state_hash="sha256:" + "e" * 64)
        old = operation_prepare(tenant=acme, action="payments.create", run=run, checkpoint=cp,
                                payload={**ACME_PAYMENT, "invoice_id": f"inv_{n}"},
                                command_id="cmd_pay")
        operation_prepare(tenant=acme, action="payments.create", run=run, checkpoint=cp,
                          payload={**ACME_PAYMENT, "invoice_id": f"inv_{n}",
                                   "amount_minor": 7_000_000},
                          command_id="cmd_pay", supersedes=old)
        counts.append(queue_queries())
    assert counts[0] == counts[1] == counts[2]
