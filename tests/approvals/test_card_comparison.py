"""What an approval card compares a re-asked intent with: the last intent of its chain a
person approved, else the one it replaces."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from approvals.selectors import last_approved_ancestors
from approvals.services import approval_approve, approval_reject, approvals_expire_overdue
from operations.models import Operation
from tests.factories import UserFactory
from tests.helpers import page_and_query_count, signed_in, triggers_off

pytestmark = pytest.mark.django_db

APPROVED_ACCOUNT = "vendor_778812345"  # the fixtures' beneficiary, shown as ••••2345
CHANGED_ACCOUNT = "acct_555500009999"  # shown as ••••9999


def _expire(approval: Approval) -> None:
    """Nobody decides in time; the sweep closes it and cancels its intent."""
    Approval.objects.filter(id=approval.id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    approvals_expire_overdue()
    assert Approval.objects.get(id=approval.id).status == ApprovalStatus.EXPIRED


def _card(html: str, approval: Approval) -> str:
    card = html[html.index(f'id="card-{approval.id}"'):]
    return re.sub(r"\s+", " ", card[:card.index("</article>")])


def _second_approver(tenant):
    from console.roles import role_grant

    second = UserFactory(username="second_approver")
    role_grant(user=second, role="Approver", tenant=tenant)
    return second


def test_it_shows_a_change_from_the_last_approved_intent_after_a_changed_request_expired(
    acme, approver, prepare_payment, no_execute
):
    """The beneficiary changed after the approval; that request ran out undecided and the
    agent asked again unchanged: compared only with the expired one, the card said "Asked
    again, unchanged", and no approver ever saw the new beneficiary as a change."""
    approved = prepare_payment(acme)
    approval_approve(approval_id=approved.id, actor=approver, comment="known vendor")
    changed = prepare_payment(acme, supersedes=Operation.objects.get(id=approved.operation_id),
                              beneficiary_id=CHANGED_ACCOUNT)
    _expire(changed)
    asked_again = prepare_payment(
        acme, supersedes=Operation.objects.get(id=changed.operation_id),
        beneficiary_id=CHANGED_ACCOUNT,
    )

    html = signed_in(_second_approver(acme)).get(
        reverse("approvals:detail", args=[asked_again.id])).content.decode()
    card = _card(html, asked_again)
    assert "Asked again, unchanged" not in card
    assert "Changed, compared with the last approved intent" in card
    assert "changed: beneficiary</span>" in card
    assert re.search(r'<del class="old">[^<]*••••2345</del>', card)
    assert re.search(r'<ins class="new">[^<]*••••9999</ins>', card)
    # It names the approved intent it is compared with, and the expired request it replaces.
    assert f'href="/operations/{approved.operation_id}/"' in card
    assert f'href="/operations/{changed.operation_id}/"' in card
    assert f'href="{reverse("approvals:detail", args=[changed.id])}"' in card
    assert "expired" in card


def test_it_compares_with_the_newest_approved_intent_of_the_chain(
    acme, approver, prepare_payment, no_execute
):
    first = prepare_payment(acme)
    approval_approve(approval_id=first.id, actor=approver)
    second = prepare_payment(acme, supersedes=first.operation, amount_minor=1_350_000)
    approval_approve(approval_id=second.id, actor=approver)
    third = prepare_payment(acme, supersedes=Operation.objects.get(id=second.operation_id),
                            amount_minor=1_450_000)

    card = _card(signed_in(approver).get(reverse("approvals:queue")).content.decode(), third)
    assert '<del class="old">13,500.00 KZT</del>' in card
    assert '<ins class="new">14,500.00 KZT</ins>' in card
    assert "12,500.00 KZT" not in card
    assert "Changed, compared with the last approved intent" in card
    assert f'href="/operations/{second.operation_id}/"' in card
    assert f'href="/operations/{first.operation_id}/"' not in card


def test_it_says_asked_again_unchanged_when_the_intent_equals_the_last_approved_one(
    acme, approver, prepare_payment, no_execute
):
    """Changed, then changed back while the change waited: nothing differs from what a
    person approved, though it differs from the request it replaces."""
    approved = prepare_payment(acme)
    approval_approve(approval_id=approved.id, actor=approver)
    changed = prepare_payment(acme, supersedes=approved.operation, beneficiary_id=CHANGED_ACCOUNT)
    _expire(changed)
    back = prepare_payment(acme, supersedes=Operation.objects.get(id=changed.operation_id))
    assert back.payload_hash == approved.payload_hash != changed.payload_hash

    card = _card(signed_in(approver).get(reverse("approvals:queue")).content.decode(), back)
    assert "Asked again, unchanged, compared with the last approved intent" in card
    assert 'class="dense diff"' not in card and "changed:" not in card


@pytest.mark.parametrize("changes", [{"amount_minor": 1_150_000}, {}],
                         ids=["changed", "asked-again-unchanged"])
def test_it_compares_with_the_intent_it_replaces_when_none_was_approved(
    acme, approver, prepare_payment, no_execute, changes
):
    rejected = prepare_payment(acme)
    approval_reject(approval_id=rejected.id, actor=approver, reason="wrong amount")
    changed = prepare_payment(acme, supersedes=rejected.operation, beneficiary_id=CHANGED_ACCOUNT)
    _expire(changed)
    again = prepare_payment(acme, supersedes=Operation.objects.get(id=changed.operation_id),
                            beneficiary_id=CHANGED_ACCOUNT, **changes)

    card = _card(signed_in(approver).get(reverse("approvals:queue")).content.decode(), again)
    heading = "Changed" if changes else "Asked again, unchanged"
    assert f"{heading}, compared with the intent it replaces" in card
    assert "No intent it replaces was ever approved" in card
    assert f'href="/operations/{changed.operation_id}/"' in card
    assert f'href="/operations/{rejected.operation_id}/"' not in card
    assert ('<ins class="new">11,500.00 KZT</ins>' in card) == bool(changes)
    assert "••••2345" not in card  # the rejected intent's beneficiary: not what it is compared with


def test_it_never_says_asked_again_unchanged_of_an_intent_whose_hash_differs(
    acme, approver, prepare_payment, no_execute
):
    """Equal in every field the card shows is not the same intent: the approval binds to
    the hash."""
    old = prepare_payment(acme)
    again = prepare_payment(acme, supersedes=old.operation)
    with triggers_off(Operation):
        Operation.objects.filter(id=old.operation_id).update(payload_hash="sha256:" + "0" * 64)

    card = _card(signed_in(approver).get(reverse("approvals:queue")).content.decode(), again)
    assert "Asked again, unchanged" not in card
    assert "Changed, compared with the intent it replaces" in card
    assert "No field shown here differs, but the two intents' hashes do" in card


def test_it_never_compares_with_an_approved_intent_of_another_tenant(
    acme, globex, approver, other_tenant_user, prepare_payment, no_execute
):
    """A supersedes link into another tenant (a row from before operations 0016, or written
    with its trigger off) ends the chain: the card shows nothing of that tenant's intent."""
    theirs = prepare_payment(globex, beneficiary_id="acct_777700001111")
    approval_approve(approval_id=theirs.id, actor=other_tenant_user)
    ours = prepare_payment(acme)
    with triggers_off(Operation):
        Operation.objects.filter(id=ours.operation_id).update(supersedes_id=theirs.operation_id)
    again = prepare_payment(acme, supersedes=Operation.objects.get(id=ours.operation_id),
                            amount_minor=1_350_000)

    assert last_approved_ancestors([again.operation]) == {}
    html = signed_in(approver).get(
        reverse("approvals:detail", args=[again.id])).content.decode()
    assert theirs.operation_id not in html and "••••1111" not in html
    card = _card(html, again)
    assert "Changed, compared with the intent it replaces" in card
    assert f'href="/operations/{ours.operation_id}/"' in card


def test_it_finds_the_newest_approved_ancestor_of_each_within_its_bound(
    acme, approver, prepare_payment, no_execute
):
    approved = prepare_payment(acme)
    approval_approve(approval_id=approved.id, actor=approver)
    chain = [approved]
    for n in range(3):
        chain.append(prepare_payment(
            acme, supersedes=Operation.objects.get(id=chain[-1].operation_id),
            amount_minor=1_300_000 + n,
        ))
    unrelated = prepare_payment(acme, invoice_id="inv_other")
    ops = [Operation.objects.get(id=a.operation_id) for a in (chain[-1], chain[1], unrelated)]

    with CaptureQueriesContext(connection) as queries:
        found = last_approved_ancestors(ops)
    assert {op_id: op.id for op_id, op in found.items()} == {
        chain[-1].operation_id: approved.operation_id,
        chain[1].operation_id: approved.operation_id,
    }
    assert len(queries) <= 2
    # Three generations back: a walk bounded to two finds none.
    assert last_approved_ancestors(ops[:1], limit=2) == {}
    assert chain[-1].operation_id in last_approved_ancestors(ops[:1], limit=3)
    # A corrupt cycle is cut by the bound, not followed for ever.
    with triggers_off(Operation):
        Operation.objects.filter(id=approved.operation_id).update(
            supersedes_id=chain[-1].operation_id
        )
    found = last_approved_ancestors([Operation.objects.get(id=chain[-1].operation_id)])
    assert found[chain[-1].operation_id].id == approved.operation_id


def test_it_reads_every_cards_comparison_in_the_same_queries_for_any_page_and_depth(
    acme, approver, prepare_payment, no_execute
):
    client = signed_in(approver)

    def queue() -> tuple[int, str]:
        return page_and_query_count(client, reverse("approvals:queue"))

    prepare_payment(acme, invoice_id="inv_first")
    queue()  # per-process caches
    counts, last = [], []
    for n in range(3):
        head = prepare_payment(acme, invoice_id=f"inv_{n}")
        approval_approve(approval_id=head.id, actor=approver)
        # Each chain one generation deeper than the last (every one has a request that ran
        # out among the decided cards, which the queue reads apart from the pending ones).
        for depth in range(n + 2):
            if depth:
                _expire(head)  # a changed request that ran out, asked again changed
            head = prepare_payment(
                acme, supersedes=Operation.objects.get(id=head.operation_id),
                invoice_id=f"inv_{n}", amount_minor=1_300_000 + depth,
            )
        last.append(head)
        count, html = queue()
        counts.append(count)
        for approval in last:
            assert "Changed, compared with the last approved intent" in _card(html, approval)
    assert counts[0] == counts[1] == counts[2], counts
