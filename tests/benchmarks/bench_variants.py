"""Fast variants of a served model: speculative decoding (workers/inference/speculative.py) with
n-gram prompt lookup and with a draft model, and int8 weights (workers/inference/quantize.py,
`serve --int8`), alone and under n-gram speculation, against the same model decoded plainly;
and each variant's eval delta on the same held-out tasks.

The checkpoints are built here (no download): a BPE tokenizer trained on a synthetic word
corpus, a Qwen3-MoE target (`--layers` layers, hidden `--hidden`) and a one-layer draft of half
its width, both trained for `--train-steps` language-modelling steps on rows of that language
in which each `--passage`-token passage is followed by repeats of itself, so both learn to copy
(two random-init models never agree, so a draft would be rejected every time: a truncated copy
of the random target was, 0 of 514 guesses). The draft is loaded through `--draft-checkpoint`.

Each engine is the serve command's own (`make_batcher` with the flags' `EngineOptions`), run in
this process with one torch thread: `--prompts` greedy requests of `--max-tokens` tokens sent
one after another (a single stream: the latency-bound case speculation is for). Prompts repeat
a passage of themselves, as edits and summaries of a given text do: a fresh `--passage`-token
passage repeated to `--prompt-tokens` tokens, the period the model learnt to copy at (it copies
from `--passage` tokens back; it did not learn to match content at other periods in 200 steps:
prompts repeating at 64 tokens made its output leave the prompt's text, n-gram acceptance 0.12;
a corpus half plain text, half repeats kept greedy loops but taught no copying, held-out score
0.03). Baselines, measured in the
same run: the default engine for this model (the continuous scheduler over the RL engine's lean
forward) and the static engine (the Hugging Face forward with its KV cache, the forward the
speculative decoder also uses; the int8 model takes this path too). Figures are medians over
`--rounds`; every speculative output is checked token-for-token against its own model's plain
greedy output (the base's, or the int8 model's for int8+ngram).

Eval delta: `--eval-tasks` held-out tasks, each a fresh `--passage`-token passage of the same
synthetic language (drawn with another seed, never trained on) followed by the first
`--eval-cue` tokens of its repeat; the variant's greedy continuation of `--eval-answer` tokens
is scored by the fraction equal to the repeat's (token accuracy, an exact-match grader per
position). Continuing an unseen passage of random words is guesswork (about 3% for every
model), so a delta there is 0 whatever a variant does; copying it back is a skill the base
has (its score is printed against chance, 1 / vocabulary), so a variant that damages the
model loses score. The base is the float model decoded plainly; every variant answers the same
tasks. A negative control, not a product variant, shows the metric moving: the same target
with Gaussian noise of `--control-noise` times each weight matrix's standard deviation,
served by the default engine, whose delta should fall well below the variants' bar.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_variants`. Ends with
DESIGN.md's lines:
    <figure>: crucible=<value> <peer>=<value> ratio=<crucible/peer> target=<op><value>
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(LETTERS[: rng.randint(6, 26)])
                            for _ in range(rng.randint(2, 7))) for _ in range(count))


def fit(model, batches: list[torch.Tensor], steps: int) -> None:
    """Language-modelling steps, so target and draft share the corpus's habits (at 3e-3 a
    2-layer model learnt to copy later than at 1e-3)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for i in range(steps):
        x = batches[i % len(batches)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def copy_rows(tok, rng: random.Random, rows: int, width: int, passage: int) -> torch.Tensor:
    """`rows` training rows of `width` tokens: a passage of `passage` tokens of the synthetic
    language followed by repeats of itself, so the models learn to copy as well as the
    language's spelling (the held-out tasks ask for exactly that on passages never seen).
    Passages of one length: copying from a fixed distance back took the 6-layer target under
    200 steps; with lengths of 8 to 28 tokens (copying by content, induction) a 2-layer
    hidden-128 model needed about 1,100 and the target showed none in 300 (lr 3e-3) or 240
    (1e-3)."""
    out = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < width:
            ids = list(tok(words(rng, 12), add_special_tokens=False)["input_ids"])[:passage]
            row += ids * 3
        out.append(row[:width])
    return torch.tensor(out)


def build(out: Path, layers: int, hidden: int, steps: int, passage: int) -> tuple[Path, Path]:
    """The target checkpoint and a one-layer draft of half its width with its tokenizer, both
    trained briefly on the same repeated-passage corpus (seed 0), in Hugging Face format."""
    from workers.rl.model import build_policy
    from workers.rl.spec import ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    rng = random.Random(0)
    tok = train_bpe([words(rng, 40) for _ in range(2000)], vocab_size=384)
    data = copy_rows(tok, rng, 16 * steps, 64, passage)
    batches = [data[i : i + 16] for i in range(0, len(data), 16)]
    dirs = []
    for name, n_layers, width in (("target", layers, hidden), ("draft", 1, hidden // 2)):
        shape = dict(hidden_size=width, num_heads=4, num_kv_heads=2, head_dim=width // 4,
                     moe_intermediate_size=width, max_position_embeddings=1024)
        model = build_policy(ModelSpec(preset=TinyMoeSpec(num_layers=n_layers, **shape)),
                             len(tok), tok.pad_token_id, tok.eos_token_id)
        fit(model, batches, steps)
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        dirs.append(out / name)
    return dirs[0], dirs[1]


def prompts_for(tok, count: int, length: int, passage: int) -> list[list[int]]:
    """Token-id prompts of `length` tokens: a `passage`-token passage (seed 1, never trained
    on) repeated, as the training rows repeat theirs, so the model's greedy continuation keeps
    copying it (a prompt repeating at another period would ask for what it never learnt)."""
    rng = random.Random(1)
    out: list[list[int]] = []
    while len(out) < count:
        ids = list(tok(words(rng, 24), add_special_tokens=False)["input_ids"])[:passage]
        if len(ids) == passage:
            out.append((ids * (length // passage + 1))[:length])
    return out


def held_out(tok, count: int, prompt_len: int, cue: int, answer_len: int
             ) -> list[tuple[list[int], list[int]]]:
    """(prompt, reference) token ids: a passage of `prompt_len` tokens never trained on (seed
    2) and the first `cue` tokens of its repeat; the reference is the repeat's next
    `answer_len` tokens. Solving it takes copying from the context, which no amount of memorising
    the training passages gives."""
    rng = random.Random(2)
    tasks: list[tuple[list[int], list[int]]] = []
    while len(tasks) < count:
        ids = list(tok(words(rng, 24), add_special_tokens=False)["input_ids"])[:prompt_len]
        if len(ids) == prompt_len:
            tasks.append((ids + ids[:cue], ids[cue : cue + answer_len]))
    return tasks


def eval_score(batcher, tasks: list[tuple[list[int], list[int]]]) -> float:
    """Mean token accuracy of the greedy continuations against the references."""
    from workers.inference.engine import SamplingParams

    answer = len(tasks[0][1])
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=answer)
    futures = [batcher.submit([p], 1, params, None) for p, _ in tasks]
    scores = []
    for f, (_, ref) in zip(futures, tasks, strict=True):
        got = f.result()[0][0].token_ids
        scores.append(sum(a == b for a, b in zip(got, ref, strict=False)) / len(ref))
    return statistics.fmean(scores)


@torch.no_grad()
def next_token_accuracy(model, tasks: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """Teacher-forced top-1 accuracy and mean negative log-likelihood of the reference
    continuations (each position given the true prefix): the model's own forward, which greedy
    decoding compounds; for int8 it shows a change too small to move greedy answers."""
    hits, nll, count = 0, 0.0, 0
    for prompt, ref in tasks:
        ids = torch.tensor([prompt + ref])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        pred = logp[len(prompt) - 1 : -1]  # (answer, V): positions predicting ref
        target = torch.tensor(ref)
        hits += int((pred.argmax(-1) == target).sum())
        nll -= float(pred.gather(-1, target[:, None]).sum())
        count += len(ref)
    return hits / count, nll / count


def noisy(policy, scale: float):
    """The negative control, not a product variant: `policy` with Gaussian noise of `scale`
    times each weight matrix's standard deviation added to every matrix (seed 3), so a reader
    sees the eval delta fall when a variant does break the model."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (scale * p.std()))
    return policy


def run(batcher, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to answer the prompts one after another, and the tokens generated."""
    from workers.inference.engine import SamplingParams

    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    outs = []
    start = time.perf_counter()
    for p in prompts:
        outs.append(batcher.submit([p], 1, params, None).result()[0][0].token_ids)
    return time.perf_counter() - start, outs


def int8_at_scale(out: Path, tok, prompts: list[list[int]], args) -> dict[str, float]:
    """Single-stream greedy tokens/s of a random-init 4-layer model of hidden `--int8-hidden`
    (8 experts, 2 per token), float (static engine) against int8, 2 prompts of 48 tokens,
    medians of `--rounds`; speed does not depend on training, and at this width reading the
    weights, not per-op overhead, bounds a decode step."""
    from workers.inference.engine import EngineOptions, Policy, make_batcher
    from workers.inference.quantize import weight_bytes
    from workers.rl.model import build_policy
    from workers.rl.spec import ModelSpec, TinyMoeSpec

    h = args.int8_hidden
    torch.manual_seed(0)
    model = build_policy(ModelSpec(preset=TinyMoeSpec(
        num_layers=4, hidden_size=h, num_heads=8, num_kv_heads=4, head_dim=h // 8,
        moe_intermediate_size=h, max_position_embeddings=1024)), len(tok), tok.pad_token_id,
        tok.eos_token_id)
    model.save_pretrained(out / "wide")
    tok.save_pretrained(out / "wide")
    del model
    result: dict[str, float] = {}
    rates: dict[str, list[float]] = {"base-static": [], "int8": []}
    policies = {"base-static": Policy(out / "wide", device="cpu"),
                "int8": Policy(out / "wide", device="cpu", int8=True)}
    result["base-bytes"] = weight_bytes(policies["base-static"].model)
    result["int8-bytes"] = weight_bytes(policies["int8"].model)
    batchers = {n: make_batcher(p, 8, EngineOptions(engine="static"))
                for n, p in policies.items()}
    try:
        for b in batchers.values():
            run(b, prompts[:1], 4)
        for r in range(args.rounds):
            for name, b in batchers.items():
                secs, outs = run(b, prompts[:2], 48)
                tokens = sum(len(o) for o in outs)
                rates[name].append(tokens / secs)
                print(f"round {r + 1} {name} at hidden {h}: {tokens} tokens, "
                      f"{tokens / secs:.1f} tokens/s", flush=True)
    finally:
        for b in batchers.values():
            b.close()
    result.update({n: statistics.median(v) for n, v in rates.items()})
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--ngram", type=int, default=2, help="--ngram-draft")
    ap.add_argument("--train-steps", type=int, default=200,
                    help="language-modelling steps for target and draft before measuring")
    ap.add_argument("--int8-hidden", type=int, default=1024,
                    help="hidden size of a second, random-init 4-layer model on which int8 "
                         "speed is also measured (weights large enough to bound decoding); "
                         "0: skip")
    ap.add_argument("--eval-tasks", type=int, default=48, help="held-out tasks")
    ap.add_argument("--passage", type=int, default=24,
                    help="tokens per passage, in the training corpus and the held-out tasks")
    ap.add_argument("--eval-cue", type=int, default=4,
                    help="tokens of the passage's repeat given after it")
    ap.add_argument("--eval-answer", type=int, default=12, help="tokens scored per task")
    ap.add_argument("--control-noise", type=float, default=1.0,
                    help="the negative control's Gaussian weight noise, times each weight "
                         "matrix's own standard deviation")
    args = ap.parse_args()
    if args.eval_cue + args.eval_answer > args.passage:
        ap.error("--eval-cue + --eval-answer must fit in --passage (the answer is its repeat)")
    torch.set_num_threads(1)

    from workers.inference.engine import EngineOptions, Policy, make_batcher
    from workers.inference.quantize import weight_bytes

    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = build(Path(tmp), args.layers, args.hidden, args.train_steps, args.passage)
        policy = Policy(tdir, device="cpu")
        quant = Policy(tdir, device="cpu", int8=True)
        memory = {"base": weight_bytes(policy.model), "int8": weight_bytes(quant.model)}
        prompts = prompts_for(policy.tok, args.prompts, args.prompt_tokens, args.passage)
        tasks = held_out(policy.tok, args.eval_tasks, args.passage, args.eval_cue,
                         args.eval_answer)
        control = noisy(Policy(tdir, device="cpu"), args.control_noise)
        engines = {
            "base": (policy, EngineOptions()),
            "base-static": (policy, EngineOptions(engine="static")),
            "ngram": (policy, EngineOptions(ngram_draft=args.ngram,
                                            num_speculative_tokens=args.k)),
            "draft": (policy, EngineOptions(draft_checkpoint=str(ddir),
                                            num_speculative_tokens=args.k)),
            "int8": (quant, EngineOptions()),
            "int8+ngram": (quant, EngineOptions(ngram_draft=args.ngram,
                                                num_speculative_tokens=args.k)),
        }
        batchers = {name: make_batcher(p, 8, opts) for name, (p, opts) in engines.items()}
        # whose plain greedy output each engine must reproduce token for token
        same_as = {"int8+ngram": "int8"}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        reference: dict[str, list[list[int]]] = {}
        mismatches = {name: 0 for name in engines}
        try:
            for b in batchers.values():  # warm-up
                run(b, prompts[:1], 8)
            for r in range(args.rounds):
                for name, b in batchers.items():
                    secs, outs = run(b, prompts, args.max_tokens)
                    reference.setdefault(name, outs)
                    want = reference[same_as.get(name, "base")]
                    mismatches[name] += sum(o != e for o, e in zip(outs, want, strict=True))
                    tokens = sum(len(o) for o in outs)
                    rates[name].append(tokens / secs)
                    print(f"round {r + 1} {name}: {tokens} tokens, {tokens / secs:.1f} tokens/s",
                          flush=True)
            stats: dict[str, dict[str, Any]] = {}
            for name, b in batchers.items():
                read: Callable[[], dict[str, Any]] = getattr(b, "stats", dict)
                stats[name] = read().get("speculative", {})
            scores = {name: eval_score(batchers[name], tasks)
                      for name in ("base", "ngram", "draft", "int8", "int8+ngram")}
            batchers["control"] = make_batcher(control, 8, EngineOptions())
            scores["control"] = eval_score(batchers["control"], tasks)
            forced = {"base": next_token_accuracy(policy.model, tasks),
                      "int8": next_token_accuracy(quant.model, tasks)}
        finally:
            for b in batchers.values():
                b.close()

        big = int8_at_scale(Path(tmp), policy.tok, prompts, args) if args.int8_hidden else None

    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\ntarget: {args.layers} layers, hidden {args.hidden}; {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.max_tokens} greedy tokens each, "
          f"K={args.k}, n-gram {args.ngram}; outputs differing from their model's plain greedy "
          f"output: {mismatches}; int8 outputs differing from the float base's: "
          f"{sum(o != e for o, e in zip(reference['int8'], reference['base'], strict=True))} "
          f"of {len(prompts)}")
    print(f"weights: base {memory['base'] / 2**20:.1f} MiB, int8 {memory['int8'] / 2**20:.1f} "
          f"MiB; eval: {len(tasks)} held-out tasks, a {args.passage}-token passage and "
          f"{args.eval_cue} tokens of its repeat, the repeat's next {args.eval_answer} scored; "
          f"control: the target with noise {args.control_noise} x std on every weight matrix")
    for name in ("ngram", "draft", "int8+ngram"):
        s = stats[name]
        print(f"{name}: proposed {s['proposed']}, accepted {s['accepted']}, "
              f"{s['target_forwards']} target forwards")
    for name in ("ngram", "draft", "int8", "int8+ngram"):
        for base in ("base", "base-static"):
            print(f"variants {name} tokens/s vs {base}: crucible={med[name]:.1f} "
                  f"{base}={med[base]:.1f} ratio={med[name] / med[base]:.2f} target=>1")
    print(f"variants int8 weight memory: crucible={memory['int8'] / 2**20:.1f} "
          f"base={memory['base'] / 2**20:.1f} ratio={memory['int8'] / memory['base']:.2f} "
          "target=<0.5")
    if big is not None:
        print(f"variants int8 tokens/s vs base-static at hidden {args.int8_hidden}: "
              f"crucible={big['int8']:.1f} base-static={big['base-static']:.1f} "
              f"ratio={big['int8'] / big['base-static']:.2f} target=>1")
        print(f"variants int8 weight memory at hidden {args.int8_hidden}: "
              f"crucible={big['int8-bytes'] / 2**20:.1f} base={big['base-bytes'] / 2**20:.1f} "
              f"ratio={big['int8-bytes'] / big['base-bytes']:.2f} target=<0.5")
    for name in ("ngram", "draft", "int8+ngram"):
        print(f"variants {name} acceptance: crucible={stats[name]['acceptance_rate']:.3f}")
    top = scores["base"]
    chance = 1 / len(policy.tok)
    print(f"variants base eval score: crucible={top:.4f} chance={chance:.4f} "
          f"ratio={top / chance:.1f} target=>=0.5")
    labels = {"ngram": "ngram", "draft": "draft", "int8": "int8", "int8+ngram": "int8+ngram",
              "control": "control(noisy weights)"}
    for name, label in labels.items():
        v = scores[name]
        print(f"variants {label} eval delta: crucible={v:.4f} base={top:.4f} "
              f"ratio={v / top if top else float('nan'):.3f} delta={v - top:+.4f} "
              f"target={'<-0.02' if name == 'control' else '>=-0.02'}")
    (acc_i, nll_i), (acc_b, nll_b) = forced["int8"], forced["base"]
    print(f"variants int8 next-token accuracy: crucible={acc_i:.4f} base={acc_b:.4f} "
          f"ratio={acc_i / acc_b if acc_b else float('nan'):.3f} delta={acc_i - acc_b:+.4f} "
          "target=>=-0.02")
    print(f"variants int8 held-out nll: crucible={nll_i:.4f} base={nll_b:.4f} "
          f"ratio={nll_i / nll_b:.4f} target=<=1.01")


if __name__ == "__main__":
    main()
