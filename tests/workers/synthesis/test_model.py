"""Model-driven generation over HTTP: a scripted OpenAI-compatible server (deterministic replies
that are right or wrong on purpose) and Crucible's own inference server with a tiny random model
(its junk must be rejected with reasons)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.synthesis import SynthesisError, parse_config, synthesize


def _reply(model: str, prompt: str) -> str:
    if model == "paraphrase":
        problem = prompt.split("Problem: ", 1)[1]
        return f"Here is the task, reworded: {problem}"
    if model in ("distract-good", "distract-bad"):
        answer = int(re.search(r"Correct answer: (-?\d+)", prompt).group(1))
        first = answer if model == "distract-bad" else answer + 1
        return f"1. {first}\n2. {answer + 2}\n3. {answer - 3}"
    if model in ("new-good", "new-wrong"):
        example = json.loads(prompt.split("Example: ", 1)[1])
        example["problem"]["numbers"] = [n * 3 for n in example["problem"]["numbers"]]
        answer = int(example["answer"]) * 3 + (model == "new-wrong")
        question = "Find the greatest common divisor of " + ", ".join(
            map(str, example["problem"]["numbers"])) + "."
        return "Sure! " + json.dumps({"question": question, "problem": example["problem"],
                                      "answer": str(answer)})
    return "I cannot help with that."


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != \
                "Bearer k":
            self.send_response(401)
            self.end_headers()
            return
        text = _reply(body["model"], body["messages"][-1]["content"])
        data = json.dumps({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def scripted() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _run(url: str, model: str, mode: str, topics: list[str], count: int = 3, key: str = "k"):
    return synthesize(parse_config({"seed": 2, "workers": 1, "generators": [
        {"kind": "model", "mode": mode, "count": count, "topics": topics, "difficulties": [1],
         "endpoint": {"base_url": url, "model": model, "api_key": key}}]}))


def _reasons(batch) -> dict[str, int]:
    out: dict[str, int] = {}
    for stage in batch.manifest["stages"]:
        for reason, n in stage["reasons"].items():
            out[reason] = out.get(reason, 0) + n
    return out


def test_paraphrases_that_keep_the_problem_are_accepted(scripted: str) -> None:
    batch = _run(scripted, "paraphrase", "paraphrase", ["linear", "gcd", "arithmetic"])
    assert len(batch.records) == 3, batch.rejected
    record = batch.records[0]
    assert record["question"].startswith("Here is the task, reworded:")
    assert record["provenance"]["generator"] == "model/paraphrase"
    assert record["provenance"]["response"] == record["question"]
    assert "k" not in json.dumps(batch.manifest["config"]["generators"][0]["endpoint"]["api_key"])


def test_distractors_must_be_wrong(scripted: str) -> None:
    good = _run(scripted, "distract-good", "distractors", ["gcd"], count=2)
    assert len(good.records) == 2, good.rejected
    assert all(len(r["choices"]) == 4 and r["answer"] in r["choices"] for r in good.records)
    bad = _run(scripted, "distract-bad", "distractors", ["gcd"], count=2)
    assert bad.records == [] and _reasons(bad) == {"logic:distractor_is_correct": 2}


def test_new_problems_are_verified_by_re_derivation(scripted: str) -> None:
    good = _run(scripted, "new-good", "new", ["gcd"], count=2)
    assert len(good.records) == 2, good.rejected
    wrong = _run(scripted, "new-wrong", "new", ["gcd"], count=2)
    assert wrong.records == [] and _reasons(wrong) == {"logic:answer_mismatch": 2}
    junk = _run(scripted, "anything", "new", ["gcd"], count=1)
    assert _reasons(junk) == {"syntax:not_json": 1}


def test_an_unreachable_or_refusing_endpoint_fails_the_run(scripted: str) -> None:
    with pytest.raises(SynthesisError, match="answered no request: HTTP 401"):
        _run(scripted, "paraphrase", "paraphrase", ["gcd"], count=1, key="wrong")
    with pytest.raises(SynthesisError, match="answered no request"):
        _run("http://127.0.0.1:9/v1", "m", "paraphrase", ["gcd"], count=1)


@pytest.mark.slow
def test_junk_from_our_inference_server_is_rejected_with_reasons(tmp_path) -> None:
    """A tiny random-init checkpoint served by workers.inference writes junk: every item fails
    verification, each with a stated reason."""
    torch = pytest.importorskip("torch")
    from workers.inference import start_server
    from workers.rl.model import build_policy
    from workers.rl.objectives import build_objective
    from workers.rl.spec import ArithmeticSpec, ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    tok = train_bpe(build_objective(ArithmeticSpec()).corpus(), vocab_size=96)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=1, max_position_embeddings=512)),
                         len(tok),
                         tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    torch.set_num_threads(1)
    with start_server(tmp_path, name="tiny") as srv:
        endpoint = {"base_url": srv.url, "model": "tiny", "max_tokens": 12, "temperature": 1.0}
        batch = synthesize(parse_config({"seed": 4, "workers": 1, "generators": [
            {"kind": "model", "mode": mode, "count": 1, "topics": ["linear"],
             "difficulties": [1], "endpoint": endpoint}
            for mode in ("paraphrase", "new")]}))
    # paraphrase and new need the problem restated exactly: junk never passes. (Random text
    # can pass as three wrong distractors when it parses as numbers, so that mode is not here.)
    assert batch.records == []
    assert len(batch.rejected) == 2
    for item in batch.rejected:
        assert item["rejected"]["stage"] in ("syntax", "logic")
        assert item["rejected"]["reason"] and item["provenance"]["response"] is not None


def test_distractor_lines_lose_bullets_but_keep_signs_and_decimals() -> None:
    from workers.synthesis.model_items import _choices

    assert _choices("1. 3.5\n- -3\n\n-4\n(b) x**2\n") == ["3.5", "-3", "-4"]
