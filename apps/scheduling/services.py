"""Every write to the inventory: registration, heartbeats, the lost sweep, the admins'
cordon/drain/uncordon and the lemon rule. Each state change is one transaction that locks the
node, appends a ``NodeTransition`` and writes the audit log, so the history explains every
state the cluster page shows.

State machine (``ready`` is the only state that takes new work)::

    ready ──cordon──▶ cordoned ──uncordon──▶ ready
    ready ──drain───▶ draining ──uncordon──▶ ready       cordoned ◀─▶ draining
    any but lost ──no heartbeat for NODE_LOST_AFTER_S──▶ lost
    lost ──register──▶ the state it had before (cordoned/draining stay so; else ready)
    ready|draining ──NODE_INFRA_FAILURES_TO_CORDON infra failures in a row──▶ cordoned
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from pydantic import ValidationError

from apps.core import audit
from apps.core.actor import Actor
from apps.core.exceptions import IllegalTransition, InvalidInput, NotFound
from apps.scheduling.models import Allocation, Node, NodeState, NodeTransition, Queue
from apps.scheduling.selectors import duration
from workers.protocol import NodeRegistration
from workers.scheduling.spec import DEFAULT_PRIORITY_CLASSES, QueueSpec

REASON_MAX = 500
CAPACITY_FIELDS = ("pool", "gpu_type", "gpu_count", "cpus", "memory_mb", "labels",
                   "agent_version")

#: Which states an admin action may leave, per action.
ADMIN_ACTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "cordon": (NodeState.CORDONED, frozenset({NodeState.READY, NodeState.DRAINING,
                                              NodeState.LOST})),
    "drain": (NodeState.DRAINING, frozenset({NodeState.READY, NodeState.CORDONED})),
    "uncordon": (NodeState.READY, frozenset({NodeState.CORDONED, NodeState.DRAINING})),
}


def lost_after() -> timedelta:
    return timedelta(seconds=settings.CRUCIBLE["NODE_LOST_AFTER_S"])


def _locked(node: Node | str) -> Node:
    name = node if isinstance(node, str) else node.name
    found = Node.objects.select_for_update().filter(name=name).first()
    if found is None:
        raise NotFound(f"No node '{name}'.")
    return found


def _transition(*, node: Node, to: str, reason: str, actor: Actor, now: datetime,
                action: str) -> None:
    """Move a locked node to ``to``: the row, its history and the audit entry together."""
    before = node.state
    node.state, node.state_reason = to, reason[:REASON_MAX]
    node.save(update_fields=["state", "state_reason"])
    NodeTransition.objects.create(node=node, from_state=before, to_state=to,
                                  reason=node.state_reason, actor=actor.label, at=now)
    audit.record(actor=actor, action=f"node.{action}", team_id=None, target_type="node",
                 target_id=node.name,
                 data={"from": before, "to": to, "reason": node.state_reason})


def _state_before_lost(node: Node) -> str:
    """Where a returning lost node goes: an admin's cordon or drain outlives the outage."""
    last = node.transitions.filter(to_state=NodeState.LOST).order_by("-id").first()
    if last is not None and last.from_state in (NodeState.CORDONED, NodeState.DRAINING):
        return last.from_state
    return NodeState.READY


def _insert(*, actor: Actor, name: str, capacity: dict[str, Any], now: datetime) -> Node | None:
    """The node's first row, or None when a concurrent first registration of the same name
    inserted it first (the unique name decides; the caller then updates that row)."""
    try:
        with transaction.atomic():  # a savepoint: the outer transaction survives a clash
            node = Node.objects.create(name=name, registered_at=now, last_heartbeat_at=now,
                                       **capacity)
    except IntegrityError:
        return None
    NodeTransition.objects.create(node=node, from_state=NodeState.READY,
                                  to_state=NodeState.READY, reason="registered",
                                  actor=actor.label, at=now)
    return node


def register_node(*, actor: Actor, registration: NodeRegistration,
                  now: datetime | None = None) -> tuple[Node, bool]:
    """Create or update the node named in ``registration`` (idempotent by name: an agent
    registers at every start). Returns ``(node, created)``. A lost node comes back in the
    state it had before it was lost (ready, unless an admin had cordoned or drained it)."""
    now = now or timezone.now()
    name = registration.name
    capacity: dict[str, Any] = registration.model_dump(include=set(CAPACITY_FIELDS))
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=name).first()
        created = False
        if node is None:
            node = _insert(actor=actor, name=name, capacity=capacity, now=now)
            created = node is not None
        if node is None:
            node = Node.objects.select_for_update().get(name=name)
        data: dict[str, Any] = {"created": created, **capacity}
        if not created:
            data["changed"] = sorted(f for f in CAPACITY_FIELDS
                                     if getattr(node, f) != capacity[f])
            for field, value in capacity.items():
                setattr(node, field, value)
            node.registered_at = node.last_heartbeat_at = now
            node.save(update_fields=[*CAPACITY_FIELDS, "registered_at", "last_heartbeat_at"])
        audit.record(actor=actor, action="node.register", team_id=None, target_type="node",
                     target_id=node.name, data=data)
        if node.state == NodeState.LOST:
            _transition(node=node, to=_state_before_lost(node), reason="",
                        actor=actor, now=now, action="return")
    return node, created


def heartbeat(*, name: str, now: datetime | None = None,
              toolchains: Mapping[str, Mapping[str, Any]] | None = None) -> Node:
    """Record a sign of life (not audited: one every few seconds per node). A lost node
    stays lost until it registers again: its capacity may have changed while it was away,
    and the answer's ``lost`` tells the agent to register. ``toolchains``: what the agent's
    sandbox probes found since its last beat; a language it reports is re-checked."""
    now = now or timezone.now()
    if not Node.objects.filter(name=name).update(last_heartbeat_at=now):
        raise NotFound(f"No node '{name}': register it first (POST /api/v1/worker/nodes/"
                       "register).")
    if toolchains:
        with transaction.atomic():
            node = _locked(name)
            _merge_toolchains(node, toolchains, source="agent", now=now)
            node.recheck = [lang for lang in node.recheck if lang not in toolchains]
            node.save(update_fields=["toolchains", "recheck"])
    return Node.objects.get(name=name)


def _merge_toolchains(node: Node, found: Mapping[str, Mapping[str, Any]], *, source: str,
                      now: datetime) -> None:
    merged = dict(node.toolchains or {})
    for lang, health in found.items():
        merged[lang] = {"ok": bool(health.get("ok")),
                        "detail": str(health.get("detail", ""))[:REASON_MAX],
                        "at": now.isoformat(), "source": source}
    node.toolchains = merged


def record_toolchain_failure(*, node: Node | str, toolchains: Mapping[str, Mapping[str, Any]],
                             run_id: str, now: datetime | None = None) -> Node:
    """A run's environment failed its sandbox probe on ``node``: remember what failed (the
    scheduler then keeps runs that need those languages off the node) and ask the node to
    rebuild and re-probe them (its next heartbeat answer carries ``recheck``). The lemon rule
    is counted by the caller (``record_run_failure(infra=True)``)."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = _locked(node)
        _merge_toolchains(locked, toolchains, source=f"run {run_id}", now=now)
        failed = sorted(lang for lang, h in toolchains.items() if not h.get("ok"))
        locked.recheck = sorted(set(locked.recheck) | set(failed))
        locked.save(update_fields=["toolchains", "recheck"])
        audit.record(actor=Actor.system(), action="node.toolchain_failure", team_id=None,
                     target_type="node", target_id=locked.name,
                     data={"run": run_id, "failed": failed,
                           "details": {lang: toolchains[lang].get("detail", "")
                                       for lang in failed}})
    return locked


def sweep_lost_nodes(*, now: datetime | None = None) -> list[str]:
    """Mark ``lost`` every node whose last heartbeat is older than NODE_LOST_AFTER_S;
    returns their names. Called with the run-lease sweep."""
    now = now or timezone.now()
    cutoff = now - lost_after()
    with transaction.atomic():
        stale = list(Node.objects.select_for_update().filter(last_heartbeat_at__lt=cutoff)
                     .exclude(state=NodeState.LOST).order_by("name"))
        for node in stale:
            silent = duration((now - node.last_heartbeat_at).total_seconds())
            _transition(node=node, to=NodeState.LOST, actor=Actor.system(), now=now,
                        action="lost",
                        reason=f"no heartbeat for {silent} (last at "
                               f"{node.last_heartbeat_at:%Y-%m-%d %H:%M:%S} UTC)")
    return [n.name for n in stale]


def _admin_action(action: str, *, actor: Actor, node: Node | str, reason: str) -> Node:
    reason = (reason or "").strip()
    if len(reason) > REASON_MAX:
        raise InvalidInput(f"reason: at most {REASON_MAX} characters.",
                           details={"reason": [f"at most {REASON_MAX} characters"]})
    if action != "uncordon" and not reason:
        raise InvalidInput(f"reason: say why the node is {ADMIN_ACTIONS[action][0]} (it is "
                           "shown on the cluster page and kept in the node's history).",
                           details={"reason": ["This field is required."]})
    to, sources = ADMIN_ACTIONS[action]
    with transaction.atomic():
        locked = _locked(node)
        if locked.state not in sources:
            allowed = ", ".join(sorted(sources))
            raise IllegalTransition(f"Node '{locked.name}' is {locked.state}; {action} applies "
                                    f"to a node that is {allowed}.")
        _transition(node=locked, to=to, reason=reason, actor=actor, now=timezone.now(),
                    action=action)
        if action == "uncordon":
            # A fresh start: the lemon rule counts again from zero.
            locked.consecutive_infra_failures = 0
            locked.save(update_fields=["consecutive_infra_failures"])
    return locked


def cordon(*, actor: Actor, node: Node | str, reason: str) -> Node:
    """No new work on this node; what runs there keeps running."""
    return _admin_action("cordon", actor=actor, node=node, reason=reason)


def drain(*, actor: Actor, node: Node | str, reason: str) -> Node:
    """No new work, and the node is meant to empty (maintenance): the scheduler moves its
    runs off or lets them finish."""
    return _admin_action("drain", actor=actor, node=node, reason=reason)


def uncordon(*, actor: Actor, node: Node | str, reason: str = "") -> Node:
    """Back to ``ready`` from cordoned or draining."""
    return _admin_action("uncordon", actor=actor, node=node, reason=reason)


def record_run_failure(*, node: Node | str, infra: bool, detail: str = "") -> Node:
    """A run on ``node`` failed. An infrastructure failure (the node's fault: a GPU error,
    a broken toolchain, the agent vanished) counts toward the lemon rule: after
    NODE_INFRA_FAILURES_TO_CORDON in a row the node is cordoned, naming them. A failure of the
    run's own (its code, its config) proves the node worked and resets the count."""
    with transaction.atomic():
        locked = _locked(node)
        if not infra:
            return _reset_failures(locked)
        locked.consecutive_infra_failures += 1
        locked.save(update_fields=["consecutive_infra_failures"])
        limit = settings.CRUCIBLE["NODE_INFRA_FAILURES_TO_CORDON"]
        if locked.consecutive_infra_failures >= limit and locked.state in (
                NodeState.READY, NodeState.DRAINING):
            reason = (f"{locked.consecutive_infra_failures} consecutive infrastructure "
                      "failures" + (f"; last: {detail}" if detail else ""))
            _transition(node=locked, to=NodeState.CORDONED, reason=reason,
                        actor=Actor.system(), now=timezone.now(), action="auto_cordon")
    return locked


def record_run_success(*, node: Node | str) -> Node:
    """A run on ``node`` finished: the lemon rule's count starts again."""
    with transaction.atomic():
        return _reset_failures(_locked(node))


def _reset_failures(node: Node) -> Node:
    if node.consecutive_infra_failures:
        node.consecutive_infra_failures = 0
        node.save(update_fields=["consecutive_infra_failures"])
    return node


# --- queues and allocations ---------------------------------------------------------------


def set_queue(*, actor: Actor, team_id: int, cohort: str | None, nominal: dict[str, float],
              borrowing_limit: dict[str, float] | None = None,
              lending_limit: dict[str, float] | None = None,
              default_priority: str = "default") -> Queue:
    """Create or replace a team's queue, validated as a ``QueueSpec`` (400 naming the first
    problem) with a priority class that exists; audited with the values before and after."""
    try:
        spec = QueueSpec(name=f"team-{team_id}", cohort=cohort or None, nominal=nominal,
                         borrowing_limit=borrowing_limit, lending_limit=lending_limit,
                         default_priority=default_priority)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "queue"
        raise InvalidInput(f"{field}: {first['msg']}", details={field: [first["msg"]]}) from exc
    classes = [c.name for c in DEFAULT_PRIORITY_CLASSES]
    if spec.default_priority not in classes:
        raise InvalidInput(f"default_priority: '{spec.default_priority}' is not one of "
                           f"{', '.join(classes)}.",
                           details={"default_priority": [spec.default_priority]})
    with transaction.atomic():
        row = Queue.objects.select_for_update().filter(team_id=team_id).first()
        before = None if row is None else {
            "cohort": row.cohort, "nominal": row.nominal, "borrowing_limit": row.borrowing_limit,
            "lending_limit": row.lending_limit, "default_priority": row.default_priority}
        row = row or Queue(team_id=team_id)
        row.cohort = spec.cohort or ""
        row.nominal = dict(spec.nominal)
        row.borrowing_limit = spec.borrowing_limit
        row.lending_limit = spec.lending_limit
        row.default_priority = spec.default_priority
        row.updated_at = timezone.now()
        row.save()
        audit.record(actor=actor, action="queue.set", team_id=team_id, target_type="queue",
                     target_id=team_id, data={
                         "before": before, "after": {
                             "cohort": row.cohort, "nominal": row.nominal,
                             "borrowing_limit": row.borrowing_limit,
                             "lending_limit": row.lending_limit,
                             "default_priority": row.default_priority}})
    return row


def allocate(*, run_id: object, placement: dict[str, tuple[int, ...]], flavor: str,
             now: datetime) -> list[Allocation]:
    """Allocation rows for one admission (in the caller's transaction)."""
    nodes = {n.name: n for n in Node.objects.filter(name__in=list(placement))}
    return Allocation.objects.bulk_create(
        Allocation(run_id=run_id, node=nodes[name], gpu_ids=list(ids), flavor=flavor,
                   created_at=now)
        for name, ids in sorted(placement.items()))


def release_allocations(*, run_id: object, now: datetime | None = None) -> list[str]:
    """Release the run's active allocations; returns the names of the nodes they were on."""
    active = Allocation.objects.filter(run_id=run_id, released_at__isnull=True)
    names = sorted(set(active.values_list("node__name", flat=True)))
    if names:
        active.update(released_at=now or timezone.now())
    return names
