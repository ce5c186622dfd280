"""The worker contract: every document that crosses between the control plane and a pool.

The web serialises a claimed run with :class:`ClaimedRun`; the client hands workers the same
typed model; the worker endpoints validate each request body with the model named here. Pure
pydantic and nothing heavy, so ``apps`` may import it (import-linter allows
``apps.** -> workers.protocol``) and its JSON Schema is published in the OpenAPI document.
Field limits that protect the database (text sizes, JSON byte budgets) stay on the web side:
they are policies of one deployment, not part of the contract.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal, NotRequired

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
    with_config,
)
from typing_extensions import TypedDict  # pydantic refuses typing's on Python < 3.12

MAX_STEP = 2**63 - 1  # steps are BIGINT columns
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
PoolName = Literal["gpu", "sandbox", "cpu"]
EventLevel = Literal["debug", "info", "warning", "error"]
# Free text a person typed or an engine wrote: surrounding whitespace is not part of it.
Text = Annotated[str, StringConstraints(strip_whitespace=True)]
# A host name as DNS and Kubernetes spell them; it is the node's identity in URLs and in the
# name of its Celery queue (node_queue).
NodeName = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=100,
                                            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
NODE_QUEUE_PREFIX = "node."


def node_queue(node: str) -> str:
    """The Celery queue of one node: where the scheduler sends a run it placed there, so only
    that node's workers take it. ``node.`` + a NodeName (letters, digits, '.', '_', '-') is a
    valid queue name for Redis, RabbitMQ and kombu's filesystem transport (whose file names
    end ``.<queue>.msg``) alike, and cannot collide with a pool's queue."""
    return NODE_QUEUE_PREFIX + node


class _Wire(BaseModel):
    """Unknown fields are kept, not refused: an older worker must read a newer web's claim."""

    model_config = ConfigDict(extra="allow")


# -- the claim --------------------------------------------------------------------------------

class DatasetPin(_Wire):
    """A dataset version frozen at launch, by the alias the run's config names it."""

    dataset: str
    digest: str
    number: int
    uri: str
    record_count: int

    @property
    def label(self) -> str:
        return f"{self.dataset}@v{self.number}"


class EnvironmentRef(_Wire):
    """The run's primary environment version (legacy single-environment field)."""

    environment: str
    digest: str
    spec: dict[str, Any]


class PinnedEnvironment(_Wire):
    """An environment version as a worker loads it: its spec, the object URIs of the datasets
    the spec reads (by digest) and the task ids its QC report quarantined."""

    environment: str
    number: int
    digest: str
    spec: dict[str, Any]
    qc_status: str = ""
    dataset_uris: dict[str, str] = Field(default_factory=dict)
    quarantined_ids: list[str] = Field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.environment} v{self.number}"


class BaseCheckpointRef(_Wire):
    """The checkpoint a run starts from (another run's, pinned at launch)."""

    id: int
    run: str
    step: int
    uri: str


class CheckpointRef(_Wire):
    """A checkpoint the run recorded and has not pruned: where a retried attempt resumes."""

    step: int
    uri: str


class ClaimedRun(_Wire):
    """What a worker needs to execute a run: the frozen document, its lease and the object URIs
    of everything it pins. Every object it reports must lie under ``object_prefix``."""

    id: str
    team: str
    project: str
    kind: str
    status: str
    pool: str
    attempt: int
    max_attempts: int
    config: dict[str, Any]
    lease_id: str
    lease_expires_at: str | None = None
    # +1 at every claim: the attempt's fencing token. Its checkpoints go to their own folder
    # of the object store and carry it, and the web refuses them once a later claim moved it.
    lease_epoch: int = 0
    object_prefix: str
    datasets: dict[str, DatasetPin] = Field(default_factory=dict)
    environment: EnvironmentRef | None = None
    environments: list[PinnedEnvironment] = Field(default_factory=list)
    base_checkpoint: BaseCheckpointRef | None = None
    checkpoints: list[CheckpointRef] = Field(default_factory=list)
    metric_seq: int = 0
    metric_steps: dict[str, int] = Field(default_factory=dict)
    # The run's frozen request (``workers.scheduling.spec.Resources``) and, with the scheduler
    # on, its allocation's node names, sorted (the first is where it was dispatched): a train
    # run over several nodes runs as one Ray job (``workers.cluster``).
    resources: dict[str, Any] = Field(default_factory=dict)
    nodes: list[str] = Field(default_factory=list)


# -- requests a worker sends ------------------------------------------------------------------

class ClaimRequest(BaseModel):
    """``node``: the node the worker runs on (``CRUCIBLE_NODE_NAME``, default its host name).
    With the scheduler on, a run is claimable only from a node its allocation names; an older
    worker that does not say is still served while the scheduler is off."""

    pool: PoolName
    worker_id: Text = Field(max_length=200)
    run_id: uuid.UUID | None = None
    node: NodeName | None = None


class ToolchainHealth(BaseModel):
    """One sandbox language's health probe on a node (workers.sandbox.health): ``ok``, else
    ``detail`` says what failed and what to install."""

    ok: bool
    detail: Text = Field(default="", max_length=500)


# A sandbox language's name (workers/sandbox/languages.py).
LANGUAGE_NAME = r"^[a-z][a-z0-9_+-]{0,31}$"
LanguageName = Annotated[str, StringConstraints(pattern=LANGUAGE_NAME)]


def _language_keys(value: dict[str, ToolchainHealth]) -> dict[str, ToolchainHealth]:
    """Keys checked here, not as patternProperties (which OpenAPI 3.0 lacks)."""
    for key in value:
        if not re.match(LANGUAGE_NAME, key):
            raise ValueError(f"{key[:40]!r} is not a sandbox language name")
    return value


Toolchains = Annotated[dict[str, ToolchainHealth], Field(max_length=64),
                       AfterValidator(_language_keys)]
FailureCause = Literal["run", "infra", "environment"]


class StatusChange(BaseModel):
    """``retry`` with ``failed``: the error may pass on another attempt; queue the run again if
    it has attempts left. Which statuses a worker may set is the web's rule (it answers 400).

    ``cause`` classifies a failure: ``run`` (its code or config: another attempt meets it
    again), ``infra`` (the node's fault: a lost GPU, an OOM kill; as ``retry``) or
    ``environment`` (the sandbox or a toolchain the run's environments need failed its health
    probe on ``node``; ``toolchains`` has the probe's findings): the run is queued again, the
    failure counts against the node, not the run, and the node is asked to re-check."""

    status: Text = Field(max_length=32)
    error: Text = ""
    retry: bool = False
    cause: FailureCause | None = None
    node: NodeName | None = None
    toolchains: Toolchains = Field(default_factory=dict)
    # With ``preempted``: the worker is shutting down (SIGTERM) and stopped the run by itself,
    # checkpointed where it can; the run is queued again at once, the attempt given back.
    drained: bool = False


class AttemptStart(BaseModel):
    """The attempt's startup is over (claim answered, inputs fetched) and its work begins,
    ``resume_step`` the checkpoint step it resumes from (0: from the start). Goodput tells
    startup from work, and kept work from redone work, by it."""

    resume_step: Step = 0


# A JSON number a float can hold: not NaN, not an infinity, not an int beyond float range.
FiniteNumber = Annotated[float, Field(allow_inf_nan=False)]
MAX_METRIC_NAME = 200


@with_config(ConfigDict(strict=True))
class MetricPoint(TypedDict):
    """One point. A TypedDict, not a model: the web validates a 10,000-point batch with it in
    one pydantic-core pass without building an object per point (faster than a hand-written
    loop). Strict: ``"5"``, ``1.5`` and ``true`` are not steps, ``"1.5"`` is not a value.
    ``wall_time`` (unix seconds) defaults to the time the web received the batch."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_METRIC_NAME)]
    step: Step
    value: FiniteNumber
    wall_time: NotRequired[FiniteNumber]


Seq = Annotated[int, Field(strict=True, ge=0, le=MAX_STEP)]


class MetricBatch(BaseModel):
    """Batches are numbered per run (``seq``): a retried batch is stored once."""

    seq: Seq
    points: list[MetricPoint] = Field(min_length=1)


class Event(BaseModel):
    message: str
    level: EventLevel = "info"
    kind: str = "log"
    data: dict[str, Any] = Field(default_factory=dict)


class EventBatch(BaseModel):
    events: list[Event] = Field(min_length=1)


class CheckpointReport(BaseModel):
    """``resumable``: it holds the training state a resume needs (a periodic checkpoint);
    ``keep``: then keep only the newest ``keep`` resumable checkpoints in the object store
    (and any that lineage points to); the rest are pruned. ``lease_epoch``: the claim's, which
    the web checks against the run's current one (a worker from before epochs leaves it out;
    the URI's ``epoch-<n>/`` folder, when it has one, is checked all the same)."""

    step: Step
    uri: Text = Field(max_length=1000)
    metrics: dict[str, Any] = Field(default_factory=dict)
    resumable: bool = False
    keep: Annotated[int, Field(ge=1, le=10_000)] | None = None
    lease_epoch: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None


class SampleRow(BaseModel):
    """One generated completion as the run page shows it."""

    step: Step
    prompt: str
    completion: str
    reward: float | None = None
    reward_components: dict[str, float] = Field(default_factory=dict)
    advantage: float | None = None
    weight_version: Step | None = None
    finish_reason: str = Field(default="", max_length=32)


class SampleBatch(BaseModel):
    samples: list[SampleRow] = Field(min_length=1)


class ReportArtifact(BaseModel):
    kind: Literal["report"]
    uri: Text = Field(max_length=1000)


class QcReport(BaseModel):
    """A QC run's result: the report summary (the crucible.qc/1 report without its per-task
    rows) and the full report's object URI."""

    report: dict[str, Any]
    uri: Text = Field(max_length=1000)


class QcResult(BaseModel):
    environment: str
    digest: str
    qc_status: str


class BatchHandOver(BaseModel):
    """A synthesize run's verified records, handed to review as a batch of ``dataset``."""

    dataset: str = Field(max_length=64, pattern=r"^[-a-zA-Z0-9_]+$")
    records: list[Any] = Field(min_length=1)
    trails: list[Any] | None = None
    manifest: dict[str, Any] = Field(default_factory=dict)
    name: Text = Field(default="", max_length=200)
    target_error_rate: float = 0.05
    confidence: float = 0.95
    sample_seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None


# -- node agents ------------------------------------------------------------------------------

NodeState = Literal["ready", "cordoned", "draining", "lost"]
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
LABEL_VALUE_MAX = 200
MAX_NODE_LABELS = 32


class NodeRegistration(BaseModel):
    """What a node agent reports about its host when it starts (and when the web forgot it):
    the capacity the scheduler may place work on. Registering again updates it."""

    name: NodeName
    pool: PoolName
    gpu_type: Text = Field(default="", max_length=100)
    gpu_count: int = Field(default=0, ge=0, le=1024)
    cpus: int = Field(ge=1, le=100_000)
    memory_mb: int = Field(ge=0, le=2**40)
    labels: dict[str, str] = Field(default_factory=dict, max_length=MAX_NODE_LABELS)
    agent_version: Text = Field(default="", max_length=50)

    @field_validator("labels")
    @classmethod
    def _label_syntax(cls, labels: dict[str, str]) -> dict[str, str]:
        """Keys as Kubernetes spells label keys, so a selector can name them."""
        for key, value in labels.items():
            if not LABEL_KEY.match(key):
                raise ValueError(f"label key {key[:70]!r} must be 1-63 letters, digits, '.', "
                                 "'_', '/' or '-', starting with a letter or digit")
            if len(value) > LABEL_VALUE_MAX:
                raise ValueError(f"label {key!r}: at most {LABEL_VALUE_MAX} characters")
        return labels

    @model_validator(mode="after")
    def _gpu_type_with_gpus(self) -> NodeRegistration:
        if self.gpu_count > 0 and not self.gpu_type:
            raise ValueError("gpu_type is required when gpu_count > 0 (e.g. \"H100-80GB\"), "
                             "so runs that ask for a GPU type can be placed")
        if self.gpu_count == 0 and self.gpu_type:
            raise ValueError("gpu_type names the node's GPUs; leave it empty when gpu_count "
                             "is 0")
        return self


class NodeHeartbeat(BaseModel):
    """An agent's periodic sign of life; the answer carries the node's state. ``toolchains``:
    the sandbox languages the agent probed since its last beat (none: nothing new)."""

    agent_version: Text = Field(default="", max_length=50)
    toolchains: Toolchains = Field(default_factory=dict)


class NodeStatus(BaseModel):
    """The web's answer to a registration or heartbeat: what the node should do now
    (``cordoned``/``draining``: take no new work; ``lost``: register again; ``recheck``:
    rebuild the sandbox state and probe these languages, a run failed on them here)."""

    name: str
    state: NodeState
    state_reason: str = ""
    recheck: list[LanguageName] = Field(default_factory=list)


class DeadLease(BaseModel):
    """A lease whose worker process the node agent found dead (``workers.liveness``): the
    lease id the process announced, so only that very lease ends."""

    run: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    lease_id: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    worker: Text = Field(default="", max_length=200)
    pid: int = Field(default=0, ge=0)


class DeadLeaseReport(BaseModel):
    """The node agent's report of its host's dead worker processes."""

    leases: list[DeadLease] = Field(min_length=1, max_length=100)


# Every document above, each published as a component of the OpenAPI document.
PROTOCOL_MODELS: tuple[type[BaseModel], ...] = (
    ClaimedRun, ClaimRequest, StatusChange, MetricBatch, EventBatch, CheckpointReport,
    SampleBatch, ReportArtifact, QcReport, QcResult, BatchHandOver, NodeRegistration,
    NodeHeartbeat, NodeStatus, ToolchainHealth, DeadLease, DeadLeaseReport,
)
