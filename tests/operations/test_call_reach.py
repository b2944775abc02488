"""A call's reach, the latest moment its request may get to the provider, is kept with the
call: the waits that turn on it (a search's lag, test_lookup_timing; closing an operation as
never done) hold for calls made under settings that a later release shortened, as in a
rolling deploy where old workers still have calls out."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from operations import engine
from operations.engine.core import unanswered_call_lands_by
from operations.models import Attempt, AttemptKind, OperationStatus
from operations.providers.transport import send_timeout
from operations.sandbox.models import PaymentIntent
from tests.operations.engine_helpers import authorized_payment, died_mid_call

S = OperationStatus


@pytest.mark.django_db(transaction=True)
def test_it_keeps_with_each_call_the_reach_its_lease_and_timeout_gave_it(
    acme, approver, sandbox, settings
):
    settings.OPERATION_LEASE_SECONDS = 30
    settings.PROVIDER_TIMEOUT_SECONDS = 2.0
    op = authorized_payment(acme, approver)
    before = timezone.now()

    report = engine.operation_execute(operation_id=op.id)

    call = Attempt.objects.get(operation=op, kind=AttemptKind.CALL)
    assert report.status == S.SUCCEEDED and PaymentIntent.objects.count() == 1
    # The lease ran 30 s from the claim, which came after `before` and before the call row.
    assert before + timedelta(seconds=32) <= call.reach_until
    assert call.reach_until <= call.started_at + timedelta(seconds=32)
    assert not Attempt.objects.filter(kind=AttemptKind.LOOKUP, reach_until__isnull=False)


@pytest.mark.django_db
def test_it_counts_an_unanswered_call_as_landing_until_its_own_reach(acme, approver, settings):
    op = authorized_payment(acme, approver)
    claimed = timezone.now() - timedelta(seconds=20)
    op = died_mid_call(op, claimed=claimed, timeout=60)
    settings.OPERATION_LEASE_SECONDS = 5
    settings.PROVIDER_TIMEOUT_SECONDS = 1.0
    late_landing = timedelta(minutes=2)

    assert unanswered_call_lands_by(op) == claimed + timedelta(seconds=90)
    assert unanswered_call_lands_by(op, late_landing=late_landing) == (
        claimed + timedelta(seconds=90) + late_landing
    )


@pytest.mark.parametrize("seconds", [1.0, 10.0, 30.0])
def test_it_has_a_request_out_or_given_up_within_the_providers_timeout(seconds):
    timeout = send_timeout(seconds)
    # Waiting for a pooled connection, connecting, then writing the headers and the body
    # (one write each): the request leaves within `seconds` of the call, as the reach kept
    # on each call assumes. The answer may take the whole of it.
    assert timeout.pool + timeout.connect + 2 * timeout.write <= seconds
    assert timeout.read == seconds


@pytest.mark.django_db
def test_it_shows_until_when_a_call_with_no_answer_may_reach_the_provider(
    acme, approver, operator
):
    from tests.helpers import signed_in

    op = authorized_payment(acme, approver)
    claimed = timezone.now() - timedelta(seconds=20)
    op = died_mid_call(op, claimed=claimed, timeout=60)
    reach_until = claimed + timedelta(seconds=90)

    page = signed_in(operator).get(f"/operations/{op.id}/")

    assert page.status_code == 200
    assert f"no answer yet; may reach the provider until {reach_until:%H:%M:%S}" in (
        page.content.decode()
    )
