"""CLI: `python -m workers.rl train --config run.toml [--resume]` (also under torchrun) and
`python -m workers.rl validate --config run.toml`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from workers import threads
from workers.rl.spec import SpecError, load_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.rl")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("train", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--config", required=True, help="run config (TOML or JSON)")
        if name == "train":
            p.add_argument(
                "--resume", action="store_true", help="continue from the last checkpoint"
            )
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.config)
    except SpecError as err:
        print(err, file=sys.stderr)
        return 2
    if args.cmd == "validate":
        print(spec.to_json())
        return 0
    # Before torch loads: under torchrun the ranks on this host share its cores.
    try:
        allot = threads.configure(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), role="trainer")
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    print(allot.describe(), file=sys.stderr, flush=True)
    from workers.rl.trainer import TrainingFailed, train

    try:
        result = train(spec, resume=args.resume)
    except TrainingFailed as err:
        print(f"training failed: {err}", file=sys.stderr)
        return 3
    print(f"done: {result.steps} steps, held-out reward {result.eval_reward}")
    return 0


def exit_now(code: int) -> NoReturn:
    """Leave with the run's own status, without C++ teardown: gloo and DeepSpeed objects freed
    after the process group sometimes abort a rank that finished ("terminate called without an
    active exception"), which would turn a completed run's exit status into SIGABRT. Everything
    the run writes (metrics, checkpoints, the final model) is closed by now; stdio is flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
