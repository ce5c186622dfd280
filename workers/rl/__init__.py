"""Crucible's RL engine: GRPO-family training of (MoE) causal LMs on DeepSpeed.

No Django here. Entry points: `python -m workers.rl train --config run.toml` and
`workers.rl.trainer.train(spec, sink)` for a Celery task.
"""
