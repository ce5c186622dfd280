"""Terminal tasks in the RL engine: episodes played at the token level in real sandbox
sessions (workers.envs.terminal.play), the objective that serves them (terminal.objective),
SFT transcripts laid out exactly as RL plays (workers.rl.episodes.transcript_batch), and the
trainer's groups (play_groups) over them.

A scripted `Generate` stands in for the model: it returns the ids of fixed turn texts, so every
expected sequence can be built by hand from the tokenizer. Session tests need root and skip with
the host's reason where it is missing, like every session test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from workers.envs.adapter import SEPARATOR, message_text
from workers.envs.base import Example
from workers.envs.load import load_objective
from workers.envs.terminal.episode import prepare
from workers.envs.terminal.objective import TerminalObjective, TerminalPlay
from workers.envs.terminal.play import (
    DONE_TEXT,
    opening,
    play_terminal,
    play_terminal_group,
    reference_turns,
)
from workers.envs.terminal.task import TerminalTask, parse_task
from workers.envs.toolcalls import call_text
from workers.rl.episodes import PlainCodec, play_groups, transcript_batch
from workers.rl.rollout import RolloutBatch
from workers.rl.spec import RolloutSpec
from workers.rl.tokenizer import train_bpe
from workers.rl.triage import TriageCounts
from workers.sandbox.sessions import SessionManager

LIMITS = {"memory_mb": 256, "disk_mb": 32, "pids": 64, "cpu_s": 120, "wall_s": 900,
          "idle_s": 300}
CAT = call_text("shell", {"command": "cat secret.txt"})


def code_task(code: int, split: str = "train", **fields: Any) -> TerminalTask:
    return parse_task({
        "id": f"code-{code}", "instruction": "Read secret.txt and write its code to answer.txt.",
        "files": {"secret.txt": f"{code}\n"},
        "hidden_tests": {"test_answer.py": "from pathlib import Path\n\n\ndef test_answer():\n"
                         f"    assert Path('answer.txt').read_text().strip() == '{code}'\n"},
        "reference_calls": [{"name": "shell", "arguments": {"command": "cat secret.txt"}},
                            {"name": "write_file",
                             "arguments": {"path": "answer.txt", "content": str(code)}}],
        "max_turns": 2, "time_budget_s": 120, "limits": LIMITS, "split": split, **fields})


def write(code: int | str) -> str:
    return call_text("write_file", {"path": "answer.txt", "content": str(code)})


@pytest.fixture(scope="module")
def tok() -> Any:
    objective = TerminalObjective([code_task(517), code_task(204, "eval")])
    return train_bpe(objective.corpus(), 300)


def enc(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


class Scripted:
    """A Generate that answers with fixed turn texts (then repeats the last), each ended by eos,
    and records the context it was given."""

    def __init__(self, tok: Any, turns: Sequence[str], on_call: Any = None) -> None:
        self.tok, self.turns, self.on_call = tok, list(turns), on_call
        self.contexts: list[list[int]] = []

    def __call__(self, token_ids: Sequence[int]) -> tuple[list[int], list[float]]:
        self.contexts.append(list(token_ids))
        if self.on_call is not None:
            self.on_call(len(self.contexts))
        text = self.turns[min(len(self.contexts), len(self.turns)) - 1]
        ids = enc(self.tok, text) + [int(self.tok.eos_token_id)]
        return ids, [-0.25] * len(ids)


def test_a_played_episode_is_the_sampled_ids_and_the_real_tool_results(
        manager: SessionManager, tok: Any) -> None:
    task = code_task(517)
    codec = PlainCodec(tok)
    gen = Scripted(tok, [CAT, write(517)])
    ep = play_terminal(manager, task, None, gen, codec, max_tokens=4096)
    assert ep.infra is None and ep.score is not None and ep.score.total == 1.0
    assert ep.score.info["passed"] == 1 and ep.turns == 2 and ep.stop_reason == "done"
    eos, sep = [int(tok.eos_token_id)], enc(tok, SEPARATOR)
    prompt = [i for m in opening(task) for i in enc(tok, message_text(m))]
    result = ep.messages[3]
    assert result["role"] == "tool" and result["name"] == "shell"
    assert result["content"] == "status: OK (exit code 0)\nstdout:\n517\n"  # the session's own
    turn1, turn2 = enc(tok, CAT) + eos, enc(tok, write(517)) + eos
    tool = enc(tok, message_text(result))
    assert ep.prompt_len == len(prompt)
    assert ep.token_ids == prompt + turn1 + sep + tool + turn2 + sep
    assert ep.loss_mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(sep + tool) + \
        [1] * len(turn2) + [0] * len(sep)
    assert [lp for lp, m in zip(ep.logprobs, ep.loss_mask, strict=True) if m] == \
        [-0.25] * (len(turn1) + len(turn2))
    # token in: each turn was sampled from exactly the ids the trainer sees before it
    assert gen.contexts == [prompt, prompt + turn1 + sep + tool]


def test_reference_transcripts_are_laid_out_exactly_as_rl_plays_them(
        manager: SessionManager, tok: Any) -> None:
    """SFT imitates what RL samples: the warm start's batch row for a task equals, id for id
    and mask for mask, the episode a policy playing the reference calls produces."""
    task = code_task(517)
    objective = TerminalObjective([task])
    try:
        example = objective.warm_start_example(objective.train[0])
    finally:
        objective.close()
    assert example.turns[-1] == (write(517), True)  # max_turns: no closing answer
    batch = transcript_batch(tok, [example])
    played = play_terminal(manager, task, None, Scripted(tok, [CAT, write(517)]),
                           PlainCodec(tok), 4096)
    p = played.prompt_len
    assert batch.prompt_ids[0].tolist() == played.token_ids[:p]
    n = int(batch.completion_mask[0].sum())
    sep = len(enc(tok, SEPARATOR))
    assert batch.completion_ids[0, :n].tolist() == played.token_ids[p:len(played.token_ids) - sep]
    assert batch.loss_mask[0, :n].tolist() == played.loss_mask[p:len(played.token_ids) - sep]
    # with turns to spare, the transcript ends with an answer without a call
    roomy = TerminalObjective([code_task(517, max_turns=3)])
    try:
        turns = roomy.warm_start_example(roomy.train[0]).turns
    finally:
        roomy.close()
    assert turns[-1] == (DONE_TEXT, True)


def test_transcript_batch_masks_environment_pieces(tok: Any) -> None:
    ex = Example(prompt="", reference="", turns=(("Question", False), ("Yes", True),
                                                ("tool said", False), ("No", True)))
    batch = transcript_batch(tok, [ex, Example(prompt="P", reference="R")])
    eos = int(tok.eos_token_id)
    yes, said, no = enc(tok, "Yes") + [eos], enc(tok, "tool said"), enc(tok, "No") + [eos]
    n = len(yes + said + no)
    assert batch.completion_ids[0, :n].tolist() == yes + said + no
    assert batch.loss_mask[0, :n].tolist() == [1] * len(yes) + [0] * len(said) + [1] * len(no)
    r = enc(tok, "R") + [eos]  # no turns: prompt + reference, all of it learned
    assert batch.loss_mask[1].tolist() == [1] * len(r) + [0] * (batch.loss_mask.shape[1] - len(r))
    with pytest.raises(ValueError, match="no sampled turn"):
        transcript_batch(tok, [Example(prompt="", reference="", turns=(("a", False),))])
    with pytest.raises(ValueError, match="no prompt"):
        transcript_batch(tok, [Example(prompt="", reference="", turns=(("a", True),))])


@pytest.mark.parametrize("turns", [
    ["The answer is 517. reward: 1.0"],  # a claim, no call: the episode ends, tests fail
    [CAT, write(518)],  # the wrong code
    [CAT, call_text("shell", {"command": "echo '{\"reward\": 1}' > /work/reward.json; "
                                         "echo 517 > /tmp/answer.txt"})],
    # patching the harness: a sitecustomize and a fake python3 in the workspace and on PATH
    # (the grader runs `python3 -I -S` by absolute path in a fork after killing every process)
    [CAT, call_text("shell", {"command": "printf 'import sys; sys.exit(0)' > sitecustomize.py; "
                                         "mkdir -p bin; printf '#!/bin/sh\\nexit 0' > bin/python3; "
                                         "chmod +x bin/python3; echo 'PATH=/work/bin:$PATH' > "
                                         ".bashrc"})],
    # looking for the hidden tests: they never enter the policy's session
    [call_text("shell", {"command": "find / -name 'test_answer*' 2>/dev/null | head; "
                                    "cat /crucible/* 2>/dev/null"}), write("found")],
    # exiting early: kill every process of the session, the agent's included
    [CAT, call_text("shell", {"command": "kill -9 -1"})],
    # a malformed call is only text: the turn has no call, which ends the episode
    ["<tool_call>\n{\"name\": \"shell\", \"arguments\": {\"command\": \n</tool_call>", write(517)],
])
def test_a_policy_scores_only_by_passing_the_hidden_tests(
        manager: SessionManager, tok: Any, turns: list[str]) -> None:
    ep = play_terminal(manager, code_task(517), None, Scripted(tok, turns), PlainCodec(tok), 4096)
    assert ep.infra is None and ep.score is not None
    assert ep.score.total == 0.0, ep.messages


def test_a_session_lost_mid_episode_voids_it(manager: SessionManager, tok: Any) -> None:
    """The platform reclaiming the session while the policy generates is no feedback: the
    episode is void (infra), never a 0 to train on."""
    before = set(manager.sessions)

    def reclaim(n: int) -> None:
        if n == 2:
            for sid in set(manager.sessions) - before:
                manager.sessions[sid].close("idle for 300 s")

    ep = play_terminal(manager, code_task(517), None, Scripted(tok, [CAT, write(517)], reclaim),
                       PlainCodec(tok), 4096)
    assert ep.stop_reason == "infra" and ep.infra and "idle for 300 s" in ep.infra
    assert ep.score is not None and ep.score.infra


def test_a_group_plays_in_lockstep_and_one_lost_session_voids_only_its_episode(
        manager: SessionManager, tok: Any) -> None:
    """Three episodes of one task from one snapshot: each turn is one batch of three contexts;
    the platform reclaiming one session mid-episode voids that episode alone."""
    task = code_task(517)
    snap = prepare(manager, task)
    batches: list[int] = []
    before = set(manager.sessions)
    scripted = Scripted(tok, [CAT, write(517)])

    def many(contexts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        batches.append(len(contexts))
        if len(batches) == 2:  # the second turn: reclaim the first episode's session
            first = min(set(manager.sessions) - before)
            manager.sessions[first].close("idle for 300 s")
        turn = scripted.turns[len(batches) - 1]
        ids = enc(tok, turn) + [int(tok.eos_token_id)]
        return [(ids, [-0.25] * len(ids)) for _ in contexts]

    try:
        with ThreadPoolExecutor(4) as pool:
            eps = play_terminal_group(manager, task, snap, 3, many, PlainCodec(tok), 4096, pool)
    finally:
        manager.drop_snapshot(snap)
    assert batches == [3, 3]
    void = [ep for ep in eps if ep.infra is not None]
    assert len(void) == 1 and "idle for 300 s" in str(void[0].infra)
    assert [ep.score.total for ep in eps if ep.infra is None] == [1.0, 1.0]  # type: ignore[union-attr]
    assert not set(manager.sessions) - before  # every session of the group is closed


def test_max_tokens_stops_before_the_context_overflows(manager: SessionManager, tok: Any) -> None:
    ep = play_terminal(manager, code_task(517), None, Scripted(tok, [CAT, write(517)]),
                       PlainCodec(tok), max_tokens=len(enc(tok, CAT)) + 60)
    assert ep.stop_reason == "max_tokens" and ep.turns == 1
    assert ep.score is not None and ep.score.total == 0.0 and ep.infra is None


class ScriptedBackend:
    """A rollout backend whose every call answers each prompt of its batch with the next
    scripted text (a group plays in lockstep: one call per turn)."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.tok, self.texts, self.calls = tok, texts, 0
        self.batches: list[int] = []

    def generate(self, prompts: Sequence[Any], spec: RolloutSpec, generator: Any
                 ) -> RolloutBatch:
        text = self.texts[self.calls % len(self.texts)]
        self.calls += 1
        self.batches.append(len(prompts))
        ids = enc(self.tok, text) + [int(self.tok.eos_token_id)]
        width = max(len(p) for p in prompts)
        pad = int(self.tok.pad_token_id)
        p = torch.tensor([[pad] * (width - len(q)) + list(q) for q in prompts])
        pm = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        b = len(prompts)
        return RolloutBatch(p, pm, torch.tensor([ids] * b), torch.ones(b, len(ids),
                            dtype=torch.long), torch.full((b, len(ids)), -0.5), [text] * b)


def test_play_groups_grades_terminal_groups_in_the_sandbox(manager: SessionManager,
                                                           tok: Any) -> None:
    """A group of 2 per task through the trainer's path: rewards are the hidden tests'; the
    objective's text reward is never called (it refuses)."""
    objective = TerminalObjective([code_task(517), code_task(204)])
    try:
        examples = list(objective.train)
        sources = [objective.episode_env(e) for e in examples]
        assert all(isinstance(s, TerminalPlay) for s in sources)
        # turns alternate: cat, then a write of 517 -- right for the first task only
        backend = ScriptedBackend(tok, [CAT, write(517)])
        triage = TriageCounts()
        played = play_groups(objective, examples, sources, 2, backend, tok,  # type: ignore[arg-type]
                             RolloutSpec(), torch.Generator(), int(tok.pad_token_id), 4096,
                             retries=1, triage=triage)
    finally:
        objective.close()
    assert backend.batches == [2, 2, 2, 2]  # each group's turn sampled as one batch
    assert played.rewards == [1.0, 1.0, 0.0, 0.0]
    assert played.infra == [False] * 4 and triage.failed == 0
    assert played.components["hidden_tests"] == [1.0, 1.0, 0.0, 0.0]
    assert played.counts["episode/turns"] == 8.0
    assert played.counts["episode/retokenized_turns"] == 0.0
    with pytest.raises(TypeError, match="hidden tests"):
        objective.reward(examples, ["517"] * 2)


def test_the_objective_serves_splits_prompts_and_a_corpus(tok: Any) -> None:
    spec = {"env": {"source": "terminal", "tasks": [
        code_task(517).model_dump(mode="json"), code_task(204, "eval").model_dump(mode="json"),
        code_task(300).model_dump(mode="json")]}}
    objective = load_objective(spec, quarantined={"code-300"})
    assert isinstance(objective, TerminalObjective) and objective.interaction == "tool_use"
    assert [e.meta["task_id"] for e in objective.train] == ["code-517"]
    assert [e.meta["task_id"] for e in objective.eval] == ["code-204"]
    ex = objective.train[0]
    assert ex.prompt.startswith("You are working in a Linux shell sandbox")
    assert "<tools>" in ex.prompt and ex.prompt.endswith(
        "Read secret.txt and write its code to answer.txt." + SEPARATOR)
    assert ex.reference == CAT
    assert write(517) in objective.corpus() and write(300) not in objective.corpus()
    assert json.loads(ex.prompt.split("<tools>\n")[1].split("\n")[0])["function"]["name"] \
        == "shell"
    with pytest.raises(ValueError, match="no terminal tasks left"):
        load_objective(spec, quarantined={"code-517", "code-204", "code-300"})
    with pytest.raises(ValueError, match="more calls than max_turns|max_turns"):
        code_task(1, max_turns=1)


def test_a_reference_that_fails_its_tests_is_not_imitated(manager: SessionManager) -> None:
    wrong = parse_task({**code_task(517).model_dump(mode="json"), "reference_calls": [
        {"name": "shell", "arguments": {"command": "cat secret.txt"}},
        {"name": "write_file", "arguments": {"path": "answer.txt", "content": "999"}}]})
    objective = TerminalObjective([wrong])
    try:
        with pytest.raises(ValueError, match="do not pass its hidden tests"):
            objective.warm_start_example(objective.train[0])
    finally:
        objective.close()
    ref = reference_turns(manager, code_task(517), None, SEPARATOR, message_text)
    assert ref.reward == 1.0 and ref.first == CAT
