"""Guessing passwords at the sign-in page: after LOGIN_FAILURE_LIMIT wrong ones for a
username from one address, that pair is refused for a while, the right password included."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.core.management import call_command
from django.db.models import F
from django.test import Client

from tests.factories import PASSWORD

pytestmark = pytest.mark.django_db

ELSEWHERE = "203.0.113.9"


def _sign_in(username: str, password: str, *, address: str = "127.0.0.1"):
    client = Client(REMOTE_ADDR=address)
    return client, client.post("/login/", {"username": username, "password": password})


def _signed_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


def test_it_pauses_a_username_after_five_wrong_passwords_from_one_address(approver, operator):
    for _ in range(4):
        client, response = _sign_in("approver", "guess")
        assert response.status_code == 200 and not _signed_in(client)
    client, response = _sign_in("approver", "guess")  # the fifth
    assert response.status_code == 429

    client, response = _sign_in("approver", PASSWORD)
    assert response.status_code == 429 and not _signed_in(client)
    page = response.content.decode()
    assert "Too many wrong passwords for <strong>approver</strong>" in page
    assert "paused for 15 minutes" in page
    assert "Nothing you sent was done" in page and PASSWORD not in page

    # Only that pair: another person here, and the same person elsewhere, sign in.
    client, response = _sign_in("operator", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)
    client, response = _sign_in("approver", PASSWORD, address=ELSEWHERE)
    assert response.status_code == 302 and _signed_in(client)


def test_it_starts_the_count_again_after_a_right_password(approver):
    for _ in range(4):
        _sign_in("approver", "guess")
    client, response = _sign_in("approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)
    for _ in range(4):
        _sign_in("approver", "guess")
    client, response = _sign_in("approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)


def test_it_lets_an_admin_lift_a_pause_from_the_shell(approver):
    for _ in range(5):
        _sign_in("approver", "guess")
    assert _sign_in("approver", PASSWORD)[1].status_code == 429
    call_command("axes_reset_username", "approver", stdout=io.StringIO())
    client, response = _sign_in("approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)


def _minutes_pass(minutes: int) -> None:
    """The clock moves on: every recorded failure is that much older."""
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - timedelta(minutes=minutes))


def test_it_lets_the_right_password_in_fifteen_minutes_after_the_pause_began(approver):
    """Each try during the pause, the right password included, started the 15 minutes again
    (django-axes' default), so a person who waited and tried again too early, as the page
    invites, was never let in."""
    for _ in range(5):
        _sign_in("approver", "guess")
    assert _sign_in("approver", PASSWORD)[1].status_code == 429  # paused

    _minutes_pass(10)
    assert _sign_in("approver", PASSWORD)[1].status_code == 429  # still paused
    assert _sign_in("approver", "guess")[1].status_code == 429  # a wrong one, the same

    _minutes_pass(6)  # 16 minutes after the fifth wrong password
    client, response = _sign_in("approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)


def _sign_in_through(forwarded_for: str, username: str, password: str, *,
                     front: str = "10.0.0.2"):
    client = Client(REMOTE_ADDR=front, HTTP_X_FORWARDED_FOR=forwarded_for)
    return client, client.post("/login/", {"username": username, "password": password})


def test_it_pauses_the_address_a_front_server_was_reached_from_not_the_front_server(
    approver, settings
):
    """Behind nginx every sign-in came from nginx's address: anyone's five wrong guesses
    paused the approver for everyone."""
    settings.FORWARDING_PROXIES = 1
    for _ in range(5):
        _sign_in_through("198.51.100.1", "approver", "guess")
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {"198.51.100.1"}
    assert _sign_in_through("198.51.100.1", "approver", PASSWORD)[1].status_code == 429
    # What the guesser writes into the header itself comes before nginx's entry: passed over.
    assert _sign_in_through("203.0.113.7, 198.51.100.1", "approver", PASSWORD)[1].status_code == 429
    assert _sign_in_through("junk, 198.51.100.1", "approver", PASSWORD)[1].status_code == 429
    # An unclosed quote joined the rest of the header into one entry for a quote-aware
    # parser, which dropped it and took the guesser's own entry for nginx's.
    assert _sign_in_through('203.0.113.7, ", 198.51.100.1', "approver",
                            PASSWORD)[1].status_code == 429

    client, response = _sign_in_through("198.51.100.2", "approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)


def test_it_takes_the_address_the_outermost_of_two_front_servers_was_reached_from(
    approver, settings
):
    settings.FORWARDING_PROXIES = 2
    # The balancer wrote the client, nginx the balancer; the client's own entry comes first.
    _sign_in_through("203.0.113.7, 198.51.100.1, 10.0.0.3", "approver", "guess")
    # Not through both: the connection's own address.
    _sign_in_through("198.51.100.9", "approver", "guess", front="10.0.0.4")
    assert sorted(AccessAttempt.objects.values_list("ip_address", flat=True)) == [
        "10.0.0.4", "198.51.100.1"]


def test_it_ignores_x_forwarded_for_unless_told_of_front_servers(approver):
    for n in range(5):
        _sign_in_through(f"198.51.100.{n}", "approver", "guess")
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {"10.0.0.2"}
    assert _sign_in_through("198.51.100.99", "approver", PASSWORD)[1].status_code == 429


def test_it_never_lets_a_guesser_choose_the_address_the_pause_counts(approver, settings):
    """Each guess written as coming from a fresh address, with an unclosed quote after it;
    nginx appends the address it saw: that one is paused after five, and no other."""
    settings.FORWARDING_PROXIES = 1
    for n in range(5):
        _sign_in_through(f'198.51.100.{n}, ", 203.0.113.50', "approver", "guess")
    _, response = _sign_in_through('198.51.100.9, ", 203.0.113.50', "approver", PASSWORD)
    assert response.status_code == 429
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {"203.0.113.50"}
    # The person at an address the guesser named signs in.
    client, response = _sign_in_through("198.51.100.1", "approver", PASSWORD)
    assert response.status_code == 302 and _signed_in(client)


def test_it_counts_the_front_server_s_address_for_an_entry_no_front_server_writes(
    approver, settings
):
    settings.FORWARDING_PROXIES = 1
    _sign_in_through("198.51.100.1:443", "approver", "guess")
    _sign_in_through("", "approver", "guess")
    assert list(AccessAttempt.objects.values_list("ip_address", flat=True)) == ["10.0.0.2"]
