"""``train`` runs: the RL engine in this worker process (a world of one), or as one Ray job
when the run spans nodes (``workers.cluster``), resumed from the run's last recorded
checkpoint when an earlier attempt was lost or preempted. A preemption
reaches the engine through its reporter (``ApiReporter.preempted``, from the heartbeat's
``stop: preempt``): the engine checkpoints its last completed step, reports it, and stops."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers.adapters.common import (
    ApiReporter,
    check_model_path,
    dataset_resolver,
    in_store,
)
from workers.client import WorkerSession
from workers.cluster.plan import plan_for
from workers.cluster.progress import check_trained
from workers.model_cache import cached_model, fetch_tar
from workers.paths import var_dir
from workers.rl.resume import local_folder, restore_phases, resume_point
from workers.storage import ObjectStore, default_store


def prepare_train(session: WorkerSession, store: ObjectStore, work: Path,
                  hold: contextlib.ExitStack | None = None) -> tuple[Any, bool]:
    """The engine's spec for this attempt, with local paths, and whether to resume.

    The checkpoint folder is new for every attempt; a retried attempt unpacks the run's last
    recorded checkpoint from the object store into it, so any worker, on any host, resumes
    where the lost one last checkpointed. A base model given as an object-store URI (an
    earlier run's checkpoint) is unpacked into the host's model cache, where ``hold`` keeps
    it from being pruned until the attempt ends.
    """
    from workers.rl.spec import parse_spec

    spec = parse_spec(session.run.config)
    root = work / "checkpoints"
    model = spec.model
    if model.source == "path" and in_store(store, model.path):
        hold = hold if hold is not None else contextlib.ExitStack()
        local = cached_model(store, str(model.path), hold)
        session.log_event(f"base model {model.path} unpacked to {local}", kind="artifact")
        model = model.model_copy(update={"path": str(local)})
    elif model.source == "path":
        check_model_path(str(model.path))
    spec = spec.model_copy(update={
        "model": model,
        "checkpoint": spec.checkpoint.model_copy(update={"dir": str(root)}),
    })
    last = resume_point(session.run.checkpoints)
    if last is None:
        return spec, False
    folder = fetch_tar(store, last.uri, local_folder(root, last))
    restore_phases(spec, root, folder)
    session.log_event(f"attempt {session.run.attempt}: resuming from the checkpoint at "
                      f"step {last.step} ({last.uri})",
                      data={"step": last.step, "uri": last.uri})
    return spec, True


def environment_objective(session: WorkerSession, store: ObjectStore) -> Any:
    """The objective made of the run's pinned environment versions (QC-quarantined tasks left
    out), or None when it pins none and the engine builds the one its config names."""
    pinned = session.run.environments
    if not pinned:
        return None
    from workers.envs.load import load_objective
    from workers.envs.mixed import MixedObjective

    objectives = []
    for env in pinned:
        objectives.append(load_objective(env.spec, resolve_dataset=dataset_resolver(env, store),
                                         quarantined=env.quarantined_ids,
                                         name=f"{env.environment}@v{env.number}"))
        session.log_event(f"environment {env.environment} v{env.number}: "
                          f"{len(objectives[-1].train)} train / {len(objectives[-1].eval)} eval "
                          f"tasks, {len(env.quarantined_ids)} quarantined by QC")
    if len(objectives) == 1:
        return objectives[0]
    from workers.envs.terminal.objective import TerminalObjective

    terminal = [f"{e.environment} v{e.number}" for e, o in zip(pinned, objectives, strict=True)
                if isinstance(o, TerminalObjective)]
    if terminal:
        for o in objectives:
            if isinstance(o, TerminalObjective):
                o.close()
        raise ValueError(f"terminal environments train alone: {', '.join(terminal)} cannot be "
                         "mixed with other environments in one run; launch one run per "
                         "terminal environment")
    return MixedObjective(objectives, [f"{e.environment}@v{e.number}" for e in pinned])


def pinned_datasets(session: WorkerSession, store: ObjectStore, spec: Any) -> Any:
    """The run's pinned dataset versions as SFT / preference pairs (workers.rl.pinned_data),
    read line by line from the object store."""
    from workers.rl.pinned_data import load_pinned

    def records(uri: str) -> Iterator[dict[str, Any]]:
        return (json.loads(line) for line in store.open_lines(uri) if line.strip())

    data = load_pinned({pin.label: records(pin.uri) for pin in session.run.datasets.values()},
                       prompt_template=spec.sft.prompt_template,
                       completion_template=spec.sft.completion_template)
    for label, (role, count) in data.sources.items():
        session.log_event(f"dataset {label}: {count} {role} records for the warm start",
                          data={"dataset": label, "role": role, "records": count})
    return data


def run(session: WorkerSession) -> None:
    """Train in a scratch folder ``var/runs/<id>/epoch-<n>`` (the claim's lease epoch: no two
    attempts share one) that is removed afterwards: what must outlive the attempt is in the
    object store and the API."""
    from workers.rl.trainer import train

    store = default_store()
    base = var_dir() / "runs" / session.run_id
    work = base / f"epoch-{session.run.lease_epoch or session.run.attempt}"
    if base.is_dir():  # leftovers of attempts that died on this host
        for old in base.iterdir():
            shutil.rmtree(old, ignore_errors=True)
    try:
        with contextlib.ExitStack() as hold:
            spec, resume = prepare_train(session, store, work, hold)
            objective = environment_objective(session, store)
            pinned = pinned_datasets(session, store, spec)
            reporter = ApiReporter(session, store, work / "upload", keep=spec.checkpoint.keep,
                                   checkpoint_on_preempt=True)
            plan = plan_for(session.run.resources, session.run.nodes,
                            spec.cluster.rollout_actors if spec.cluster else 0)
            last = resume_point(session.run.checkpoints) if resume else None
            session.attempt_started(last.step if last else 0)
            if plan is None:  # one host: the engine in this process, no Ray
                result = train(spec, reporter, resume=resume, objective=objective,
                               pinned=pinned)
                # A resumed attempt that trained nothing is a failure, not a success.
                check_trained(last.step if last else 0, spec.trainer.steps, result.train_time)
            else:  # several nodes or rollout actors: one Ray job, this process its driver
                from workers.cluster.ray_job import run_on_ray

                run_on_ray(spec, reporter, plan, resume=resume, objective=objective,
                           pinned=pinned)
    finally:
        shutil.rmtree(work, ignore_errors=True)
