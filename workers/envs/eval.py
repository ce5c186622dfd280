"""Evaluation: run a policy on an environment's split and report capability, cost and latency.

A policy is anything with `chat(messages, sampling) -> Completion`: a Python callable
(`CallablePolicy`) or any OpenAI-compatible server (`EndpointPolicy`, over httpx; our inference
engine serves checkpoints this way). Each task gets `samples_per_task` independent episodes
(multi-turn and tool-use environments reply between turns); final answers are scored in one
batch. The report gives pass@k (unbiased estimator), mean reward, breakdowns by difficulty,
topic and reward component, and latency and tokens per task. `render_html` turns a report into
an escaped HTML fragment; `compare_reports` lines two reports up and marks regressions.

Terminal tasks are played in sandbox sessions by `workers.envs.terminal.evaluate`, with
`EndpointPolicy.chat_tools` (OpenAI tools, assistant tool_calls and tool messages) and the same
`build_report`.
"""

from __future__ import annotations

import hashlib
import html
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from workers.envs.base import Environment, EnvTask, InfraError, Message
from workers.envs.spec import EndpointPolicySpec, SamplingSpec

REPORT_SCHEMA = "crucible.eval/1"
COMPARISON_SCHEMA = "crucible.eval-comparison/1"


# -- pass@k ------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), the chance that at least one
    of k samples drawn without replacement from n (c of them correct) is correct. Computed as a
    running product, which stays exact-ish where the binomials overflow."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


# -- policies ----------------------------------------------------------------------------------

@dataclass
class Completion:
    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0


@dataclass
class ToolCompletion:
    """An assistant message of a tool-using chat: `message` is OpenAI-shaped (`role`,
    `content`, and `tool_calls` when the model called tools)."""

    message: dict[str, Any]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0


class Policy(Protocol):
    name: str

    def chat(self, messages: Sequence[Message], sampling: SamplingSpec) -> Completion: ...


class CallablePolicy:
    """A Python function from the conversation (list of messages) to the reply text."""

    def __init__(self, fn: Callable[[Sequence[Message]], str], name: str = "callable") -> None:
        self.fn = fn
        self.name = name

    def chat(self, messages: Sequence[Message], sampling: SamplingSpec) -> Completion:
        start = time.perf_counter()
        text = self.fn(messages)
        return Completion(text=text, latency_s=time.perf_counter() - start)


class PolicyError(RuntimeError):
    """The policy endpoint failed; the message says how."""


class EndpointPolicy:
    """An OpenAI-compatible server: POST /v1/chat/completions (or /v1/completions with the
    messages joined as plain text)."""

    def __init__(self, spec: EndpointPolicySpec, client: Any | None = None) -> None:
        import httpx

        self.spec = spec
        self.name = f"{spec.model}@{spec.base_url}"
        headers = {}
        if spec.api_key_env:
            key = os.environ.get(spec.api_key_env)
            if not key:
                raise PolicyError(f"environment variable {spec.api_key_env} (the API key) is "
                                  "not set")
            headers["Authorization"] = f"Bearer {key}"
        base = spec.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.client = client or httpx.Client(base_url=base, headers=headers,
                                             timeout=spec.timeout_s)

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict[str, Any]) -> tuple[Any, float]:
        """POST to the endpoint: the 200 response and its latency, else PolicyError."""
        import httpx

        start = time.perf_counter()
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise PolicyError(f"{self.name}: request failed: {exc}") from exc
        latency = time.perf_counter() - start
        if response.status_code != 200:
            raise PolicyError(f"{self.name}: HTTP {response.status_code}: "
                              f"{response.text[:500]}")
        return response, latency

    def chat(self, messages: Sequence[Message], sampling: SamplingSpec) -> Completion:

        body: dict[str, Any] = {"model": self.spec.model, "max_tokens": sampling.max_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.spec.api == "chat":
            path = "/chat/completions"
            # Tool calls travel in the text (see workers.envs.base), so results go back as
            # user turns: the chat API's "tool" role needs structured tool_call ids.
            body["messages"] = [
                {"role": "user", "content": f"[{m.get('name', 'tool')} result]\n{m['content']}"}
                if m["role"] == "tool" else {"role": m["role"], "content": m["content"]}
                for m in messages
            ]
        else:
            path = "/completions"
            body["prompt"] = "\n\n".join(m["content"] for m in messages)
        response, latency = self._post(path, body)
        data = response.json()
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.spec.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError) as exc:
            raise PolicyError(f"{self.name}: unexpected response shape: {str(data)[:300]}") from exc
        usage = data.get("usage") or {}
        return Completion(text=text or "", prompt_tokens=usage.get("prompt_tokens"),
                          completion_tokens=usage.get("completion_tokens"), latency_s=latency)

    def chat_tools(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                   sampling: SamplingSpec) -> ToolCompletion:
        """One assistant turn of a tool-using chat: `messages` go as they are (assistant
        `tool_calls`, `tool` messages with their `tool_call_id`), `tools` as OpenAI function
        schemas; the reply's content and tool calls come back (PolicyError when the server
        fails or answers in another shape)."""

        if self.spec.api != "chat":
            raise PolicyError(f"{self.name}: tool use needs the chat API (api: chat), not "
                              f"{self.spec.api!r}")
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        body: dict[str, Any] = {
            "model": self.spec.model, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "messages": [{k: m[k] for k in keep if k in m} for m in messages],
            "tools": list(tools), "tool_choice": "auto"}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        response, latency = self._post("/chat/completions", body)
        try:
            data = response.json()
            reply = data["choices"][0]["message"]
            content, calls = reply.get("content"), reply.get("tool_calls")
            if not (content is None or isinstance(content, str)) or \
                    not (calls is None or isinstance(calls, list)):
                raise TypeError("content must be a string, tool_calls a list")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise PolicyError(f"{self.name}: unexpected response shape ({exc}): "
                              f"{response.text[:300]}") from exc
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            message["tool_calls"] = calls
        usage = data.get("usage") or {}
        return ToolCompletion(message, prompt_tokens=usage.get("prompt_tokens"),
                              completion_tokens=usage.get("completion_tokens"), latency_s=latency)


# -- running -----------------------------------------------------------------------------------

@dataclass
class Sample:
    task_id: str
    messages: list[Message]
    latency_s: float = 0.0
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    error: str | None = None
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)


def sample_seed(seed: int, task_id: str, sample: int, turn: int = 0) -> int:
    """The seed sent for one turn of one sample: a hash of the spec's seed, the task id, the
    sample's index and the turn. One seed for every request would make a task's samples
    identical (pass@k = pass@1); a derived one keeps them distinct and the eval reproducible.
    Keyed by task id rather than position, so `limit` or QC exclusions do not reshuffle the
    seeds of the remaining tasks. 31 bits: what every OpenAI-compatible server accepts."""
    key = f"{seed}\x00{task_id}\x00{sample}\x00{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") & 0x7FFF_FFFF


def _episode(env: Environment, task: EnvTask, policy: Policy, sampling: SamplingSpec,
             index: int = 0) -> Sample:
    messages = env.initial_messages(task)
    sample = Sample(task_id=task.id, messages=messages)
    try:
        while True:
            turn = sum(1 for m in messages if m["role"] == "assistant")
            seeded = sampling if sampling.seed is None else sampling.model_copy(
                update={"seed": sample_seed(sampling.seed, task.id, index, turn)})
            completion = policy.chat(messages, seeded)
            sample.latency_s += completion.latency_s
            for attr in ("prompt_tokens", "completion_tokens"):
                got, have = getattr(completion, attr), getattr(sample, attr)
                setattr(sample, attr, None if got is None or have is None else have + got)
            messages.append({"role": "assistant", "content": completion.text})
            if sum(1 for m in messages if m["role"] == "assistant") >= env.max_turns:
                break
            reply = env.respond(task, messages)
            if reply.done:
                break
            messages.extend(reply.messages)
    except PolicyError as exc:
        sample.error = str(exc)
    except InfraError as exc:  # the platform's failure: an error, not the policy's answer
        sample.error = f"infrastructure: {exc}"
    return sample


def evaluate(
    env: Environment, policy: Policy, *, split: str = "eval", samples_per_task: int = 1,
    k: Sequence[int] = (1,), sampling: SamplingSpec | None = None, limit: int | None = None,
    concurrency: int = 4, success_threshold: float | None = None, include_samples: bool = False,
    exclude: Sequence[str] = (),
) -> dict[str, Any]:
    """Run `policy` on `env`'s split and return the report (see docs/environments.md).

    With a `sampling.seed`, each request carries `sample_seed(seed, task, sample, turn)`: the
    samples of a task differ, and the same seed gives the same report again.

    A sample counts as correct for pass@k when its reward reaches `success_threshold`
    (default: the rubric's maximum total, i.e. full marks). `include_samples` adds every
    sample's final answer and reward (for inspection; reports stay small without). `exclude`
    drops task ids (e.g. a QC report's `quarantined_ids`)."""
    sampling = sampling or SamplingSpec()
    bad_k = [x for x in k if x < 1 or x > samples_per_task]
    if bad_k:
        raise ValueError(f"pass@k needs 1 <= k <= samples_per_task ({samples_per_task}); "
                         f"got {bad_k}")
    skipped = set(exclude)
    tasks = [t for t in env.split(split) if t.id not in skipped]  # type: ignore[arg-type]
    if limit is not None:
        tasks = tasks[:limit]
    if not tasks:
        raise ValueError(f"environment {env.name!r} has no tasks in split {split!r}")
    threshold = env.rubric.max_total if success_threshold is None else success_threshold
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    jobs = [(t, i) for t in tasks for i in range(samples_per_task)]
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="eval") as pool:
        samples = list(pool.map(lambda job: _episode(env, job[0], policy, sampling, job[1]),
                                jobs))
    generate_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores = env.score_conversations([t for t, _ in jobs], [s.messages for s in samples])
    score_s = time.perf_counter() - t1
    for sample, score in zip(samples, scores, strict=True):
        if score.infra and not sample.error:
            sample.error = f"infrastructure: {score.infra}"
        sample.reward = 0.0 if sample.error else score.total
        sample.components = {n: (0.0 if sample.error else v)
                             for n, v in score.components.items()}
    report = build_report(env, tasks, samples, k=k, threshold=threshold, split=split,
                          samples_per_task=samples_per_task)
    report["policy"] = {"name": policy.name, "sampling": sampling.model_dump()}
    if include_samples:
        report["samples"] = [
            {"task_id": s.task_id, "final_answer": env.final_answer(s.messages),
             "reward": s.reward, "components": s.components, "error": s.error}
            for s in samples]
    report["started_at"] = started.isoformat()
    report["timings"] = {"total_s": round(time.perf_counter() - t0, 3),
                         "generate_s": round(generate_s, 3), "score_s": round(score_s, 3)}
    return report


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 6) if values else None


def _group(rows: list[dict[str, Any]], key: str, ks: Sequence[int]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[str(row[key]) if row[key] is not None else "unspecified"].append(row)
    return {name: {"tasks": len(items), "mean_reward": _mean([r["mean_reward"] for r in items]),
                   "pass_at": {str(x): _mean([r["pass_at"][str(x)] for r in items]) for x in ks}}
            for name, items in sorted(groups.items())}


class ReportTask(Protocol):
    """What a report row needs of a task (an `EnvTask`, or a terminal task's stand-in)."""

    @property
    def id(self) -> str: ...
    @property
    def difficulty(self) -> str | None: ...
    @property
    def topic(self) -> str | None: ...


@dataclass(frozen=True)
class ReportEnvironment:
    """What a report says of an environment that is not an `Environment` (terminal tasks):
    its summary (name, digest, ...) and its reward components as (name, weight)."""

    summary: dict[str, Any]
    components: tuple[tuple[str, float], ...]


def build_report(
    env: Environment | ReportEnvironment, tasks: Sequence[ReportTask],
    samples: Sequence[Sample], *, k: Sequence[int], threshold: float, split: str,
    samples_per_task: int,
) -> dict[str, Any]:
    """Aggregate scored samples into the report (pure: no policy, no scoring)."""
    if isinstance(env, ReportEnvironment):
        summary, weights = env.summary, list(env.components)
    else:
        summary, weights = env.summary(), [(c.name, c.weight) for c in env.rubric.components]
    by_task: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_task[sample.task_id].append(sample)
    names = [c for c, _ in weights]
    rows: list[dict[str, Any]] = []
    for task in tasks:
        mine = by_task[task.id]
        n = len(mine)
        correct = sum(s.reward >= threshold - 1e-9 for s in mine)
        lat = [s.latency_s for s in mine]
        ptoks = [s.prompt_tokens for s in mine]
        ctoks = [s.completion_tokens for s in mine]
        rows.append({
            "task_id": task.id, "difficulty": task.difficulty, "topic": task.topic,
            "samples": n, "correct": correct, "mean_reward": _mean([s.reward for s in mine]),
            "pass_at": {str(x): round(pass_at_k(n, correct, x), 6) for x in k},
            "components": {c: _mean([s.components.get(c, 0.0) for s in mine]) for c in names},
            "latency_s": {"mean": _mean(lat), "max": round(max(lat), 6) if lat else None},
            "prompt_tokens": _mean([p for p in ptoks if p is not None])
            if all(p is not None for p in ptoks) else None,
            "completion_tokens": _mean([c for c in ctoks if c is not None])
            if all(c is not None for c in ctoks) else None,
            "turns": _mean([sum(1 for m in s.messages if m["role"] == "assistant")
                            for s in mine]),
            "errors": [s.error for s in mine if s.error][:3],
        })
    all_lat = [s.latency_s for s in samples]
    ctok = [r["completion_tokens"] for r in rows if r["completion_tokens"] is not None]
    ptok = [r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None]
    return {
        "schema": REPORT_SCHEMA,
        "environment": summary,
        "split": split,
        "samples_per_task": samples_per_task,
        "k": list(k),
        "success_threshold": threshold,
        "summary": {
            "tasks": len(rows), "samples": len(samples),
            "errors": sum(1 for s in samples if s.error),
            "mean_reward": _mean([s.reward for s in samples]),
            "pass_at": {str(x): _mean([r["pass_at"][str(x)] for r in rows]) for x in k},
            "latency_s": {"mean": _mean(all_lat), "p50": _quantile(all_lat, 0.5),
                          "p95": _quantile(all_lat, 0.95)},
            "prompt_tokens_per_task": _mean(ptok), "completion_tokens_per_task": _mean(ctok),
        },
        "components": {c: {"weight": w, "mean": _mean([s.components.get(c, 0.0)
                                                      for s in samples])}
                       for c, w in weights},
        "by_difficulty": _group(rows, "difficulty", k),
        "by_topic": _group(rows, "topic", k),
        "tasks": rows,
    }


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 6)


# -- presentation and comparison ---------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
        for row in rows)
    return f'<table class="{html.escape(cls)}"><thead><tr>{head}</tr></thead>' \
           f"<tbody>{body}</tbody></table>"


def render_html(report: dict[str, Any]) -> str:
    """An HTML fragment (no <html>/<body>) for the dashboard; every value is escaped."""
    s, env = report["summary"], report["environment"]
    ks = [str(x) for x in report["k"]]
    parts = [
        '<section class="eval-report">',
        f"<h3>{html.escape(str(env['name']))} · {html.escape(str(report['split']))} · "
        f"{html.escape(str(report.get('policy', {}).get('name', '')))}</h3>",
        _table(["tasks", "samples", "mean reward", *[f"pass@{x}" for x in ks],
                "latency mean (s)", "completion tokens/task", "errors"],
               [[s["tasks"], s["samples"], s["mean_reward"], *[s["pass_at"][x] for x in ks],
                 s["latency_s"]["mean"], s["completion_tokens_per_task"], s["errors"]]],
               "eval-summary"),
        "<h4>By difficulty</h4>",
        _table(["difficulty", "tasks", "mean reward", *[f"pass@{x}" for x in ks]],
               [[d, g["tasks"], g["mean_reward"], *[g["pass_at"][x] for x in ks]]
                for d, g in report["by_difficulty"].items()], "eval-breakdown"),
        "<h4>By topic</h4>",
        _table(["topic", "tasks", "mean reward", *[f"pass@{x}" for x in ks]],
               [[d, g["tasks"], g["mean_reward"], *[g["pass_at"][x] for x in ks]]
                for d, g in report["by_topic"].items()], "eval-breakdown"),
        "<h4>Reward components</h4>",
        _table(["component", "weight", "mean"],
               [[c, v["weight"], v["mean"]] for c, v in report["components"].items()],
               "eval-components"),
        "</section>",
    ]
    return "\n".join(parts)


def compare_reports(
    base: dict[str, Any], new: dict[str, Any], *, tolerance: float = 0.0
) -> dict[str, Any]:
    """Line up two reports: headline metrics, breakdowns and tasks. A regression is a drop of
    more than `tolerance` in a higher-is-better metric (reward, pass@k)."""
    def metric_rows(prefix: str, a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
        rows = []
        keys = [("mean_reward", a.get("mean_reward"), b.get("mean_reward"))]
        for x in sorted(set(a.get("pass_at", {})) | set(b.get("pass_at", {})), key=int):
            keys.append((f"pass@{x}", a.get("pass_at", {}).get(x), b.get("pass_at", {}).get(x)))
        for name, va, vb in keys:
            delta = None if va is None or vb is None else round(vb - va, 6)
            rows.append({"metric": f"{prefix}{name}", "base": va, "new": vb, "delta": delta,
                         "regression": delta is not None and delta < -tolerance})
        return rows

    rows = metric_rows("", base["summary"], new["summary"])
    for group in ("by_difficulty", "by_topic"):
        for name in sorted(set(base.get(group, {})) & set(new.get(group, {}))):
            rows += metric_rows(f"{group[3:]}={name} ", base[group][name], new[group][name])
    for comp in sorted(set(base.get("components", {})) & set(new.get("components", {}))):
        va, vb = base["components"][comp]["mean"], new["components"][comp]["mean"]
        delta = None if va is None or vb is None else round(vb - va, 6)
        rows.append({"metric": f"component={comp}", "base": va, "new": vb, "delta": delta,
                     "regression": delta is not None and delta < -tolerance})
    base_tasks = {t["task_id"]: t for t in base.get("tasks", [])}
    regressed, improved = [], []
    for task in new.get("tasks", []):
        old = base_tasks.get(task["task_id"])
        if old is None or old["mean_reward"] is None or task["mean_reward"] is None:
            continue
        delta = round(task["mean_reward"] - old["mean_reward"], 6)
        entry = {"task_id": task["task_id"], "base": old["mean_reward"],
                 "new": task["mean_reward"], "delta": delta}
        if delta < -tolerance:
            regressed.append(entry)
        elif delta > tolerance:
            improved.append(entry)
    latency = (base["summary"]["latency_s"]["mean"], new["summary"]["latency_s"]["mean"])
    return {
        "schema": COMPARISON_SCHEMA,
        "base": {"environment": base["environment"].get("digest"),
                 "policy": base.get("policy", {}).get("name")},
        "new": {"environment": new["environment"].get("digest"),
                "policy": new.get("policy", {}).get("name")},
        "same_environment": base["environment"].get("digest") == new["environment"].get(
            "digest"),
        "tolerance": tolerance,
        "metrics": rows,
        "regressions": [r["metric"] for r in rows if r["regression"]],
        "latency_s": {"base": latency[0], "new": latency[1]},
        "tasks_regressed": sorted(regressed, key=lambda e: e["delta"]),
        "tasks_improved": sorted(improved, key=lambda e: -e["delta"]),
    }


def render_comparison_html(comparison: dict[str, Any]) -> str:
    """Escaped HTML fragment; regression rows carry class "regression"."""
    rows = []
    for r in comparison["metrics"]:
        cls = ' class="regression"' if r["regression"] else ""
        cells = "".join(f"<td>{html.escape(_fmt(v))}</td>"
                        for v in (r["metric"], r["base"], r["new"], r["delta"]))
        rows.append(f"<tr{cls}>{cells}</tr>")
    warn = "" if comparison["same_environment"] else (
        '<p class="warning">The reports used different environment versions.</p>')
    tasks = "".join(f"<li>{html.escape(t['task_id'])}: {_fmt(t['base'])} → {_fmt(t['new'])}"
                    "</li>" for t in comparison["tasks_regressed"][:50])
    return ('<section class="eval-comparison">' + warn
            + "<table><thead><tr><th>metric</th><th>base</th><th>new</th><th>Δ</th></tr>"
            + "</thead><tbody>" + "".join(rows) + "</tbody></table>"
            + (f"<h4>Tasks that regressed</h4><ul>{tasks}</ul>" if tasks else "")
            + "</section>")
