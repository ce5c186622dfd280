"""The vLLM rollout backend (GPU pools): the `hf` backend's contract at vLLM's speed.

Same contract as `HFRollout`: token ids and the sampling policy's per-token logprobs, laid out
as the trainer re-scores them (left-padded prompt, right-padded completion that includes the
eos/stop token, texts cut at the first stop string). Differences worth knowing:

* Logprobs come from vLLM with `logprobs_mode="processed_logprobs"`: the distribution actually
  sampled from (after temperature, and after top-p truncation and renormalisation when
  top_p < 1; the `hf` backend reports the temperature-scaled distribution before top-p).
* Each row is its own request with a seed drawn from the step's torch generator, so a step's
  samples are reproducible for given weights.
* Weights are pushed after each update with a version number (`load_state` / `sync_weights`):
  in-process through `LLM.collective_rpc` into a small worker extension that calls the
  model's own `load_weights`, followed by `reset_prefix_cache()` (cached KV blocks were computed
  by the old weights). A push that exceeds `sync_timeout_s` fails loudly and leaves the backend
  refusing to generate (its weights may be half-loaded) instead of sampling from them.
* Prefix caching (a group's copies of one prompt share its KV blocks) and chunked prefill (long
  prompts prefill in chunks next to running decodes) are switched by `VllmSpec`.

vLLM is imported lazily: CPU installs never need it; constructing the backend without it says
to `pip install .[gpu]`. Needs vLLM >= 0.11 (`logprobs_mode`, V1 engine).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from workers.rl.rollout import Prompt, RolloutBatch, cut_at_stop, left_pad
from workers.rl.spec import RolloutSpec
from workers.rl.spec_data import VllmSpec

INSTALL_HINT = ("the vLLM rollout backend needs vLLM on a CUDA machine: install the GPU extra "
                "with `pip install .[gpu]`")
MIN_VLLM = (0, 11)
EXTENSION = "workers.rl.vllm_rollout.CrucibleWorkerExtension"
R = TypeVar("R")


class VllmUnavailable(ImportError):
    """vLLM (or a GPU) is missing; the message says what to install."""


class WeightSyncError(RuntimeError):
    """A weight push failed or stalled; the engine may hold partial weights."""


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise VllmUnavailable(f"{INSTALL_HINT} ({exc})") from exc
    version = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VLLM:
        raise VllmUnavailable(f"vLLM {vllm.__version__} is too old: the vLLM backend needs "
                              f">= {'.'.join(map(str, MIN_VLLM))} (`pip install -U .[gpu]`)")
    return vllm


# ---- pure parts: weight names, logprob extraction, batch layout, versions ------------------


def checkpoint_named_weights(
    state: Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's parameter names and shapes as a Hugging Face checkpoint stores them, which
    is what vLLM's `load_weights` understands. transformers 5 keeps MoE experts fused in memory
    (`experts.gate_up_proj` (E, 2I, H), `experts.down_proj` (E, H, I)); checkpoints list each
    expert's `gate_proj` / `up_proj` / `down_proj` (gate is the first half of gate_up)."""
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter]
                yield f"{base}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> list[float]:
    """Per-token logprob of each sampled token from a vLLM `CompletionOutput.logprobs`: one
    mapping token id -> `Logprob` (or float) per position, as a list or vLLM's `FlatLogprobs`
    (which indexes the same way). With `SamplingParams(logprobs=0)` each position holds just
    the sampled token."""
    if logprobs is None:
        raise ValueError("vLLM returned no logprobs: the request needs SamplingParams(logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} logprob positions for "
                         f"{len(token_ids)} tokens")
    out = []
    for pos, tid in enumerate(token_ids):
        entry = logprobs[pos]
        lp = entry.get(tid) if entry is not None else None
        if lp is None:
            raise ValueError(f"vLLM gave no logprob for the sampled token {tid} at position {pos}")
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def assemble_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, outputs: Sequence[Any], pad_id: int,
    stops: list[str],
) -> RolloutBatch:
    """A RolloutBatch from vLLM `RequestOutput`s (one per row, first completion each), with the
    tokenizer's left-padded prompt layout; completion tokens right-padded with `pad_id`."""
    if len(outputs) != prompt_ids.shape[0]:
        raise ValueError(f"{len(outputs)} vLLM outputs for {prompt_ids.shape[0]} prompts")
    comps = [o.outputs[0] for o in outputs]
    ids = [list(c.token_ids) for c in comps]
    lps = [sampled_logprobs(i, c.logprobs) for i, c in zip(ids, comps, strict=True)]
    width = max(1, max(len(i) for i in ids))
    b = len(ids)
    completion_ids = torch.full((b, width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((b, width), dtype=torch.long)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    for r, (row, lp) in enumerate(zip(ids, lps, strict=True)):
        completion_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        completion_mask[r, : len(row)] = 1
        logprobs[r, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    texts = [cut_at_stop(c.text, stops)[0] for c in comps]
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, texts)


def prompt_layout(tok: Any, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B,P) prompt ids and mask: text through the tokenizer (no special tokens
    added), token ids as given."""
    if all(isinstance(p, str) for p in prompts):
        enc = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]
    seqs = [list(tok(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str)
            else [int(t) for t in p] for p in prompts]
    return left_pad(seqs, tok.pad_token_id)


@dataclass
class WeightVersions:
    """Which weights the engine samples from. Versions only move forward; a failed push poisons
    the engine until it is rebuilt, because its weights may be half old, half new."""

    current: int = 0
    pending: int | None = None
    failed: str | None = None

    def check(self) -> None:
        if self.failed is not None:
            raise WeightSyncError(f"the vLLM engine's weights are unusable: {self.failed}; "
                                  "rebuild the backend from the latest checkpoint")

    def begin(self, version: int) -> None:
        self.check()
        if version <= self.current:
            raise ValueError(f"weight version {version} is not newer than the loaded version "
                             f"{self.current}")
        self.pending = version

    def commit(self) -> int:
        assert self.pending is not None
        self.current, self.pending = self.pending, None
        return self.current

    def fail(self, reason: str) -> None:
        self.failed, self.pending = reason, None


def run_with_timeout(fn: Callable[[], R], timeout: float, what: str) -> R:
    """Run `fn` on a helper thread; raise WeightSyncError if it neither returns nor raises in
    `timeout` seconds (the thread is abandoned: a stuck CUDA call cannot be interrupted)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="vllm-weight-sync", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise WeightSyncError(f"{what} did not finish in {timeout:.0f} s (vllm.sync_timeout_s)")
    if "error" in box:
        raise WeightSyncError(f"{what} failed: {box['error']}") from box["error"]
    return box["value"]


# ---- inside vLLM's worker process ----------------------------------------------------------


class CrucibleWorkerExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); called via `collective_rpc`."""

    def crucible_load_weights(self, weights: list[tuple[str, torch.Tensor]], version: int) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        device = next(model.parameters()).device
        model.load_weights(weights=((n, t.to(device, non_blocking=True)) for n, t in weights))
        torch.cuda.synchronize(device)
        self._crucible_version = version
        return version

    def crucible_weight_version(self) -> int:
        return getattr(self, "_crucible_version", 0)


# ---- the backend -----------------------------------------------------------------------------


class VllmRollout:
    """`RolloutBackend` on a vLLM engine built from a model directory (config, weights and
    tokenizer: e.g. the SFT output or a checkpoint's `hf/`); the trainer's weights replace the
    directory's after every update."""

    def __init__(self, model_dir: str | Path, tokenizer: Any, spec: VllmSpec,
                 version: int = 0) -> None:
        """`version`: the weight version the directory holds (the resumed step, say)."""
        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise VllmUnavailable(f"{INSTALL_HINT}; no CUDA device is visible")
        self.spec, self.tok = spec, tokenizer
        self.versions = WeightVersions(current=version)
        self._sampling_cls = vllm.SamplingParams
        if spec.tensor_parallel_size == 1:
            # In-process engine: collective_rpc hands tensors over without serialising them.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": spec.dtype,
            "seed": spec.seed,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "gpu_memory_utilization": spec.gpu_memory_utilization,
            "enable_prefix_caching": spec.enable_prefix_caching,
            "enable_chunked_prefill": spec.enable_chunked_prefill,
            "enforce_eager": spec.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
            "enable_sleep_mode": spec.sleep_between_steps,
        }
        for key in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
        if spec.rope_scaling is not None:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            kwargs["hf_overrides"] = spec.rope_scaling.overrides(config)
        self.llm = vllm.LLM(**kwargs)
        self._asleep = False

    @property
    def version(self) -> int:
        """The weight version the next `generate` samples from."""
        return self.versions.current

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], spec: RolloutSpec,
                 generator: torch.Generator) -> RolloutBatch:
        """Text prompts are tokenized here; token-id prompts (an episode's context) go to
        vLLM as `prompt_token_ids` untouched, so no turn is decoded and re-encoded."""
        self.versions.check()
        self._wake()
        prompt_ids, prompt_mask = prompt_layout(self.tok, prompts)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        requests = [{"prompt_token_ids": row[m.bool()].tolist()}
                    for row, m in zip(prompt_ids, prompt_mask, strict=True)]
        params = [
            self._sampling_cls(
                n=1, temperature=spec.temperature, top_p=spec.top_p,
                max_tokens=spec.max_new_tokens, stop=list(spec.stop) or None, logprobs=0,
                seed=int(s), skip_special_tokens=True,
            )
            for s in seeds
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.spec.sleep_between_steps:
            self.llm.sleep(level=1)
            self._asleep = True
        return assemble_batch(prompt_ids, prompt_mask, outputs, self.tok.pad_token_id,
                              list(spec.stop))

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Push a full state dict (the trainer's names) as weight version `version`."""
        self.versions.begin(version)
        named = list(checkpoint_named_weights(state))
        if self.spec.tensor_parallel_size > 1:  # crosses process boundaries: plain CPU tensors
            named = [(n, t.detach().cpu()) for n, t in named]

        def push() -> list[int]:
            self._wake()
            got = self.llm.collective_rpc("crucible_load_weights", args=(named, version))
            self.llm.reset_prefix_cache()
            return got

        try:
            got = run_with_timeout(push, self.spec.sync_timeout_s,
                                   f"pushing weight version {version} to vLLM")
        except WeightSyncError as err:
            self.versions.fail(str(err))
            raise
        if any(v != version for v in got):
            self.versions.fail(f"workers report versions {got} after pushing {version}")
            self.versions.check()
        self.versions.commit()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """`RolloutBackend.sync_weights`: push the module's current weights as the next version.
        Under ZeRO-3 pass a gathered snapshot to `load_state` instead."""
        self.load_state(model.state_dict(), self.versions.current + 1)

    def worker_versions(self) -> list[int]:
        """What every vLLM worker reports it has loaded (a cross-check for tests and logs)."""
        return list(self.llm.collective_rpc("crucible_weight_version"))
