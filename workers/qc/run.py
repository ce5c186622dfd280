"""Environment QC: can this version's rewards be trusted for training?

Environment-level checks: the spec loads (imports and dependencies resolve), the environment's
own `self_check` passes (toolchains, packages), it has tasks. Per task, every probe is scored
through the environment itself (so code runs in the sandbox exactly as in training):

- `reference_fails`: the reference completion earns less than `full_reward` x the rubric's max;
- `nondeterministic`: repeated scorings of the reference disagree (total or any component);
- `limits`: a reference run hit a sandbox limit (TLE, MLE, OLE) or took > max_task_seconds;
- `empty_rewarded` / `trivial_rewarded`: the empty answer or a trivial one (the environment's
  `trivial_answers`: `pass`, identity, echo, "I don't know") earns anything; under a rubric
  with partial-credit components a trivial answer may earn up to `trivial_max_share` of their
  weight on a task (an echo shares characters with the answer), and the version is blocked
  when the best trivial answer earns more than `trivial_mean_share` of it on average;
- `lax_checker`: a near-miss wrong answer (`wrong_answers`: off by one, doubled, negated, an
  extra digit) earns full reward;
- `ambiguous_duplicate`: another task has the same prompt but a different answer, reference or
  tests, so one prompt has two truths;
- `forgeable`: on code environments (unit tests, call cases, stdin/stdout cases), one of the
  known reward
  forgeries (`workers/qc/forgeries.py`: test machinery replaced, the reporter reached through
  frames, an always-equal object, forged records on every fd, the right output followed by a
  crash...) earns anything on a sample of tasks (`forgery_tasks`). This also blocks the
  version, whatever the quarantined share: the grader itself can be fooled;
- `scoring_error`: the scorer raised.

Such tasks are quarantined (excluded from training, listed with reasons). Flags do not
quarantine: `no_reference` (nothing to check full reward with), `exact_duplicate`,
`near_duplicate`, `split_leak` (a duplicate pair across train and eval). The version is blocked
when an environment-level check fails or the quarantined share exceeds the threshold.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from workers.envs.base import Environment, EnvTask, Score
from workers.envs.checkers import extract_code
from workers.qc import forgeries
from workers.qc.dedup import exact_groups, near_pairs
from workers.qc.spec import QcSpec

REPORT_SCHEMA = "crucible.qc/1"
LIMIT_STATUSES = {"TLE", "MLE", "OLE", "SANDBOX_ERROR"}
DETAIL_CHARS = 500


@dataclass
class _Probe:
    task: EnvTask
    kind: str  # reference | empty | trivial | wrong | forgery
    completion: str
    score: Score | None = None
    error: str | None = None
    label: str = ""  # the forgery's id


def _forgery_probes(env: Environment, tasks: Sequence[EnvTask]) -> list[_Probe]:
    """The known forgeries as answers to these tasks, for each code checker of the rubric."""
    probes: list[_Probe] = []
    kinds = {c.kind: c for c in env.rubric.components}
    for task in tasks:
        if "unit_tests" in kinds and task.tests:
            name = forgeries.function_under_test(task.tests, task.metadata.get("entry_point"))
            for forgery in forgeries.for_language("python", "unit"):
                probes.append(_Probe(task, "forgery", _fenced(forgery.render(name=name)),
                                     label=forgery.id))
        calls = kinds.get("call_cases")
        if calls is not None and task.metadata.get("calls"):
            name = str(task.metadata["calls"][0]["function"])
            language = str(calls.params.get("language", "python"))
            for forgery in forgeries.for_language(language, "unit"):
                probes.append(_Probe(task, "forgery", _fenced(forgery.render(name=name)),
                                     label=forgery.id))
        stdio = kinds.get("stdio_cases")
        if stdio is not None and task.metadata.get("cases"):
            language = str(stdio.params.get("language", "python"))
            reference = extract_code(task.reference) if task.reference else ""
            for forgery in forgeries.for_language(language, "stdio"):
                if forgery.needs_reference and not reference:
                    continue
                probes.append(_Probe(task, "forgery",
                                     _fenced(forgery.render(reference=reference)),
                                     label=forgery.id))
    return probes


def _fenced(code: str) -> str:
    return f"```\n{code}\n```"


@dataclass
class _TaskState:
    task: EnvTask
    reasons: list[dict[str, str]] = field(default_factory=list)
    probes: list[_Probe] = field(default_factory=list)

    def fail(self, check: str, detail: str) -> None:
        self.reasons.append({"check": check, "detail": detail[:DETAIL_CHARS]})


def _score_probes(env: Environment, probes: list[_Probe]) -> None:
    """Score in one batch; if the batch raises, score one by one to pin the culprit."""
    if not probes:
        return
    try:
        scores = env.score([p.task for p in probes], [p.completion for p in probes])
        for probe, score in zip(probes, scores, strict=True):
            probe.score = score
        return
    except Exception:  # noqa: BLE001 - isolate below
        pass
    for probe in probes:
        try:
            [probe.score] = env.score([probe.task], [probe.completion])
        except Exception as exc:  # noqa: BLE001 - a scorer crash is a finding, not a QC crash
            probe.error = f"{type(exc).__name__}: {exc}"


def _same(a: Score, b: Score) -> bool:
    return a.total == b.total and a.components == b.components


def _describe(score: Score) -> str:
    parts = [f"reward {score.total:g}"]
    if score.info.get("status"):
        parts.append(f"status {score.info['status']}")
    if score.info.get("feedback"):
        parts.append(str(score.info["feedback"]).strip().splitlines()[-1][:200])
    return "; ".join(parts)


def _judge(state: _TaskState, spec: QcSpec, full: float, allowed: float = 0.0
           ) -> dict[str, Any]:
    """Apply the per-task checks to the scored probes; returns the task's report row.
    `allowed`: what a trivial answer may earn (0 unless the rubric gives partial credit)."""
    by_kind: dict[str, list[_Probe]] = defaultdict(list)
    for probe in state.probes:
        by_kind[probe.kind].append(probe)
    for probe in state.probes:
        if probe.error:
            state.fail("scoring_error", f"{probe.kind} answer: {probe.error}")
    refs = [p for p in by_kind["reference"] if p.score]
    row: dict[str, Any] = {"task_id": state.task.id, "split": state.task.split}
    if refs:
        first = refs[0].score
        assert first is not None
        row["reference_reward"] = first.total
        statuses = [str(p.score.info.get("status")) for p in refs if p.score]
        reported = [p.score.info.get("wall_ms") for p in refs if p.score]
        walls = [w for w in reported if isinstance(w, int | float)]
        if walls:
            row["reference_wall_ms"] = max(walls)
        over = sorted({s for s in statuses if s in LIMIT_STATUSES})
        if over:
            state.fail("limits", f"reference run hit a limit: {', '.join(over)} "
                                 f"({_describe(first)})")
        elif walls and max(walls) > spec.max_task_seconds * 1000:
            state.fail("limits", f"reference run took {max(walls) / 1000:.1f} s "
                                 f"(> {spec.max_task_seconds:g} s)")
        if first.total < full - 1e-9:
            state.fail("reference_fails", f"reference earns {first.total:g} of {full:g}: "
                                          f"{_describe(first)}")
        if not all(_same(first, p.score) for p in refs[1:] if p.score):
            totals = [p.score.total for p in refs if p.score]
            state.fail("nondeterministic", f"reference rewards over {len(refs)} runs: {totals}")
        row["deterministic"] = all(_same(first, p.score) for p in refs[1:] if p.score)
    for kind, check, bound in (("empty", "empty_rewarded", 0.0),
                               ("trivial", "trivial_rewarded", allowed)):
        scored = [p for p in by_kind[kind] if p.score]
        if scored:
            row[f"{kind}_reward"] = max(p.score.total for p in scored if p.score)
        for probe in scored:
            assert probe.score is not None
            if probe.score.total > bound + 1e-9:
                limit = f" (a trivial answer may earn at most {bound:g} under this rubric's " \
                        "partial credit)" if bound else ""
                state.fail(check, f"{kind} answer {probe.completion[:80]!r} earns "
                                  f"{probe.score.total:g}{limit}")
    for probe in by_kind["wrong"]:
        if probe.score and probe.score.total >= full - 1e-9:
            state.fail("lax_checker", f"wrong answer {probe.completion[:80]!r} earns full "
                                      f"reward {probe.score.total:g}")
    forged = [p for p in by_kind["forgery"] if p.score]
    if forged:
        row["forgeries"] = len(forged)
    for probe in forged:
        assert probe.score is not None
        if probe.score.total > 1e-9:
            state.fail("forgeable", f"forgery {probe.label!r} earns {probe.score.total:g} "
                                    f"({_describe(probe.score)})")
    row["probes"] = len(state.probes)
    row["status"] = "quarantined" if state.reasons else "ok"
    row["reasons"] = sorted({r["check"] for r in state.reasons})
    return row


def _dedup(tasks: Sequence[EnvTask], spec: QcSpec, states: Mapping[str, _TaskState]
           ) -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    flags: list[dict[str, Any]] = []
    for group in exact_groups(tasks):
        ids = [t.id for t in group]
        truths = {(t.answer, t.reference, t.tests) for t in group}
        if len(truths) > 1:
            for task in group:
                others = [i for i in ids if i != task.id]
                states[task.id].fail("ambiguous_duplicate",
                                     f"same prompt as {others[:5]} with a different answer, "
                                     "reference or tests")
            flags.append({"kind": "ambiguous", "task_ids": ids,
                          "detail": "same prompt, different answers/references/tests"})
        else:
            flags.append({"kind": "exact_duplicate", "task_ids": ids,
                          "detail": "same prompt and same answer"})
        if len({t.split for t in group}) > 1:
            flags.append({"kind": "split_leak", "task_ids": ids,
                          "detail": "the same prompt is in both train and eval"})
    for a, b, sim in near_pairs(tasks, spec.near_duplicate_threshold):
        differ = (a.answer, a.tests) != (b.answer, b.tests)
        flags.append({"kind": "near_duplicate", "task_ids": [a.id, b.id], "similarity": sim,
                      "detail": "prompts nearly identical" + (
                          "; answers or tests differ" if differ else "")})
        if a.split != b.split:
            flags.append({"kind": "split_leak", "task_ids": [a.id, b.id],
                          "detail": f"near-duplicate prompts (similarity {sim}) across train "
                                    "and eval"})
    return flags, time.perf_counter() - t0


def _env_checks(env: Environment) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        problems = env.self_check()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        problems = [f"self check raised {type(exc).__name__}: {exc}"]
    checks.append({"check": "dependencies", "ok": not problems, "detail": "; ".join(problems),
                   "seconds": round(time.perf_counter() - t0, 3)})
    checks.append({"check": "has_tasks", "ok": bool(env.tasks),
                   "detail": "" if env.tasks else "the environment has no tasks"})
    return checks


def run_qc(
    env: Environment, spec: QcSpec | None = None, *,
    progress: Callable[[int, int], None] | None = None, load_seconds: float | None = None,
) -> dict[str, Any]:
    """QC an environment; returns the report (schema in docs/environments.md)."""
    spec = spec or QcSpec()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    checks = _env_checks(env)
    if load_seconds is not None:
        checks.insert(0, {"check": "load", "ok": True, "detail": "",
                          "seconds": round(load_seconds, 3)})
    full = spec.full_reward * env.rubric.max_total
    states = {t.id: _TaskState(t) for t in env.tasks}
    rows: list[dict[str, Any]] = []
    flags: list[dict[str, Any]] = []
    score_s = 0.0
    # Partial credit (a similarity, a share of fields) gives a trivial answer some reward by
    # construction (an echoed string shares characters with the answer). Judged against the
    # rubric's range: on one task it must stay below `trivial_max_share` of what the graded
    # components give (above, the task is degenerate: echoing nearly answers it), and on
    # average below `trivial_mean_share` (above, a no-effort policy collects the reward).
    # Binary components still must give it nothing.
    allowed = spec.trivial_max_share * env.rubric.graded_total
    forgery_ids = set()
    if spec.forgeries:
        picked = env.tasks if spec.forgery_tasks == 0 else env.tasks[:spec.forgery_tasks]
        forgery_ids = {t.id for t in picked}
    if all(c["ok"] for c in checks):
        done = 0
        for start in range(0, len(env.tasks), spec.chunk_size):
            chunk = env.tasks[start:start + spec.chunk_size]
            probes: list[_Probe] = []
            for task in chunk:
                if task.reference is not None:
                    probes += [_Probe(task, "reference", task.reference)
                               for _ in range(spec.repeats)]
                probes.append(_Probe(task, "empty", ""))
                if spec.trivial:
                    probes += [_Probe(task, "trivial", a) for a in env.trivial_answers(task)]
                if spec.perturbations:
                    probes += [_Probe(task, "wrong", a) for a in env.wrong_answers(task)]
                if task.id in forgery_ids:
                    probes += _forgery_probes(env, [task])
            t1 = time.perf_counter()
            _score_probes(env, probes)
            score_s += time.perf_counter() - t1
            for probe in probes:
                states[probe.task.id].probes.append(probe)
            done += len(chunk)
            if progress:
                progress(done, len(env.tasks))
        for task in env.tasks:
            if task.reference is None:
                flags.append({"kind": "no_reference", "task_ids": [task.id],
                              "detail": "no reference completion: full reward is unchecked"})
        dedup_flags, dedup_s = _dedup(env.tasks, spec, states)
        flags += dedup_flags
        rows = [_judge(states[t.id], spec, full, allowed) for t in env.tasks]
    else:
        dedup_s = 0.0
    quarantined: list[dict[str, Any]] = [{"task_id": s.task.id, "reasons": s.reasons}
                                         for s in states.values() if s.reasons]
    n = len(env.tasks)
    rate = len(quarantined) / n if n else 0.0
    block: list[str] = [f"environment check '{c['check']}' failed: {c['detail']}"
                        for c in checks if not c["ok"]]
    if rate > spec.quarantine_threshold:
        block.append(f"{len(quarantined)} of {n} tasks quarantined ({rate:.1%}), above the "
                     f"threshold of {spec.quarantine_threshold:.1%}")
    graded = env.rubric.graded_total
    trivial = [r["trivial_reward"] for r in rows if "trivial_reward" in r]
    trivial_mean = statistics.fmean(trivial) if trivial else None
    if graded > 0 and trivial_mean is not None and \
            trivial_mean > spec.trivial_mean_share * graded + 1e-9:
        block.append(f"the best trivial answer earns {trivial_mean:.3g} on average over the "
                     f"tasks, above {spec.trivial_mean_share:g} of the partial-credit weight "
                     f"({graded:g}): a policy that does not try would collect it")
    forgeable = sorted({r["detail"].split("'")[1] for q in quarantined for r in q["reasons"]
                        if r["check"] == "forgeable"})
    if forgeable:
        block.append(f"forgeable: {len(forgeable)} known forgeries earn reward "
                     f"({', '.join(forgeable[:8])}); the grader can be fooled without solving "
                     "the task")
    by_reason: dict[str, int] = defaultdict(int)
    for q in quarantined:
        for check in {r["check"] for r in q["reasons"]}:
            by_reason[check] += 1
    probes_total = sum(len(s.probes) for s in states.values())
    walls = [r["reference_wall_ms"] for r in rows if "reference_wall_ms" in r]
    total_s = time.perf_counter() - t0 + (load_seconds or 0.0)
    return {
        "schema": REPORT_SCHEMA,
        "environment": env.summary(),
        "config": spec.model_dump(),
        "passed": not block,
        "blocked": bool(block),
        "block_reasons": block,
        "environment_checks": checks,
        "summary": {
            "tasks": n, "quarantined": len(quarantined), "quarantine_rate": round(rate, 6),
            "threshold": spec.quarantine_threshold,
            "usable_tasks": {"train": sum(1 for t in env.tasks if t.split == "train"
                                          and not states[t.id].reasons),
                             "eval": sum(1 for t in env.tasks if t.split == "eval"
                                         and not states[t.id].reasons)},
            "reference_full_reward": sum(1 for r in rows if r.get("reference_reward") is not None
                                         and r["reference_reward"] >= full - 1e-9),
            "empty_zero": sum(1 for r in rows if r.get("empty_reward") == 0.0),
            "trivial_allowed": round(allowed, 6),
            "trivial_mean": round(trivial_mean, 6) if trivial_mean is not None else None,
            "forgery_probes": sum(r.get("forgeries", 0) for r in rows),
            "forgeable": forgeable,
            "by_reason": dict(sorted(by_reason.items())),
            "flags": dict(sorted(_count(f["kind"] for f in flags).items())),
        },
        "quarantined": quarantined,
        "quarantined_ids": [q["task_id"] for q in quarantined],
        "flags": flags,
        "tasks": rows,
        "timings": {
            "total_s": round(total_s, 3), "load_s": round(load_seconds or 0.0, 3),
            "scoring_s": round(score_s, 3), "dedup_s": round(dedup_s, 3),
            "probes": probes_total,
            "probes_per_s": round(probes_total / score_s, 2) if score_s > 0 else None,
            "reference_wall_ms": {"median": statistics.median(walls) if walls else None,
                                  "max": max(walls) if walls else None},
        },
        "started_at": started.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for item in items:
        out[item] += 1
    return out


def run_qc_spec(spec: Mapping[str, Any], qc: QcSpec | None = None, **load_kwargs: Any
                ) -> dict[str, Any]:
    """QC from a stored environment spec. A spec that does not load (bad module, missing
    dependency, invalid tasks) gives a blocked report saying why instead of raising."""
    from workers.envs.load import load_environment

    qc = qc or QcSpec()
    t0 = time.perf_counter()
    source = (spec.get("env") or {}).get("source") if isinstance(spec.get("env"), Mapping) \
        else None
    if source == "terminal":  # played in sandbox sessions: workers/qc/terminal.py
        from workers.envs.spec import EnvSpecError, TerminalEnvSpec, parse_environment_spec
        from workers.qc.terminal import run_terminal_qc

        try:
            parsed = parse_environment_spec(dict(spec)).env
        except EnvSpecError:
            parsed = None  # the generic path below reports the invalid spec
        if isinstance(parsed, TerminalEnvSpec):
            return run_terminal_qc(parsed, qc, load_kwargs.get("resolve_dataset"))
    try:
        env = load_environment(spec, **load_kwargs)
    except Exception as exc:  # noqa: BLE001 - every load failure is the report's finding
        detail = f"{type(exc).__name__}: {exc}"
        now = datetime.now(UTC).isoformat()
        return {
            "schema": REPORT_SCHEMA, "environment": None, "config": qc.model_dump(),
            "passed": False, "blocked": True,
            "block_reasons": [f"environment check 'load' failed: {detail}"],
            "environment_checks": [{"check": "load", "ok": False, "detail": detail,
                                    "seconds": round(time.perf_counter() - t0, 3)}],
            "summary": {"tasks": 0, "quarantined": 0, "quarantine_rate": 0.0,
                        "threshold": qc.quarantine_threshold,
                        "usable_tasks": {"train": 0, "eval": 0}, "reference_full_reward": 0,
                        "empty_zero": 0, "trivial_allowed": 0.0, "trivial_mean": None,
                        "by_reason": {}, "flags": {}},
            "quarantined": [], "quarantined_ids": [], "flags": [], "tasks": [],
            "timings": {"total_s": round(time.perf_counter() - t0, 3),
                        "load_s": round(time.perf_counter() - t0, 3), "scoring_s": 0.0,
                        "dedup_s": 0.0, "probes": 0, "probes_per_s": None,
                        "reference_wall_ms": {"median": None, "max": None}},
            "started_at": now, "finished_at": now,
        }
    return run_qc(env, qc, load_seconds=time.perf_counter() - t0)
