"""Model-driven items: an OpenAI-compatible endpoint paraphrases verified problems, writes
multiple-choice distractors for them, or writes new problems; all of it is verified like any item.

The model's text is untrusted: replies are length-capped, expressions go through the whitelist
parser of `math_verify`, and a reply that does not verify is rejected with its reason.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import httpx

from .items import MathTask, Outcome, math_outcome
from .math_verify import Reject, _same, parse, verify
from .spec import Endpoint, ModelGenerator

_MAX_REPLY = 4000
_BULLET = re.compile(r"^\s*(?:[-*•]|\(?[0-9a-dA-D][.)])\s+")  # "1. ", "- ", "(a) "; not "-3"


class EndpointError(RuntimeError):
    """The endpoint did not answer with a chat completion."""


class ChatClient:
    """Minimal OpenAI chat-completions client (POST {base_url}/chat/completions)."""

    def __init__(self, endpoint: Endpoint) -> None:
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self.endpoint = endpoint
        self.http = httpx.Client(base_url=endpoint.base_url.rstrip("/"), headers=headers,
                                 timeout=endpoint.timeout_s)

    def complete(self, prompt: str, seed: int) -> str:
        body = {"model": self.endpoint.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.endpoint.max_tokens,
                "temperature": self.endpoint.temperature, "seed": seed % (2**31)}
        try:
            response = self.http.post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise EndpointError(f"HTTP {response.status_code}: {response.text[:300]}")
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"not a chat completion: {response.text[:300]}") from None
        if not isinstance(content, str):
            raise EndpointError("the completion has no text content")
        return content[:_MAX_REPLY]

    def close(self) -> None:
        self.http.close()


@dataclass(frozen=True)
class ModelTask:
    index: int
    generator: int
    topic: str
    difficulty: int
    seed: int


def prompt_for(mode: str, base: dict[str, Any]) -> str:
    if mode == "paraphrase":
        return ("Rewrite the following math problem in different words. Keep every number and "
                "every expression exactly as written. Reply with the rewritten problem only.\n\n"
                f"Problem: {base['question']}")
    if mode == "distractors":
        return ("Here is a math problem and its correct answer. Write three plausible but wrong "
                "answers in the same format, one per line, with no explanations.\n\n"
                f"Problem: {base['question']}\nCorrect answer: {base['answer']}")
    example = {"question": base["question"], "problem": base["problem"], "answer": base["answer"]}
    return ("Write a new math problem of the same kind as this example, with different numbers. "
            "Reply with one JSON object with the same keys (question, problem, answer); the "
            "question must state the problem's expressions exactly.\n\nExample: "
            + json.dumps(example))


def _choices(reply: str) -> list[str]:
    lines = [_BULLET.sub("", line).strip() for line in reply.splitlines()]
    return [line for line in lines if line][:3]


def _json_object(reply: str) -> Any:
    start, end = reply.find("{"), reply.rfind("}")
    if start < 0 or end <= start:
        raise Reject("syntax:not_json", "the reply holds no JSON object")
    try:
        return json.loads(reply[start:end + 1])
    except json.JSONDecodeError as exc:
        raise Reject("syntax:not_json", f"invalid JSON: {exc.msg}") from None


def model_outcome(task: ModelTask, spec: ModelGenerator, client: ChatClient) -> Outcome:
    """Ask the model about a freshly generated, verified problem, then verify its reply."""
    base = math_outcome(MathTask(task.index, task.generator, task.topic, task.difficulty,
                                 task.seed))
    out = Outcome(task.index, task.generator, {
        "kind": "math", "topic": task.topic, "difficulty": task.difficulty,
        "provenance": {"generator": f"model/{spec.mode}", "seed": task.seed,
                       "model": spec.endpoint.model}})
    if base.stage is not None:
        return out.reject("generate", "generate:parent_unverified", base.detail)
    out.passed("generate", "parent_verified", base.trail[-1]["detail"])
    prompt = prompt_for(spec.mode, base.record)
    try:
        reply = client.complete(prompt, task.seed)
    except EndpointError as exc:
        return out.reject("generate", "generate:endpoint_error", str(exc))
    provenance = {**out.record["provenance"], "params": base.record["provenance"]["params"],
                  "parent": {"question": base.record["question"]}, "prompt": prompt,
                  "response": reply}
    out.passed("generate", "model_replied", f"{len(reply)} characters")
    record = {**base.record, "provenance": provenance}
    if spec.mode == "paraphrase":
        record["question"] = reply.strip()
        out.record = record
        return out.add_checks(verify(task.topic, record["question"], record["answer"],
                                     record["problem"]))
    if spec.mode == "new":
        out.record = record
        try:
            made = _json_object(reply)
            if not isinstance(made, dict) or not {"question", "problem", "answer"} <= set(made):
                raise Reject("syntax:bad_field", "the JSON needs question, problem and answer")
            op = base.record["problem"].get("op")
            if op is not None and isinstance(made["problem"], dict) \
                    and made["problem"].get("op") != op:
                raise Reject("syntax:bad_field", f"problem.op must stay {op!r}")
        except Reject as exc:
            return out.reject("syntax", exc.code, exc.detail)
        record.update(question=str(made["question"]), answer=made["answer"],
                      problem=made["problem"])
        if isinstance(made["answer"], int | float) and not isinstance(made["answer"], bool):
            record["answer"] = str(made["answer"])
        return out.add_checks(verify(task.topic, record["question"], record["answer"],
                                     record["problem"]))
    # distractors: three wrong answers that parse and differ from the answer and each other
    out.record = record
    choices = _choices(reply)
    names = frozenset(_names(base.record["problem"]))
    try:
        if len(choices) < 3:
            raise Reject("syntax:too_few_choices", f"{len(choices)} distractors, need 3")
        parsed = [parse(c, names) for c in choices]
    except Reject as exc:
        return out.reject("syntax", exc.code, exc.detail)
    out.passed("syntax", "parsed", "three distractors parse")
    correct = parse(base.record["answer"], names) if task.topic != "primes" or \
        base.record["problem"]["op"] != "isprime" else None
    for i, value in enumerate(parsed):
        if correct is not None and (_same(value, correct) if not isinstance(value, list | tuple)
                                    else value == correct):
            return out.reject("logic", "logic:distractor_is_correct",
                              f"distractor {choices[i]!r} equals the answer")
        if any(value == other for other in parsed[:i]):
            return out.reject("logic", "logic:duplicate_distractor", f"{choices[i]!r} repeats")
    options = [base.record["answer"], *choices]
    random.Random(task.seed).shuffle(options)
    record["choices"] = options
    out.passed("logic", "distractors_wrong", "no distractor equals the verified answer")
    return out


def _names(problem: dict[str, Any]) -> list[str]:
    if "variable" in problem:
        return [problem["variable"]]
    return list(problem.get("variables", []))
