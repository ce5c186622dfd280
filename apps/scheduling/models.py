"""The cluster's inventory: one ``Node`` per host a node agent runs on, and the insert-only
history of its state. The state changes only in :mod:`apps.scheduling.services`, so every
change has a ``NodeTransition`` row and an audit row."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class NodeState(models.TextChoices):
    """``ready`` takes new work; ``cordoned`` takes none (an admin's or the lemon rule's
    decision); ``draining`` takes none and lets its runs finish; ``lost`` missed its
    heartbeats (the agent or the host is gone)."""

    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    LOST = "lost"


class Pool(models.TextChoices):
    """The worker pools (workers.protocol.PoolName): which Celery queue a node serves."""

    GPU = "gpu"
    SANDBOX = "sandbox"
    CPU = "cpu"


class Node(models.Model):
    name = models.CharField(max_length=100, unique=True)
    pool = models.CharField(max_length=16, choices=Pool.choices)
    gpu_type = models.CharField(max_length=100, blank=True)
    gpu_count = models.PositiveIntegerField(default=0)
    cpus = models.PositiveIntegerField(default=1)
    memory_mb = models.BigIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    agent_version = models.CharField(max_length=50, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.READY,
                             db_index=True)
    state_reason = models.CharField(max_length=500, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(default=timezone.now, db_index=True)
    consecutive_infra_failures = models.PositiveIntegerField(default=0)
    # Sandbox health per language, as last probed here ({"python": {"ok", "detail", "at",
    # "source"}}): by the agent, or a run whose environment failed on this node. The
    # scheduler places no run on a node failing a language its environments need.
    toolchains = models.JSONField(default=dict, blank=True)
    # Languages the node is asked to rebuild and re-probe (a run's environment failed on
    # them here); the agent's next report of a language clears it.
    recheck = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def broken_languages(self) -> frozenset[str]:
        """Languages whose last probe on this node failed."""
        return frozenset(name for name, health in (self.toolchains or {}).items()
                         if isinstance(health, dict) and not health.get("ok", False))


class NodeTransition(models.Model):
    """One state change of a node: insert-only, newest last."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="transitions")
    from_state = models.CharField(max_length=16, choices=NodeState.choices)
    to_state = models.CharField(max_length=16, choices=NodeState.choices)
    reason = models.CharField(max_length=500, blank=True)
    actor = models.CharField(max_length=200, help_text="username, worker:<token> or system")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["node", "id"])]

    def __str__(self) -> str:
        return f"{self.node_id}: {self.from_state} -> {self.to_state}"


class Queue(models.Model):
    """A team's queue (``workers.scheduling.spec.QueueSpec``): nominal quota per flavor, and
    inside a cohort how much it may borrow and lend. A team without a row gets the default
    queue (``apps.scheduling.queues.default_spec``): the whole cluster, no cohort."""

    team = models.OneToOneField("teams.Team", on_delete=models.CASCADE, related_name="queue")
    cohort = models.CharField(max_length=128, blank=True)
    nominal = models.JSONField(default=dict, blank=True)
    borrowing_limit = models.JSONField(null=True, blank=True)
    lending_limit = models.JSONField(null=True, blank=True)
    default_priority = models.CharField(max_length=64, default="default")
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"queue of team {self.team_id}"


class Allocation(models.Model):
    """What the admission pass gave a run on one node: the GPU ids there (empty for CPU
    work). Active while ``released_at`` is null; released whenever the run leaves
    claimed/running (``apps.runs.services.transition``), so no exit path keeps GPUs."""

    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="allocations")
    gpu_ids = models.JSONField(default=list, blank=True)
    flavor = models.CharField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # When the run's Celery message was sent (once its GPUs were physically free).
    dispatched_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["run", "released_at"])]

    def __str__(self) -> str:
        return f"{self.run_id} on {self.node_id} {self.gpu_ids}"
