"""A run's mode decides what its operations may call: a replay's runtime prepares its nodes'
commands again in the new run, under keys the provider dedups nothing against, so what the
original run paid would be paid twice. Evidence replays call nothing, simulations only this
console's sandbox, live replays make irreversible effects only when their launcher may."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.roles import role_revoke
from operations.engine import operation_authorize, operation_execute, operation_prepare
from operations.intents import IntentError
from operations.models import EvidenceKind, OperationStatus, RunMode
from operations.sandbox.models import Deal, PaymentIntent
from operations.sandbox.selectors import sandbox_counts
from tests.factories import CheckpointFactory, RunFactory
from tests.operations.engine_helpers import PAYMENT
from tests.operations.failure_helpers import payment_posts

S = OperationStatus
DEAL = {"name": "Acme renewal", "amount_minor": 500000, "currency": "EUR",
        "owner": "anna@acme.test"}

pytestmark = pytest.mark.django_db(transaction=True)


def _paid_in_the_original(acme, approver):
    checkpoint = CheckpointFactory(run=RunFactory(tenant=acme))
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                           run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_pay_01")
    _approved_and_executed(op, approver)
    assert op.status == S.SUCCEEDED and PaymentIntent.objects.count() == 1
    return checkpoint


def _approved_and_executed(op, approver):
    if not op.authorized_hash:  # the policy lets small deals through unapproved
            operation_authorize(operation_id=op.id, approved_hash=op.payload_hash,
                            policy_version=op.policy_version, approved_by=approver,
                            expires_at=timezone.now() + timedelta(minutes=30))
    report = operation_execute(operation_id=op.id)
    op.refresh_from_db()
    return report


def _replay(checkpoint, mode, launched_by):
    return RunFactory(derived_from=checkpoint, mode=mode, launched_by=launched_by)


def test_it_refuses_any_intent_in_an_evidence_replay(acme, approver, admin_user, providers):
    checkpoint = _paid_in_the_original(acme, approver)
    replay = _replay(checkpoint, RunMode.EVIDENCE, admin_user)
    requests_before = sandbox_counts()["requests"]
    for action, payload in (("payments.create", PAYMENT), ("crm.create_deal", DEAL)):
        with pytest.raises(IntentError, match="evidence replay: it replays recorded outputs"):
            operation_prepare(tenant=acme, action=action, payload=payload, run=replay,
                              command_id="cmd_01")
    assert not replay.operations.exists()
    assert sandbox_counts()["requests"] == requests_before
    assert PaymentIntent.objects.count() == 1


def test_it_lets_a_simulation_call_the_sandbox_and_nothing_else(
    acme, approver, operator, providers, settings
):
    checkpoint = _paid_in_the_original(acme, approver)
    simulation = _replay(checkpoint, RunMode.SIMULATION, operator)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                           run=simulation, command_id="cmd_pay_01")
    assert _approved_and_executed(op, approver).outcome == "called"
    assert op.status == S.SUCCEEDED and PaymentIntent.objects.count() == 2

    settings.PAYMENTS_API_BASE = "https://api.payments.example/"
    with pytest.raises(IntentError, match="simulation: it calls this console's sandbox"):
        operation_prepare(tenant=acme, action="payments.create",
                          payload={**PAYMENT, "invoice_id": "inv_2"}, run=simulation,
                          command_id="cmd_pay_02")


def test_it_refuses_an_irreversible_effect_in_a_live_replay_whose_launcher_may_not(
    acme, globex, approver, operator, other_tenant_user, providers
):
    checkpoint = _paid_in_the_original(acme, approver)
    # The operator replays runs but holds no replay_live_irreversible; the other tenant's
    # admin holds it on globex only; a replay launched by no one holds it nowhere.
    for launcher in (operator, other_tenant_user, None):
        live = _replay(checkpoint, RunMode.LIVE, launcher)
        with pytest.raises(IntentError, match="may not make an irreversible effect"):
            operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT,
                              run=live, command_id="cmd_pay_01")
        # A deal is created under a unique field that refuses a second one: not irreversible.
        deal = operation_prepare(tenant=acme, action="crm.create_deal", payload=DEAL,
                                 run=live, command_id="cmd_deal_01")
        assert _approved_and_executed(deal, approver).outcome == "called"
    assert PaymentIntent.objects.count() == 1
    assert Deal.objects.count() == 3


def test_it_makes_the_irreversible_call_of_a_live_replay_its_launcher_may_make(
    acme, approver, admin_user, providers
):
    checkpoint = _paid_in_the_original(acme, approver)
    live = _replay(checkpoint, RunMode.LIVE, admin_user)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=live,
                           command_id="cmd_pay_01")
    assert _approved_and_executed(op, approver).outcome == "called"
    assert op.status == S.SUCCEEDED and len(payment_posts(op)) == 1
    assert PaymentIntent.objects.count() == 2


def test_it_cancels_without_a_call_when_the_launcher_lost_the_permission_since(
    acme, approver, admin_user, providers
):
    checkpoint = _paid_in_the_original(acme, approver)
    live = _replay(checkpoint, RunMode.LIVE, admin_user)
    op = operation_prepare(tenant=acme, action="payments.create", payload=PAYMENT, run=live,
                           command_id="cmd_pay_01")
    role_revoke(user=admin_user, role="Admin", tenant=acme, reason="left the team")
    hash_before = op.payload_hash

    report = _approved_and_executed(op, approver)

    assert report.outcome == "cancelled" and op.status == S.CANCELLED
    assert op.error_code == "run_mode" and "live replay launched by admin" in op.error_message
    assert op.provider_calls == 0 and not payment_posts(op).exists()
    assert PaymentIntent.objects.count() == 1 and op.payload_hash == hash_before
    assert op.evidence.filter(kind=EvidenceKind.AUTHORIZATION, to_status=S.CANCELLED).exists()


def test_it_lets_a_branch_make_its_new_effects(acme, approver, operator, providers):
    checkpoint = _paid_in_the_original(acme, approver)
    branch = _replay(checkpoint, RunMode.BRANCH, operator)
    op = operation_prepare(tenant=acme, action="payments.create",
                           payload={**PAYMENT, "amount_minor": 1200000}, run=branch,
                           command_id="cmd_pay_01")
    assert _approved_and_executed(op, approver).outcome == "called"
    assert op.status == S.SUCCEEDED and PaymentIntent.objects.count() == 2


def test_it_returns_the_stored_result_when_the_original_run_continues_past_a_paid_node(
    acme, approver, providers
):
    """Continue is not a replay: the node's code runs again in the same run, and its
    command's intent is the one already paid, under the same key."""
    checkpoint = _paid_in_the_original(acme, approver)
    paid = checkpoint.run.operations.get()

    again = operation_prepare(tenant=acme, action="payments.create", payload=dict(PAYMENT),
                              run=checkpoint.run, checkpoint=checkpoint, command_id="cmd_pay_01")
    report = operation_execute(operation_id=again.id)

    paid.refresh_from_db()
    assert again.id == paid.id and again.idempotency_key == paid.idempotency_key
    assert report.outcome == "already_succeeded" and paid.status == S.SUCCEEDED
    assert paid.provider_calls == 1 and len(payment_posts(paid)) == 1
    assert PaymentIntent.objects.count() == 1
