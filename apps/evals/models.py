"""Eval suites: a named, team-scoped set of evaluations (environment version, split, sampling,
k) run on every checkpoint of a run that names the suite, and on served variants.

A suite's entries are frozen at creation so every evaluation of it is comparable with every
other (a different set of tasks is a different suite). An evaluation is one subject (a
checkpoint, or a served variant / model given by reference) under the suite: one ``eval`` run
per entry, whose result is copied here when the run finishes. Verdicts, comparisons and the
leaderboard are computed on read from these rows (``apps.evals.gating``, ``.pareto``).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class EvalSuite(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    # Where the suite's eval runs are launched (runs belong to a project).
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="+")
    slug = models.SlugField(max_length=64)
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    # The evaluation every other one is compared with besides its previous version.
    baseline = models.ForeignKey("evals.SuiteEvaluation", on_delete=models.SET_NULL, null=True,
                                 blank=True, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "slug"], name="uniq_suite_slug")]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.slug}"


class SuiteEntry(models.Model):
    """One evaluation of the suite: what an ``eval`` run of ``environment_version`` is given
    (``params``: split, samples_per_task, k, sampling, limit, concurrency), the figure that
    scores it (``pass@<k>`` or ``mean_reward``) and the absolute drop of that figure that
    counts as a regression."""

    suite = models.ForeignKey(EvalSuite, on_delete=models.CASCADE, related_name="entries")
    position = models.PositiveSmallIntegerField()
    environment_version = models.ForeignKey("environments.EnvironmentVersion",
                                            on_delete=models.PROTECT, related_name="+")
    params = models.JSONField(default=dict)
    metric = models.CharField(max_length=32)
    threshold = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["suite", "position"],
                                               name="uniq_suite_entry_position")]
        ordering = ["position"]

    def __str__(self) -> str:
        return f"{self.suite_id}#{self.position}"


class SubjectKind(models.TextChoices):
    CHECKPOINT = "checkpoint"  # a checkpoint of a run on the platform
    VARIANT = "variant"  # a served model derived from a checkpoint (an endpoint or folder)
    MODEL = "model"  # anything else ``base_model`` accepts (preset, path)


class SuiteEvaluation(models.Model):
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    suite = models.ForeignKey(EvalSuite, on_delete=models.CASCADE, related_name="evaluations")
    subject_kind = models.CharField(max_length=16, choices=SubjectKind.choices)
    # A checkpoint subject (and a variant's source checkpoint, when it has one).
    checkpoint = models.ForeignKey("runs.Checkpoint", on_delete=models.CASCADE, null=True,
                                   blank=True, related_name="+")
    # How the eval runs were given the policy: a base_model reference or an endpoint URL.
    subject_ref = models.CharField(max_length=1000)
    label = models.CharField(max_length=200)
    trigger = models.CharField(max_length=16)  # checkpoint | manual | variant
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["suite", "-created_at"], name="suite_eval_created"),
                   models.Index(fields=["checkpoint", "suite"], name="suite_eval_checkpoint")]

    def __str__(self) -> str:
        return f"{self.suite_id}:{self.label}"


class ResultStatus(models.TextChoices):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class EntryResult(models.Model):
    """One entry of one evaluation: its eval run and, once the run finished, the figures
    copied from its report and attempts (so reads never open report objects)."""

    evaluation = models.ForeignKey(SuiteEvaluation, on_delete=models.CASCADE,
                                   related_name="results")
    entry = models.ForeignKey(SuiteEntry, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("runs.Run", on_delete=models.SET_NULL, null=True, blank=True,
                            related_name="+")
    status = models.CharField(max_length=16, choices=ResultStatus.choices,
                              default=ResultStatus.PENDING)
    score = models.FloatField(null=True, blank=True)  # the entry's metric
    mean_reward = models.FloatField(null=True, blank=True)
    pass_at = models.JSONField(default=dict, blank=True)
    tasks = models.PositiveIntegerField(null=True, blank=True)
    latency_s = models.FloatField(null=True, blank=True)  # mean per sample
    # Resource-seconds the run's attempts held (claim to end, times the request).
    cpu_seconds = models.FloatField(null=True, blank=True)
    gpu_seconds = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["evaluation", "entry"],
                                               name="uniq_result_entry")]
        indexes = [models.Index(fields=["run"], name="entry_result_run")]

    def __str__(self) -> str:
        return f"{self.evaluation_id}/{self.entry_id} {self.status}"


class Promotion(models.Model):
    """A checkpoint promoted (released for use), with the suite evaluation that allowed it."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    checkpoint = models.OneToOneField("runs.Checkpoint", on_delete=models.CASCADE,
                                      related_name="+")
    # SET_NULL: deleting a suite keeps the promotions it allowed (and their audit rows).
    evaluation = models.ForeignKey(SuiteEvaluation, on_delete=models.SET_NULL, null=True,
                                   blank=True, related_name="+")
    note = models.CharField(max_length=500, blank=True)
    promoted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                    null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"promoted {self.checkpoint_id}"


class VariantKind(models.TextChoices):
    INT8 = "int8"  # int8 weights, per-channel scales (serve --int8)
    NGRAM = "ngram"  # speculative decoding by n-gram prompt lookup (serve --ngram-draft)
    DRAFT = "draft"  # speculative decoding with a draft checkpoint (serve --draft-checkpoint)


class ServedVariant(models.Model):
    """A served model derived from a checkpoint: the checkpoint's weights served with
    ``serving`` (the serve command's flags: ``int8``, ``ngram_draft``,
    ``num_speculative_tokens``; the draft checkpoint is ``draft``). Immutable once created;
    its lineage edges run from ``source`` (and ``draft``) to it, and from it to the eval
    runs of its ``evaluation``."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    source = models.ForeignKey("runs.Checkpoint", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=VariantKind.choices)
    draft = models.ForeignKey("runs.Checkpoint", on_delete=models.CASCADE, null=True,
                              blank=True, related_name="+")
    serving = models.JSONField(default=dict)
    label = models.CharField(max_length=200)
    # The suite evaluation launched at creation (when a suite was named).
    evaluation = models.ForeignKey(SuiteEvaluation, on_delete=models.SET_NULL, null=True,
                                   blank=True, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL,
                                   null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["team", "-created_at"], name="variant_team_created")]

    def __str__(self) -> str:
        return f"{self.team_id}:{self.kind}:{self.source_id}"
