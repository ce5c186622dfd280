"""The training loop: SFT warm start, then GRPO-family RL, on a DeepSpeed ZeRO engine.

One step = sample `prompts_per_step` prompts (split over ranks) x `group_size` completions,
score them, compute group-relative advantages, then one optimizer step per
`updates_per_batch` over micro-batches (gradient accumulation is DeepSpeed's).
Every source of randomness in a step is derived from (seed, step, rank), so a resumed run
replays exactly what an uninterrupted one would have done.

Engine set-up lives in `workers.rl.engine`, the completion forward in `workers.rl.forward`,
the losses and advantages as pure functions in `losses` / `advantages`; this module only
sequences the phases and their steps.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workers import threads
from workers.reporting import Reporter, Stopped
from workers.rl import advantages as adv_lib
from workers.rl import balance, expert_parallel
from workers.rl import checkpoint as ckpt
from workers.rl.actor import (
    AsyncActor,
    Producer,
    RolloutLauncher,
    RolloutSetup,
    RolloutSource,
    Seeds,
    StepBatch,
    WeightStore,
    lag_histogram,
    rollout_copy,
)
from workers.rl.curriculum import TaskSampler
from workers.rl.distributed import (
    all_reduce_max,
    all_reduce_sum,
    any_rank,
    from_rank0,
    on_cuda,
    process_group,
)
from workers.rl.engine import clip_gradients, frozen_copy, make_engine, use_bf16, weight_snapshot
from workers.rl.episodes import (
    EpisodeBatch,
    episodic,
    loss_mask,
    norm_len,
    play_groups,
    plays_episodes,
    transcript_batch,
)
from workers.rl.forward import (
    Router,
    completion_batch,
    forward_completion,
    forward_routed,
    reference_logprobs,
    replay_self_test,
)
from workers.rl.lora import AdaptersOff, is_lora
from workers.rl.losses import (
    aggregate,
    dpo_loss,
    entropy,
    kl_k3,
    load_balancing_loss,
    masked_mean,
    policy_loss,
    router_statistics,
    stacked,
    token_logprobs,
)
from workers.rl.model import build_policy, is_moe
from workers.rl.objectives import Example, Objective
from workers.rl.objectives.environment import objective_from_spec
from workers.rl.pinned_data import PinnedData
from workers.rl.preference import check_pinned, preference_phase
from workers.rl.prompt_format import PromptFormat
from workers.rl.rollout import RolloutBatch, make_backend
from workers.rl.route_taps import replayable_routers
from workers.rl.routing import MismatchMeter, check_replayed
from workers.rl.samples import finish_reason, pick_samples, reports_at
from workers.rl.sinks import JsonlSink, MultiSink, NullSink, StdoutSink
from workers.rl.spec import DEFAULT_VOCAB_SIZE, MODE_SETTINGS, ModelSpec, RunSpec
from workers.rl.tokenizer import load_tokenizer, train_bpe
from workers.rl.triage import InfraFailure, TriageCounts, grade

# What every rank does at a safe point (`Trainer.agreed_stop`).
GO, CHECKPOINT_AND_STOP, STOP = 0, 1, 2


class TrainingFailed(RuntimeError):
    """The run stopped cleanly (e.g. too many consecutive NaN steps); checkpoints are intact."""


@dataclass
class RunResult:
    """What a finished run hands back to its caller (the CLI, a Celery task, a benchmark)."""

    steps: int
    eval_reward: dict[int, float] = field(default_factory=dict)  # RL step -> held-out reward
    losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    final_dir: str | None = None
    steps_per_s: float = 0.0
    train_time: dict[int, float] = field(default_factory=dict)  # step -> RL wall s, no evals
    curriculum: dict[str, Any] = field(default_factory=dict)  # rank 0's sampler state at end


@dataclass
class Learner:
    """What the RL phase trains with, built once before its first step: the engine and its
    frozen reference, the rollout side, and the batch layout every update follows."""

    engine: Any  # a DeepSpeed engine over the policy
    ref: torch.nn.Module | None  # the frozen KL / DPO reference, None when neither is on
    backend: Any  # the rollout backend the learner samples (and evaluates) with
    producer: Producer
    sampler: TaskSampler
    model_spec: ModelSpec  # the policy as built (the warm start's output when there is one)
    micro: int  # sequences per micro-batch
    moe: bool
    top_k: int  # experts per token, 0 for a dense model
    vllm: bool  # the backend holds its own weights: every update is pushed to it
    # The warm-start folder each checkpoint carries (as warm/), when the RL phase needs it
    # beyond the policy: a KL/DPO reference or a LoRA policy's frozen base is built from it.
    warm: Path | None = None


def expert_load(counts: torch.Tensor) -> dict[str, float]:
    """Per-layer routing metrics from (layers, experts) token counts: each layer's load
    entropy normalised to [0, 1] (1 = perfectly even) and each expert's token count."""
    # All layers in one pass of tensor ops (each row's reduction is the per-layer one, up to
    # the order a CPU's vector units sum a row in), read out with one tolist each.
    p = counts / counts.sum(-1, keepdim=True).clamp(min=1.0)
    ent = (-(p * p.clamp(min=1e-12).log()).sum(-1) / math.log(counts.shape[-1])).tolist()
    out: dict[str, float] = {}
    for layer, row in enumerate(counts.tolist()):
        out[f"moe/layer{layer}/load_entropy"] = ent[layer]
        for e, c in enumerate(row):
            out[f"moe/layer{layer}/expert{e}_tokens"] = c
    return out


class Trainer:
    """One run's phases on one rank: SFT, then (in `workers.rl.preference`) DPO, then RL.

    Built by `train`; holds what every phase reads (the spec, the objective, the sink, the rank's
    place in the world) and no engine: each phase builds its own and drops it when done."""

    def __init__(
        self, spec: RunSpec, sink: Reporter | None, objective: Objective | None, rank: int,
        world: int, pinned: PinnedData | None = None, rollouts: RolloutLauncher | None = None,
    ) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.seeds = Seeds(spec.trainer.seed)
        # Out-of-process rollout actors (a run on Ray with cluster.rollout_actors): the rank
        # then trains only, and pushes its weights to its actor after every update.
        self.rollouts = rollouts
        if spec.cluster is not None and spec.cluster.rollout_actors and rollouts is None:
            raise ValueError("cluster.rollout_actors places rollout actors on a Ray cluster: "
                             "this run was started on one host without Ray; start it on Ray "
                             "(a multi-node allocation, workers.cluster.ray_job) or set "
                             "cluster.rollout_actors = 0")
        if rollouts is None and spec.trainer.async_actor == "process":
            from workers.rl.process_actor import ProcessRollouts

            self.rollouts = ProcessRollouts()  # the actor in a child process on this host
        if objective is not None and (spec.task is not None or spec.environment is not None):
            field = "task" if spec.task is not None else "environment"
            raise ValueError(f"this run trains on the environments it was given; its config's "
                             f"{field} would be ignored: remove it")
        self.objective = objective or objective_from_spec(spec)
        self.pinned = pinned or PinnedData()
        check_pinned(spec, self.pinned)
        # Prompts are plain text, never a chat template: recorded with every saved model.
        self.prompt_format = PromptFormat(
            format="raw", layout="episode" if plays_episodes(self.objective) else "single_turn")
        self.cache: Any = None  # workers.rl.datacache.DataCache when data.source is set
        self.episode_tok: Any = None  # the evaluation's tokenizer copy for episodic objectives
        if spec.data.source is not None:
            from workers.rl.datacache import records_objective
            from workers.storage import default_store

            self.cache, self.objective = records_objective(self.objective, spec.data,
                                                           default_store())
        if spec.rollout.backend == "vllm" and rollouts is None:  # else the actors run vLLM
            from workers.rl.vllm_rollout import INSTALL_HINT, VllmUnavailable, import_vllm

            import_vllm()  # fail before SFT, naming what to install, not after it
            if not torch.cuda.is_available():
                raise VllmUnavailable(f"{INSTALL_HINT}; no CUDA device is visible")
        self.root = Path(spec.checkpoint.folder)
        self.sink: Reporter = (sink or default_sink(spec)) if rank == 0 else NullSink()
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if on_cuda() else "cpu"
        )
        self.meter: MismatchMeter | None = None  # open during a step's first update
        # The policy's top-k routers (None: not a Qwen3-MoE), looked up once per step.
        self.routers: list[torch.nn.Module] | None = None
        self.step_load: torch.Tensor | None = None  # (L,E) loads of the step so far
        self.global_counts: torch.Tensor | None = None  # global_aux: the update's loads
        if spec.moe.router_replay and plays_episodes(self.objective):
            raise ValueError("moe.router_replay replays routes the sampler recorded, and "
                             "multi-turn / tool-use episodes do not record them yet: use a "
                             "single-turn objective or moe.router_replay = false")
        self.check_world()

    def check_world(self) -> None:
        """Refuse, before any phase starts, a layout the ranks could not train together."""
        ts, world = self.spec.trainer, self.world
        if world > 1 and ts.zero_stage == 3 and plays_episodes(self.objective):
            # ZeRO-3 ranks gather parameters collectively in every forward, but episodes take
            # as many generate calls as their turns, which differ between ranks.
            raise ValueError(
                f"multi-turn / tool-use tasks cannot run with trainer.zero_stage = 3 on {world} "
                "ranks (episodes generate a different number of turns per rank); use "
                "zero_stage 0-2 or a single rank"
            )
        if self.spec.moe.expert_parallel > 1 and plays_episodes(self.objective):
            raise ValueError("moe.expert_parallel exchanges tokens between ranks in every "
                             "forward, and multi-turn / tool-use episodes generate a different "
                             "number of turns per rank; use a single-turn objective")
        if self.spec.algorithm.overlong_buffer and plays_episodes(self.objective):
            raise ValueError("algorithm.overlong_buffer shapes single-turn completions against "
                             "rollout.max_new_tokens; this objective plays multi-turn episodes")
        ep = self.spec.moe.expert_parallel
        if world % ep:
            raise ValueError(f"moe.expert_parallel = {ep} must divide the world size {world}: "
                             "ranks form world / expert_parallel groups of that many ranks")
        if ts.prompts_per_step % world:
            raise ValueError(
                f"trainer.prompts_per_step={ts.prompts_per_step} must be divisible by the "
                f"world size {world}"
            )

    # ---- helpers -------------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait for every rank (a no-op without a process group)."""
        if dist.is_initialized():
            dist.barrier()

    def agreed_stop(self) -> int:
        """What every rank does at this safe point, as rank 0's reporter says (it alone holds
        the run's): GO on, CHECKPOINT_AND_STOP (a preemption), or STOP at once (a cancel or a
        lost lease: another worker may own the run, so nothing more is written). Broadcast, so
        all ranks take the same branch into the collectives that follow."""
        code = GO
        if self.rank == 0 and self.sink.should_stop():
            code = CHECKPOINT_AND_STOP if self.sink.preempted() else STOP
        return from_rank0(code)

    def warmup_stop(self, phase: str, step: int) -> None:
        """A warm-up phase's safe point. SFT and DPO keep no resumable state until they finish
        (only their final model), so any stop ends the run here, with nothing to save: the
        next attempt trains the phase again."""
        if self.agreed_stop() != GO:
            raise Stopped(f"stopped during {phase} at step {step}; the warm start keeps no "
                          "checkpoint before it ends and is trained again on resume")

    def generator(self, *key: int) -> torch.Generator:
        """A generator seeded by (seed, *key): the same draw on a resumed run as on the
        uninterrupted one."""
        return self.seeds.generator(*key)

    def permutation(self, epoch: int, n: int) -> list[int]:
        """The seeded shuffle of the training set for one epoch (same on every rank)."""
        return self.seeds.permutation(epoch, n)

    def tokenizer(self) -> Any:
        """The model's own tokenizer, or a BPE trained on the objective's and pinned data's text."""
        if self.spec.tokenizer.source == "model":
            assert self.spec.model.path is not None
            return load_tokenizer(self.spec.model.path)
        return train_bpe(self.objective.corpus() + self.pinned.corpus(),
                         self.spec.tokenizer.vocab_size or DEFAULT_VOCAB_SIZE)

    def sft_example(self, index: int) -> Example:
        """SFT example ``index`` of the objective's references (when sft.environment) followed by
        the pinned SFT datasets' pairs."""
        own = len(self.objective.train) if self.spec.sft.environment else 0
        if index < own:
            warm = getattr(self.objective, "warm_start_example", None)  # whole episodes
            return warm(self.objective.train[index]) if warm else self.objective.train[index]
        prompt, completion = self.pinned.sft[index - own]
        return Example(prompt=prompt, reference=completion)

    # ---- SFT -----------------------------------------------------------------------------

    def sft(self, tok: Any) -> Path:
        """Cross-entropy on references; saves the warm-started policy as `<dir>/sft`."""
        spec, out = self.spec, self.root / "sft"
        if (out / "config.json").is_file() or spec.sft.steps == 0:
            return out
        model = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
        # The initial policy's held-out reward, measured as RL measures it later, so the run
        # summary can tell what SFT gained from what RL gained.
        model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' to() stub
        with torch.no_grad():
            before = self.evaluate(make_backend("hf", model, tok, False), tok)
        model.train()
        self.sink.log(0, {"eval/reward_before_sft": before})
        per_rank = max(1, spec.sft.batch_size // self.world)
        # Constant LR for the warm start; the RL schedule belongs to the RL phase.
        ts = spec.trainer.model_copy(update={"schedule": "constant", "warmup_steps": 0})
        engine = make_engine(model, ts, spec.sft.lr, spec.sft.steps, per_rank, 1)
        moe = is_moe(model)
        own = len(self.objective.train) if spec.sft.environment else 0
        n_examples = own + len(self.pinned.sft)
        for step in range(spec.sft.steps):
            self.warmup_stop("SFT", step)
            g = self.generator(20_000 + step, self.rank)
            idx = torch.randint(n_examples, (per_rank,), generator=g)
            examples = [self.sft_example(int(i)) for i in idx]
            batch = transcript_batch(tok, examples) if any(e.turns for e in examples) \
                else completion_batch(tok, examples)
            loss = self.sft_loss(engine, batch, moe)
            engine.backward(loss)
            engine.step()
            if step % 10 == 0 or step == spec.sft.steps - 1:
                val = float(all_reduce_sum(loss.detach().cpu().reshape(1))) / self.world
                self.sink.log(step, {"sft/loss": val})
        ckpt.save_hf_atomic(engine.module, tok, out, spec.trainer.zero_stage, self.prompt_format)
        self.sink.event("info", f"SFT warm start done after {spec.sft.steps} steps", {})
        del engine
        return out

    def sft_loss(self, engine: Any, batch: RolloutBatch, moe: bool) -> torch.Tensor:
        """Mean token cross-entropy of the references, plus the router auxiliary loss."""
        # transformers' own forward: the warm start every later RL run (and the benchmark,
        # for both engines) begins from stays bit-identical to earlier versions.
        logits, router, flat_mask = forward_completion(
            engine, batch, slice(None), moe, self.device, lean=False
        )
        mask = loss_mask(batch).to(self.device).float()  # a transcript's sampled turns only
        logp = token_logprobs(logits, batch.completion_ids.to(self.device))
        loss = -masked_mean(logp, mask)
        if router is not None:
            k = engine.module.config.num_experts_per_tok
            loss = loss + self.spec.model.router_aux_loss_coef * load_balancing_loss(
                router, k, flat_mask
            )
        return loss

    def evaluate(self, backend: Any, tok: Any) -> float:
        """Mean reward on held-out prompts, sampled at the rollout temperature."""
        ev = list(self.objective.eval)
        mine = [e for i, e in enumerate(ev) if i % self.world == self.rank] or ev[:1]
        weight = 1.0 if any(i % self.world == self.rank for i in range(len(ev))) else 0.0
        reps = [e for e in mine for _ in range(self.spec.trainer.eval_samples)]
        sources = episodic(self.objective, mine) if plays_episodes(self.objective) else []
        retries = self.spec.triage.retries
        if any(sources):  # multi-turn / tool use: the held-out reward of whole episodes
            played = play_groups(
                self.objective, mine, sources, self.spec.trainer.eval_samples, backend,
                # before RL (SFT's starting point) no actor thread shares `tok`
                self.episode_tok or tok, self.spec.rollout, self.generator(30_000),
                tok.pad_token_id, getattr(self.objective, "episode_max_tokens", 4096), retries)
            rewards, infra = played.rewards, played.infra
        else:
            batch = backend.generate([e.prompt for e in reps], self.spec.rollout,
                                     self.generator(30_000))
            graded = grade(self.objective.reward, reps, batch.texts, retries, TriageCounts())
            rewards, infra = graded.rewards, graded.infra
        # a sample the platform failed is left out of the mean, not counted as 0
        valid = [r for r, bad in zip(rewards, infra, strict=True) if not bad]
        tot = all_reduce_sum(torch.tensor([sum(valid) * weight, len(valid) * weight]))
        if float(tot[1]) == 0.0:
            raise InfraFailure("every held-out sample failed for infrastructure reasons "
                               "(sandbox errors, lost sessions): no evaluation reward")
        return float(tot[0] / tot[1])

    # ---- RL: set-up ----------------------------------------------------------------------

    def rl(self, tok: Any, sft_dir: Path, resume: bool) -> RunResult:
        """GRPO-family RL from the warm start in `sft_dir` (or the spec's initial model), or
        from the latest checkpoint when resuming; saves `<dir>/final` when asked."""
        ts = self.spec.trainer
        lrn = self.learner(tok, sft_dir)
        result = RunResult(steps=0)
        start, nan_streak = self.rl_start(lrn, tok, resume, result)
        self.stop_before_rl(lrn, tok, start)
        store = WeightStore()
        actor = self.start_actor(lrn, tok, store, start, sft_dir)
        t_run = t_end = time.perf_counter()
        t_evals = 0.0
        try:
            for step in range(start, ts.steps):
                sb, metrics, skipped = self.rl_step(lrn, step, actor)
                nan_streak = self.track_finite(step, metrics, skipped, nan_streak, result)
                done = step + 1
                result.train_time[done] = time.perf_counter() - t_run - t_evals
                if ts.eval_every and done % ts.eval_every == 0:
                    t0 = time.perf_counter()
                    result.eval_reward[done] = metrics["eval/reward_mean"] = self.evaluate(
                        lrn.backend, tok)
                    t_evals += time.perf_counter() - t0
                saved = self.report_step(lrn, tok, sb, done, metrics, skipped, nan_streak)
                result.steps = done
                result.curriculum = sb.sampler_state
                self.stop_after_step(lrn, tok, done, sb.sampler_state, nan_streak, metrics,
                                     saved)
            t_end = time.perf_counter()  # stopping the actor is not training time
        finally:
            if actor is not None:
                actor.stop()
        elapsed = t_end - t_run - t_evals
        result.steps_per_s = (ts.steps - start) / elapsed if elapsed > 0 else 0.0
        self.rl_finish(lrn, tok, result)
        return result

    def micro_batch(self) -> int:
        """Sequences per micro-batch: it must divide the sequences each rank trains on."""
        ts = self.spec.trainer
        n_seq = ts.prompts_per_step // self.world * self.spec.rollout.group_size  # per rank
        micro = min(ts.micro_batch_size, n_seq)
        if n_seq % micro:
            raise ValueError(
                f"trainer.micro_batch_size={micro} must divide the {n_seq} sequences each rank "
                f"trains on per step (prompts_per_step / world * group_size)"
            )
        return micro

    def learner(self, tok: Any, sft_dir: Path) -> Learner:
        """The policy's engine, its frozen reference, the rollout backend and the producer
        that samples each step's batch."""
        spec, ts, algo = self.spec, self.spec.trainer, self.spec.algorithm
        micro = self.micro_batch()
        gas = ts.prompts_per_step // self.world * spec.rollout.group_size // micro
        model_spec = spec.model
        if (sft_dir / "config.json").is_file():
            model_spec = model_spec.model_copy(update={"source": "path", "path": str(sft_dir)})
        policy = build_policy(model_spec, len(tok), tok.pad_token_id, tok.eos_token_id)
        moe = is_moe(policy)
        top_k = policy.config.num_experts_per_tok if moe else 0
        ref: torch.nn.Module | None = None
        if (algo.kl_coef > 0 or algo.dpo_coef > 0) and is_lora(policy):
            ref = AdaptersOff(policy)  # the base = the policy with adapters off: no copy
        elif algo.kl_coef > 0 or algo.dpo_coef > 0:
            ref = frozen_copy(policy, self.device, use_bf16(ts))
        if spec.moe.balance == "aux_free" and moe:  # after the reference copy: it keeps none
            routers = replayable_routers(policy)
            if routers is None:
                raise ValueError("moe.balance = 'aux_free' needs a Qwen3-MoE with a sparse "
                                 "MoE block in every layer")
            balance.attach(routers)
        if spec.moe.expert_parallel > 1:  # after the reference copy: it stays whole
            self.shard_experts(policy, moe)
        total_opt_steps = ts.steps * algo.updates_per_batch
        engine = make_engine(policy, ts, ts.lr, total_opt_steps, micro, gas, own_clip=True)
        if spec.moe.router_replay:  # fail before step 1 if replay cannot bind every layer
            replay_self_test(engine, len(tok), self.device, ts.seed)
        backend = self.rollout_backend(engine, tok, sft_dir)
        per_rank = ts.prompts_per_step // self.world
        # Store-backed records give their own shard-major order, so prefetch runs ahead.
        order = getattr(self.objective.train, "order", None) or self.seeds.permutation
        sampler = TaskSampler(self.objective.train, spec.curriculum, ts.seed, self.rank,
                              self.world, order)
        episodes = plays_episodes(self.objective)
        # Episodes encode environment replies and decode sampled turns: the producer (the
        # actor thread when async) and the learner's evaluation each get a tokenizer copy.
        self.episode_tok = copy.deepcopy(tok) if episodes else None
        producer = Producer(spec, self.objective, sampler, tok.pad_token_id, per_rank,
                            self.rank, self.seeds.generator, ts.max_async_steps,
                            tokenizer=copy.deepcopy(tok) if episodes else None)
        warm = (sft_dir if (sft_dir / "config.json").is_file()
                and (ref is not None or is_lora(policy)) else None)
        return Learner(engine=engine, ref=ref, backend=backend, producer=producer,
                       sampler=sampler, model_spec=model_spec, micro=micro, moe=moe,
                       top_k=top_k, warm=warm,
                       vllm=spec.rollout.backend == "vllm" and self.rollouts is None)

    def shard_experts(self, policy: torch.nn.Module, moe: bool) -> None:
        """Keep only this rank's share of every MoE layer's experts (`moe.expert_parallel`),
        on DeepSpeed's expert groups, so the engine built next reduces their gradients over the
        ranks holding the same experts."""
        ep = self.spec.moe.expert_parallel
        if not moe:
            raise ValueError(f"moe.expert_parallel = {ep} needs a mixture-of-experts model; "
                             "this one has no sparse MoE layers")
        names = expert_parallel.shard_experts(policy, expert_parallel.deepspeed_layout(ep))
        self.sink.event("info", f"expert parallel: {len(names)} MoE layers sharded over groups "
                        f"of {ep} ranks", {"expert_parallel": ep, "layers": len(names)})

    def lockstep(self) -> bool:
        """Whether every rank must run the same number of forwards when sampling: ZeRO-3
        gathers parameters and expert parallelism exchanges tokens in each one."""
        return self.spec.trainer.zero_stage == 3 or self.spec.moe.expert_parallel > 1

    def rollout_backend(self, engine: Any, tok: Any, sft_dir: Path) -> Any:
        """The learner's sampler: the engine's own module, or a vLLM engine with its copy."""
        spec = self.spec
        # With rollout actors vLLM runs on their GPUs; the rank evaluates with its own module.
        if spec.rollout.backend != "vllm" or self.rollouts is not None:
            return make_backend("hf" if self.rollouts is not None else spec.rollout.backend,
                                engine.module, tok, self.lockstep(), spec.rollout.engine)
        from workers.rl.vllm_rollout import VllmRollout

        return VllmRollout(self.vllm_dir(engine, tok, sft_dir), tok, spec.vllm, version=0)

    def vllm_dir(self, engine: Any, tok: Any, sft_dir: Path) -> Path:
        """vLLM loads config, weights and tokenizer from a directory: the SFT output, or the
        initial policy written out once (under the checkpoint folder, which every node sees)."""
        if (sft_dir / "config.json").is_file():
            return sft_dir
        init_dir = self.root / "vllm-init"
        ckpt.save_hf_atomic(engine.module, tok, init_dir, self.spec.trainer.zero_stage,
                            self.prompt_format)
        return init_dir

    def rl_start(self, lrn: Learner, tok: Any, resume: bool,
                 result: RunResult) -> tuple[int, int]:
        """Restore the latest checkpoint when resuming (returns its step and NaN streak);
        otherwise measure the starting policy's held-out reward as step 0's."""
        last = ckpt.latest(self.root) if resume else None
        if last is None:
            result.eval_reward[0] = self.evaluate(lrn.backend, tok)
            self.sink.log(0, {"eval/reward_mean": result.eval_reward[0]})
            return 0, 0
        state = ckpt.load(lrn.engine, last)
        start, nan_streak = state["step"], state["nan_streak"]
        rank_state = ckpt.load_rank_state(last)
        if rank_state is not None:
            lrn.sampler.load_state_dict(rank_state["sampler"])
        else:  # a checkpoint from before the curriculum: only the global cursor is known
            lrn.sampler.cursor = state["cursor"] // self.world
        self.sink.event("info", f"resumed from {last} at step {start}", {"step": start})
        if lrn.vllm and start:
            lrn.backend.load_state(weight_snapshot(lrn.engine.module,
                                                   self.spec.trainer.zero_stage, merged=True),
                                   start)
        return start, nan_streak

    def start_actor(self, lrn: Learner, tok: Any, store: WeightStore, start: int,
                    sft_dir: Path) -> RolloutSource | None:
        """Where the batches come from when the rank does not sample inline: rollout actors
        in other processes (on Ray, or `trainer.async_actor = "process"` on this host), else
        the asynchronous actor thread when
        `max_async_steps` allows one, else None."""
        ts = self.spec.trainer
        aux_free = self.spec.moe.balance == "aux_free" and lrn.moe
        if self.rollouts is not None:
            vllm = self.spec.rollout.backend == "vllm"
            setup = RolloutSetup(
                producer=lrn.producer, model_spec=lrn.model_spec, tokenizer=copy.deepcopy(tok),
                start=start, total=ts.steps, bound=ts.max_async_steps,
                timeout=ts.sync_timeout_s, bf16=use_bf16(ts), aux_free=aux_free,
                vllm_dir=str(self.vllm_dir(lrn.engine, tok, sft_dir)) if vllm else None,
                vllm=self.spec.vllm if vllm else None, engine=self.spec.rollout.engine)
            return self.rollouts.start(setup, self.snapshot(lrn))
        if not ts.max_async_steps:
            return None
        gen_model = rollout_copy(lrn.model_spec, tok, self.device, use_bf16(ts), aux_free)
        store.publish(start, self.snapshot(lrn))
        backend = make_backend("hf", gen_model, copy.deepcopy(tok), False,
                               self.spec.rollout.engine)
        actor = AsyncActor(lrn.producer, gen_model, backend,
                           store, start, ts.steps, ts.max_async_steps, ts.sync_timeout_s)
        actor.start()
        return actor

    def snapshot(self, lrn: Learner, clone: bool = True) -> dict[str, torch.Tensor]:
        """The weights the rollout side samples with (collective under ZeRO-3): merged full
        weights for a vLLM rollout actor, else what `weight_snapshot` gives a policy copy
        (`clone=False`: uncopied, for a source that copies what it is given before returning)."""
        merged = self.rollouts is not None and self.spec.rollout.backend == "vllm"
        return weight_snapshot(lrn.engine.module, self.spec.trainer.zero_stage, merged=merged,
                               clone=clone)

    # ---- RL: one step --------------------------------------------------------------------

    def rl_step(self, lrn: Learner, step: int, actor: RolloutSource | None,
                ) -> tuple[StepBatch, dict[str, float], bool]:
        """Sample (or take the actor's) batch, learn from it, hand the new weights to the
        sampler; returns the batch, the step's metrics and whether the step was skipped."""
        ts = self.spec.trainer
        t_step = time.perf_counter()
        if actor is not None:
            sb = actor.get(step)
        else:
            backend = lrn.backend
            lockstep_agree = any_rank if (self.world > 1 and self.lockstep()) else None

            def current(s: int = step) -> tuple[int, Any]:
                return s, backend

            sb = lrn.producer.produce(step, current, lockstep_agree)
        t_wait = time.perf_counter() - t_step
        metrics, skipped = self.learn(lrn.engine, sb, lrn.ref, lrn.micro, lrn.moe, lrn.top_k)
        if actor is not None:
            # A rollout process copies into shared memory at once: no snapshot copy first.
            actor.publish(step + 1, self.snapshot(lrn, clone=not getattr(actor, "copies", False)))
        elif lrn.vllm:  # the generator holds its own copy: push the update, versioned
            lrn.backend.load_state(weight_snapshot(lrn.engine.module, ts.zero_stage,
                                                   merged=True), step + 1)
        else:  # updated in place: a backend keeping derived state (fused weights, cached
            # keys: the continuous engine) rebuilds it; HFRollout reads the module each call
            lrn.backend.sync_weights(lrn.engine.module)
        if self.cache is not None:
            metrics.update(self.cache.window())
        t_total = time.perf_counter() - t_step
        counts = {**sb.counts, **lag_histogram(sb.versions, step, ts.max_async_steps,
                                                self.spec.rollout.group_size)}
        if actor is not None:
            gen_idle = sb.gen_idle_s / max(sb.gen_idle_s + sb.gen_s, 1e-9)
        else:
            gen_idle = 1.0 - t_wait / max(t_total, 1e-9)
        fractions = {"async/learner_idle": t_wait / max(t_total, 1e-9),
                     "async/generator_idle": gen_idle}
        metrics.update(self.reduce_counts(counts, fractions))
        metrics["lr"] = float(lrn.engine.get_lr()[0])
        return sb, metrics, skipped

    def track_finite(self, step: int, metrics: dict[str, float], skipped: bool,
                     nan_streak: int, result: RunResult) -> int:
        """Count consecutive non-finite steps (stopping the run at the spec's bound) and warn
        about dropped micro-batches; returns the new streak."""
        if not skipped:
            result.losses[step + 1] = metrics["loss"]
            if metrics.get("dropped_microbatches"):
                self.sink.event("warning", f"step {step + 1}: non-finite micro-batch dropped",
                                {"step": step + 1, "dropped": metrics["dropped_microbatches"]})
            return 0
        nan_streak += 1
        result.skipped_steps.append(step + 1)
        self.sink.event("warning", f"step {step + 1}: non-finite loss, step skipped",
                        {"step": step + 1, "nan_streak": nan_streak})
        if nan_streak >= self.spec.trainer.max_consecutive_nan:
            self.sink.event("error", f"{nan_streak} consecutive non-finite steps; "
                            "stopping with the last good checkpoint intact",
                            {"last_checkpoint": str(ckpt.latest(self.root))})
            raise TrainingFailed(
                f"{nan_streak} consecutive non-finite losses at step {step + 1}; "
                f"last good checkpoint: {ckpt.latest(self.root)}"
            )
        return nan_streak

    def report_step(self, lrn: Learner, tok: Any, sb: StepBatch, done: int,
                    metrics: dict[str, float], skipped: bool, nan_streak: int) -> bool:
        """Log step `done`'s metrics, its samples when due, and its checkpoint when due (never
        for a skipped step, so the latest checkpoint is always a good one). Returns whether it
        wrote the checkpoint."""
        spec = self.spec
        self.sink.log(done, metrics)
        if self.rank == 0 and reports_at(spec.samples, done):
            self.sink.samples(done, self.step_samples(sb, tok))
        if spec.checkpoint.every and done % spec.checkpoint.every == 0 and not skipped:
            self.save_checkpoint(lrn, tok, done, sb.sampler_state, nan_streak, metrics)
            return True
        return False

    def save_checkpoint(self, lrn: Learner, tok: Any, done: int, sampler_state: dict[str, Any],
                        nan_streak: int, metrics: dict[str, float]) -> None:
        """Checkpoint the state after RL step `done` (collective) and report it: the one path
        of periodic and preemption checkpoints."""
        spec = self.spec
        cursor = sampler_state["cursor"] * self.world
        path = ckpt.save(lrn.engine, tok, self.root, done,
                         {"cursor": cursor, "nan_streak": nan_streak, "metrics": metrics},
                         spec.checkpoint.keep, spec.trainer.zero_stage,
                         rank_state={"sampler": sampler_state},
                         prompt_format=self.prompt_format, warm=lrn.warm)
        self.sink.checkpoint(done, str(path / "hf"), metrics)

    def stop_before_rl(self, lrn: Learner, tok: Any, start: int) -> None:
        """The safe point before the first RL step. A resumed run has nothing new since the
        checkpoint it started from; a fresh one has just finished its warm start, which a
        preemption keeps as a checkpoint at step 0 (a resume from it skips SFT and DPO)."""
        code = self.agreed_stop()
        if code == GO:
            return
        warm = self.spec.sft.steps > 0 or self.spec.preference.steps > 0
        if code == CHECKPOINT_AND_STOP and start == 0 and warm \
                and ckpt.latest(self.root) is None:
            self.save_checkpoint(lrn, tok, 0, lrn.sampler.state_dict(), 0, {})
            self.sink.event("info", "preempted before RL step 1: the warm start is kept as "
                            "the checkpoint at step 0", {"step": 0})
        raise Stopped(f"stopped before RL step {start + 1}")

    def stop_after_step(self, lrn: Learner, tok: Any, done: int, sampler_state: dict[str, Any],
                        nan_streak: int, metrics: dict[str, float], saved: bool) -> None:
        """An RL step's safe point. A preemption checkpoints step `done` (unless its periodic
        checkpoint was just written) and stops, so the next attempt resumes at `done` + 1; a
        cancel or a lost lease stops without writing. After a skipped (non-finite) step the
        weights are still the last good ones and the state records the NaN streak, so its
        checkpoint resumes as the uninterrupted run would go on."""
        code = self.agreed_stop()
        if code == GO:
            return
        if code == STOP:
            raise Stopped(f"stopped after step {done}: the run was canceled or its lease lost")
        if not saved:
            self.save_checkpoint(lrn, tok, done, sampler_state, nan_streak, metrics)
        self.sink.event("info", f"preempted: stopped after step {done}, checkpointed",
                        {"step": done})
        raise Stopped(f"preempted after step {done}; its checkpoint is written")

    def rl_finish(self, lrn: Learner, tok: Any, result: RunResult) -> None:
        """The final held-out reward (unless the last step measured it) and the final model."""
        ts, spec = self.spec.trainer, self.spec
        if ts.steps not in result.eval_reward:
            result.eval_reward[ts.steps] = self.evaluate(lrn.backend, tok)
            self.sink.log(ts.steps, {"eval/reward_mean": result.eval_reward[ts.steps]})
        if spec.checkpoint.save_final:
            final = self.root / "final"
            ckpt.save_hf_atomic(lrn.engine.module, tok, final, ts.zero_stage, self.prompt_format)
            result.final_dir = str(final)
            self.sink.checkpoint(ts.steps, str(final), {"eval/reward_mean":
                                                        result.eval_reward[ts.steps]})

    # ---- RL: learning from one batch -----------------------------------------------------

    def learn(self, engine: Any, sb: StepBatch, ref: torch.nn.Module | None, micro: int,
              moe: bool, top_k: int) -> tuple[dict[str, float], bool]:
        """Advantages, reference log-probs and `updates_per_batch` optimizer steps on one
        step's batch. Returns (rank-averaged metrics, skipped)."""
        spec, algo = self.spec, self.spec.algorithm
        group = spec.rollout.group_size
        batch = sb.batch
        rewards, keep, dapo = self.dapo_rewards(sb)
        advs = adv_lib.compute(algo.advantage, rewards.view(-1, group)).reshape(-1)
        sb.advantages = advs  # reported with the step's samples
        ref_logp = None
        if ref is not None:
            ref_logp = reference_logprobs(ref, batch, micro, self.device,
                                          spec.rollout.temperature)
        t1 = time.perf_counter()
        stats: dict[str, float] = {}
        skipped = False
        # Train/infer mismatch: measured in the first update, before any optimizer step.
        routers = self.routers = replayable_routers(engine) if moe else None
        meter = self.meter = MismatchMeter(layers=len(routers or []))
        self.step_load = None
        for _ in range(algo.updates_per_batch):
            upd, skipped = self.update(engine, batch, advs, rewards, ref_logp, micro, moe,
                                       top_k, keep)
            self.meter = None
            for k, v in upd.items():
                stats[k] = stats.get(k, 0.0) + v / algo.updates_per_batch
            if skipped:
                break
        if routers and self.step_load is not None and balance.biases(routers) is not None \
                and not skipped:  # aux-free: nudge the selection bias against the load
            balance.update_biases(routers, self.step_load, spec.moe.bias_rate)
            stats.update({f"moe/bias_absmax/layer_{i}": float(v) for i, v in
                          enumerate(balance.biases(routers).abs().amax(-1).tolist())})
        stats.update(meter.result(all_reduce_sum, all_reduce_max))
        t_train = time.perf_counter() - t1
        stats.update(dapo)
        return self.step_metrics(sb.rewards, sb.components, batch, stats, sb.gen_s,
                                 t_train), skipped

    def dapo_rewards(self, sb: StepBatch
                     ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """DAPO's reward side: the rewards trained on (with the overlong penalty when
        `overlong_buffer` is set), the per-sequence loss weight that drops zero-advantage groups
        under `dynamic_sampling` (None when off), and their metrics. The dropped-group count
        goes to `sb.counts`, summed over ranks."""
        algo, group = self.spec.algorithm, self.spec.rollout.group_size
        rewards, metrics = sb.rewards, {}
        if algo.overlong_buffer:
            lengths = sb.batch.completion_mask.sum(-1)
            pen = adv_lib.overlong_penalty(lengths, self.spec.rollout.max_new_tokens,
                                           algo.overlong_buffer, algo.overlong_factor)
            rewards = rewards + pen
            metrics["dapo/overlong_penalty"] = float(pen.mean())
            metrics["dapo/overlong_frac"] = float((pen < 0).float().mean())
        if not algo.dynamic_sampling:
            return rewards, None, metrics
        dropped = adv_lib.uniform_groups(rewards.view(-1, group))  # (groups,)
        sb.counts["dapo/dropped_groups"] = float(dropped.sum())
        keep = (~dropped).float().repeat_interleave(group)  # (groups * G,)
        return rewards, keep, metrics

    def step_samples(self, sb: StepBatch, tok: Any) -> list[dict[str, Any]]:
        """This rank's sample rows of a trained step (see workers.rl.samples)."""
        batch, group = sb.batch, self.spec.rollout.group_size
        advantages = sb.advantages if sb.advantages is not None else torch.zeros(
            len(batch.texts))
        return pick_samples(
            self.spec.samples, prompts=sb.prompts, texts=batch.texts,
            rewards=sb.rewards.tolist(), components=sb.components,
            advantages=advantages.tolist(),
            versions=[v for v in sb.versions for _ in range(group)],
            reasons=finish_reason(batch.completion_mask, batch.completion_ids,
                                  tok.eos_token_id, self.spec.rollout.max_new_tokens,
                                  episode=isinstance(batch, EpisodeBatch)))

    def reduce_counts(self, counts: dict[str, float],
                      fractions: dict[str, float]) -> dict[str, float]:
        """Counts summed over ranks, fractions averaged (same keys on every rank)."""
        ck, fk = sorted(counts), sorted(fractions)
        local = [counts[k] for k in ck] + [fractions[k] for k in fk]
        tot = all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        out = dict(zip(ck, tot[: len(ck)], strict=True))
        out.update({k: v / self.world for k, v in zip(fk, tot[len(ck):], strict=True)})
        return out

    def update(self, engine: Any, batch: RolloutBatch, advs: torch.Tensor,
               rewards: torch.Tensor, ref_logp: torch.Tensor | None, micro: int, moe: bool,
               top_k: int, keep: torch.Tensor | None = None) -> tuple[dict[str, float], bool]:
        """One optimizer step over all micro-batches. Returns (metric sums, skipped).
        `keep`: per-sequence 0/1 loss weight (DAPO's dropped groups), None for all.

        A non-finite loss on any rank in the first micro-batch skips the step; in a later one
        the micro-batch contributes an exact zero (so DeepSpeed's accumulation boundary still
        lines up) and is counted in `dropped_microbatches`."""
        seq_len = norm_len(batch, self.spec.rollout.max_new_tokens)  # seq_sum_norm's constant
        n_seq = batch.completion_ids.shape[0]
        gas = n_seq // micro
        sums: dict[str, float] = {}
        dropped = 0
        util_counts: list[torch.Tensor] = []
        own_norm: float | None = None
        self.global_counts = (self.step_counts(engine, batch, micro, moe, top_k)
                              if moe and self.spec.moe.balance == "global_aux" else None)
        for mb, i in enumerate(range(0, n_seq, micro)):
            loss, logits, parts, util = self.micro_loss(
                engine, batch, slice(i, i + micro), advs, rewards, ref_logp, moe, top_k,
                seq_len, keep)
            if util is not None:
                util_counts.append(util)
            finite = not any_rank(not bool(torch.isfinite(loss)))
            if not finite:
                if mb == 0:
                    return {}, True  # nothing accumulated yet: skip the whole step cleanly
                # Later micro-batch: contribute an exact zero so DeepSpeed's accumulation
                # boundary still lines up; the step uses the finite micro-batches only.
                loss = logits.nan_to_num(0.0, 0.0, 0.0).sum() * 0.0
                dropped += 1
            engine.backward(loss)
            if mb == gas - 1:
                own_norm = clip_gradients(engine)
            engine.step()
            if finite:
                for k, v in parts.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        return self.update_metrics(engine, sums, gas, dropped, own_norm, util_counts), False

    @torch.no_grad()
    def step_counts(self, engine: Any, batch: RolloutBatch, micro: int, moe: bool,
                    top_k: int) -> torch.Tensor:
        """(L,E) expert loads of the whole update -- every micro-batch, summed over ranks --
        for the global-batch balance loss: one gradient-free forward pass first, because
        each micro-batch's loss needs the step's loads before its own backward."""
        total: torch.Tensor | None = None
        for i in range(0, batch.completion_ids.shape[0], micro):
            _, router, flat_mask, _ = forward_routed(engine, batch, slice(i, i + micro), moe,
                                                     self.device,
                                                     replay=self.spec.moe.router_replay)
            assert router is not None
            c = balance.expert_counts(stacked(router), top_k, flat_mask).cpu()
            total = c if total is None else total + c
        assert total is not None
        return all_reduce_sum(total.double()).float()

    def micro_loss(self, engine: Any, batch: RolloutBatch, sl: slice, advs: torch.Tensor,
                   rewards: torch.Tensor, ref_logp: torch.Tensor | None, moe: bool,
                   top_k: int, seq_len: int, keep: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor | None]:
        """One micro-batch's loss (policy gradient, entropy bonus, KL, DPO and router terms)
        with its completion logits, its metric parts and its (layers, experts) token counts
        (None for a dense model)."""
        algo, temp = self.spec.algorithm, self.spec.rollout.temperature
        logits, router, flat_mask, routes = forward_routed(
            engine, batch, sl, moe, self.device, replay=self.spec.moe.router_replay)
        c_ids = batch.completion_ids[sl].to(self.device)
        # Loss mask: sampled tokens only (environment/tool tokens of episodes are attended to
        # in the forward pass but never trained on); the completion mask single-turn.
        mask = loss_mask(batch)[sl].to(self.device).float()  # (b,C)
        if keep is not None:  # DAPO's dropped groups leave the loss (and its denominator)
            mask = mask * keep[sl].to(self.device).unsqueeze(-1)
        logp = token_logprobs(logits, c_ids, temp)  # (b,C)
        self.track_routes(batch, sl, logp, mask, routes)
        pg, st = policy_loss(
            logp, batch.logprobs[sl].to(self.device), advs[sl].to(self.device), mask,
            importance=algo.importance, clip_low=algo.clip_low, clip_high=algo.clip_high,
            tis_cap=algo.tis_cap, mask_low=algo.ratio_mask_low,
            mask_high=algo.ratio_mask_high, agg=algo.loss_agg, norm_len=seq_len,
            **{k: algo.mode_setting(k) for k in MODE_SETTINGS},
        )
        loss = pg
        ent = masked_mean(entropy(logits.detach(), temp), mask)
        parts: dict[str, Any] = {"pg_loss": pg.detach(), "entropy": ent}
        if algo.entropy_coef:
            ent_g = masked_mean(entropy(logits, temp), mask)
            loss = loss - algo.entropy_coef * ent_g
        if ref_logp is not None:
            loss = self.reference_terms(loss, logp, ref_logp[sl].to(self.device), mask,
                                        rewards[sl], seq_len, parts)
        util = None
        if router is not None:
            loss, util = self.router_terms(engine, loss, router, top_k, flat_mask, parts)
        parts["loss"] = loss.detach()
        return loss, logits, {**parts, **st}, util

    def track_routes(self, batch: RolloutBatch, sl: slice, logp: torch.Tensor,
                     mask: torch.Tensor, routes: torch.Tensor | None) -> None:
        """Under router replay, check that the forward used the recorded routes on every
        layer and token (raises `ReplayBindingError`); feed the step's mismatch meter."""
        recorded = batch.completion_routes
        if self.spec.moe.router_replay and batch.prompt_routes is not None \
                and recorded is not None and routes is not None:
            check_replayed(torch.cat([batch.prompt_routes[sl], recorded[sl]], 1),
                           routes.cpu(), f" (rows {sl.start}..{sl.stop})")
        if self.meter is not None:
            p = batch.prompt_ids.shape[1]
            self.meter.add(logp.detach(), batch.logprobs[sl].to(logp.device), mask,
                           None if recorded is None else recorded[sl],
                           None if routes is None else routes[:, p:])

    def reference_terms(self, loss: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                        mask: torch.Tensor, rewards: torch.Tensor, seq_len: int,
                        parts: dict[str, Any]) -> torch.Tensor:
        """`loss` plus the KL penalty and the in-group DPO term against the reference; their
        values go to `parts`."""
        algo = self.spec.algorithm
        kl = aggregate(kl_k3(logp, ref_logp), mask, algo.loss_agg, seq_len)
        parts["kl"] = kl.detach()
        if algo.kl_coef:
            loss = loss + algo.kl_coef * kl
        if algo.dpo_coef:
            d_loss, d_acc, pairs = self.dpo_term(logp, ref_logp, mask, rewards)
            # Every rank reports the same keys (metrics are all-reduced as one vector).
            parts["dpo_pairs"] = torch.tensor(float(pairs))
            parts["dpo_loss"], parts["dpo_acc"] = torch.zeros(()), torch.zeros(())
            if d_loss is not None:
                loss = loss + algo.dpo_coef * d_loss
                parts["dpo_loss"], parts["dpo_acc"] = d_loss.detach(), d_acc
        return loss

    def router_terms(self, engine: Any, loss: torch.Tensor, router: Router, top_k: int,
                     flat_mask: torch.Tensor, parts: dict[str, Any]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` plus the router terms of `moe.balance` (and the z-loss), and the (layers,
        2 * experts) token counts and router-probability sums the step's expert-load and
        balance metrics are summed from."""
        assert router is not None
        ms = self.spec.moe
        logits = stacked(router)  # (L,N,E), stacked once for every term below
        bias = balance.biases(self.routers) if self.routers else None
        # One softmax and top-k for the auxiliary loss and the unbiased load metrics.
        aux, counts, psums = router_statistics(logits, top_k, flat_mask)
        parts["aux_loss"] = aux.detach()
        coef = self.spec.model.router_aux_loss_coef
        if ms.balance == "aux":
            loss = loss + coef * aux
        elif ms.balance == "global_aux":
            assert self.global_counts is not None
            g = balance.global_balance_loss(logits, self.global_counts, flat_mask)
            parts["global_aux_loss"] = g.detach()
            loss = loss + coef * g
        if ms.z_loss_coef:
            z = balance.z_loss(logits, flat_mask)
            loss = loss + ms.z_loss_coef * z
        else:  # a metric only: no autograd graph for it
            with torch.no_grad():
                z = balance.z_loss(logits, flat_mask)
        parts["z_loss"] = z.detach()
        if bias is not None:  # aux-free balancing selects with the bias: count as it does
            counts = balance.expert_counts(logits, top_k, flat_mask, bias)
        return loss, torch.cat([counts.cpu(), psums.cpu()], -1)

    def update_metrics(self, engine: Any, sums: dict[str, float], gas: int, dropped: int,
                       own_norm: float | None, util_counts: list[torch.Tensor]
                       ) -> dict[str, float]:
        """An update's metrics: part sums averaged over finite micro-batches, the gradient
        norm, and the expert load summed over micro-batches and ranks."""
        out = {k: v / (gas - dropped) for k, v in sums.items()}
        out["dropped_microbatches"] = float(dropped)
        gn = engine.get_global_grad_norm()
        if gn is None:
            gn = own_norm
        if gn is not None:
            out["grad_norm"] = float(gn)
        if util_counts:
            both = all_reduce_sum(torch.stack(util_counts).sum(0).double()).float()
            counts, psums = both.chunk(2, -1)  # (L,E) each
            out.update(expert_load(counts))
            out.update(balance.layer_metrics(counts, psums))
            self.step_load = counts if self.step_load is None else self.step_load + counts
        return out

    def dpo_term(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                 rewards: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Preference pairs from each group: best vs worst completion (if rewards differ)."""
        group = self.spec.rollout.group_size
        seq = (logp * mask).sum(-1).view(-1, group)  # (groups,G)
        ref_seq = (ref_logp * mask).sum(-1).view(-1, group)
        r = rewards.view(-1, group)
        best, worst = r.argmax(1), r.argmin(1)
        keep = (r.max(1).values > r.min(1).values).to(seq.device)
        if not bool(keep.any()):
            return None, None, 0
        rows = torch.arange(seq.shape[0], device=seq.device)[keep]
        b, w = best.to(seq.device)[keep], worst.to(seq.device)[keep]
        loss, acc = dpo_loss(seq[rows, b], seq[rows, w], ref_seq[rows, b], ref_seq[rows, w],
                             self.spec.algorithm.dpo_beta)
        return loss, acc, int(keep.sum())

    def step_metrics(self, rewards: torch.Tensor, components: dict[str, list[float]],
                     batch: RolloutBatch, stats: dict[str, float], t_gen: float,
                     t_train: float) -> dict[str, float]:
        """Average over ranks: rewards and components by sample, losses by rank."""
        names = sorted(components)
        local = [float(rewards.sum()), float((rewards**2).sum()), float(rewards.numel())]
        local += [sum(components[n]) for n in names]
        # moe/ and mismatch/ metrics arrive reduced over ranks already.
        keys = sorted(k for k in stats if not k.startswith(("moe/", "mismatch/")))
        local += [stats[k] for k in keys]
        gen_tokens = float(batch.num_tokens)
        train_tokens = float(batch.prompt_mask.sum() + batch.completion_mask.sum())
        local += [gen_tokens, train_tokens, t_gen, t_train]
        tot = all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        n = tot[2]
        mean = tot[0] / n
        out: dict[str, float] = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(0.0, tot[1] / n - mean**2)),
        }
        for j, name in enumerate(names):
            out[f"reward/{name}"] = tot[3 + j] / n
        off = 3 + len(names)
        for j, k in enumerate(keys):
            out[k] = tot[off + j] / self.world
        off += len(keys)
        g_tok, t_tok, tg, tt = tot[off : off + 4]
        # Ranks work in parallel: tokens/s uses the mean per-rank wall time.
        out["gen_tokens_per_s"] = g_tok / max(tg / self.world, 1e-9)
        out["train_tokens_per_s"] = t_tok / max(tt / self.world, 1e-9)
        out["completion_len"] = g_tok / n
        out.update({k: v for k, v in stats.items() if k.startswith(("moe/", "mismatch/"))})
        return out


def default_sink(spec: RunSpec) -> Reporter:
    """Where a run with no sink of its own reports: stdout and/or a metrics JSONL file."""
    sinks: list[Reporter] = []
    if spec.output.stdout:
        sinks.append(StdoutSink())
    if spec.output.metrics_jsonl:
        sinks.append(JsonlSink(spec.output.metrics_jsonl))
    return MultiSink(*sinks)


def start_tokenizer(trainer: Trainer, resume: bool) -> Any:
    """The tokenizer a run continues with: the latest checkpoint's when resuming, a finished
    warm start's, else a new one (a run's tokenizer never changes once a phase saved it)."""
    root = trainer.root
    last = ckpt.latest(root) if resume else None
    if last is not None:
        return load_tokenizer(last / "hf")
    if (root / "sft" / "config.json").is_file():
        return load_tokenizer(root / "sft")
    if (root / "preference" / "config.json").is_file():
        return load_tokenizer(root / "preference")
    return trainer.tokenizer()


def announce(trainer: Trainer, resume: bool) -> None:
    """Write the run's spec beside its checkpoints and report it (rank 0), and refuse to start
    a new run over an old one's checkpoints."""
    spec, root, world = trainer.spec, trainer.root, trainer.world
    if trainer.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / "spec.json").write_text(spec.to_json())
        used = threads.in_use()
        trainer.sink.event("info", f"run {spec.name} on {world} rank(s), "
                           f"{used['torch_threads']} torch thread(s) per rank, config:\n"
                           f"{spec.to_json()}",
                           {"spec": spec.model_dump(mode="json"), "world_size": world,
                            "threads": used})
    if not resume and (ckpt.latest(root) is not None or (root / "sft").exists()
                       or (root / "preference").exists()):
        raise ValueError(
            f"checkpoint.dir {root} already holds a run; resume it or choose another dir"
        )


def train(
    spec: RunSpec, sink: Reporter | None = None, *, resume: bool = False,
    objective: Objective | None = None, pinned: PinnedData | None = None,
    rollouts: RolloutLauncher | None = None,
) -> RunResult:
    """Run (or resume) one training run. Callable from the CLI, torchrun or a Celery task.
    ``pinned``: the run's pinned SFT / preference datasets (see pinned_data.py).
    ``rollouts``: this rank's out-of-process rollout actor (a Ray run's, see
    workers.cluster.rollouts); None samples in this process, as on one host."""
    with process_group() as (rank, world):
        trainer = Trainer(spec, sink, objective, rank, world, pinned, rollouts)
        announce(trainer, resume)
        trainer.barrier()
        tok = start_tokenizer(trainer, resume)
        try:
            warm_dir = preference_phase(trainer, tok, trainer.sft(tok))
            return trainer.rl(tok, warm_dir, resume)
        finally:
            if trainer.cache is not None:
                trainer.cache.close()
            close = getattr(trainer.objective, "close", None)
            if close is not None:  # a terminal objective's sandbox sessions and snapshots
                close()
