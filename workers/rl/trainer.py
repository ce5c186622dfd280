"""The training loop: SFT warm start, then GRPO-family RL, on a DeepSpeed ZeRO engine.

One step = sample `prompts_per_step` prompts (split over ranks) x `group_size` completions,
score them, compute group-relative advantages, then one optimizer step per
`updates_per_batch` over micro-batches (gradient accumulation is DeepSpeed's).
Every source of randomness in a step is derived from (seed, step, rank), so a resumed run
replays exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workers import threads
from workers.reporting import Reporter
from workers.rl import advantages as adv_lib
from workers.rl import checkpoint as ckpt
from workers.rl.actor import AsyncActor, Producer, StepBatch, WeightStore, lag_histogram
from workers.rl.curriculum import TaskSampler
from workers.rl.distributed import all_reduce_sum, any_rank, process_group
from workers.rl.episodes import (
    EpisodeBatch,
    episodic,
    loss_mask,
    norm_len,
    play_groups,
    plays_episodes,
)
from workers.rl.lean import LeanQwen3Moe
from workers.rl.lean import supported as lean_supported
from workers.rl.losses import (
    aggregate,
    dpo_loss,
    entropy,
    expert_utilisation,
    kl_k3,
    load_balancing_loss,
    masked_mean,
    policy_loss,
    token_logprobs,
)
from workers.rl.model import build_policy, is_moe
from workers.rl.pinned_data import PinnedData
from workers.rl.preference import check_pinned, preference_phase
from workers.rl.prompt_format import PromptFormat
from workers.rl.rollout import HFRollout, RolloutBatch, make_backend, position_ids
from workers.rl.samples import finish_reason, pick_samples, reports_at
from workers.rl.sinks import JsonlSink, MultiSink, NullSink, StdoutSink
from workers.rl.spec import DEFAULT_VOCAB_SIZE, RunSpec, TrainerSpec
from workers.rl.tasks import Example, Task
from workers.rl.tasks.environment import task_from_spec
from workers.rl.tokenizer import load_tokenizer, train_bpe


class TrainingFailed(RuntimeError):
    """The run stopped cleanly (e.g. too many consecutive NaN steps); checkpoints are intact."""


@dataclass
class RunResult:
    steps: int
    eval_reward: dict[int, float] = field(default_factory=dict)  # RL step -> held-out reward
    losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    final_dir: str | None = None
    steps_per_s: float = 0.0
    train_time: dict[int, float] = field(default_factory=dict)  # step -> RL wall s, no evals
    curriculum: dict[str, Any] = field(default_factory=dict)  # rank 0's sampler state at end


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then
    cosine or linear decay to `min_ratio`, or constant."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1 - min_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def use_bf16(ts: TrainerSpec) -> bool:
    if ts.precision == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return ts.precision == "bf16"


def make_engine(model, ts: TrainerSpec, lr: float, total_steps: int, micro: int, gas: int,
                own_clip: bool = False):
    """`own_clip`: a stage-0 engine in a world of one leaves gradient clipping to the caller's
    `clip_gradients` (the same arithmetic, bit for bit, without DeepSpeed's per-tensor loop and
    its all-reduce of the norm); `engine.crucible_clip` holds the bound, 0 where DeepSpeed
    clips."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=ts.weight_decay, **adamw_impl(params))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, total_steps, ts.warmup_steps, ts.schedule, ts.min_lr_ratio),
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    clip_here = own_clip and ts.zero_stage == 0 and world == 1 and ts.grad_clip > 0
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0 if clip_here else ts.grad_clip,
        "zero_optimization": {"stage": ts.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": use_bf16(ts)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ts.zero_stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=config
    )
    if ts.zero_stage == 0 and engine.world_size == 1:
        # In a world of one the stage-0 gradient all-reduce is an identity that still
        # flattens every gradient into a bucket, reduces it and copies it back each step.
        engine.enable_backward_allreduce = False
    engine.crucible_clip = ts.grad_clip if clip_here else 0.0
    return engine


def clip_gradients(engine) -> float | None:
    """Clip the accumulated gradients to `engine.crucible_clip` as DeepSpeed's stage-0
    `clip_grad_norm_` does in a world of one (per-tensor 2-norms, their root sum of squares,
    coefficient min(1, bound / (norm + 1e-6)) applied to every gradient), with multi-tensor
    ops. Call before the accumulation boundary's `engine.step()`. Returns the norm, or None
    where DeepSpeed clips."""
    bound = getattr(engine, "crucible_clip", 0.0)
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not bound or not grads:
        return None
    total = torch.stack(torch._foreach_norm(grads, 2.0)).pow(2.0).sum().float().pow(0.5)
    coef = torch.tensor([float(bound)], device=total.device) / (total + 1e-6)
    coef = torch.min(torch.tensor([1.0], device=coef.device), coef)
    torch._foreach_mul_(grads, coef.reshape(()))
    return float(total)


def adamw_impl(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch's multi-tensor (foreach) AdamW where the parameters are dense float tensors: a few
    ops over all tensors instead of a dozen per tensor (torch picks it by default on CUDA only),
    with bit-identical results. Not the fused kernel (about 0.5 ms less per CPU benchmark step):
    its rounding differs, and on the tiny models the SFT warm start and the RL curve move with
    float noise (with it in the RL phase the proof-of-learning run ended +0.19, not +0.275)."""
    if params and all(p.is_floating_point() and p.layout == torch.strided for p in params):
        return {"foreach": True}
    return {}


def weight_snapshot(module: torch.nn.Module, zero_stage: int) -> dict[str, torch.Tensor]:
    """A full copy of the policy's weights for the actor (collective under ZeRO-3)."""
    import deepspeed

    ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
           if zero_stage == 3 else contextlib.nullcontext())
    with ctx:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def router_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]] | None:
    """The modules whose output (at the index given) is a layer's router logits, in forward
    order, read from the transformers model's own output-recording table; None if it has none
    we can hook plainly."""
    if model in _ROUTERS:
        return _ROUTERS[model]
    from transformers.utils.output_capturing import OutputRecorder

    rec = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    found = None
    if isinstance(rec, OutputRecorder) and rec.layer_name is None and rec.class_name is None:
        found = [(m, rec.index) for m in model.modules() if isinstance(m, rec.target_class)]
    elif isinstance(rec, type):
        found = [(m, 0) for m in model.modules() if isinstance(m, rec)]
    _ROUTERS[model] = found or None
    return _ROUTERS[model]


def lean_trainable(module) -> torch.nn.Module | None:
    """The model whose training forward can run as `LeanQwen3Moe.train_forward`, or None: a
    model the lean forward supports, bare or wrapped by a stage-0 DeepSpeed engine (whose forward
    adds nothing but timers; ZeRO optimizers hook the engine's forward outputs). Any other
    wrapper's own forward is respected."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if hasattr(module, "zero_optimization_stage"):  # a DeepSpeed engine
        if module.zero_optimization_stage() != 0 or isinstance(
                getattr(module, "optimizer", None), ZeROOptimizer):
            return None
        module = module.module
    if isinstance(module, torch.nn.Module) and lean_supported(module):
        return module
    return None


def forward_completion(module, batch: RolloutBatch, sl: slice, moe: bool, device,
                       lean: bool = True):
    """Run the policy on prompt+completion, as laid out at sampling time.
    Returns completion logits (b,C,V), router logits per layer ((b*L),E) or None, and the
    (b*L,) attention mask that router logits are aligned with.

    With `lean` (and a model it supports) the forward is `LeanQwen3Moe.train_forward`: the same
    mathematics as the transformers forward (logits and gradients equal to float rounding) in
    fewer ops. Otherwise the transformers forward runs, and router logits are read by forward
    hooks on the router modules for this one call: asking it for `output_router_logits` also
    makes it compute its own auxiliary loss, which the trainer does not use (it computes its
    per-layer one from the same logits)."""
    p_ids, p_mask = batch.prompt_ids[sl], batch.prompt_mask[sl]
    c_ids, c_mask = batch.completion_ids[sl], batch.completion_mask[sl]
    ids = torch.cat([p_ids, c_ids], 1).to(device)  # (b, L = P + C)
    mask = torch.cat([p_mask, c_mask], 1).to(device)
    p = p_ids.shape[1]
    model = lean_trainable(module) if lean else None
    if model is not None:
        lean_fwd = LeanQwen3Moe(model, 0, ids.shape[1])
        packed = lean_fwd.train_forward_packed(p_ids.to(device), p_mask.to(device),
                                               c_ids.to(device), c_mask.to(device))
        if packed is not None:
            logits, routers, weights = packed
            return logits, (routers if moe else None), weights
        logits, routers = lean_fwd.train_forward(ids, mask)
        return logits[:, p - 1 : -1], (routers if moe else None), mask.reshape(-1)
    taps = router_modules(getattr(module, "module", module)) if moe else None
    captured: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _a, out, i=i: captured.append(out[i]))
               for m, i in taps or []]
    kwargs: dict[str, Any] = {"output_router_logits": True} if moe and not taps else {}
    try:
        out = module(
            input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
            use_cache=False, **kwargs,
        )
    finally:
        for h in handles:
            h.remove()
    logits = out.logits[:, p - 1 : -1]  # (b,C,V): position t predicts completion token t
    router = None
    if moe:
        router = tuple(captured) if taps else getattr(out, "router_logits", None)
    return logits, router, mask.reshape(-1)


class Run:
    def __init__(
        self, spec: RunSpec, sink: Reporter | None, task: Task | None, rank: int, world: int,
        pinned: PinnedData | None = None,
    ):
        self.spec, self.rank, self.world = spec, rank, world
        if task is not None and (spec.task is not None or spec.environment is not None):
            field = "task" if spec.task is not None else "environment"
            raise ValueError(f"this run trains on the environments it was given; its config's "
                             f"{field} would be ignored: remove it")
        self.task = task or task_from_spec(spec)
        self.pinned = pinned or PinnedData()
        check_pinned(spec, self.pinned)
        # Prompts are plain text, never a chat template: recorded with every saved model.
        self.prompt_format = PromptFormat(
            format="raw", layout="episode" if plays_episodes(self.task) else "single_turn")
        self.cache: Any = None  # workers.rl.datacache.DataCache when data.source is set
        self.episode_tok: Any = None  # the evaluation's tokenizer copy for episode tasks
        if spec.data.source is not None:
            from workers.rl.datacache import records_task
            from workers.storage import default_store

            self.cache, self.task = records_task(self.task, spec.data, default_store())
        if spec.rollout.backend == "vllm":
            from workers.rl.vllm_rollout import INSTALL_HINT, VllmUnavailable, import_vllm

            import_vllm()  # fail before SFT, naming what to install, not after it
            if not torch.cuda.is_available():
                raise VllmUnavailable(f"{INSTALL_HINT}; no CUDA device is visible")
        self.root = Path(spec.checkpoint.folder)
        self.sink: Reporter = (sink or default_sink(spec)) if rank == 0 else NullSink()
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        ts = spec.trainer
        if world > 1 and ts.zero_stage == 3 and plays_episodes(self.task):
            # ZeRO-3 ranks gather parameters collectively in every forward, but episodes take
            # as many generate calls as their turns, which differ between ranks.
            raise ValueError(
                f"multi-turn / tool-use tasks cannot run with trainer.zero_stage = 3 on {world} "
                "ranks (episodes generate a different number of turns per rank); use "
                "zero_stage 0-2 or a single rank"
            )
        if ts.prompts_per_step % world:
            raise ValueError(
                f"trainer.prompts_per_step={ts.prompts_per_step} must be divisible by the "
                f"world size {world}"
            )

    # ---- helpers -------------------------------------------------------------------------

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def generator(self, *key: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(hash((self.spec.trainer.seed, *key)) & 0x7FFF_FFFF_FFFF)
        return g

    def permutation(self, epoch: int, n: int) -> list[int]:
        """The seeded shuffle of the training set for one epoch (same on every rank)."""
        return torch.randperm(n, generator=self.generator(10_000 + epoch)).tolist()

    def tokenizer(self):
        if self.spec.tokenizer.source == "model":
            assert self.spec.model.path is not None
            return load_tokenizer(self.spec.model.path)
        return train_bpe(self.task.corpus() + self.pinned.corpus(),
                         self.spec.tokenizer.vocab_size or DEFAULT_VOCAB_SIZE)

    def sft_example(self, index: int) -> Example:
        """SFT example ``index`` of the task's references (when sft.environment) followed by
        the pinned SFT datasets' pairs."""
        own = len(self.task.train) if self.spec.sft.environment else 0
        if index < own:
            return self.task.train[index]
        prompt, completion = self.pinned.sft[index - own]
        return Example(prompt=prompt, reference=completion)

    def completion_batch(self, tok, examples: list[Example]) -> RolloutBatch:
        """Reference completions laid out like a rollout, for SFT."""
        enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        comp = [tok(e.reference, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                for e in examples]
        c_ids, c_mask = pad_right(comp, tok.pad_token_id)
        zeros = torch.zeros(c_ids.shape)
        return RolloutBatch(enc["input_ids"], enc["attention_mask"], c_ids, c_mask, zeros, [])

    # ---- phases --------------------------------------------------------------------------

    def sft(self, tok) -> Path:
        """Cross-entropy on references; saves the warm-started policy as `<dir>/sft`."""
        spec, out = self.spec, self.root / "sft"
        if (out / "config.json").is_file() or spec.sft.steps == 0:
            return out
        model = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
        # The initial policy's held-out reward, measured as RL measures it later, so the run
        # summary can tell what SFT gained from what RL gained.
        model.to(self.device).eval()
        with torch.no_grad():
            before = self.evaluate(make_backend("hf", model, tok, False), tok)
        model.train()
        self.sink.log(0, {"eval/reward_before_sft": before})
        per_rank = max(1, spec.sft.batch_size // self.world)
        # Constant LR for the warm start; the RL schedule belongs to the RL phase.
        ts = spec.trainer.model_copy(update={"schedule": "constant", "warmup_steps": 0})
        engine = make_engine(model, ts, spec.sft.lr, spec.sft.steps, per_rank, 1)
        moe = is_moe(model)
        n_examples = (len(self.task.train) if spec.sft.environment else 0) + len(self.pinned.sft)
        for step in range(spec.sft.steps):
            g = self.generator(20_000 + step, self.rank)
            idx = torch.randint(n_examples, (per_rank,), generator=g)
            batch = self.completion_batch(tok, [self.sft_example(int(i)) for i in idx])
            # transformers' own forward: the warm start every later RL run (and the benchmark,
            # for both engines) begins from stays bit-identical to earlier versions.
            logits, router, flat_mask = forward_completion(
                engine, batch, slice(None), moe, self.device, lean=False
            )
            mask = batch.completion_mask.to(self.device).float()
            logp = token_logprobs(logits, batch.completion_ids.to(self.device))
            loss = -masked_mean(logp, mask)
            if router is not None:
                k = engine.module.config.num_experts_per_tok
                loss = loss + spec.model.router_aux_loss_coef * load_balancing_loss(
                    router, k, flat_mask
                )
            engine.backward(loss)
            engine.step()
            if step % 10 == 0 or step == spec.sft.steps - 1:
                val = float(all_reduce_sum(loss.detach().cpu().reshape(1))) / self.world
                self.sink.log(step, {"sft/loss": val})
        ckpt.save_hf_atomic(engine.module, tok, out, spec.trainer.zero_stage, self.prompt_format)
        self.sink.event("info", f"SFT warm start done after {spec.sft.steps} steps", {})
        del engine
        return out

    def evaluate(self, backend, tok) -> float:
        """Mean reward on held-out prompts, sampled at the rollout temperature."""
        ev = list(self.task.eval)
        mine = [e for i, e in enumerate(ev) if i % self.world == self.rank] or ev[:1]
        weight = 1.0 if any(i % self.world == self.rank for i in range(len(ev))) else 0.0
        reps = [e for e in mine for _ in range(self.spec.trainer.eval_samples)]
        sources = episodic(self.task, mine) if plays_episodes(self.task) else []
        if any(sources):  # multi-turn / tool use: the held-out reward of whole episodes
            rewards = play_groups(
                self.task, mine, sources, self.spec.trainer.eval_samples, backend,
                self.episode_tok, self.spec.rollout, self.generator(30_000),
                tok.pad_token_id, getattr(self.task, "episode_max_tokens", 4096)).rewards
        else:
            batch = backend.generate([e.prompt for e in reps], self.spec.rollout,
                                     self.generator(30_000))
            rewards, _ = self.task.reward(reps, batch.texts)
        tot = all_reduce_sum(torch.tensor([sum(rewards) * weight, len(rewards) * weight]))
        return float(tot[0] / tot[1])

    def rl(self, tok, sft_dir: Path, resume: bool) -> RunResult:
        spec, ts, algo = self.spec, self.spec.trainer, self.spec.algorithm
        group = spec.rollout.group_size
        n_seq = ts.prompts_per_step // self.world * group  # sequences per rank per step
        micro = min(ts.micro_batch_size, n_seq)
        if n_seq % micro:
            raise ValueError(
                f"trainer.micro_batch_size={micro} must divide the {n_seq} sequences each rank "
                f"trains on per step (prompts_per_step / world * group_size)"
            )
        gas = n_seq // micro
        model_spec = spec.model
        if (sft_dir / "config.json").is_file():
            model_spec = model_spec.model_copy(update={"source": "path", "path": str(sft_dir)})
        policy = build_policy(model_spec, len(tok), tok.pad_token_id, tok.eos_token_id)
        moe = is_moe(policy)
        top_k = policy.config.num_experts_per_tok if moe else 0
        ref = None
        if algo.kl_coef > 0 or algo.dpo_coef > 0:
            ref = copy.deepcopy(policy).to(self.device).eval().requires_grad_(False)
            if use_bf16(ts):
                ref = ref.to(torch.bfloat16)
        total_opt_steps = ts.steps * algo.updates_per_batch
        engine = make_engine(policy, ts, ts.lr, total_opt_steps, micro, gas, own_clip=True)
        vllm = spec.rollout.backend == "vllm"
        if vllm:
            from workers.rl.vllm_rollout import VllmRollout

            # vLLM loads config, weights and tokenizer from a directory: the SFT output, or
            # the initial policy written out once.
            init_dir = sft_dir
            if not (sft_dir / "config.json").is_file():
                init_dir = self.root / "vllm-init"
                ckpt.save_hf_atomic(engine.module, tok, init_dir, ts.zero_stage,
                                    self.prompt_format)
            backend: Any = VllmRollout(init_dir, tok, spec.vllm, version=0)
        else:
            backend = make_backend(spec.rollout.backend, engine.module, tok, ts.zero_stage == 3)

        per_rank = ts.prompts_per_step // self.world
        # Store-backed records give their own shard-major order, so prefetch runs ahead.
        order = getattr(self.task.train, "order", None) or self.permutation
        sampler = TaskSampler(self.task.train, spec.curriculum, ts.seed, self.rank, self.world,
                              order)
        bound = ts.max_async_steps
        episodes = plays_episodes(self.task)
        # Episodes decode and re-encode turns: the producer (the actor thread when async) and
        # the learner's evaluation each get their own tokenizer copy.
        self.episode_tok = copy.deepcopy(tok) if episodes else None
        producer = Producer(spec, self.task, sampler, tok.pad_token_id, per_rank, self.rank,
                            self.generator, bound,
                            tokenizer=copy.deepcopy(tok) if episodes else None)
        start, nan_streak = 0, 0
        result = RunResult(steps=0)
        last = ckpt.latest(self.root) if resume else None
        if last is not None:
            state = ckpt.load(engine, last)
            start, nan_streak = state["step"], state["nan_streak"]
            rank_state = ckpt.load_rank_state(last)
            if rank_state is not None:
                sampler.load_state_dict(rank_state["sampler"])
            else:  # a checkpoint from before the curriculum: only the global cursor is known
                sampler.cursor = state["cursor"] // self.world
            self.sink.event("info", f"resumed from {last} at step {start}", {"step": start})
            if vllm and start:
                backend.load_state(weight_snapshot(engine.module, ts.zero_stage), start)
        else:
            result.eval_reward[0] = self.evaluate(backend, tok)
            self.sink.log(0, {"eval/reward_mean": result.eval_reward[0]})

        actor: AsyncActor | None = None
        store = WeightStore()
        if bound:
            # The actor samples from its own plain (unsharded) copy of the policy, refreshed
            # from versioned snapshots the learner publishes after every update.
            gen_model = build_policy(model_spec, len(tok), tok.pad_token_id,
                                     tok.eos_token_id).to(self.device).eval()
            if use_bf16(ts):
                gen_model = gen_model.to(torch.bfloat16)
            store.publish(start, weight_snapshot(engine.module, ts.zero_stage))
            actor = AsyncActor(producer, gen_model, HFRollout(gen_model, copy.deepcopy(tok)),
                               store, start, ts.steps, bound, ts.sync_timeout_s)
            actor.start()
        lockstep_agree = any_rank if (self.world > 1 and ts.zero_stage == 3) else None

        t_run = time.perf_counter()
        t_evals = 0.0
        try:
            for step in range(start, ts.steps):
                t_step = time.perf_counter()
                if actor is not None:
                    sb = actor.get(step)
                    t_wait = time.perf_counter() - t_step
                else:
                    sb = producer.produce(step, lambda s=step: (s, backend), lockstep_agree)
                    t_wait = time.perf_counter() - t_step
                metrics, skipped = self.learn(engine, sb, ref, micro, moe, top_k)
                if actor is not None:
                    store.publish(step + 1, weight_snapshot(engine.module, ts.zero_stage))
                elif vllm:  # the generator holds its own copy: push the update, versioned
                    backend.load_state(weight_snapshot(engine.module, ts.zero_stage), step + 1)
                if self.cache is not None:
                    metrics.update(self.cache.window())
                t_total = time.perf_counter() - t_step
                counts = {**sb.counts, **lag_histogram(sb.versions, step, bound,
                                                        spec.rollout.group_size)}
                if actor is not None:
                    gen_idle = sb.gen_idle_s / max(sb.gen_idle_s + sb.gen_s, 1e-9)
                else:
                    gen_idle = 1.0 - t_wait / max(t_total, 1e-9)
                fractions = {"async/learner_idle": t_wait / max(t_total, 1e-9),
                             "async/generator_idle": gen_idle}
                metrics.update(self.reduce_counts(counts, fractions))
                metrics["lr"] = float(engine.get_lr()[0])
                if skipped:
                    nan_streak += 1
                    result.skipped_steps.append(step + 1)
                    self.sink.event("warning", f"step {step + 1}: non-finite loss, step skipped",
                                    {"step": step + 1, "nan_streak": nan_streak})
                    if nan_streak >= ts.max_consecutive_nan:
                        self.sink.event("error", f"{nan_streak} consecutive non-finite steps; "
                                        "stopping with the last good checkpoint intact",
                                        {"last_checkpoint": str(ckpt.latest(self.root))})
                        raise TrainingFailed(
                            f"{nan_streak} consecutive non-finite losses at step {step + 1}; "
                            f"last good checkpoint: {ckpt.latest(self.root)}"
                        )
                else:
                    nan_streak = 0
                    result.losses[step + 1] = metrics["loss"]
                    if metrics.get("dropped_microbatches"):
                        self.sink.event("warning",
                                        f"step {step + 1}: non-finite micro-batch dropped",
                                        {"step": step + 1,
                                         "dropped": metrics["dropped_microbatches"]})
                done = step + 1
                result.train_time[done] = time.perf_counter() - t_run - t_evals
                if ts.eval_every and done % ts.eval_every == 0:
                    t0 = time.perf_counter()
                    result.eval_reward[done] = metrics["eval/reward_mean"] = self.evaluate(
                        backend, tok)
                    t_evals += time.perf_counter() - t0
                self.sink.log(done, metrics)
                if self.rank == 0 and reports_at(spec.samples, done):
                    self.sink.samples(done, self.step_samples(sb, tok))
                if spec.checkpoint.every and done % spec.checkpoint.every == 0 and not skipped:
                    cursor = sb.sampler_state["cursor"] * self.world
                    path = ckpt.save(engine, tok, self.root, done,
                                     {"cursor": cursor, "nan_streak": nan_streak,
                                      "metrics": metrics}, spec.checkpoint.keep, ts.zero_stage,
                                     rank_state={"sampler": sb.sampler_state},
                                     prompt_format=self.prompt_format)
                    self.sink.checkpoint(done, str(path / "hf"), metrics)
                result.steps = done
                result.curriculum = sb.sampler_state
        finally:
            if actor is not None:
                actor.stop()

        elapsed = time.perf_counter() - t_run - t_evals
        result.steps_per_s = (ts.steps - start) / elapsed if elapsed > 0 else 0.0
        if ts.steps not in result.eval_reward:
            result.eval_reward[ts.steps] = self.evaluate(backend, tok)
            self.sink.log(ts.steps, {"eval/reward_mean": result.eval_reward[ts.steps]})
        if spec.checkpoint.save_final:
            final = self.root / "final"
            ckpt.save_hf_atomic(engine.module, tok, final, ts.zero_stage, self.prompt_format)
            result.final_dir = str(final)
            self.sink.checkpoint(ts.steps, str(final), {"eval/reward_mean":
                                                        result.eval_reward[ts.steps]})
        return result

    def learn(self, engine, sb: StepBatch, ref, micro: int, moe: bool,
              top_k: int) -> tuple[dict[str, float], bool]:
        """Advantages, reference log-probs and `updates_per_batch` optimizer steps on one
        step's batch. Returns (rank-averaged metrics, skipped)."""
        spec, algo = self.spec, self.spec.algorithm
        group = spec.rollout.group_size
        batch, rewards = sb.batch, sb.rewards
        n_seq = batch.completion_ids.shape[0]
        advs = adv_lib.compute(algo.advantage, rewards.view(-1, group)).reshape(-1)
        sb.advantages = advs  # reported with the step's samples
        ref_logp = None
        if ref is not None:
            with torch.no_grad():
                ref_logp = torch.cat([
                    token_logprobs(forward_completion(ref, batch, slice(i, i + micro),
                                                      False, self.device)[0],
                                   batch.completion_ids[i:i + micro].to(self.device),
                                   spec.rollout.temperature).float().cpu()
                    for i in range(0, n_seq, micro)
                ])
        t1 = time.perf_counter()
        stats: dict[str, float] = {}
        skipped = False
        for _ in range(algo.updates_per_batch):
            upd, skipped = self.update(engine, batch, advs, rewards, ref_logp, micro, moe,
                                       top_k)
            for k, v in upd.items():
                stats[k] = stats.get(k, 0.0) + v / algo.updates_per_batch
            if skipped:
                break
        t_train = time.perf_counter() - t1
        return self.step_metrics(rewards, sb.components, batch, stats, sb.gen_s,
                                 t_train), skipped

    def step_samples(self, sb: StepBatch, tok) -> list[dict[str, Any]]:
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

    def update(self, engine, batch: RolloutBatch, advs, rewards, ref_logp, micro: int,
               moe: bool, top_k: int) -> tuple[dict[str, float], bool]:
        """One optimizer step over all micro-batches. Returns (metric sums, skipped)."""
        spec, algo = self.spec, self.spec.algorithm
        temp = spec.rollout.temperature
        seq_len = norm_len(batch, spec.rollout.max_new_tokens)  # seq_sum_norm's constant
        n_seq = batch.completion_ids.shape[0]
        gas = n_seq // micro
        sums: dict[str, float] = {}
        dropped = 0
        util_counts: list[torch.Tensor] = []
        own_norm: float | None = None
        for mb, i in enumerate(range(0, n_seq, micro)):
            sl = slice(i, i + micro)
            logits, router, flat_mask = forward_completion(engine, batch, sl, moe, self.device)
            c_ids = batch.completion_ids[sl].to(self.device)
            # Loss mask: sampled tokens only (environment/tool tokens of episodes are attended
            # to in the forward pass but never trained on); the completion mask single-turn.
            mask = loss_mask(batch)[sl].to(self.device).float()  # (b,C)
            logp = token_logprobs(logits, c_ids, temp)  # (b,C)
            pg, st = policy_loss(
                logp, batch.logprobs[sl].to(self.device), advs[sl].to(self.device), mask,
                importance=algo.importance, clip_low=algo.clip_low, clip_high=algo.clip_high,
                tis_cap=algo.tis_cap, mask_low=algo.ratio_mask_low,
                mask_high=algo.ratio_mask_high, agg=algo.loss_agg, norm_len=seq_len,
            )
            loss = pg
            ent = masked_mean(entropy(logits.detach(), temp), mask)
            parts = {"pg_loss": pg.detach(), "entropy": ent}
            if algo.entropy_coef:
                ent_g = masked_mean(entropy(logits, temp), mask)
                loss = loss - algo.entropy_coef * ent_g
            if ref_logp is not None:
                kl = aggregate(kl_k3(logp, ref_logp[sl].to(self.device)), mask, algo.loss_agg,
                               seq_len)
                parts["kl"] = kl.detach()
                if algo.kl_coef:
                    loss = loss + algo.kl_coef * kl
            if algo.dpo_coef and ref_logp is not None:
                d_loss, d_acc, pairs = self.dpo_term(logp, ref_logp[sl].to(self.device), mask,
                                                     rewards[sl])
                # Every rank reports the same keys (metrics are all-reduced as one vector).
                parts["dpo_pairs"] = torch.tensor(float(pairs))
                parts["dpo_loss"], parts["dpo_acc"] = torch.zeros(()), torch.zeros(())
                if d_loss is not None:
                    loss = loss + algo.dpo_coef * d_loss
                    parts["dpo_loss"], parts["dpo_acc"] = d_loss.detach(), d_acc
            if router is not None:
                aux = load_balancing_loss(router, top_k, flat_mask)
                loss = loss + spec.model.router_aux_loss_coef * aux
                parts["aux_loss"] = aux.detach()
                util_counts.append(torch.stack([
                    torch.tensor(u["tokens"]) for u in expert_utilisation(router, top_k,
                                                                           flat_mask)
                ]))  # (layers,E)
            parts["loss"] = loss.detach()
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
                for k, v in {**parts, **st}.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        sums = {k: v / (gas - dropped) for k, v in sums.items()}
        sums["dropped_microbatches"] = float(dropped)
        gn = engine.get_global_grad_norm()
        if gn is None:
            gn = own_norm
        if gn is not None:
            sums["grad_norm"] = float(gn)
        if util_counts:
            counts = all_reduce_sum(torch.stack(util_counts).sum(0).float())  # (layers,E)
            for layer, row in enumerate(counts):
                p = row / row.sum().clamp(min=1.0)
                ent = -(p * p.clamp(min=1e-12).log()).sum() / math.log(len(row))
                sums[f"moe/layer{layer}/load_entropy"] = float(ent)
                for e, c in enumerate(row.tolist()):
                    sums[f"moe/layer{layer}/expert{e}_tokens"] = c
        return sums, False

    def dpo_term(self, logp, ref_logp, mask, rewards):
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

    def step_metrics(self, rewards, components, batch, stats, t_gen, t_train):
        """Average over ranks: rewards and components by sample, losses by rank."""
        names = sorted(components)
        local = [float(rewards.sum()), float((rewards**2).sum()), float(rewards.numel())]
        local += [sum(components[n]) for n in names]
        keys = sorted(k for k in stats if not k.startswith("moe/"))
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
        out.update({k: v for k, v in stats.items() if k.startswith("moe/")})
        return out


def default_sink(spec: RunSpec) -> Reporter:
    sinks: list[Reporter] = []
    if spec.output.stdout:
        sinks.append(StdoutSink())
    if spec.output.metrics_jsonl:
        sinks.append(JsonlSink(spec.output.metrics_jsonl))
    return MultiSink(*sinks)


def train(
    spec: RunSpec, sink: Reporter | None = None, *, resume: bool = False,
    task: Task | None = None, pinned: PinnedData | None = None,
) -> RunResult:
    """Run (or resume) one training run. Callable from the CLI, torchrun or a Celery task.
    ``pinned``: the run's pinned SFT / preference datasets (see pinned_data.py)."""
    with process_group() as (rank, world):
        run = Run(spec, sink, task, rank, world, pinned)
        root = run.root
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            (root / "spec.json").write_text(spec.to_json())
            used = threads.in_use()
            run.sink.event("info", f"run {spec.name} on {world} rank(s), {used['torch_threads']} "
                           f"torch thread(s) per rank, config:\n{spec.to_json()}",
                           {"spec": spec.model_dump(mode="json"), "world_size": world,
                            "threads": used})
        if not resume and (ckpt.latest(root) is not None or (root / "sft").exists()
                           or (root / "preference").exists()):
            raise ValueError(
                f"checkpoint.dir {root} already holds a run; resume it or choose another dir"
            )
        run.barrier()
        last = ckpt.latest(root) if resume else None
        if last is not None:
            tok = load_tokenizer(last / "hf")
        elif (root / "sft" / "config.json").is_file():
            tok = load_tokenizer(root / "sft")
        elif (root / "preference" / "config.json").is_file():
            tok = load_tokenizer(root / "preference")
        else:
            tok = run.tokenizer()
        try:
            warm_dir = preference_phase(run, tok, run.sft(tok))
            return run.rl(tok, warm_dir, resume)
        finally:
            if run.cache is not None:
                run.cache.close()
