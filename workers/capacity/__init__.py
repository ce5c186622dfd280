"""The capacity planner: weights, KV cache, activation memory and decode bandwidth of a
model at a concurrency and context length, and the tensor/expert-parallel layouts of a GPU
type that hold it (docs/capacity.md). Plain Python, no ML libraries, so the control plane's
page and API call it directly."""

from workers.capacity.gpus import GPUS, Gpu
from workers.capacity.plan import Plan, Request, plan
from workers.capacity.presets import PRESETS
from workers.capacity.shapes import ConfigError, ModelShape, shape_from_config

__all__ = ["GPUS", "PRESETS", "ConfigError", "Gpu", "ModelShape", "Plan", "Request", "plan",
           "shape_from_config"]
