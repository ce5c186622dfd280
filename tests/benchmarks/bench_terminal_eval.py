"""Terminal-task evaluation throughput: `evaluate_terminal` on 8 tasks x 4 samples, each
sample a 3-turn episode (write a file, run it, answer) against a scripted OpenAI-compatible
server over loopback HTTP, in real sandbox sessions, graded by hidden tests in a fork.

Run: `python -m tests.benchmarks.bench_terminal_eval` (root, bubblewrap). No peer runs here
(Terminal-Bench's harness needs Docker): the figures have no peer fields."""

from __future__ import annotations

import statistics

from tests.skips import sandbox_unavailable
from tests.workers.envs.chat_server import chat_server
from tests.workers.envs.test_terminal_eval import SOLVE, answer_task, solver
from workers.envs.eval import EndpointPolicy
from workers.envs.spec import EndpointPolicySpec
from workers.envs.terminal.evaluate import evaluate_terminal

TASKS, SAMPLES, REPEATS = 8, 4, 3


def main() -> None:
    reason = sandbox_unavailable()
    if reason:
        raise SystemExit(f"sessions unavailable here: {reason}")
    tasks = [answer_task(id=f"t{i}", instruction=SOLVE, split="eval") for i in range(TASKS)]
    with chat_server(solver) as server:
        for concurrency in (1, 4):
            rates = []
            for _ in range(REPEATS):
                policy = EndpointPolicy(EndpointPolicySpec(base_url=server.url, model="m"))
                report = evaluate_terminal(tasks, policy, samples_per_task=SAMPLES,
                                           concurrency=concurrency)
                assert report["summary"]["errors"] == 0
                assert report["summary"]["pass_at"]["1"] == 1.0
                rates.append(report["summary"]["samples"] / report["timings"]["total_s"])
            print(f"terminal_eval_samples_per_s_c{concurrency}: "
                  f"crucible={statistics.median(rates):.2f}")


if __name__ == "__main__":
    main()
