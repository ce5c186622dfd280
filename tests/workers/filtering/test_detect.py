"""The detector on planted secrets and addresses, and on text that has none."""

from __future__ import annotations

import pytest

from tests.workers.filtering.planted import (
    AWS_KEY,
    CLEAN,
    EMAIL,
    GITHUB_TOKEN,
    LEAKY,
    OPENAI_KEY,
    SECRETS,
)
from workers.filtering import KINDS, Mode, find, kinds_of, redact, screen_text, screen_value


@pytest.mark.parametrize(("kind", "secret"), sorted(SECRETS.items()))
def test_each_planted_secret_is_found_with_its_exact_span(kind, secret):
    text = f"before {secret} after"
    assert [(f.kind, text[f.start:f.end]) for f in find(text)] == [(kind, secret)]
    assert redact(text) == f"before [REDACTED:{kind}] after"
    assert kind in KINDS


def test_several_findings_are_redacted_in_place():
    assert redact(LEAKY) == (
        "Use the key [REDACTED:aws-access-key] with token [REDACTED:github-token]; the OpenAI "
        "key is [REDACTED:openai-token]. Questions to [REDACTED:email].")
    assert kinds_of(LEAKY) == ("aws-access-key", "email", "github-token", "openai-token")


@pytest.mark.parametrize("text", [
    CLEAN,
    "x@localhost and a@b are not addresses; neither is user@ nor @example.com",
    "git@ is half; name@example is missing its top-level domain",
    "ghp_short is too short to be a token; sk-not-a-key either",
    "The model's reply: def add(a, b):\n    return a + b\n",
    "",
])
def test_text_without_secrets_has_no_findings(text):
    assert find(text) == []
    assert redact(text) == text


def test_an_address_followed_by_generated_digits_is_still_found():
    assert redact(f"{EMAIL}42 and {EMAIL}.") == "[REDACTED:email]42 and [REDACTED:email]."


def test_an_assignment_of_an_aws_secret_redacts_the_value_not_the_name():
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    text = f'aws_secret_access_key = "{secret}"'
    assert redact(text) == 'aws_secret_access_key = "[REDACTED:aws-access-key]"'


def test_a_password_in_a_url_is_a_credential_not_an_address():
    text = "postgres://admin:hunter2secret@db.example.com/app"
    (finding,) = find(text)
    assert finding.kind == "basic-auth-credentials"
    assert "hunter2secret" not in redact(text)


def test_a_private_key_is_redacted_to_its_end_line():
    key = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx4Z\nq9Zz0c==\n"
           "-----END RSA PRIVATE KEY-----")
    out = redact(f"key:\n{key}\ndone")
    assert "MIIEow" not in out and "q9Zz0c" not in out
    assert out.endswith("[REDACTED:private-key]\ndone")


def test_modes_on_text():
    assert screen_text(LEAKY, Mode.OFF).kinds == ()
    flagged = screen_text(LEAKY, "flag")
    assert flagged.value == LEAKY and flagged.kinds and not flagged.blocked
    redacted = screen_text(LEAKY, Mode.REDACT)
    assert AWS_KEY not in redacted.value and redacted.changed and not redacted.blocked
    blocked = screen_text(LEAKY, Mode.BLOCK)
    assert blocked.blocked and blocked.value == LEAKY  # the caller refuses it
    assert not screen_text(CLEAN, Mode.BLOCK).blocked
    with pytest.raises(ValueError):
        screen_text(LEAKY, "shout")


def test_a_json_value_is_screened_in_every_string_but_not_in_keys():
    record = {"id": 7, EMAIL: "key", "messages": [{"role": "user", "content": f"hi {EMAIL}"},
                                                   {"role": "assistant", "content": GITHUB_TOKEN}],
              "meta": {"score": 0.5, "ok": True, "note": None, "key": OPENAI_KEY}}
    out = screen_value(record, Mode.REDACT)
    assert out.kinds == ("email", "github-token", "openai-token")
    assert out.value == {
        "id": 7, EMAIL: "key",
        "messages": [{"role": "user", "content": "hi [REDACTED:email]"},
                     {"role": "assistant", "content": "[REDACTED:github-token]"}],
        "meta": {"score": 0.5, "ok": True, "note": None, "key": "[REDACTED:openai-token]"}}
    assert screen_value(record, Mode.FLAG).value is record  # flag changes nothing
