from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from operations.models import Attempt, AttemptKind, AttemptOutcome, Evidence, EvidenceKind
from operations.selectors import operation_timeline
from operations.selectors.timeline import TIMELINE_HEAD, TIMELINE_TAIL
from tests.helpers import page_and_query_count, signed_in, triggers_off
from tests.operations.engine_helpers import prepared_payment


def _looked_up(op, *, times: int, account_switch_at: int | None = None,
               reference_at: int | None = None) -> None:
    """`times` lookups ten seconds apart, each with its evidence written in the same instant
    (so the timeline's order of equal times is exercised throughout). `account_switch_at`:
    that lookup reached another provider account. `reference_at`: that lookup checked a
    person's reference, recorded on the evidence of the first lookup."""
    start = timezone.now() + timedelta(seconds=1)
    Attempt.objects.bulk_create([
        Attempt(
            operation=op, number=n, kind=AttemptKind.LOOKUP,
            outcome=AttemptOutcome.INCONCLUSIVE, error_class="timeout",
            started_at=start + timedelta(seconds=10 * n), finished_at=start,
            provider_account="acct_other" if n == account_switch_at else "acct_main",
        )
        for n in range(1, times + 1)
    ])
    rows = Evidence.objects.bulk_create([
        Evidence(
            operation=op, kind=EvidenceKind.LOOKUP, from_status="unknown",
            to_status="unknown", summary=f"lookup {n}: nothing conclusive",
            data={"provider_reference": "pi_typed", "attempt": reference_at}
            if n == 1 and reference_at else {},
        )
        for n in range(1, times + 1)
    ])
    with triggers_off(Evidence):
        for n, row in enumerate(rows, start=1):
            Evidence.objects.filter(id=row.id).update(
                created_at=start + timedelta(seconds=10 * n))


def _shown(html: str) -> list[str]:
    return re.findall(r'<li class="timeline-(?:attempt|evidence|webhook|audit)">', html)


@pytest.mark.django_db
def test_it_shows_a_long_timeline_s_beginning_and_its_newest_entries(acme, approver):
    op = prepared_payment(acme, invoice_id="inv_long")
    _looked_up(op, times=300, account_switch_at=40, reference_at=300)
    whole = list(operation_timeline(op, whole=True))
    assert len(whole) > 600

    shown = operation_timeline(op)
    # Exactly the whole timeline's first and last entries, in the same order, ties included.
    assert shown.head == whole[:TIMELINE_HEAD]
    assert shown.tail == whole[-TIMELINE_TAIL:]
    assert shown.left_out == len(whole) - TIMELINE_HEAD - TIMELINE_TAIL
    assert shown.head[0].title == "Intent recorded"
    # Facts kept on entries left out still shape the ones shown: the other account reached
    # by lookup 40, the reference recorded on the first lookup's evidence.
    newest_attempt = next(e for e in reversed(shown.tail) if e.kind == "attempt")
    assert newest_attempt.title == (
        "Attempt 300: lookup of the reference pi_typed → inconclusive")
    assert "account acct_main" in newest_attempt.detail

    html = signed_in(approver).get(f"/operations/{op.id}/").content.decode()
    assert len(_shown(html)) == TIMELINE_HEAD + TIMELINE_TAIL
    assert f"{shown.left_out} entries in between not shown." in html
    assert f'href="/operations/{op.id}/?timeline=whole#timeline"' in html
    assert "Attempt 300: " in html and "Attempt 150: " not in html


@pytest.mark.django_db
def test_it_names_no_account_on_a_long_timeline_whose_requests_all_reached_one(acme):
    op = prepared_payment(acme, invoice_id="inv_one_account")
    _looked_up(op, times=150)
    whole = list(operation_timeline(op, whole=True))
    shown = operation_timeline(op)
    assert shown.left_out and shown.tail == whole[-TIMELINE_TAIL:]
    assert not any("account" in entry.detail for entry in shown)


@pytest.mark.django_db
def test_it_shows_the_whole_timeline_when_asked(acme, approver):
    op = prepared_payment(acme, invoice_id="inv_long")
    _looked_up(op, times=150)
    html = signed_in(approver).get(f"/operations/{op.id}/?timeline=whole").content.decode()
    assert len(_shown(html)) == len(list(operation_timeline(op, whole=True))) > 300
    assert "not shown" not in html and "Attempt 75: " in html


@pytest.mark.django_db
def test_it_leaves_nothing_out_of_a_timeline_that_fits(acme, approver):
    op = prepared_payment(acme, invoice_id="inv_fits")
    before = len(list(operation_timeline(op, whole=True)))
    _looked_up(op, times=(TIMELINE_HEAD + TIMELINE_TAIL - before) // 2)
    whole = list(operation_timeline(op, whole=True))
    assert len(whole) in (TIMELINE_HEAD + TIMELINE_TAIL, TIMELINE_HEAD + TIMELINE_TAIL - 1)
    assert list(operation_timeline(op)) == whole
    html = signed_in(approver).get(f"/operations/{op.id}/").content.decode()
    assert len(_shown(html)) == len(whole) and "not shown" not in html


@pytest.mark.django_db
def test_it_builds_a_long_timeline_s_page_with_the_same_queries_as_a_short_one(
    acme, approver
):
    short, long = (prepared_payment(acme, invoice_id=f"inv_{n}") for n in (1, 2))
    _looked_up(short, times=120)
    _looked_up(long, times=2000)
    client = signed_in(approver)
    short_queries, short_html = page_and_query_count(client, f"/operations/{short.id}/")
    long_queries, long_html = page_and_query_count(client, f"/operations/{long.id}/")
    assert short_queries == long_queries
    assert len(_shown(short_html)) == len(_shown(long_html)) == TIMELINE_HEAD + TIMELINE_TAIL
