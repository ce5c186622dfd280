"""The run summary at the top of the run page: did it work, how far along is it, how fast.

Every number names how it was measured, so the page's numbers reconcile: a training run's
held-out curve (``eval/reward_mean``, sampled at the rollout temperature) is not the same
estimate as an eval run of its checkpoint (its own sampling settings, usually greedy), and
the summary shows both side by side rather than one standing in for the other. The gain is
split by phase: SFT is what the held-out reward did between ``eval/reward_before_sft`` (the
initial policy) and RL step 0 (the warm-started policy); RL is RL step 0 to the last step.
A few small indexed queries, whatever the run's size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from apps.metrics.models import MetricPoint, MetricSeries
from apps.runs.models import Checkpoint, Run, RunKind, RunStatus

TRAIN_REWARD_NAMES = ("reward_mean", "reward/mean", "reward")
HELDOUT = "eval/reward_mean"
HELDOUT_BEFORE_SFT = "eval/reward_before_sft"
STEP_CLOCK = ("loss", "reward_mean", "reward/mean")  # per-step series that time the RL loop
WINDOW = 5  # steps averaged for "first" and "last" training reward
MAX_EVALS = 10


@dataclass
class Gain:
    phase: str
    before: float
    after: float

    @property
    def delta(self) -> float:
        return self.after - self.before


@dataclass
class EvalOfCheckpoint:
    run: Run
    step: int
    mean_reward: float | None = None
    pass_at: dict[str, float] = field(default_factory=dict)
    tasks: int | None = None
    temperature: float | None = None


@dataclass
class RunSummary:
    kind: str
    status: str
    duration_s: float | None = None
    step: int | None = None
    total_steps: int | None = None
    sft_steps: int = 0
    steps_per_s: float | None = None
    eta_s: float | None = None
    tokens_per_s: float | None = None
    reward_name: str | None = None
    reward_first: float | None = None
    reward_last: float | None = None
    reward_window: int = WINDOW
    heldout_before_sft: float | None = None
    heldout_start: float | None = None
    heldout_start_step: int | None = None
    heldout_end: float | None = None
    heldout_end_step: int | None = None
    heldout_samples: int | None = None
    heldout_temperature: float | None = None
    gains: list[Gain] = field(default_factory=list)
    evals: list[EvalOfCheckpoint] = field(default_factory=list)
    report: dict[str, Any] | None = None

    @property
    def progress_pct(self) -> float | None:
        if self.step is None or not self.total_steps:
            return None
        return max(0.0, min(100.0, 100.0 * self.step / self.total_steps))


def _points(run_id: object, name: str, *, first: bool, n: int) -> list[tuple[int, float, float]]:
    rows = MetricPoint.objects.filter(run_id=run_id, name=name).order_by(
        "step" if first else "-step", "id" if first else "-id"
    ).values_list("step", "value", "wall_time")[:n]
    return list(rows)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _config(run: Run, section: str, key: str) -> Any:
    part = run.config.get(section) if isinstance(run.config, dict) else None
    return part.get(key) if isinstance(part, dict) else None


def run_summary(run: Run, *, report: dict[str, Any] | None = None) -> RunSummary:
    out = RunSummary(kind=run.kind, status=run.status, report=report)
    if run.started_at:
        end = run.finished_at or (timezone.now() if run.status == RunStatus.RUNNING else None)
        if end is not None:
            out.duration_s = max(0.0, (end - run.started_at).total_seconds())
    series = {s.name: s for s in MetricSeries.objects.filter(run_id=run.pk)}
    if run.kind == RunKind.TRAIN:
        _training(run, out, series)
    return out


def _training(run: Run, out: RunSummary, series: dict[str, MetricSeries]) -> None:
    out.total_steps = _config(run, "trainer", "steps")
    out.sft_steps = _config(run, "sft", "steps") or 0
    out.heldout_samples = _config(run, "trainer", "eval_samples")
    out.heldout_temperature = _config(run, "rollout", "temperature")
    clock = next((n for n in STEP_CLOCK if n in series), None)
    if clock is not None:
        info = series[clock]
        out.step = info.last_step
        first = _points(run.pk, clock, first=True, n=1)
        last = _points(run.pk, clock, first=False, n=1)
        if first and last and last[0][0] > first[0][0] and last[0][2] > first[0][2]:
            out.steps_per_s = (last[0][0] - first[0][0]) / (last[0][2] - first[0][2])
            if out.total_steps and out.status in (RunStatus.RUNNING, RunStatus.CLAIMED):
                out.eta_s = max(0, out.total_steps - out.step) / out.steps_per_s
    tokens = next((n for n in series if n.endswith("tokens_per_s")), None)
    if tokens is not None:
        out.tokens_per_s = _mean([v for _, v, _ in _points(run.pk, tokens, first=False,
                                                           n=WINDOW)])
    reward = next((n for n in TRAIN_REWARD_NAMES if n in series), None)
    if reward is not None:
        window = max(1, min(WINDOW, series[reward].count // 2))
        out.reward_name, out.reward_window = reward, window
        out.reward_first = _mean([v for _, v, _ in _points(run.pk, reward, first=True,
                                                           n=window)])
        out.reward_last = _mean([v for _, v, _ in _points(run.pk, reward, first=False,
                                                          n=window)])
    if HELDOUT in series:
        start = _points(run.pk, HELDOUT, first=True, n=1)
        end = _points(run.pk, HELDOUT, first=False, n=1)
        if start:
            out.heldout_start_step, out.heldout_start = start[0][0], start[0][1]
        if end:
            out.heldout_end_step, out.heldout_end = end[0][0], end[0][1]
    if HELDOUT_BEFORE_SFT in series:
        before = _points(run.pk, HELDOUT_BEFORE_SFT, first=True, n=1)
        if before:
            out.heldout_before_sft = before[0][1]
    if out.heldout_before_sft is not None and out.heldout_start is not None:
        out.gains.append(Gain("SFT", out.heldout_before_sft, out.heldout_start))
    if (out.heldout_start is not None and out.heldout_end is not None
            and out.heldout_end_step != out.heldout_start_step):
        out.gains.append(Gain("RL", out.heldout_start, out.heldout_end))
    out.evals = checkpoint_evals(run)


def checkpoint_evals(run: Run) -> list[EvalOfCheckpoint]:
    """Eval runs of this team that started from one of this run's checkpoints, newest first,
    with their report's headline numbers (from their metrics: no object-store read)."""
    steps = dict(Checkpoint.objects.filter(run=run).values_list("pk", "step"))
    if not steps:
        return []
    runs = list(Run.objects.filter(team_id=run.team_id, kind=RunKind.EVAL,
                                   base_checkpoint_id__in=steps)
                .order_by("-created_at")[:MAX_EVALS])
    found: dict[Any, dict[str, float]] = {}
    for run_id, name, value in MetricPoint.objects.filter(
        run_id__in=[r.pk for r in runs], name__startswith="eval/"
    ).values_list("run_id", "name", "value"):
        found.setdefault(run_id, {})[name] = value
    out = []
    for r in runs:
        values = found.get(r.pk, {})
        out.append(EvalOfCheckpoint(
            run=r, step=steps[r.base_checkpoint_id], mean_reward=values.get("eval/mean_reward"),
            pass_at={k.split("@", 1)[1]: v for k, v in values.items()
                     if k.startswith("eval/pass@")},
            tasks=int(values["eval/tasks"]) if "eval/tasks" in values else None,
            temperature=_config(r, "sampling", "temperature")))
    return out
