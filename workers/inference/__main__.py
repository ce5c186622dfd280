"""`python -m workers.inference serve --model DIR [--port N]`: serve a checkpoint directory."""

from __future__ import annotations

import argparse
import json
import os
import sys

from workers import threads


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.inference")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a Hugging Face checkpoint directory")
    serve.add_argument("--model", required=True, help="checkpoint directory (config.json, "
                       "weights, tokenizer), e.g. <checkpoint.dir>/final")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--name", help="model id clients send (default: the directory's name)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer <key>`")
    serve.add_argument("--chat-format", choices=["auto", "template", "plain", "raw"],
                       default="auto", help="how chat messages become the prompt; auto: the "
                       "checkpoint's recorded format (prompt_format.json, raw for what "
                       "Crucible trained), else the tokenizer's template, else 'role: text'")
    serve.add_argument("--max-batch", type=int, default=64,
                       help="sequences sampled together at most")
    serve.add_argument("--engine", choices=["auto", "continuous", "static"], default="auto",
                       help="continuous: requests join and leave the running batch between "
                       "decode steps (a plain fp32 Qwen3-MoE, what Crucible trains); static: "
                       "batches of requests with equal settings; auto: continuous where it fits")
    serve.add_argument("--prefill-chunk", type=int, default=512,
                       help="prompt tokens prefilled between two decode steps at most "
                       "(chunked prefill of long prompts)")
    serve.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse the keys/values of prompts seen before")
    serve.add_argument("--prefix-cache-tokens", type=int, default=16384,
                       help="tokens of cached prefixes kept (least recently used go first)")
    serve.add_argument("--ngram-draft", type=int, default=0, metavar="N",
                       help="speculative decoding with prompt lookup: guess the tokens that "
                       "followed the last N tokens earlier in the context (0: off)")
    serve.add_argument("--draft-checkpoint", metavar="DIR",
                       help="speculative decoding with a small draft model (a Hugging Face "
                       "checkpoint with the served model's tokenizer)")
    serve.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                       help="tokens guessed per target forward under speculative decoding")
    serve.add_argument("--rope-scaling", type=_json_object, metavar="JSON",
                       help='long context, e.g. \'{"rope_type": "yarn", "factor": 4.0}\' '
                       "(as vLLM's hf_overrides take it)")
    serve.add_argument("--max-model-len", type=int,
                       help="context served (default: the checkpoint's, times the RoPE factor)")
    serve.add_argument("--int8", action="store_true",
                       help="int8 weights with per-channel scales for the projections and "
                       "experts (CPU; workers/inference/quantize.py); composes with the "
                       "speculative flags (the target is quantised, a draft checkpoint is not)")
    serve.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: cuda if present)")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    serve.add_argument("--output-filter", choices=["off", "flag", "redact", "block"],
                       default=os.environ.get("CRUCIBLE_OUTPUT_FILTER", "off"),
                       help="secrets and e-mail addresses in completions: flag them, redact "
                       "them, or block the choice (finish_reason content_filter); default "
                       "$CRUCIBLE_OUTPUT_FILTER, else off. A team's serve policy is at "
                       "GET /api/v1/teams/<team>/filtering/policy (docs/filtering.md)")
    serve.add_argument("--threads", type=int, help="torch/OpenMP/MKL threads (default: "
                       f"${threads.SETTING}, else the usable cores / ${threads.SHARERS})")
    args = parser.parse_args(argv)
    if args.threads is not None:
        os.environ[threads.SETTING] = str(args.threads)
    try:  # before torch loads, so OpenMP and MKL start with the allotment
        allot = threads.configure(role="inference server")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from workers.inference.engine import EngineOptions
    from workers.inference.server import serve_forever
    from workers.rl.model import ModelDirError

    try:
        serve_forever(
            args.model, host=args.host, port=args.port, name=args.name, api_key=args.api_key,
            chat_format=args.chat_format, max_rows=args.max_batch, device=args.device,
            dtype=args.dtype, output_filter=args.output_filter, int8=args.int8,
            rope_scaling=args.rope_scaling, max_model_len=args.max_model_len,
            engine=EngineOptions(engine=args.engine, prefill_chunk=args.prefill_chunk,
                                 prefix_caching=not args.no_prefix_caching,
                                 prefix_cache_tokens=args.prefix_cache_tokens,
                                 ngram_draft=args.ngram_draft,
                                 draft_checkpoint=args.draft_checkpoint,
                                 num_speculative_tokens=args.num_speculative_tokens),
            on_ready=lambda url: print(f"serving {args.model} at {url}; {allot.describe()}",
                                       flush=True),
        )
    except (ModelDirError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
