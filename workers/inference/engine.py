"""The served policy: a Hugging Face checkpoint directory sampled through the RL engine's own
rollout path, so "our inference" samples exactly as training does.

One thread owns the model. For the models the RL engine trains (a plain fp32 Qwen3-MoE, see
`workers.rl.lean`) that thread is the continuous scheduler (`workers.inference.continuous`):
requests join and leave the running batch between decode steps, shared prompts prefill once,
cached prefixes are reused, long prompts prefill in chunks. Any other model samples through
`HFRollout` with `Batcher`: requests that arrive while it is busy and share their sampling
settings are merged into one batch (a request with a `seed` runs alone, so the same request
always gives the same completions). Every decode step reports each row's token, its logprob and
the top alternatives from that step's logits (`TokenEvent`); a streaming request receives them
as they are sampled, the others in their finished `Sample`s.
"""

from __future__ import annotations

import copy
import json
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from workers.envs import toolcalls as tool_format
from workers.envs.adapter import SEPARATOR, message_text
from workers.inference.continuous import ContinuousBatcher, can_serve
from workers.inference.quantize import quantize_model
from workers.inference.speculative import DraftModel, NgramProposer, SpeculativeDecoder
from workers.rl import prompt_format as prompt_formats
from workers.rl.model import check_model_dir
from workers.rl.prompt_format import Layout
from workers.rl.rollout import (
    HFRollout,
    Prompt,
    cut_at_stop,
)
from workers.rl.sampling import Job, JobInbox, Sample, SamplingParams, TokenEvent
from workers.rl.spec import RolloutSpec
from workers.rl.tokenizer import load_tokenizer

ChatFormat = Literal["auto", "template", "plain", "raw"]
# HFRollout samples at temperature > 0; this one makes sampling an argmax in float32.
GREEDY_TEMPERATURE = 1e-6


class ChatFormatError(ValueError):
    """A conversation the chosen chat format cannot express."""


def plain_chat(messages: list[tuple[str, str]]) -> str:
    """The documented fallback format: `<role>: <content>\\n` per message, then `assistant:`."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def raw_chat(messages: list[tuple[str, str]], layout: Layout = "single_turn",
             eos_token: str = "") -> str:
    """The prompt text the RL engine trains on (workers.rl.prompt_format): single-turn, the
    contents joined by a blank line, so a lone user message is sent verbatim (`3+4=`)."""
    try:
        return prompt_formats.render(messages, layout, eos_token)
    except prompt_formats.PromptFormatError as exc:
        raise ChatFormatError(f"chat format 'raw': {exc}") from None


def raw_tool_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  layout: Layout = "single_turn", eos_token: str = "") -> str:
    """A tool conversation for a raw-prompt checkpoint. In the `episode` layout it is the text
    the RL engine trains terminal episodes on (`workers.envs.terminal.play`): the tools block
    after the system prompt, each assistant turn its text and `<tool_call>` blocks closed by
    the end-of-turn token, and each tool result as `[<tool name> result]` and its content (the
    name found from the call it answers), not a `<tool_response>` block. So an evaluation
    shows a trained checkpoint the layout it learnt in."""
    if layout != "episode":
        return raw_chat(tool_format.text_messages(messages, tools), layout, eos_token)
    if messages and messages[-1].get("role") == "assistant":
        raise ChatFormatError("chat format 'raw': a raw-prompt model cannot continue an "
                              "assistant message; end the conversation with a user (or tool) "
                              "message")
    rendered = tool_format.text_messages(messages, tools)
    offset = len(rendered) - len(messages)  # 1 when a tools block became the first message
    names = {c.get("id"): c["function"].get("name", "tool")
             for m in messages if m.get("role") == "assistant"
             for c in m.get("tool_calls") or []
             if isinstance(c, dict) and isinstance(c.get("function"), dict)}
    out = [message_text({"role": r, "content": t}) for r, t in rendered[:offset]]
    for m, (role, text) in zip(messages, rendered[offset:], strict=True):
        if role == "assistant":
            out.append(text + eos_token + SEPARATOR)
        elif role == "tool":
            out.append(message_text({
                "role": "tool", "name": names.get(m.get("tool_call_id"), "tool"),
                "content": m.get("content") or ""}))
        else:
            out.append(message_text({"role": role, "content": text}))
    return "".join(out)


ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def long_context_config(config: Any, rope_scaling: dict[str, Any],
                        max_model_len: int | None) -> Any:
    """The checkpoint's config with its RoPE parameters replaced for a longer context:
    `rope_scaling` as vLLM's `hf_overrides` and Qwen's model cards give it (`rope_type`,
    `factor`, and for yarn optionally `original_max_position_embeddings`)."""
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type must be one of {', '.join(ROPE_TYPES)}; "
                         f"got {kind!r}")
    factor = rope_scaling.get("factor")
    if not isinstance(factor, int | float) or factor < 1.0:
        raise ValueError("rope_scaling.factor must be a number >= 1")
    base = dict(getattr(config, "rope_parameters", None) or {})
    original = int(getattr(config, "max_position_embeddings", 0) or 0)
    params = {**base, **{k: v for k, v in rope_scaling.items() if k != "type"},
              "rope_type": kind}
    params.setdefault("original_max_position_embeddings", original)
    config.rope_parameters = params
    config.max_position_embeddings = max_model_len or int(original * float(factor))
    return config


class Policy:
    """A causal LM and its tokenizer loaded from a checkpoint directory."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: Literal["auto", "float32", "bfloat16"] = "auto",
        chat_format: ChatFormat = "auto",
        rope_scaling: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        int8: bool = False,
    ) -> None:
        """`rope_scaling` (e.g. `{"rope_type": "yarn", "factor": 4.0}`) replaces the
        checkpoint's RoPE parameters for long contexts; `max_model_len` sets the context served
        (default: the checkpoint's, times a scaling factor). `int8` stores the projection and
        expert weights as int8 with per-channel scales (`workers.inference.quantize`; CPU)."""
        path = check_model_dir(model_dir)
        self.path = path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if int8 and self.device.type != "cpu":
            raise ValueError(f"--int8 quantises for CPU serving (torch's int8 CPU kernel); on "
                             f"{self.device.type} serve with --dtype bfloat16 or the vLLM "
                             "backend instead")
        self.tok = load_tokenizer(path)
        if dtype == "auto":
            bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            dtype = "bfloat16" if bf16 else "float32"
        overrides: dict[str, Any] = {}
        if rope_scaling is not None:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            overrides["config"] = long_context_config(config, rope_scaling, max_model_len)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype), **overrides
        )
        # transformers types `to` (a wrapped method) as taking the model again.
        self.model = model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.int8: dict[str, int] | None = None  # what quantize_model replaced, when asked
        if int8:
            self.int8 = quantize_model(self.model)
        self.rollout = HFRollout(self.model, self.tok)
        # Fast tokenizers refuse concurrent calls that touch their padding state ("Already
        # borrowed"): the batcher thread samples with `tok`, request handlers use their own.
        self.request_tok = copy.deepcopy(self.tok)
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        if max_model_len is not None:
            if self.context is not None and rope_scaling is None and max_model_len > self.context:
                raise ValueError(f"max_model_len {max_model_len} exceeds the checkpoint's "
                                 f"context of {self.context} tokens; give rope_scaling to "
                                 "stretch it")
            self.context = max_model_len
        has_template = bool(getattr(self.tok, "chat_template", None))
        # How the checkpoint was trained (prompt_format.json), when the RL engine wrote it.
        self.recorded = prompt_formats.read(path)
        self.layout: Layout = self.recorded.layout if self.recorded else "single_turn"
        if chat_format == "auto":
            if self.recorded is not None and self.recorded.format == "raw":
                chat_format = "raw"
            else:
                chat_format = "template" if has_template else "plain"
        if chat_format == "template" and not has_template:
            raise ValueError(f"the tokenizer in {path} has no chat template; use 'plain' or 'raw'")
        self.chat_format: ChatFormat = chat_format

    # ---- prompts ---------------------------------------------------------------------------

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        if self.chat_format == "template":
            # tokenize=False returns the text; transformers types every return form.
            return self.request_tok.apply_chat_template(  # type: ignore[return-value]
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False, add_generation_prompt=True,
            )
        if self.chat_format == "raw":
            return raw_chat(messages, self.layout, self.request_tok.eos_token or "")
        return plain_chat(messages)

    def render_tool_chat(self, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None) -> str:
        """A conversation with tools offered or tool calls in its history (OpenAI-shaped
        dicts). A chat template that renders tools itself (Qwen's, Hermes') gets them as
        structured messages, so the model sees exactly its training format; every other
        format gets the text rendering of `workers.envs.toolcalls`."""
        if self.chat_format == "template":
            template = str(getattr(self.request_tok, "chat_template", "") or "")
            if "tool" in template:
                structured = [
                    {**m, "tool_calls": [
                        {**c, "function": {**c["function"],
                                           "arguments": json.loads(c["function"]["arguments"])}}
                        for c in m["tool_calls"]]} if m.get("tool_calls") else m
                    for m in messages]
                return self.request_tok.apply_chat_template(  # type: ignore[return-value]
                    structured, tools=list(tools) if tools else None, tokenize=False,
                    add_generation_prompt=True)
            return self.render_chat(tool_format.text_messages(messages, tools, tool_role="user"))
        if self.chat_format == "raw":
            return raw_tool_chat(messages, tools, self.layout, self.request_tok.eos_token or "")
        return self.render_chat(tool_format.text_messages(messages, tools))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt exactly as sampling sees it (request threads only)."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        return self.request_tok(prompt, add_special_tokens=False)["input_ids"]

    def count_tokens(self, prompt: Prompt) -> int:
        return len(self.encode(prompt))

    # decode of one id list is one str; transformers types it `str | list[str]`.
    def token_text(self, token_id: int) -> str:
        return self.request_tok.decode([token_id])  # type: ignore[return-value]

    def decode(self, token_ids: list[int]) -> str:
        """Completion text of sampled ids, special tokens (the eos) left out (request threads)."""
        return self.request_tok.decode(token_ids, skip_special_tokens=True)  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    # ---- sampling --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], params: SamplingParams, seed: int | None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> list[Sample]:
        """One sample per prompt (repeat a prompt for several). Logprobs are those of the sampling
        distribution (logits after any repetition penalty, / temperature, before top-k, top-p
        and min-p), as the RL engine records them; for greedy decoding (temperature 0) they are
        the model's own (temperature 1). They come from each decode step's logits, and
        `on_token` receives every row's token as it is sampled (streaming)."""
        greedy = params.temperature == 0.0
        spec = RolloutSpec(
            max_new_tokens=params.max_tokens,
            temperature=GREEDY_TEMPERATURE if greedy else params.temperature,
            top_p=params.top_p,
            stop=list(params.stop),
        )
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else secrets.randbits(62))
        scale = 1.0 if greedy else params.temperature
        k = params.top_logprobs
        lps: list[list[float]] = [[] for _ in prompts]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in prompts]

        def step(_t: int, tokens: torch.Tensor, logits: torch.Tensor, live: torch.Tensor) -> None:
            logp = torch.log_softmax(logits / scale, dim=-1)  # (B,V)
            chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).cpu().tolist()
            alts: list[list[tuple[int, float]]] = [[] for _ in chosen]
            if k:
                vals, idx = logp.topk(k, dim=-1)
                alts = [list(zip(i, v, strict=True))
                        for i, v in zip(idx.cpu().tolist(), vals.cpu().tolist(), strict=True)]
            for row in torch.nonzero(live).flatten().tolist():
                lps[row].append(chosen[row])
                tops[row].append(alts[row])
                if on_token is not None:
                    on_token(TokenEvent(row, int(tokens[row]), chosen[row], alts[row]))

        batch = self.rollout.generate(prompts, spec, gen, controls=params.controls(),
                                      on_step=step)
        eos = self.tok.eos_token_id
        out = []
        for i in range(len(prompts)):
            m = batch.completion_mask[i].bool()
            ids = batch.completion_ids[i][m].tolist()
            full: str = self.tok.decode(ids, skip_special_tokens=True)  # type: ignore[assignment]
            text, hit_stop = cut_at_stop(full, list(params.stop))
            ended = bool(ids) and ids[-1] == eos
            out.append(Sample(ids, lps[i][: len(ids)], tops[i][: len(ids)] if k else [], text,
                              "stop" if ended or hit_stop else "length", eos=ended))
        return out


@dataclass(frozen=True)
class EngineOptions:
    """How the served policy schedules its sequences (the serve command's flags)."""

    engine: Literal["auto", "continuous", "static"] = "auto"
    prefill_chunk: int = 512  # prompt tokens prefilled per scheduler iteration at most
    prefix_caching: bool = True
    prefix_cache_tokens: int = 16384  # tokens of cached prefixes kept (LRU)
    # Speculative decoding (workers.inference.speculative): guesses from prompt lookup with
    # n-grams of this length, or from a draft checkpoint sharing the tokenizer; K per step.
    ngram_draft: int = 0
    draft_checkpoint: str | None = None
    num_speculative_tokens: int = 4

    @property
    def speculative(self) -> bool:
        return self.ngram_draft > 0 or self.draft_checkpoint is not None


def make_batcher(policy: Policy, max_rows: int, options: EngineOptions | None = None
                 ) -> Batcher | ContinuousBatcher:
    """The continuous scheduler where it is exact for the model, else the merging `Batcher`."""
    opts = options or EngineOptions()
    if opts.prefill_chunk < 1 or opts.prefix_cache_tokens < 0 or max_rows < 1:
        raise ValueError("prefill_chunk and max_rows must be >= 1, prefix_cache_tokens >= 0")
    if opts.speculative:
        return SpeculativeBatcher(policy, max_rows, speculative_decoder(policy, opts))
    fits = can_serve(policy.model)
    if opts.engine == "continuous" and not fits:
        raise ValueError("the continuous engine serves a plain fp32 Qwen3-MoE with default "
                         "RoPE and float weights (see workers/rl/lean.py); use engine 'static' "
                         "for this model" + (" (int8 weights)" if policy.int8 else ""))
    if opts.engine == "static" or not fits:
        return Batcher(policy, max_rows)
    return ContinuousBatcher(policy, max_rows, prefill_chunk=opts.prefill_chunk,
                             prefix_cache_tokens=opts.prefix_cache_tokens,
                             prefix_caching=opts.prefix_caching)


class Batcher(JobInbox):
    """Runs jobs on one thread; merges queued jobs with equal params (and no seed)."""

    def __init__(self, policy: Policy, max_rows: int = 64) -> None:
        super().__init__()
        self.policy, self.max_rows = policy, max_rows
        self.batches = 0  # batches run, for tests and logs
        self._thread = threading.Thread(target=self._loop, name="inference-batcher",
                                        daemon=True)
        self._thread.start()

    def _take(self) -> list[Job] | None:
        with self._cv:
            while not self._jobs and not self._closed:
                self._cv.wait()
            if not self._jobs:
                return None
            first = self._jobs.pop(0)
            group, rows = [first], first.rows
            if first.seed is None:
                for job in list(self._jobs):
                    if (job.seed is None and job.params == first.params
                            and rows + job.rows <= self.max_rows):
                        self._jobs.remove(job)
                        group.append(job)
                        rows += job.rows
            return group

    def _loop(self) -> None:
        while (group := self._take()) is not None:
            group = [j for j in group if j.future.set_running_or_notify_cancel()]
            if not group:
                continue
            prompts = [p for j in group for p in j.prompts for _ in range(j.n)]
            owners: list[tuple[Job, int]] = [(j, r) for j in group for r in range(j.rows)]

            def route(ev: TokenEvent, owners: list[tuple[Job, int]] = owners) -> None:
                job, row = owners[ev.row]
                if job.on_token is not None:
                    job.on_token(TokenEvent(row, ev.token_id, ev.logprob, ev.top_logprobs))

            streaming = any(j.on_token is not None for j in group)
            try:
                samples = self._generate(prompts, group[0].params, group[0].seed,
                                         route if streaming else None)
            except Exception as exc:  # noqa: BLE001 - handed to every waiting request
                for j in group:
                    j.future.set_exception(exc)
                continue
            self.batches += 1
            at = 0
            for j in group:
                mine = samples[at : at + j.rows]
                at += j.rows
                j.future.set_result([mine[i * j.n : (i + 1) * j.n]
                                     for i in range(len(j.prompts))])

    def _generate(self, prompts: list[Prompt], params: SamplingParams, seed: int | None,
                  on_token: Callable[[TokenEvent], None] | None) -> list[Sample]:
        return self.policy.generate(prompts, params, seed, on_token)

    def stats(self) -> dict[str, Any]:
        """Engine counters for /health (none for the plain batcher)."""
        return {}


def speculative_decoder(policy: Policy, opts: EngineOptions) -> SpeculativeDecoder:
    """The decoder the serve flags ask for: n-gram lookup or a draft checkpoint, not both."""
    if opts.ngram_draft > 0 and opts.draft_checkpoint is not None:
        raise ValueError("give either --ngram-draft or --draft-checkpoint, not both")
    if opts.num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    proposer: NgramProposer | DraftModel
    if opts.draft_checkpoint is not None:
        dtype = next(policy.model.parameters()).dtype
        proposer = DraftModel(opts.draft_checkpoint, policy.tok, policy.vocab_size,
                              policy.device, dtype)
    else:
        proposer = NgramProposer(opts.ngram_draft)
    return SpeculativeDecoder(policy.model, proposer, opts.num_speculative_tokens,
                              policy.tok.eos_token_id,
                              lambda ids: str(policy.tok.decode(ids, skip_special_tokens=True)))


class SpeculativeBatcher(Batcher):
    """The `Batcher` with each row decoded speculatively, one sequence at a time (a batch's
    rows take turns: speculation pays most where a single stream is latency-bound). Requests
    with a repetition penalty take the plain path (the penalty makes the target's distribution
    depend on the guesses themselves), and so do requests with a `logit_bias` or a structured
    output constraint (the proposers would guess from unbiased, unmasked logits; the plain
    sampler applies the bias and the grammar mask exactly)."""

    def __init__(self, policy: Policy, max_rows: int, decoder: SpeculativeDecoder) -> None:
        self.decoder = decoder
        self.method = ("draft-model" if isinstance(decoder.proposer, DraftModel)
                       else "ngram")
        super().__init__(policy, max_rows)

    def _generate(self, prompts: list[Prompt], params: SamplingParams, seed: int | None,
                  on_token: Callable[[TokenEvent], None] | None) -> list[Sample]:
        if (params.repetition_penalty != 1.0 or params.logit_bias
                or params.constraint is not None):
            return self.policy.generate(prompts, params, seed, on_token)
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else secrets.randbits(62))
        tok, eos = self.policy.tok, self.policy.tok.eos_token_id
        out = []
        for row, prompt in enumerate(prompts):
            ids = ([int(t) for t in prompt] if not isinstance(prompt, str)
                   else list(tok(prompt, add_special_tokens=False)["input_ids"]))

            def emit(t: int, lp: float, alts: list[tuple[int, float]], row: int = row) -> None:
                if on_token is not None:
                    on_token(TokenEvent(row, t, lp, alts))

            got = self.decoder.generate(
                ids, max_tokens=params.max_tokens, temperature=params.temperature,
                top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                stop=params.stop, top_logprobs=params.top_logprobs, gen=gen,
                context_limit=self.policy.context, on_token=emit)
            full: str = tok.decode(got.token_ids, skip_special_tokens=True)  # type: ignore[assignment]
            text, hit = cut_at_stop(full, list(params.stop))
            ended = bool(got.token_ids) and got.token_ids[-1] == eos
            out.append(Sample(got.token_ids, got.logprobs, got.top_logprobs, text,
                              "stop" if ended or hit else "length", eos=ended))
        return out

    def stats(self) -> dict[str, Any]:
        d = self.decoder
        return {"speculative": {"method": self.method, "num_speculative_tokens": d.k,
                                "proposed": d.proposed, "accepted": d.accepted,
                                "acceptance_rate": round(d.acceptance_rate, 4),
                                "target_forwards": d.steps}}
