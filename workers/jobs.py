"""Run adapters for the environment kinds: ``qc``, ``eval`` and ``synthesize``.

Each takes a claimed run (a ``WorkerSession``), calls its engine and reports through the API
only: metrics, events, samples, the report (stored in the object store) and, for QC, the
version's QC result; for synthesis, a review batch. No database, no Django.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers import egress
from workers.client import WorkerSession
from workers.storage import ObjectStore, default_store, run_key

SAMPLE_BATCH = 500


class JobError(ValueError):
    """A run document this adapter cannot execute (another attempt would fail the same way)."""

    retryable = False


def _dump(value: Any) -> bytes:
    return json.dumps(_finite(value), sort_keys=True, ensure_ascii=False).encode()


def _finite(value: Any) -> Any:
    """Strict JSON: NaN and infinities become null."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _pinned(session: WorkerSession) -> dict[str, Any]:
    """The run's one pinned environment version, as the worker view gives it."""
    pinned = session.run.get("environments") or []
    if len(pinned) != 1:
        raise JobError(f"a {session.run['kind']} run pins exactly one environment version; "
                       f"this one pins {len(pinned)}")
    return pinned[0]


def dataset_resolver(env: dict[str, Any], store: ObjectStore) -> Any:
    """``resolve_dataset`` for an environment whose tasks live in a dataset version: the
    records from the object-store URI the API listed for its digest."""
    uris: dict[str, str] = env.get("dataset_uris") or {}

    def records(ref: Any) -> Iterator[dict[str, Any]]:
        uri = uris.get(ref.digest)
        if uri is None:
            raise FileNotFoundError(f"environment dataset {ref.dataset} v{ref.version} "
                                    f"({ref.digest[:12]}) is not among the team's datasets")
        return (json.loads(line) for line in store.open_lines(uri) if line.strip())

    return records


def _metrics(session: WorkerSession, step: int, values: dict[str, Any]) -> None:
    points = [{"name": k, "step": step, "value": float(v)} for k, v in values.items()
              if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    if points:
        session.log_metrics(points)


def _label(env: dict[str, Any]) -> str:
    return f"{env['environment']} v{env['number']}"


# -- qc ------------------------------------------------------------------------------------------

def run_qc(session: WorkerSession) -> None:
    """QC the pinned version; the report goes to the object store, its summary to the version
    (passed, or failed with block reasons) and the run's metrics."""
    from workers.qc.run import run_qc_spec
    from workers.qc.spec import QcSpec

    store = default_store()
    env = _pinned(session)
    qc = QcSpec.model_validate(session.run["config"].get("qc") or {})
    session.log_event(f"QC of {_label(env)} started", data={"config": qc.model_dump()})
    report = run_qc_spec(env["spec"], qc, resolve_dataset=dataset_resolver(env, store))
    uri = store.put_bytes(run_key(session.run, "qc-report.json"), _dump(report))
    summary = report.get("summary") or {}
    _metrics(session, 0, {
        "qc/tasks": summary.get("tasks"), "qc/quarantined": summary.get("quarantined"),
        "qc/quarantine_rate": summary.get("quarantine_rate"),
        "qc/passed": 1.0 if report.get("passed") else 0.0,
        "qc/total_s": (report.get("timings") or {}).get("total_s"),
    })
    brief = {k: v for k, v in report.items() if k != "tasks"}
    result = session.client.request("POST", f"worker/runs/{session.run_id}/qc",
                                    json={"report": _finite(brief), "uri": uri},
                                    headers=session.headers, idempotent=True)
    if report.get("passed"):
        session.log_event(f"QC passed: {_label(env)} is {result['qc_status']} "
                          f"({summary.get('quarantined', 0)} of {summary.get('tasks', 0)} tasks "
                          "quarantined)", data={"summary": summary})
    else:
        session.log_event(f"QC blocked {_label(env)}: "
                          + "; ".join(report.get("block_reasons") or []),
                          level="warning", data={"block_reasons": report.get("block_reasons")})
    session.set_report(uri)


# -- eval ----------------------------------------------------------------------------------------

def _var_dir() -> Path:
    import os

    return Path(os.environ.get("CRUCIBLE_VAR_DIR") or Path(__file__).resolve().parents[1] / "var")


def preset_model_dir(env_spec: dict[str, Any], model: dict[str, Any],
                     tokenizer: dict[str, Any] | None, resolve: Any, target: Path) -> Path:
    """The tiny-MoE preset as a Hugging Face folder: seeded random weights and a BPE
    tokenizer trained on the environment's tasks (what a train run on it starts from)."""
    from workers.envs.adapter import as_rl_task
    from workers.envs.load import load_environment
    from workers.rl import prompt_format
    from workers.rl.episodes import plays_episodes
    from workers.rl.model import build_policy
    from workers.rl.spec import DEFAULT_VOCAB_SIZE, ModelSpec, TokenizerSpec
    from workers.rl.tokenizer import train_bpe

    spec = ModelSpec.model_validate(model)
    tok_spec = TokenizerSpec.model_validate(tokenizer or {})
    if tok_spec.source != "train":
        raise JobError("the preset model has no tokenizer of its own: tokenizer.source must "
                       "be 'train'")
    task = as_rl_task(load_environment(env_spec, resolve_dataset=resolve))
    tok = train_bpe(task.corpus(), tok_spec.vocab_size or DEFAULT_VOCAB_SIZE)
    policy = build_policy(spec, len(tok), tok.pad_token_id, tok.eos_token_id)
    target.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(target)
    tok.save_pretrained(target)
    # The prompts a train run on it would see: raw text, as the engine records it.
    layout = "episode" if plays_episodes(task) else "single_turn"
    prompt_format.write(target, prompt_format.PromptFormat(format="raw", layout=layout))
    return target


def _model_dir(session: WorkerSession, env: dict[str, Any], store: ObjectStore,
               scratch: Path, hold: contextlib.ExitStack) -> tuple[str, dict[str, Any]]:
    """A local model folder for the run's ``model`` (preset, directory, or a checkpoint object
    unpacked into this host's model cache, kept from pruning while ``hold`` is open) and how
    the report names it."""
    cfg = session.run["config"]
    model = cfg.get("model") or {}
    if model.get("source", "preset") == "preset":
        folder = preset_model_dir(env["spec"], model, cfg.get("tokenizer"),
                                  dataset_resolver(env, store), scratch / "preset")
        return str(folder), {"kind": "preset", "seed": model.get("seed", 0)}
    path = str(model.get("path") or "")
    if path.startswith(store.url + "/"):
        from workers.model_cache import ModelCache

        local = hold.enter_context(ModelCache(_var_dir() / "models").use(store, path)) / "hf"
        session.log_event(f"model {path} unpacked to {local}", kind="artifact")
        return str(local), {"kind": "checkpoint", "uri": path}
    try:
        egress.check_model_path(path, egress.model_roots_from_env())
    except egress.EgressRefused as exc:
        raise JobError(str(exc)) from exc
    return path, {"kind": "path", "path": path}


def check_endpoint(url: str) -> None:
    """This worker's CRUCIBLE_ENDPOINT_ALLOW, with the host resolved, right before use."""
    try:
        egress.endpoint_allow_from_env().check(url, resolve=True)
    except egress.EgressRefused as exc:
        raise JobError(str(exc)) from exc


EVAL_FIELDS = ("split", "samples_per_task", "k", "limit", "concurrency", "sampling")


def run_eval(session: WorkerSession) -> None:
    """Evaluate a policy on the pinned version: report (JSON and HTML) in the object store,
    mean reward and pass@k as metrics, per-task answers as samples."""
    from workers.envs.eval import EndpointPolicy, evaluate, render_html
    from workers.envs.load import load_environment
    from workers.envs.spec import EndpointPolicySpec, EvalSpec

    store = default_store()
    env = _pinned(session)
    cfg = session.run["config"]
    resolve = dataset_resolver(env, store)
    loaded = load_environment(env["spec"], resolve_dataset=resolve)
    params = {k: cfg[k] for k in EVAL_FIELDS if k in cfg}
    # EvalSpec requires a policy; a checkpoint policy's endpoint exists only once it is served
    # below, so the sampling fields are validated against a stand-in that is never called.
    stand_in = {"kind": "endpoint", "base_url": "http://127.0.0.1", "model": "policy"}
    spec = EvalSpec.model_validate({**params, "policy": cfg.get("policy") or stand_in})
    kwargs: dict[str, Any] = {
        "split": spec.split, "samples_per_task": spec.samples_per_task, "k": spec.k,
        "sampling": spec.sampling, "limit": spec.limit, "concurrency": spec.concurrency,
        "include_samples": True, "exclude": env.get("quarantined_ids") or ()}
    if cfg.get("policy"):
        check_endpoint(spec.policy.base_url)
        named = {"kind": "endpoint", "base_url": spec.policy.base_url}
        session.log_event(f"evaluating endpoint policy on {_label(env)}", data=named)
        report = evaluate(loaded, EndpointPolicy(spec.policy), **kwargs)
    else:
        from workers.inference import start_server

        with tempfile.TemporaryDirectory(prefix=f"eval-{session.run_id}-") as tmp, \
                contextlib.ExitStack() as hold:
            folder, named = _model_dir(session, env, store, Path(tmp), hold)
            with start_server(folder, name="policy",
                              chat_format=cfg.get("chat_format", "auto")) as server:
                # "auto" resolves to the checkpoint's recorded prompt format (raw for what the
                # RL engine trained), else its tokenizer's template, else plain lines.
                named["chat_format"] = server.openai_app.policy.chat_format
                session.log_event(f"evaluating {named['kind']} policy on {_label(env)} (served "
                                  f"here, chat format {named['chat_format']})",
                                  data={"policy": named})
                endpoint = EndpointPolicySpec(base_url=server.url, model="policy")
                report = evaluate(loaded, EndpointPolicy(endpoint), **kwargs)
    report["policy"]["source"] = named
    prompts = {t.id: t.prompt for t in loaded.tasks}
    samples = report.pop("samples", None) or []
    uri = store.put_bytes(run_key(session.run, "eval-report.json"), _dump(report))
    store.put_bytes(run_key(session.run, "eval-report.html"), render_html(report).encode())
    summary = report["summary"]
    values: dict[str, Any] = {"eval/mean_reward": summary.get("mean_reward"),
                              "eval/tasks": summary.get("tasks"),
                              "eval/errors": summary.get("errors")}
    for k, value in (summary.get("pass_at") or {}).items():
        values[f"eval/pass@{k}"] = value
    for name, comp in (report.get("components") or {}).items():
        values[f"eval/{name}"] = comp.get("mean")
    _metrics(session, 0, values)
    rows = [{"step": 0, "prompt": prompts.get(s["task_id"], s["task_id"]),
             "completion": s.get("final_answer") or "",
             "reward": s.get("reward"),
             "reward_components": {k: float(v) for k, v in (s.get("components") or {}).items()
                                   if isinstance(v, int | float) and math.isfinite(v)}}
            for s in samples[:int(cfg.get("samples", 50))]]
    for i in range(0, len(rows), SAMPLE_BATCH):
        session.add_samples(_finite(rows[i:i + SAMPLE_BATCH]))
    passes = ", ".join(f"pass@{k}={v:.3f}" for k, v in (summary.get("pass_at") or {}).items()
                       if isinstance(v, int | float))
    session.log_event(f"eval done on {_label(env)}: mean reward "
                      f"{summary.get('mean_reward')}, {passes}", data={"summary": summary})
    session.set_report(uri)


# -- synthesize ----------------------------------------------------------------------------------

class _Progress:
    """Synthesis progress → ``items_done`` / ``items_total`` metrics, at most once a second
    (and at the end); checks for cancellation on every report."""

    def __init__(self, session: WorkerSession, total: int, every_s: float = 1.0) -> None:
        self.session, self.total, self.every_s = session, total, every_s
        self.stages: dict[str, int] = {}
        self.step, self.last = 0, 0.0

    def __call__(self, progress: Any) -> None:
        from workers.profile.engine import Stopped

        if self.session.should_stop:
            raise Stopped(f"run {self.session.run_id} was canceled or its lease lost")
        if progress.stage in ("math", "model", "code"):
            self.stages[progress.stage] = progress.done
        now = time.monotonic()
        if progress.stage == "done" or now - self.last >= self.every_s:
            self.flush()
            self.last = now

    def flush(self) -> None:
        self.step += 1
        _metrics(self.session, self.step, {"items_done": sum(self.stages.values()),
                                           "items_total": self.total})


def run_synthesize(session: WorkerSession) -> None:
    """Generate and verify a batch, store it, and hand it to the review app as a batch of
    ``config.dataset`` (accepted batches become that dataset's versions)."""
    from workers.synthesis import parse_config, synthesize

    store = default_store()
    cfg = session.run["config"]
    config = parse_config(cfg["synthesis"])
    for generator in config.generators:
        endpoint = getattr(generator, "endpoint", None)
        if endpoint is not None:
            check_endpoint(endpoint.base_url)
    total = sum(g.count for g in config.generators)
    session.log_event(f"synthesis '{config.name}' started: {total} candidates planned",
                      data={"config": config.public_dict()})
    progress = _Progress(session, total)
    batch = synthesize(config, progress)
    progress.flush()
    key = run_key(session.run, "synthesis")
    records_uri = store.put_bytes(f"{key}/records.jsonl", batch.jsonl())
    rejected_uri = store.put_bytes(
        f"{key}/rejected.jsonl",
        b"".join(_dump(r) + b"\n" for r in batch.rejected))
    review = cfg.get("review") or {}
    created = session.client.request(
        "POST", f"worker/runs/{session.run_id}/batches", headers=session.headers,
        idempotent=True,
        json={"dataset": cfg["dataset"], "records": batch.records, "manifest": batch.manifest,
              "name": cfg.get("batch_name") or config.name,
              "target_error_rate": review.get("target_error_rate", 0.05),
              "confidence": review.get("confidence", 0.95),
              "sample_seed": review.get("sample_seed")})
    _metrics(session, progress.step, {"accepted": len(batch.records),
                                      "rejected": len(batch.rejected)})
    report = {"schema": "crucible.synthesize-run/1", "batch": created.get("id"),
              "dataset": cfg["dataset"], "records": len(batch.records),
              "rejected": len(batch.rejected), "records_uri": records_uri,
              "rejected_uri": rejected_uri, "manifest": batch.manifest,
              "timings": batch.timings}
    uri = store.put_bytes(f"{key}/report.json", _dump(report))
    session.log_event(f"synthesis done: {len(batch.records)} of {batch.manifest['candidates']} "
                      f"candidates verified; review batch {created.get('id')} for dataset "
                      f"'{cfg['dataset']}'", kind="artifact",
                      data={"batch": created.get("id"), "records_uri": records_uri})
    session.set_report(uri)
