"""The environment protocol: tasks, a rubric of named weighted components, an interaction mode.

An `Environment` is what a training or evaluation run pins: its `content_hash()` covers every
field that affects scoring (tasks, rubric, mode, tools, limits, the built-in's scoring version),
so two versions with equal hashes score any completion identically.

Scoring is batched (`score(tasks, completions)`): code checkers send a whole batch to the sandbox
at once. Multi-turn and tool-use environments also answer model turns (`respond`); the rollout
driver (`workers.envs.rollout`) and the evaluator (`workers.envs.eval`) drive that loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from workers.envs.spec import SPEC_FORMAT, digest

Split = Literal["train", "eval"]
Mode = Literal["single_turn", "multi_turn", "tool_use"]
Message = dict[str, str]
"""A chat message: {"role": "system"|"user"|"assistant"|"tool", "content": str[, "name": str]}."""


@dataclass(frozen=True)
class Example:
    """A task reduced to what training reads: the prompt, the completion SFT imitates and the
    reward checks against, and free-form metadata. Defined here, below the RL engine, so an
    environment can serve training without importing the engine."""

    prompt: str
    reference: str
    meta: dict[str, str] = field(default_factory=dict)
    # The reference as a whole episode, (text, sampled) pieces in the RL layout, each encoded
    # on its own as the rollout driver encodes them: the prompt's messages (the pieces before
    # the first sampled one), then assistant turns (sampled) and environment messages. SFT
    # learns only the sampled ones. Empty: `prompt` + `reference` is one completion.
    turns: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True)
class EnvTask:
    """One task. `answer` is the ground truth answer checkers compare with; `tests` the code
    code checkers run; `reference` a completion that must earn full reward (QC's first check)."""

    id: str
    prompt: str
    answer: str | None = None
    reference: str | None = None
    tests: str | None = None
    split: Split = "train"
    difficulty: str | None = None
    topic: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "prompt": self.prompt, "answer": self.answer,
            "reference": self.reference, "tests": self.tests, "split": self.split,
            "difficulty": self.difficulty, "topic": self.topic, "metadata": dict(self.metadata),
        }


INFRA = "infra/failed"
"""The reserved reward-component column through which an objective tells the RL engine which
samples could not be scored because the platform failed (1.0) rather than the policy (0.0).
Not an identifier, so no rubric component can take its name; present only when some sample
failed. The engine (workers/rl/triage.py) retries those samples, then drops their group: their
0 reward is never trained on."""


class InfraError(RuntimeError):
    """The platform, not the policy, failed: the sandbox engine, a lost or reclaimed session, a
    tool whose infrastructure timed out. Raised by tools and `Environment.respond` instead of
    answering the model with the failure (feedback from a broken sandbox would teach it
    nothing true); the rollout driver ends the episode as `infra`."""


@dataclass
class Score:
    """A completion's reward: `total` = sum of weight * component, plus per-component values
    and free-form `info` (sandbox status, error text) that QC and feedback turns read. `infra`
    is why scoring failed for the platform's sake (None: the score is the policy's own); the
    total is then not a verdict on the completion."""

    total: float
    components: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)
    infra: str | None = None


ComponentFn = Callable[[Sequence[EnvTask], Sequence[str]], list[tuple[float, dict[str, Any]]]]
"""Batched reward function: one (value in [0, 1], info) per (task, completion)."""


@dataclass(frozen=True)
class Component:
    name: str
    weight: float
    fn: ComponentFn
    kind: str
    """Checker name, hashed with `params` (the function itself is code, pinned by `version`)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    graded: bool = False
    """Partial credit: values strictly between 0 and 1 are meaningful (a similarity, a share of
    fields). QC then lets a trivial answer earn a bounded share of it instead of nothing.
    Derived from kind and params, so not hashed."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, "kind": self.kind,
                "params": dict(self.params)}


@dataclass(frozen=True)
class Rubric:
    components: tuple[Component, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a rubric needs uniquely named components, got {names}")

    def score(self, tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[Score]:
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
        scores = [Score(0.0, {}) for _ in tasks]
        for comp in self.components:
            for score, (value, info) in zip(scores, comp.fn(tasks, completions), strict=True):
                value = float(value)
                score.components[comp.name] = value
                score.total += comp.weight * value
                if info.get("infra"):  # a component's checker could not run
                    score.infra = score.infra or f"{comp.name}: {info['infra']}"
                for key, item in info.items():
                    score.info.setdefault(key, item)
        return scores

    @property
    def max_total(self) -> float:
        """Total of a perfect completion: components lie in [0, 1]."""
        return sum(c.weight for c in self.components if c.weight > 0)

    @property
    def graded_total(self) -> float:
        """The part of `max_total` that partial-credit components give."""
        return sum(c.weight for c in self.components if c.weight > 0 and c.graded)

    def describe(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.components]


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model turn: messages to append, and whether the episode
    is over (the model's last turn is then its final answer)."""

    messages: list[Message]
    done: bool


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""
    run: Callable[[Mapping[str, Any]], str]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": dict(self.parameters)}


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_PROMPT = (
    "You can call tools. To call one, write exactly\n"
    '<tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call>\n'
    "and wait for the result. When you are done, answer without a tool call.\n"
    "Tools:\n{tools}"
)


def parse_tool_calls(text: str) -> list[dict[str, Any]] | str:
    """The tool calls in a model turn, or an error message for a malformed one."""
    calls: list[dict[str, Any]] = []
    for raw in _TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as exc:
            return f"error: tool call is not valid JSON ({exc.msg})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'error: a tool call is an object {"name": ..., "arguments": {...}}'
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            return "error: tool call arguments must be an object"
        calls.append({"name": call["name"], "arguments": args})
    return calls


class Environment:
    """Base class: single-turn by default; subclasses set tasks, rubric, and override
    `respond` for multi-turn behaviour. Tool use is handled here from `tools`."""

    name: str = "environment"
    version: str = "1"
    """Scoring-code version of the built-in: bump it when scoring changes (it is hashed)."""

    def __init__(
        self, *, tasks: Sequence[EnvTask], rubric: Rubric, mode: Mode = "single_turn",
        max_turns: int = 1, tools: Sequence[Tool] = (), system_prompt: str | None = None,
        params: Mapping[str, Any] | None = None, name: str | None = None,
    ) -> None:
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"task id {dup!r} is used twice")
        if mode == "tool_use" and not tools:
            raise ValueError("a tool_use environment needs tools")
        if mode == "single_turn" and max_turns != 1:
            raise ValueError("a single_turn environment has max_turns = 1")
        self.tasks: list[EnvTask] = list(tasks)
        self.rubric = rubric
        self.mode: Mode = mode
        self.max_turns = max_turns
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.system_prompt = system_prompt
        self.params: dict[str, Any] = dict(params or {})
        if name is not None:
            self.name = name
        self._by_id = {t.id: t for t in self.tasks}

    # -- tasks ----------------------------------------------------------------------------------
    def split(self, split: Split) -> list[EnvTask]:
        return [t for t in self.tasks if t.split == split]

    def task(self, task_id: str) -> EnvTask:
        try:
            return self._by_id[task_id]
        except KeyError:
            raise KeyError(f"environment {self.name!r} has no task {task_id!r}") from None

    def with_tasks(self, tasks: Sequence[EnvTask]) -> Environment:
        """The same environment over other tasks (a subset, or a modified copy)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.tasks = list(tasks)
        clone._by_id = {t.id: t for t in clone.tasks}
        return clone

    # -- scoring --------------------------------------------------------------------------------
    def score(self, tasks: Sequence[EnvTask], completions: Sequence[str]) -> list[Score]:
        """Rewards of final answers (for multi-turn: the model's last turn)."""
        return self.rubric.score(tasks, completions)

    def score_conversations(
        self, tasks: Sequence[EnvTask], conversations: Sequence[Sequence[Message]]
    ) -> list[Score]:
        finals = [self.final_answer(c) for c in conversations]
        scores = self.score(tasks, finals)
        for score, conv in zip(scores, conversations, strict=True):
            score.info["turns"] = sum(1 for m in conv if m["role"] == "assistant")
        return scores

    @staticmethod
    def final_answer(conversation: Sequence[Message]) -> str:
        return next((m["content"] for m in reversed(conversation) if m["role"] == "assistant"),
                    "")

    # -- interaction ----------------------------------------------------------------------------
    def initial_messages(self, task: EnvTask) -> list[Message]:
        system = self.system_prompt
        if self.mode == "tool_use":
            tools = "\n".join(json.dumps(t.describe(), sort_keys=True)
                              for t in self.tools.values())
            system = ((system + "\n\n") if system else "") + TOOL_PROMPT.format(tools=tools)
        head: list[Message] = [{"role": "system", "content": system}] if system else []
        return [*head, {"role": "user", "content": task.prompt}]

    def respond(self, task: EnvTask, conversation: Sequence[Message]) -> Reply:
        """Reply to the model's last turn. Single-turn: done. Tool use: run the calls."""
        turns = sum(1 for m in conversation if m["role"] == "assistant")
        if self.mode != "tool_use" or turns >= self.max_turns:
            return Reply([], done=True)
        calls = parse_tool_calls(conversation[-1]["content"])
        if isinstance(calls, str):
            return Reply([{"role": "tool", "name": "error", "content": calls}], done=False)
        if not calls:
            return Reply([], done=True)
        return Reply([self.call_tool(c["name"], c["arguments"]) for c in calls], done=False)

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> Message:
        tool = self.tools.get(name)
        if tool is None:
            text = f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        else:
            try:
                text = tool.run(arguments)
            except InfraError:
                raise  # the platform's failure, not the model's: the episode ends as infra
            except Exception as exc:  # noqa: BLE001 - a tool failure is feedback for the model
                text = f"error: {type(exc).__name__}: {exc}"
        return {"role": "tool", "name": name, "content": text}

    # -- QC hooks ---------------------------------------------------------------------------------
    def trivial_answers(self, task: EnvTask) -> list[str]:
        """Answers that must earn zero (beyond the empty one): no-effort or echo answers."""
        return ["I don't know."]

    def wrong_answers(self, task: EnvTask) -> list[str]:
        """Answers a hair away from the truth that must still earn zero (a lax checker
        accepting them makes the reward untrustworthy)."""
        return []

    def self_check(self) -> list[str]:
        """Problems with the environment's dependencies (imports, toolchains); [] if none."""
        return []

    # -- identity -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Everything that affects scoring, as JSON (hashed by `content_hash`)."""
        return {
            "format": SPEC_FORMAT, "name": self.name, "version": self.version,
            "params": self.params, "mode": self.mode, "max_turns": self.max_turns,
            "tools": [t.describe() for t in self.tools.values()],
            "system_prompt": self.system_prompt, "rubric": self.rubric.describe(),
            "tasks": [t.to_json() for t in self.tasks],
        }

    def content_hash(self) -> str:
        return digest(self.describe())

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "version": self.version, "digest": self.content_hash(),
            "mode": self.mode, "max_turns": self.max_turns, "tools": sorted(self.tools),
            "components": [c.describe() for c in self.rubric.components],
            "tasks": len(self.tasks), "train": len(self.split("train")),
            "eval": len(self.split("eval")),
        }
