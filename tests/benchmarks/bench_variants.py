"""Fast variants of a served model: speculative decoding (workers/inference/speculative.py) with
n-gram prompt lookup and with a draft model, against the same model decoded plainly.

The checkpoints are built here (no download): a BPE tokenizer trained on a synthetic word
corpus, a Qwen3-MoE target (`--layers` layers, hidden `--hidden`) and a one-layer draft of half
its width, both trained for `--train-steps` language-modelling steps on that corpus (two
random-init models never agree, so a draft would be rejected every time: a truncated copy of
the random target was, 0 of 514 guesses). The draft is loaded through `--draft-checkpoint`.

Each engine is the serve command's own (`make_batcher` with the flags' `EngineOptions`), run in
this process with one torch thread: `--prompts` greedy requests of `--max-tokens` tokens sent
one after another (a single stream: the latency-bound case speculation is for). Prompts repeat
a passage of themselves, as edits and summaries of a given text do. Baselines, measured in the
same run: the default engine for this model (the continuous scheduler over the RL engine's lean
forward) and the static engine (the Hugging Face forward with its KV cache, the forward the
speculative decoder also uses). Figures are medians over `--rounds`; every speculative output
is checked token-for-token against the baseline's greedy output.

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
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(LETTERS[: rng.randint(6, 26)])
                            for _ in range(rng.randint(2, 7))) for _ in range(count))


def fit(model, batches: list[torch.Tensor], steps: int) -> None:
    """A few language-modelling steps, so target and draft share the corpus's habits."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for i in range(steps):
        x = batches[i % len(batches)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build(out: Path, layers: int, hidden: int, steps: int) -> tuple[Path, Path]:
    """The target checkpoint and a one-layer draft of half its width with its tokenizer, both
    trained briefly on the same corpus, in Hugging Face format."""
    from workers.rl.model import build_policy
    from workers.rl.spec import ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    rng = random.Random(0)
    corpus = [words(rng, 40) for _ in range(2000)]
    tok = train_bpe(corpus, vocab_size=384)
    ids = [t for line in corpus for t in tok(line, add_special_tokens=False)["input_ids"]]
    batches = [torch.tensor(ids[i : i + 16 * 64]).view(16, 64)
               for i in range(0, len(ids) - 16 * 64, 16 * 64)]
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


def prompts_for(tok, count: int, length: int) -> list[list[int]]:
    """Token-id prompts of about `length` tokens whose second half repeats part of the first."""
    rng = random.Random(1)
    out = []
    for _ in range(count):
        ids = list(tok(words(rng, length), add_special_tokens=False)["input_ids"])[:length]
        out.append(ids + ids[: length // 2])
    return out


def run(batcher, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to answer the prompts one after another, and the tokens generated."""
    from workers.inference.engine import SamplingParams

    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    outs = []
    start = time.perf_counter()
    for p in prompts:
        outs.append(batcher.submit([p], 1, params, None).result()[0][0].token_ids)
    return time.perf_counter() - start, outs


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
    ap.add_argument("--train-steps", type=int, default=60,
                    help="language-modelling steps for target and draft before measuring")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from workers.inference.engine import EngineOptions, Policy, make_batcher

    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = build(Path(tmp), args.layers, args.hidden, args.train_steps)
        policy = Policy(tdir, device="cpu")
        prompts = prompts_for(policy.tok, args.prompts, args.prompt_tokens)
        engines = {
            "base": EngineOptions(),
            "base-static": EngineOptions(engine="static"),
            "ngram": EngineOptions(ngram_draft=args.ngram, num_speculative_tokens=args.k),
            "draft": EngineOptions(draft_checkpoint=str(ddir), num_speculative_tokens=args.k),
        }
        batchers = {name: make_batcher(policy, 8, opts) for name, opts in engines.items()}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        reference: list[list[int]] | None = None
        mismatches = {name: 0 for name in engines}
        try:
            for b in batchers.values():  # warm-up
                run(b, prompts[:1], 8)
            for r in range(args.rounds):
                for name, b in batchers.items():
                    secs, outs = run(b, prompts, args.max_tokens)
                    if reference is None:
                        reference = outs
                    mismatches[name] += sum(o != e for o, e in zip(outs, reference, strict=True))
                    tokens = sum(len(o) for o in outs)
                    rates[name].append(tokens / secs)
                    print(f"round {r + 1} {name}: {tokens} tokens, {tokens / secs:.1f} tokens/s",
                          flush=True)
            stats = {name: getattr(b, "stats", dict)().get("speculative", {})
                     for name, b in batchers.items()}
        finally:
            for b in batchers.values():
                b.close()

    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\ntarget: {args.layers} layers, hidden {args.hidden}; {args.prompts} prompts of "
          f"~{args.prompt_tokens * 3 // 2} tokens, {args.max_tokens} greedy tokens each, "
          f"K={args.k}, n-gram {args.ngram}; outputs differing from the base: {mismatches}")
    for name in ("ngram", "draft"):
        s = stats[name]
        print(f"{name}: proposed {s['proposed']}, accepted {s['accepted']}, "
              f"{s['target_forwards']} target forwards")
    for name in ("ngram", "draft"):
        for base in ("base", "base-static"):
            print(f"variants {name} tokens/s vs {base}: crucible={med[name]:.1f} "
                  f"{base}={med[base]:.1f} ratio={med[name] / med[base]:.2f} target=>1")
    for name in ("ngram", "draft"):
        print(f"variants {name} acceptance: crucible={stats[name]['acceptance_rate']:.3f}")


if __name__ == "__main__":
    main()
