"""``eval`` runs: a policy (an endpoint, or a model served here) on the pinned environment
version; report (JSON and HTML), mean reward and pass@k, per-task answers as samples."""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.adapters.common import (
    ApiReporter,
    JobError,
    check_endpoint,
    check_model_path,
    dataset_resolver,
    dump,
    in_store,
    pinned_environment,
)
from workers.client import WorkerSession
from workers.envs.spec import EndpointPolicySpec
from workers.protocol import PinnedEnvironment
from workers.rl.spec import EvalRunConfig, ModelSpec, TokenizerSpec
from workers.storage import ObjectStore, default_store, run_key


def model_dir(cfg: EvalRunConfig, reporter: ApiReporter, env: PinnedEnvironment,
              store: ObjectStore, scratch: Path, hold: contextlib.ExitStack
              ) -> tuple[str, dict[str, Any]]:
    """A local model folder for the run's ``model`` (preset, directory, or a checkpoint object
    unpacked into this host's model cache, kept from pruning while ``hold`` is open) and how
    the report names it."""
    model = cfg.model or ModelSpec()
    if model.source == "preset" and (env.spec.get("env") or {}).get("source") == "terminal":
        raise JobError(f"{env.label} holds terminal tasks: evaluate an endpoint or a trained "
                       "checkpoint on them (base_model '<run>@<step>' or a path); the preset is "
                       "an untrained model whose tokenizer is built for other environments")
    if model.source == "preset":
        from workers.rl.preset import preset_model_dir

        folder = preset_model_dir(env.spec, model, cfg.tokenizer or TokenizerSpec(),
                                  dataset_resolver(env, store), scratch / "preset")
        return str(folder), {"kind": "preset", "seed": model.seed}
    path = str(model.path or "")
    if in_store(store, path):
        from workers.model_cache import cached_model

        local = cached_model(store, path, hold)
        reporter.event("info", f"model {path} unpacked to {local}", kind="artifact")
        return str(local), {"kind": "checkpoint", "uri": path}
    check_model_path(path)
    return path, {"kind": "path", "path": path}


def serve_options(cfg: EvalRunConfig, reporter: ApiReporter, store: ObjectStore,
                  hold: contextlib.ExitStack) -> dict[str, Any]:
    """`start_server` options for the run's serving settings (a served variant): int8 weights
    and speculative decoding, with a draft checkpoint unpacked from the store like the model."""
    from workers.inference.engine import EngineOptions

    serving = cfg.serving
    draft = None
    if serving.draft is not None:
        if in_store(store, serving.draft):
            from workers.model_cache import cached_model

            draft = str(cached_model(store, serving.draft, hold))
            reporter.event("info", f"draft {serving.draft} unpacked to {draft}", kind="artifact")
        else:
            check_model_path(serving.draft)
            draft = serving.draft
    return {"int8": serving.int8,
            "engine": EngineOptions(ngram_draft=serving.ngram_draft, draft_checkpoint=draft,
                                    num_speculative_tokens=serving.num_speculative_tokens)}


def evaluator(env: PinnedEnvironment, store: ObjectStore, kwargs: dict[str, Any]
              ) -> tuple[Callable[[Any], dict[str, Any]], dict[str, str]]:
    """How to evaluate a policy on the pinned version, and each task's prompt by id (for the
    run's samples): terminal tasks are played in sandbox sessions
    (`workers.envs.terminal.evaluate`), any other source by `workers.envs.eval.evaluate`."""
    from workers.envs.load import load_environment, terminal_tasks
    from workers.envs.spec import TerminalEnvSpec, parse_environment_spec

    spec = parse_environment_spec(dict(env.spec))
    resolve = dataset_resolver(env, store)
    if isinstance(spec.env, TerminalEnvSpec):
        from workers.envs.terminal.evaluate import evaluate_terminal

        tasks = terminal_tasks(spec.env, resolve)
        return (lambda policy: evaluate_terminal(tasks, policy, name=env.environment,
                                                 **kwargs),
                {t.id: t.instruction for t in tasks})
    from workers.envs.eval import evaluate

    loaded = load_environment(spec, resolve_dataset=resolve)
    return (lambda policy: evaluate(loaded, policy, **kwargs),
            {t.id: t.prompt for t in loaded.tasks})


def run(session: WorkerSession) -> None:
    """Evaluate, store the reports, and report metrics, samples and a closing event."""
    from workers.envs.eval import EndpointPolicy, render_html

    store = default_store()
    reporter = ApiReporter(session, store)
    env = pinned_environment(session)
    cfg = EvalRunConfig.model_validate(session.run.config)
    kwargs: dict[str, Any] = {**cfg.evaluate_kwargs(), "include_samples": True,
                              "exclude": env.quarantined_ids}
    evaluate, prompts = evaluator(env, store, kwargs)
    if cfg.policy is not None:
        check_endpoint(cfg.policy.base_url)
        named: dict[str, Any] = {"kind": "endpoint", "base_url": cfg.policy.base_url}
        reporter.event("info", f"evaluating endpoint policy on {env.label}", named)
        report = evaluate(EndpointPolicy(cfg.policy))
    else:
        from workers.inference import start_server

        with tempfile.TemporaryDirectory(prefix=f"eval-{session.run_id}-") as tmp, \
                contextlib.ExitStack() as hold:
            folder, named = model_dir(cfg, reporter, env, store, Path(tmp), hold)
            options = serve_options(cfg, reporter, store, hold)
            if not cfg.serving.default:
                named["serving"] = cfg.serving.model_dump(mode="json")
            with start_server(folder, name="policy", chat_format=cfg.chat_format,
                              **options) as server:
                # "auto" resolves to the checkpoint's recorded prompt format (raw for what the
                # RL engine trained), else its tokenizer's template, else plain lines.
                named["chat_format"] = server.openai_app.policy.chat_format
                if not cfg.serving.default:  # what the server really runs, not the request
                    stats: dict[str, Any] = getattr(server.openai_app.batcher, "stats", dict)()
                    spec = stats.get("speculative", {})
                    named["served"] = {
                        "weights": "int8" if server.openai_app.policy.int8 else "float",
                        "speculative": spec.get("method")}
                reporter.event("info", f"evaluating {named['kind']} policy on {env.label} "
                               f"(served here, chat format {named['chat_format']})",
                               {"policy": named})
                endpoint = EndpointPolicySpec(base_url=server.url, model="policy")
                report = evaluate(EndpointPolicy(endpoint))
    report["policy"]["source"] = named
    samples = report.pop("samples", None) or []
    uri = store.put_bytes(run_key(session.run, "eval-report.json"), dump(report))
    store.put_bytes(run_key(session.run, "eval-report.html"), render_html(report).encode())
    summary = report["summary"]
    values: dict[str, Any] = {"eval/mean_reward": summary.get("mean_reward"),
                              "eval/tasks": summary.get("tasks"),
                              "eval/errors": summary.get("errors")}
    for k, value in (summary.get("pass_at") or {}).items():
        values[f"eval/pass@{k}"] = value
    for name, comp in (report.get("components") or {}).items():
        values[f"eval/{name}"] = comp.get("mean")
    reporter.log(0, values)
    rows = [{"prompt": prompts.get(s["task_id"], s["task_id"]),
             "completion": s.get("final_answer") or "",
             "reward": s.get("reward"),
             "reward_components": {k: float(v) for k, v in (s.get("components") or {}).items()
                                   if isinstance(v, int | float) and math.isfinite(v)}}
            for s in samples[:cfg.samples]]
    reporter.samples(0, rows)
    passes = ", ".join(f"pass@{k}={v:.3f}" for k, v in (summary.get("pass_at") or {}).items()
                       if isinstance(v, int | float))
    reporter.event("info", f"eval done on {env.label}: mean reward "
                   f"{summary.get('mean_reward')}, {passes}", {"summary": summary})
    session.set_report(uri)
