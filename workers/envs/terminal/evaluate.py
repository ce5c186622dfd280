"""Evaluate a policy on terminal tasks: episodes in sandbox sessions, graded by hidden tests.

`evaluate_terminal` is `workers.envs.eval.evaluate` for terminal tasks: each task's initial
workspace is prepared once as a snapshot, every sample is a `run_episode` forked from it with an
endpoint policy that speaks OpenAI tools (`EndpointPolicy.chat_tools`), and the reward is the
hidden tests' grade of the final workspace, never the policy's text. The report is the one
`build_report` writes for every environment (schema `crucible.eval/1`, pass@k, per-task rows
with turns, the single component `hidden_tests`), so the platform's eval pages and comparisons
read it unchanged.

A sample the platform failed (its session could not be forked, was lost or reclaimed while the
episode ran, or the grading could not run: `InfraError`, `GradeResult.infra`) or whose endpoint
failed (`PolicyError`) is an error: counted in the summary's `errors`, listed in its task's row,
scored 0 as `evaluate` scores errors, and never reported as the policy's own 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from workers.envs.base import InfraError
from workers.envs.eval import (
    PolicyError,
    ReportEnvironment,
    Sample,
    ToolCompletion,
    build_report,
    sample_seed,
)
from workers.envs.spec import SamplingSpec, digest
from workers.envs.terminal.episode import prepare, run_episode
from workers.envs.terminal.grader import GRADER_LIMITS
from workers.envs.terminal.task import TerminalTask, TerminalTaskError
from workers.envs.terminal.tools import TOOL_SCHEMAS
from workers.envs.toolcalls import call_text
from workers.sandbox.sessions import SessionError, SessionManager

COMPONENT = "hidden_tests"
TRANSCRIPT_CHARS = 20_000  # of a sample's transcript kept in the report (include_samples)
WARM_SANDBOXES = 8


class ToolPolicy(Protocol):
    name: str

    def chat_tools(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                   sampling: SamplingSpec) -> ToolCompletion: ...


@dataclass(frozen=True)
class _Row:
    """A terminal task as a report row sees it (difficulty and topic from its metadata)."""

    id: str
    difficulty: str | None
    topic: str | None


def _row(task: TerminalTask) -> _Row:
    meta = task.metadata
    return _Row(task.id, meta.get("difficulty"), meta.get("topic") or meta.get("category"))


def environment_summary(tasks: Sequence[TerminalTask], name: str) -> dict[str, Any]:
    """The report's `environment` for terminal tasks, in the keys `Environment.summary` has;
    the digest is of every task (the same tasks give the same digest in both reports of a
    comparison)."""
    return {
        "name": name, "version": None,
        "digest": digest([t.model_dump(mode="json") for t in tasks]),
        "mode": "terminal", "max_turns": max(t.max_turns for t in tasks),
        "tools": sorted(s["function"]["name"] for s in TOOL_SCHEMAS),
        "components": [{"name": COMPONENT, "weight": 1.0, "kind": "hidden_tests",
                        "params": {}}],
        "tasks": len(tasks), "train": sum(t.split == "train" for t in tasks),
        "eval": sum(t.split == "eval" for t in tasks),
    }


class _Turns:
    """The policy one sample's episode calls: each turn sent with its own seed, latency and
    tokens summed, the conversation kept as far as it got (an episode cut short by an error
    still shows its turns)."""

    def __init__(self, policy: ToolPolicy, sampling: SamplingSpec, sample: Sample,
                 index: int) -> None:
        self.policy, self.sampling, self.sample, self.index = policy, sampling, sample, index

    def __call__(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
                 ) -> dict[str, Any]:
        sample = self.sample
        turn = sum(1 for m in messages if m["role"] == "assistant")
        seeded = self.sampling if self.sampling.seed is None else self.sampling.model_copy(
            update={"seed": sample_seed(self.sampling.seed, sample.task_id, self.index, turn)})
        sample.messages = list(messages)
        got = self.policy.chat_tools(messages, tools, seeded)
        sample.latency_s += got.latency_s
        for attr in ("prompt_tokens", "completion_tokens"):
            new, have = getattr(got, attr), getattr(sample, attr)
            setattr(sample, attr, None if new is None or have is None else have + new)
        sample.messages.append(got.message)
        return got.message


def _play(manager: SessionManager, task: TerminalTask, snapshot: str | Exception,
          policy: ToolPolicy, sampling: SamplingSpec, index: int) -> tuple[Sample, dict[str, Any]]:
    """One sample: the episode, its grade, and what `include_samples` shows of it."""
    sample = Sample(task_id=task.id, messages=[])
    info: dict[str, Any] = {"stop_reason": None, "grade": None}
    if isinstance(snapshot, Exception):
        sample.error = f"infrastructure: could not prepare the task's workspace: {snapshot}"
        return sample, info
    try:
        result = run_episode(manager, task, _Turns(policy, sampling, sample, index), snapshot)
    except PolicyError as exc:
        sample.error = str(exc)
    except InfraError as exc:  # the platform's failure: an error, not the policy's answer
        sample.error = f"infrastructure: {exc}"
    except (SessionError, OSError) as exc:  # the episode's session could not be forked
        sample.error = f"infrastructure: could not start the episode's session: {exc}"
    else:
        sample.messages = result.messages
        info = {"stop_reason": result.stop_reason, "grade": result.grade.as_json()}
        if result.grade.infra:
            sample.error = f"infrastructure: {result.grade.error or 'grading failed'}"
        else:
            sample.reward = result.grade.reward
    sample.components = {COMPONENT: sample.reward}
    return sample, info


def _call(call: Any) -> str:
    """A call as the policy would write it; one that is not well formed, as it came."""
    fn = call.get("function") if isinstance(call, dict) else None
    try:
        return call_text(str(fn["name"]), fn.get("arguments"))  # type: ignore[index, union-attr]
    except (TypeError, KeyError, ValueError, AttributeError):
        return repr(call)[:2000]


def transcript(messages: Sequence[dict[str, Any]]) -> str:
    """A sample's episode as text for people: each assistant turn's words and calls (in the
    Hermes form the policy writes them) and each tool result, cut to TRANSCRIPT_CHARS."""
    parts: list[str] = []
    for m in messages:
        if m["role"] == "assistant":
            text = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                text += "\n" + _call(call)
            parts.append(f"[assistant]\n{text.strip()}")
        elif m["role"] == "tool":
            parts.append(f"[tool]\n{m.get('content', '')}")
    out = "\n\n".join(parts)
    return out if len(out) <= TRANSCRIPT_CHARS else out[:TRANSCRIPT_CHARS] + "\n[cut]"


def evaluate_terminal(
    tasks: Sequence[TerminalTask], policy: ToolPolicy, *, split: str = "eval",
    samples_per_task: int = 1, k: Sequence[int] = (1,), sampling: SamplingSpec | None = None,
    limit: int | None = None, concurrency: int = 4, include_samples: bool = False,
    exclude: Sequence[str] = (), name: str = "terminal", manager: SessionManager | None = None,
) -> dict[str, Any]:
    """Play `policy` on the terminal tasks of `split` and return the eval report (see the
    module docstring). The arguments are `evaluate`'s; `name` names the environment in the
    report; `manager` runs the sessions (one of its own, closed at the end, when None).
    A sample is correct (pass@k) when every hidden test passed."""
    sampling = sampling or SamplingSpec()
    bad_k = [x for x in k if x < 1 or x > samples_per_task]
    if bad_k:
        raise ValueError(f"pass@k needs 1 <= k <= samples_per_task ({samples_per_task}); "
                         f"got {bad_k}")
    if not tasks:
        raise ValueError(f"terminal environment {name!r} has no tasks")
    skipped = set(exclude)
    chosen = [t for t in tasks if t.split == split and t.id not in skipped]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise ValueError(f"terminal environment {name!r} has no tasks in split {split!r}"
                         + (f" ({len(skipped)} excluded)" if skipped else ""))
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    own = manager is None
    mgr = SessionManager() if manager is None else manager
    snapshots: dict[str, str | Exception] = {}
    try:
        if own:  # episodes and gradings fork into sandboxes started ahead
            kinds = {t.limits.model_dump_json(): t.limits for t in chosen}
            for limits in [*kinds.values(), GRADER_LIMITS]:
                mgr.keep_warm(limits, min(concurrency, WARM_SANDBOXES))

        def prepared(task: TerminalTask) -> str | Exception:
            try:
                return prepare(mgr, task)
            except (SessionError, OSError, TerminalTaskError) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=max(1, concurrency),
                                thread_name_prefix="terminal-eval") as pool:
            for task, snap in zip(chosen, pool.map(prepared, chosen), strict=True):
                snapshots[task.id] = snap
            jobs = [(t, i) for t in chosen for i in range(samples_per_task)]
            played = list(pool.map(
                lambda job: _play(mgr, job[0], snapshots[job[0].id], policy, sampling, job[1]),
                jobs))
    finally:
        for snap in snapshots.values():
            if isinstance(snap, str):
                mgr.drop_snapshot(snap)
        if own:
            mgr.close()
    samples = [s for s, _ in played]
    env = ReportEnvironment(environment_summary(tasks, name), ((COMPONENT, 1.0),))
    report = build_report(env, [_row(t) for t in chosen], samples, k=k, threshold=1.0,
                          split=split, samples_per_task=samples_per_task)
    report["policy"] = {"name": policy.name, "sampling": sampling.model_dump()}
    if include_samples:
        report["samples"] = [
            {"task_id": s.task_id, "final_answer": transcript(s.messages), "reward": s.reward,
             "components": s.components, "error": s.error, "turns": sum(
                 1 for m in s.messages if m["role"] == "assistant"), **info}
            for s, info in played]
    total = time.perf_counter() - t0
    report["started_at"] = started.isoformat()
    # episodes are graded as they end: generation and scoring overlap
    report["timings"] = {"total_s": round(total, 3), "generate_s": round(total, 3),
                         "score_s": None}
    return report
