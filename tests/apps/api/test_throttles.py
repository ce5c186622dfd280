"""Rate limits: password logins lock out (django-axes), API calls are throttled per token,
per worker token and per address, and guessed token secrets stop being checked at all;
every refusal is a 429 with Retry-After."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.core.actor import Actor
from apps.teams.services import personal_token_create
from tests.django_fixtures import client_for_token

LOGIN = "/accounts/login/"
ME = "/api/v1/me"


def _rates(settings, **rates: str) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE,
                         "THROTTLE_RATES": {**settings.CRUCIBLE["THROTTLE_RATES"], **rates}}


def _login(client: Client, username: str, password: str, ip: str = "10.9.8.7"):
    return client.post(LOGIN, {"username": username, "password": password},
                       REMOTE_ADDR=ip)


def _assert_429(response) -> int:
    assert response.status_code == 429, response.content[:300]
    wait = int(response["Retry-After"])
    assert wait > 0
    return wait


def test_wrong_passwords_lock_the_login_out_even_for_the_right_one(member, settings):
    client = Client()
    limit = settings.AXES_FAILURE_LIMIT
    assert limit == 10  # the shipped default
    for _ in range(limit - 1):
        assert _login(client, member.user.username, "wrong").status_code == 200  # form again
    # The last allowed failure locks; from then on even the right password is refused.
    assert _login(client, member.user.username, "wrong").status_code == 429
    locked = _login(client, member.user.username, "pw-for-tests-1")
    wait = _assert_429(locked)
    assert wait == int(settings.AXES_COOLOFF_TIME.total_seconds())
    assert "locked" in locked.content.decode()
    assert "_auth_user_id" not in client.session
    # Another address is not locked out of that account (no denial of service by name).
    other = Client()
    ok = _login(other, member.user.username, "pw-for-tests-1", ip="10.1.1.1")
    assert ok.status_code == 302 and "_auth_user_id" in other.session


def test_a_few_wrong_passwords_do_not_lock_and_success_resets_the_count(member):
    client = Client()
    for _ in range(5):
        assert _login(client, member.user.username, "wrong").status_code == 200
    assert _login(client, member.user.username, "pw-for-tests-1").status_code == 302
    for _ in range(5):
        assert _login(Client(), member.user.username, "wrong").status_code == 200
    assert _login(Client(), member.user.username, "pw-for-tests-1").status_code == 302


def test_guessed_token_secrets_are_throttled_per_address(member, settings):
    _rates(settings, auth_failure="5/min")
    prefix = member.token.split("_")[1]
    for i in range(5):
        guess = client_for_token(f"crc_{prefix}_guess{i}")
        assert guess.get(ME, REMOTE_ADDR="10.0.0.66").status_code == 401
    refused = client_for_token(f"crc_{prefix}_guess-more").get(ME, REMOTE_ADDR="10.0.0.66")
    _assert_429(refused)
    assert refused.json()["code"] == "throttled"
    # While the address is over its limit even the real secret is not checked from there...
    _assert_429(member.client.get(ME, REMOTE_ADDR="10.0.0.66"))
    # ...but it works from elsewhere, and revoked/expired tokens do not count as guesses.
    assert member.client.get(ME, REMOTE_ADDR="10.0.0.67").status_code == 200


def test_api_calls_are_throttled_per_token(member, settings):
    _rates(settings, user="5/min")
    for _ in range(5):
        assert member.client.get(ME).status_code == 200
    wait = _assert_429(member.client.get(ME))
    assert wait <= 60
    # A second token of the same user has its own allowance; other users are unaffected.
    _, raw = personal_token_create(actor=Actor.of_user(member.user), user=member.user,
                                   name="second")
    assert client_for_token(raw).get(ME).status_code == 200


def test_sessions_are_throttled_per_user(member, settings):
    _rates(settings, user="3/min")
    browser = Client()
    browser.force_login(member.user)
    for _ in range(3):
        assert browser.get(ME).status_code == 200
    _assert_429(browser.get(ME))


def test_worker_tokens_have_their_own_rate(worker, member, settings):
    _rates(settings, worker="4/min", user="1000/min")
    for _ in range(4):
        assert worker.get(ME).status_code == 200
    _assert_429(worker.get(ME))
    assert member.client.get(ME).status_code == 200


def test_anonymous_calls_are_throttled_per_address(db, settings):
    _rates(settings, anon="3/min")
    anon = Client()
    for _ in range(3):
        assert anon.get(ME, REMOTE_ADDR="10.0.0.5").status_code in (401, 403)
    _assert_429(anon.get(ME, REMOTE_ADDR="10.0.0.5"))
    assert anon.get(ME, REMOTE_ADDR="10.0.0.6").status_code in (401, 403)


@pytest.mark.parametrize(("proxies", "expected_locked"), [(0, "10.0.0.9"), (1, "203.0.113.7")])
def test_forwarded_for_is_trusted_only_behind_configured_proxies(db, settings, proxies,
                                                                 expected_locked):
    """With no trusted proxy a client cannot dodge the limit by inventing X-Forwarded-For;
    behind one, the proxy-reported address is what is limited."""
    settings.CRUCIBLE = {**settings.CRUCIBLE, "TRUSTED_PROXIES": proxies}
    _rates(settings, anon="2/min")
    anon = Client()
    for n in range(2):
        anon.get(ME, REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}, "
                                                                  "203.0.113.7")
    third = anon.get(ME, REMOTE_ADDR="10.0.0.9", HTTP_X_FORWARDED_FOR="198.51.100.99, "
                                                                     "203.0.113.7")
    _assert_429(third)
    # The locked identity is the one the configuration names; a fresh one is allowed.
    fresh_remote = anon.get(ME, REMOTE_ADDR="10.0.0.10", HTTP_X_FORWARDED_FOR="203.0.113.7")
    if expected_locked == "10.0.0.9":
        assert fresh_remote.status_code in (401, 403)
    else:
        assert fresh_remote.status_code == 429
