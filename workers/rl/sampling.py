"""A generation request and its answer, as the continuous scheduler (`workers.rl.continuous`)
takes and gives them: shared by the served policy (`workers.inference`) and the RL engine's
rollouts, which run on that one scheduler."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch

from workers.rl.rollout import Prompt, SamplingControls, TokenConstraint


@dataclass(frozen=True)
class SamplingParams:
    """Requests with equal params can share a batch."""

    temperature: float  # 0 = greedy
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # alternatives per position to return
    top_k: int = 0  # vLLM's controls (0 / 0.0 / 1.0: off)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted
    # structured output: builds each row's constraint (grammar.Grammar); None: free text
    constraint: Callable[[], TokenConstraint] | None = None

    def controls(self) -> SamplingControls:
        return SamplingControls(self.top_k, self.min_p, self.repetition_penalty,
                                self.logit_bias, self.constraint)


@dataclass
class Sample:
    token_ids: list[int]  # sampled tokens, including a final eos
    logprobs: list[float]  # per token, under the sampling distribution (see `Policy.generate`)
    top_logprobs: list[list[tuple[int, float]]]  # per token, when requested
    text: str  # decoded, cut at the first stop string
    finish_reason: Literal["stop", "length"]
    eos: bool = False  # the last token is the end of sequence (a stop signal, not text)
    # Mixture-of-experts routes, when the scheduler records them (training rollouts): the
    # prompt's (P,L,k) and the completion's (C,L,k), the last sampled token's NO_ROUTE (it is
    # never fed through the model); see `workers.rl.routing`.
    routes: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, kw_only=True)

    @property
    def text_tokens(self) -> int:
        """Completion tokens as usage counts them: the eos is not one."""
        return len(self.token_ids) - int(self.eos)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one row (the request's own row: prompt-major, n per prompt)."""

    row: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class Job:
    prompts: list[Prompt]
    n: int
    params: SamplingParams
    seed: int | None
    future: Future = field(default_factory=Future)
    on_token: Callable[[TokenEvent], None] | None = None  # called on the batcher's thread

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n


class JobInbox:
    """Where request threads leave `Job`s for the one thread that owns the model (the
    server's batchers, the continuous scheduler): `submit` queues, `close` stops taking new
    ones and waits for the owning thread, which reads `_jobs` under `_cv`."""

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None  # set by the subclass, then started

    def submit(self, prompts: list[Prompt], n: int, params: SamplingParams,
               seed: int | None, on_token: Callable[[TokenEvent], None] | None = None
               ) -> Future:
        """Future of `list[list[Sample]]`: per prompt, its n samples. `on_token` (called on
        the owning thread) receives each of the job's tokens as it is sampled."""
        self._check(n)
        job = Job(prompts, n, params, seed, on_token=on_token)
        with self._cv:
            if self._closed:
                raise RuntimeError("the inference server is shutting down")
            self._jobs.append(job)
            self._cv.notify()
        return job.future

    def _check(self, n: int) -> None:
        """Refuse a request before it is queued (a subclass's limits)."""

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
