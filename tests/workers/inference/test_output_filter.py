"""Served completions through the output filter (``--output-filter``). The tiny model
writes no secrets of its own, so the planted ones come back through ``echo`` (the prompt is
part of the choice's text): flag marks the choice, redact replaces the findings (and drops
the logprobs and token ids that would spell them out), block empties the choice with
finish_reason ``content_filter``; streams under redact and block are sent once complete."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.workers.filtering.planted import AWS_KEY, EMAIL, GITHUB_TOKEN, LEAKY
from tests.workers.inference.conftest import KEY
from workers.filtering import Mode

KINDS = ["aws-access-key", "email", "github-token"]
# Short enough for the tiny model's 128-token context (one token per character here).
PLANTED = f"{AWS_KEY} {GITHUB_TOKEN} {EMAIL} "
ECHO = {"model": "tiny", "prompt": PLANTED, "echo": True, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as c:
        yield c


@pytest.fixture
def mode(server):
    """Set the running server's filter mode for one test (then back to off)."""
    config = server.openai_app.config

    def use(value: str) -> None:
        config.output_filter = Mode(value)

    yield use
    config.output_filter = Mode.OFF


def events(response: httpx.Response) -> list[dict]:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line.removeprefix("data: ")))
    return out


def test_off_serves_the_text_as_generated(http, mode):
    mode("off")
    r = http.post("/completions", json=ECHO)
    choice = r.json()["choices"][0]
    assert r.headers["x-crucible-filter"] == "off"
    assert choice["text"].startswith(PLANTED) and "filter" not in choice


def test_flag_serves_the_text_and_marks_the_choice(http, mode):
    mode("flag")
    choice = http.post("/completions", json=ECHO).json()["choices"][0]
    assert choice["text"].startswith(PLANTED)
    assert choice["filter"] == {"action": "flag", "kinds": KINDS}
    assert choice["token_ids"]  # flag takes nothing away
    # A live stream carries the flag on the choice's last chunk.
    r = http.post("/completions", json={**ECHO, "stream": True})
    chunks = events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(PLANTED)
    assert chunks[-1]["choices"][0]["filter"] == {"action": "flag", "kinds": KINDS}


def test_redact_replaces_findings_and_drops_what_would_spell_them(http, mode):
    mode("redact")
    r = http.post("/completions", json=ECHO)  # (echo takes no logprobs on this server)
    choice = r.json()["choices"][0]
    assert r.headers["x-crucible-filter"] == "redact"
    assert choice["text"].startswith("[REDACTED:aws-access-key] [REDACTED:github-token] "
                                     "[REDACTED:email] ")
    for secret in (AWS_KEY, GITHUB_TOKEN, EMAIL):
        assert secret not in r.text
    assert choice["logprobs"] is None and "token_ids" not in choice
    assert choice["filter"] == {"action": "redact", "kinds": KINDS}
    # A stream is held until the choice is complete, then sent redacted.
    streamed = http.post("/completions", json={**ECHO, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert AWS_KEY not in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    chunks = events(streamed)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == choice["text"]
    assert chunks[-2]["choices"][0]["filter"]["action"] == "redact"
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def test_block_empties_the_choice_with_content_filter(http, mode):
    mode("block")
    body = http.post("/completions", json={**ECHO, "n": 2, "temperature": 1.0,
                                           "seed": 1}).json()
    for choice in body["choices"]:
        assert (choice["text"], choice["finish_reason"]) == ("", "content_filter")
        assert choice["filter"] == {"action": "block", "kinds": KINDS}
    chunks = events(http.post("/completions", json={**ECHO, "stream": True}))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "content_filter"]
    assert chunks[0]["choices"][0]["text"] == ""


def test_clean_text_passes_every_mode_unchanged(http, mode):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "2+5="}],
            "max_tokens": 6, "temperature": 0, "logprobs": True}
    mode("off")
    plain = http.post("/chat/completions", json=chat).json()["choices"][0]
    for value in ("flag", "redact", "block"):
        mode(value)
        choice = http.post("/chat/completions", json=chat).json()["choices"][0]
        # No finding: same text, tokens and finish, no filter field. Logprobs agree to float
        # rounding only: the continuous engine serves a repeated prompt from its prefix cache,
        # whose keys were computed in another batch shape.
        assert choice.keys() == plain.keys()
        assert (choice["message"], choice["finish_reason"]) == \
            (plain["message"], plain["finish_reason"])
        got, want = choice["logprobs"]["content"], plain["logprobs"]["content"]
        assert [t["token"] for t in got] == [t["token"] for t in want]
        assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want],
                                                            abs=1e-4)
        chunks = events(http.post("/chat/completions", json={**chat, "stream": True}))
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
            plain["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == plain["finish_reason"]


def test_a_chat_choice_with_a_finding_under_each_mode(server, mode):
    """The chat shape of the same rule (the tiny model cannot be made to write a key)."""
    oa = server.openai_app
    for value, content, finish in (("flag", LEAKY, "stop"),
                                   ("redact", None, "stop"),
                                   ("block", "", "content_filter")):
        mode(value)
        choice = {"index": 0, "message": {"role": "assistant", "content": LEAKY},
                  "logprobs": {"content": []}, "finish_reason": "stop", "token_ids": [1]}
        oa._filter_choice(choice, choice["message"])
        assert choice["filter"] == {"action": value, "kinds": [*KINDS, "openai-token"]}
        assert choice["finish_reason"] == finish
        if content is not None:
            assert choice["message"]["content"] == content
        else:
            assert "[REDACTED:github-token]" in choice["message"]["content"]
        assert ("token_ids" in choice) == (value == "flag")


def test_the_cli_refuses_an_unknown_mode(model_dir, monkeypatch, capsys):
    from workers.inference.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--model", str(model_dir), "--output-filter", "shout"])
    assert "invalid choice" in capsys.readouterr().err
    monkeypatch.setenv("CRUCIBLE_OUTPUT_FILTER", "loud")
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--threads", "1"]) == 2
    assert "'loud' is not a valid Mode" in capsys.readouterr().err
