"""Python function problems checked by unit tests in the sandbox, single-turn (`code`) and
multi-turn repair (`code_repair`: start from a buggy attempt; each failing test run becomes the
next user turn)."""

from __future__ import annotations

from collections.abc import Sequence

from workers.envs.base import Component, Environment, EnvTask, Message, Reply, Rubric
from workers.envs.builtins.problems import PROBLEMS, fenced, prompt_for, repair_prompt_for
from workers.envs.checkers import Sandbox, code_request, grader_key, raise_if_infra, unit_tests
from workers.envs.spec import CodeParams, CodeRepairParams
from workers.envs.splits import eval_ids
from workers.sandbox.scoring import score

FEEDBACK = ("Your code failed the tests:\n{feedback}\n\nFix it and reply with the complete "
            "corrected function in one ```python code block.")


def _tasks(params: CodeParams, repair: bool) -> list[EnvTask]:
    held = eval_ids([p.slug for p in PROBLEMS], params.eval_fraction, params.seed)
    return [
        EnvTask(id=p.slug, prompt=repair_prompt_for(p) if repair else prompt_for(p),
                reference=fenced(p.solution), tests=p.tests, topic=p.topic,
                difficulty=p.difficulty, split="eval" if p.slug in held else "train",
                metadata={"buggy": p.buggy})
        for p in PROBLEMS
    ]


class CodeEnvironment(Environment):
    name = "code"
    version = "1"

    def __init__(self, params: CodeParams, sandbox: Sandbox | None = None,
                 *, repair: bool = False) -> None:
        self.sandbox = sandbox or Sandbox()
        self.limits = params.limits
        rubric = Rubric((Component("tests", 1.0, unit_tests(self.sandbox, params.limits,
                                                         grader_key(self.name)),
                                   "unit_tests", {"limits": params.limits.model_dump()}),))
        turns = params.max_turns if isinstance(params, CodeRepairParams) else 1
        super().__init__(tasks=_tasks(params, repair), rubric=rubric,
                         mode="multi_turn" if repair else "single_turn", max_turns=turns,
                         params=params.model_dump(mode="json"))

    def trivial_answers(self, task: EnvTask) -> list[str]:
        return [fenced("pass\n")]

    def self_check(self) -> list[str]:
        probe = EnvTask(id="probe", prompt="", tests="assert f() == 1\n")
        [result] = self.sandbox.run([code_request(probe, "def f():\n    return 1\n",
                                                  self.limits)])
        if score(result) != 1.0:
            return [f"the sandbox cannot run Python tests: {result.status} {result.message}"]
        return []


class CodeRepairEnvironment(CodeEnvironment):
    name = "code_repair"
    version = "1"

    def __init__(self, params: CodeRepairParams, sandbox: Sandbox | None = None) -> None:
        super().__init__(params, sandbox, repair=True)

    def trivial_answers(self, task: EnvTask) -> list[str]:
        return [fenced("pass\n"), fenced(task.metadata["buggy"])]

    def respond(self, task: EnvTask, conversation: Sequence[Message]) -> Reply:
        """Run the tests on the last answer: passing ends the episode, failing replies with the
        test output (until the turns run out)."""
        turns = sum(1 for m in conversation if m["role"] == "assistant")
        [value] = self.rubric.components[0].fn([task], [conversation[-1]["content"]])
        raise_if_infra(value[1])
        if value[0] >= 1.0 or turns >= self.max_turns:
            return Reply([], done=True)
        feedback = value[1].get("feedback") or "the tests did not pass"
        return Reply([{"role": "user", "content": FEEDBACK.format(feedback=feedback)}],
                     done=False)

