"""What a run asks of the scheduler, and what a team's queue may use.

Pure pydantic with no heavy imports, so the control plane can validate a run's `resources` and a
team's queue settings when they are saved, without importing the decision engine.

Quota is counted per *resource flavor*: a GPU type (``H100``, ``A100`` ...) counts GPUs, and the
flavor ``cpu`` counts CPU cores of runs that ask for no GPU (sandbox and synthesis work).
"""

from __future__ import annotations

from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CPU_FLAVOR = "cpu"
"""The flavor of nodes without GPUs; its quota is counted in CPU cores."""


class Resources(BaseModel):
    """A run's request. A gang of `nodes` nodes is placed all at once or not at all, every node
    of one GPU type, each giving `gpus_per_node` GPUs, `cpus` cores and `memory_gb`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_node: int = Field(0, ge=0, le=64, description="0 for CPU or sandbox work")
    nodes: int = Field(1, ge=1, le=1024, description="gang size: all nodes start together")
    gpu_types: tuple[str, ...] = Field(
        (), description="any of these GPU types; empty means any type")
    cpus: float = Field(1.0, gt=0, description="CPU cores per node")
    memory_gb: float = Field(1.0, ge=0, description="memory per node")
    max_runtime_s: float | None = Field(
        None, gt=0, description="upper bound of the run's duration; backfill plans with it")

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _types_as_tuple(cls, value: object) -> object:
        """Accept a list from JSON; keep a tuple so the model stays hashable."""
        return tuple(value) if isinstance(value, list) else value

    @field_validator("gpu_types")
    @classmethod
    def _types_distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not t.strip() for t in value):
            raise ValueError("gpu_types: a GPU type name cannot be empty")
        if len(set(value)) != len(value):
            raise ValueError(f"gpu_types: {list(value)} lists a type twice")
        if CPU_FLAVOR in value:
            raise ValueError(f"gpu_types: '{CPU_FLAVOR}' is not a GPU type; ask for "
                             "gpus_per_node=0 to run on CPU nodes")
        return value

    @model_validator(mode="after")
    def _cpu_work_names_no_gpu(self) -> Resources:
        if self.gpus_per_node == 0 and self.gpu_types:
            raise ValueError("gpu_types is set but gpus_per_node is 0: ask for at least one "
                             "GPU per node, or drop gpu_types for CPU work")
        return self

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @cached_property
    def amount(self) -> float:
        """What one admission of this request counts against its flavor's quota (cached: a
        pass asks for it often)."""
        return float(self.total_gpus) if self.gpus_per_node else self.cpus * self.nodes

    def quota_amount(self) -> float:
        return self.amount


class PriorityClass(BaseModel):
    """A named priority. Higher `value` goes first; only `preemptible` classes are ever stopped
    to make room, and a queue's runs of classes that cannot be preempted stay within its nominal
    quota (what it borrows must always be returnable to its lender)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    value: int
    preemptible: bool = True


DEFAULT_PRIORITY_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass(name="production", value=1000, preemptible=False),
    PriorityClass(name="default", value=100, preemptible=True),
    PriorityClass(name="preemptible", value=0, preemptible=True),
)


class QueueSpec(BaseModel):
    """A team's queue (Kueue's ClusterQueue): a guaranteed `nominal` quota per flavor, and,
    inside a `cohort`, up to `borrowing_limit` more taken from other queues' idle quota, while
    at most `lending_limit` of its own nominal quota is lent out. A limit left out (None) means
    no limit: borrow all the cohort has idle, lend all of the nominal quota."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    cohort: str | None = None
    nominal: dict[str, float] = Field(default_factory=dict)
    borrowing_limit: dict[str, float] | None = None
    lending_limit: dict[str, float] | None = None
    default_priority: str = "default"

    @field_validator("nominal", "borrowing_limit", "lending_limit")
    @classmethod
    def _non_negative(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for flavor, amount in (value or {}).items():
            if amount < 0:
                raise ValueError(f"quota for flavor '{flavor}' is {amount}; it must be >= 0")
        return value

    @model_validator(mode="after")
    def _limits_make_sense(self) -> QueueSpec:
        if self.cohort is None and (self.borrowing_limit or self.lending_limit):
            raise ValueError(f"queue '{self.name}': borrowing and lending limits need a cohort "
                             "to borrow from or lend to")
        for flavor, amount in (self.lending_limit or {}).items():
            if amount > self.nominal.get(flavor, 0):
                raise ValueError(
                    f"queue '{self.name}': lending_limit for '{flavor}' ({amount}) exceeds its "
                    f"nominal quota ({self.nominal.get(flavor, 0)})")
        return self

    def borrow_cap(self, flavor: str) -> float:
        """How far above nominal this queue may go on `flavor` (inf when unlimited)."""
        if self.cohort is None:
            return 0.0
        if self.borrowing_limit is None or flavor not in self.borrowing_limit:
            return float("inf")
        return self.borrowing_limit[flavor]

    def lendable(self, flavor: str) -> float:
        """How much of this queue's nominal quota on `flavor` other queues may use."""
        nominal = self.nominal.get(flavor, 0.0)
        if self.cohort is None:
            return 0.0
        if self.lending_limit is None or flavor not in self.lending_limit:
            return nominal
        return self.lending_limit[flavor]
