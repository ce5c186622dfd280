"""Serving benchmark: Crucible's OpenAI-compatible server next to `transformers serve` on the same
checkpoint, and GRPO group sampling with and without prefix sharing.

The checkpoint is built here (no download): a BPE tokenizer trained on the fly on a synthetic
word corpus (a few hundred tokens, so a random-init policy rarely samples its eos and
completions run to `--max-tokens`) and a randomly initialised Qwen3-MoE from the CPU preset
(`--layers` layers, 512 positions), saved in Hugging Face format.

Serving: both servers run as their own processes on the same checkpoint, one torch thread each
(`python -m workers.inference serve --threads 1`; `transformers serve --device cpu --dtype
float32` with `OMP_NUM_THREADS=1`, its default generation path: transformers' own continuous
batching (`--continuous-batching`, paged attention) took over 100 s to answer a first 8-token
request on this CPU, so it is not the peer). Each concurrency level (`--concurrency`, default
1, 8, 32) sends the same `--requests` (default 256) greedy `/v1/completions` requests of
`--max-tokens` tokens from that many client connections, Crucible then transformers at each
level, `--rounds` times; generated tokens are the servers' own `usage.completion_tokens`.
Figures are medians over rounds: generated tokens/s, and p50/p95 request latency (seconds).
Before measuring, both servers answer the same greedy request; the texts are printed (they
agree when both compute the same greedy decode).

Rollout (the RL engine's hf backend, `workers.rl.rollout.HFRollout`, in this process): GRPO
group sampling of `--groups` prompts of about `--rollout-prompt` tokens x `--group-size`
samples of 32 tokens, temperature 1, with each group's prompt prefilled once and its keys copied
to the group's rows (`share_prefix`, the default) against every row prefilling its own copy;
and the same through the serving scheduler (one n-sample request per group, against n
single-sample requests with the prefix cache off). Then the RL engine's two rollout engines on
the same batches (`rollout.engine`): `continuous` (`workers.rl.continuous.ContinuousRollout`,
the serving scheduler) against `batch` (`HFRollout`): GRPO groups, and `--turns`-turn episodes
of `--group-size` distinct contexts (token in, token out: each turn's prompt is the previous
context, its completion and a 16-token tool result), where the continuous engine reuses the
keys of the context each turn continues and the batch engine prefills it again.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_serve` (needs the
`rl` and `bench` extras). Ends with DESIGN.md's lines:
    <figure>: crucible=<value> <peer>=<value> ratio=<crucible/peer> target=<op><value>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(LETTERS[: rng.randint(6, 26)])
                            for _ in range(rng.randint(2, 7))) for _ in range(count))


def build_checkpoint(out: Path, layers: int) -> Path:
    from workers.rl.model import build_policy
    from workers.rl.spec import ModelSpec, TinyMoeSpec
    from workers.rl.tokenizer import train_bpe

    rng = random.Random(0)
    tok = train_bpe([words(rng, 40) for _ in range(2000)], vocab_size=384)
    spec = ModelSpec(preset=TinyMoeSpec(num_layers=layers, max_position_embeddings=512))
    model = build_policy(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process; `url` is its OpenAI base URL."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        self.name, self.url = name, f"http://127.0.0.1:{port}/v1"
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited at start; see {log}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start in 300 s; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def load(url: str, model: str, prompts: list[str], concurrency: int,
               max_tokens: int) -> dict[str, float]:
    """All prompts through `concurrency` connections; tokens/s and latency percentiles."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = time.perf_counter()
            r = await client.post(f"{url}/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
            latencies.append(time.perf_counter() - t0)
            tokens += int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=20, method="inclusive")
    return {"tok_s": tokens / wall, "p50": statistics.median(latencies), "p95": q[18],
            "tokens": tokens, "wall": wall}


def multi_turn(backend, contexts: list[list[int]], turns: int, spec, seed: int) -> int:
    """Play `turns` turns of token-in episodes; returns the tokens generated."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tool_result = list(range(5, 21))  # 16 token ids standing in for a tool's answer
    total = 0
    for _ in range(turns):
        b = backend.generate(contexts, spec, gen)
        total += b.num_tokens
        contexts = [ctx + row[keep.bool()].tolist() + tool_result for ctx, row, keep
                    in zip(contexts, b.completion_ids, b.completion_mask, strict=True)]
    return total


def rollout_figures(ckpt: Path, groups: int, group_size: int, prompt_words: int,
                    rounds: int, turns: int) -> dict[str, float]:
    """Generated tokens/s of GRPO group sampling, shared prefill against per-row prefill, in
    the hf rollout backend and in the serving scheduler; and of both rollout engines on
    groups and on multi-turn episodes."""
    import torch

    from workers.inference.engine import EngineOptions, Policy, SamplingParams, make_batcher
    from workers.rl.continuous import ContinuousRollout
    from workers.rl.rollout import HFRollout
    from workers.rl.spec import RolloutSpec

    torch.set_num_threads(1)
    policy = Policy(ckpt, device="cpu", dtype="float32")
    rng = random.Random(1)
    prompts = [words(rng, prompt_words) for _ in range(groups)]
    batch = [p for p in prompts for _ in range(group_size)]
    spec = RolloutSpec(max_new_tokens=32, temperature=1.0)
    out: dict[str, list[float]] = {k: [] for k in (
        "hf_shared", "hf_unshared", "cb_shared", "cb_unshared", "engine_continuous",
        "engine_batch", "turns_continuous", "turns_batch")}
    contexts = [list(policy.tok(words(rng, prompt_words), add_special_tokens=False)
                     ["input_ids"]) for _ in range(group_size)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32)
    for r in range(rounds):
        for share in (True, False):
            rollout = HFRollout(policy.model, policy.tok, share_prefix=share)
            t0 = time.perf_counter()
            b = rollout.generate(batch, spec, torch.Generator().manual_seed(r))
            out["hf_shared" if share else "hf_unshared"].append(
                b.num_tokens / (time.perf_counter() - t0))
        for share in (True, False):
            eng = make_batcher(policy, len(batch), EngineOptions(prefix_caching=share))
            try:
                t0 = time.perf_counter()
                if share:
                    futs = [eng.submit([p], group_size, params, r) for p in prompts]
                else:
                    futs = [eng.submit([p], 1, params, r) for p in batch]
                n = sum(s.text_tokens + int(s.eos) for f in futs for g in f.result(600)
                        for s in g)
                out["cb_shared" if share else "cb_unshared"].append(
                    n / (time.perf_counter() - t0))
            finally:
                eng.close()
        for name in ("continuous", "batch"):
            backend = (ContinuousRollout(policy.model, policy.tok) if name == "continuous"
                       else HFRollout(policy.model, policy.tok))
            # untimed: the continuous engine sizes its scheduler on its first call
            backend.generate(batch, spec, torch.Generator().manual_seed(r))
            t0 = time.perf_counter()
            b = backend.generate(batch, spec, torch.Generator().manual_seed(r))
            out[f"engine_{name}"].append(b.num_tokens / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            n = multi_turn(backend, contexts, turns, spec, r)
            out[f"turns_{name}"].append(n / (time.perf_counter() - t0))
            if isinstance(backend, ContinuousRollout):
                backend.close()
    return {k: statistics.median(v) for k, v in out.items()}


def line(figure: str, ours: float, peer_name: str, peer: float, target: str,
         fmt: str = ".1f") -> str:
    ratio = ours / peer if peer else 0.0
    return (f"{figure}: crucible={ours:{fmt}} {peer_name}={peer:{fmt}} ratio={ratio:.2f} "
            f"target={target}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int,
                        default=int(os.environ.get("BENCH_SERVE_REQUESTS", "256")))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rollout-prompt", type=int, default=120,
                        help="words per rollout prompt (a few hundred tokens)")
    parser.add_argument("--turns", type=int, default=4,
                        help="turns of each multi-turn rollout episode")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-rollout", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        ckpt = build_checkpoint(Path(tmp) / "policy", args.layers)
        print(f"checkpoint: {ckpt} ({args.layers} layers); load {os.getloadavg()}", flush=True)
        lines: list[str] = []
        if not args.skip_serving:
            rng = random.Random(2)
            prompts = [words(rng, args.prompt_words) for _ in range(args.requests)]
            ours_port, peer_port = free_port(), free_port()
            ours = Server("crucible", [sys.executable, "-m", "workers.inference", "serve",
                                       "--model", str(ckpt), "--port", str(ours_port),
                                       "--name", "policy", "--threads", "1",
                                       "--max-batch", str(max(levels)), "--device", "cpu"],
                          ours_port, Path(tmp) / "crucible.log")
            exe = Path(sys.executable).parent / "transformers"
            try:
                peer = Server("transformers", [str(exe), "serve", str(ckpt), "--port",
                                               str(peer_port), "--host", "127.0.0.1",
                                               "--device", "cpu", "--dtype", "float32"],
                              peer_port, Path(tmp) / "transformers.log")
            except Exception:
                ours.stop()
                raise
            results: dict[tuple[str, int], list[dict[str, float]]] = {}
            try:
                probe = prompts[0]
                for srv, model in ((ours, "policy"), (peer, str(ckpt))):
                    r = httpx.post(f"{srv.url}/completions", timeout=300, json={
                        "model": model, "prompt": probe, "max_tokens": args.max_tokens,
                        "temperature": 0})
                    r.raise_for_status()
                    print(f"{srv.name} greedy probe: {r.json()['choices'][0]['text']!r}",
                          flush=True)
                for rnd in range(args.rounds):
                    for c in levels:
                        for srv, model in ((ours, "policy"), (peer, str(ckpt))):
                            res = asyncio.run(load(srv.url, model, prompts, c, args.max_tokens))
                            results.setdefault((srv.name, c), []).append(res)
                            print(f"round {rnd} c={c} {srv.name}: {res['tok_s']:.1f} tok/s "
                                  f"p50 {res['p50']:.3f}s p95 {res['p95']:.3f}s "
                                  f"({res['tokens']} tokens in {res['wall']:.1f}s) "
                                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            finally:
                ours.stop()
                peer.stop()

            def med(name: str, c: int, key: str) -> float:
                return statistics.median(r[key] for r in results[(name, c)])

            for c in levels:
                target = ">=2" if c == 8 else ">=1"
                lines.append(line(f"serve_tokens_per_s_c{c}", med("crucible", c, "tok_s"),
                                  "transformers", med("transformers", c, "tok_s"), target))
                for q in ("p50", "p95"):
                    lines.append(line(f"serve_latency_{q}_s_c{c}", med("crucible", c, q),
                                      "transformers", med("transformers", c, q), "<=1",
                                      ".3f"))
        if not args.skip_rollout:
            roll = rollout_figures(ckpt, args.groups, args.group_size, args.rollout_prompt,
                                   max(1, args.rounds), args.turns)
            lines.append(line("rollout_group_tokens_per_s", roll["hf_shared"], "unshared",
                              roll["hf_unshared"], ">=1"))
            lines.append(line("serve_group_tokens_per_s", roll["cb_shared"], "unshared",
                              roll["cb_unshared"], ">=1"))
            lines.append(line("rollout_engine_group_tokens_per_s", roll["engine_continuous"],
                              "batch", roll["engine_batch"], ">=1"))
            lines.append(line(f"rollout_engine_{args.turns}turn_tokens_per_s",
                              roll["turns_continuous"], "batch", roll["turns_batch"], ">=1"))
        print(f"load average: {os.getloadavg()}")
        for text in lines:
            print(text)


if __name__ == "__main__":
    main()
