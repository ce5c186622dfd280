"""The launch form. It launches exactly as the API does (``run_launch``, shared by create
and preview), then maps the API's error details onto the form's fields so each message
sits next to the field it is about."""

from __future__ import annotations

import json
from typing import Any

from django import forms

from apps.core.actor import Actor
from apps.core.exceptions import InvalidInput
from apps.runs.launch import Launch, run_launch
from apps.runs.models import Pool, Run
from apps.runs.specs import available_kinds
from apps.teams.models import Team

# Presets fill the form; they are ordinary configs, validated like any other.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-moe-grpo": {
        "label": "Tiny MoE · arithmetic GRPO (CPU-friendly)",
        "kind": "train",
        "name": "tiny-moe-arith-grpo",
        "config": {
            "name": "tiny-moe-arith-grpo",
            "model": {"source": "preset"},
            "task": {"name": "arithmetic", "max_operand": 9, "ops": ["+"]},
            "rollout": {"group_size": 8, "max_new_tokens": 6},
            "algorithm": {"advantage": "grpo", "kl_coef": 0.0},
            "trainer": {"steps": 50, "prompts_per_step": 8, "lr": 0.001, "zero_stage": 2},
            "checkpoint": {"every": 10},
        },
    },
    "tiny-moe-sft-grpo": {
        "label": "Tiny MoE · SFT warm start + GRPO",
        "kind": "train",
        "name": "tiny-moe-sft-grpo",
        "config": {
            "name": "tiny-moe-sft-grpo",
            "task": {"name": "arithmetic", "max_operand": 9, "ops": ["+", "-"]},
            "sft": {"steps": 40},
            "trainer": {"steps": 30, "eval_every": 10},
        },
    },
    "profile": {
        "label": "Profile a dataset version",
        "kind": "profile",
        "name": "profile",
        "config": {"top_values": 5, "progress_every": 1000},
    },
}


# The config a fresh form starts with for each kind (the launch page swaps it in when the
# kind changes, so a train config is never left under a profile run).
KIND_STARTERS: dict[str, dict[str, Any]] = {
    "train": PRESETS["tiny-moe-sft-grpo"]["config"],
    "profile": PRESETS["profile"]["config"],
    "eval": {"samples_per_task": 1, "k": [1], "sampling": {"max_tokens": 16,
                                                          "temperature": 0.0}},
    "qc": {},
    "synthesize": {},
}
DEFAULT_KIND = "train"


def kind_starters() -> dict[str, str]:
    return {k: json.dumps(v, indent=2, sort_keys=True) for k, v in KIND_STARTERS.items()}


def _dataset_choices(team: Team) -> list[tuple[str, str]]:
    from apps.datasets.models import Dataset

    rows = Dataset.objects.filter(team=team).select_related("current_version").order_by("slug")
    return [(d.slug, f"{d.slug} (latest v{d.current_version.number})" if d.current_version_id
             else f"{d.slug} (no versions yet)") for d in rows]


def _environment_choices(team: Team) -> list[tuple[str, str]]:
    from apps.environments.models import Environment

    rows = Environment.objects.filter(team=team).order_by("slug").values_list("slug", flat=True)
    return [("", "None")] + [(s, s) for s in rows]


class LaunchForm(forms.Form):
    project = forms.ChoiceField(help_text="Where the run is filed.")
    kind = forms.ChoiceField(help_text="Which engine runs it.")
    name = forms.CharField(max_length=200, required=False,
                           help_text="Optional; shown in the runs table.")
    datasets = forms.MultipleChoiceField(
        required=False, widget=forms.SelectMultiple(attrs={"size": 4}),
        help_text="Pinned at launch (latest version of each). Profile runs pin exactly one.")
    environment = forms.ChoiceField(required=False, help_text="Latest version is pinned.")
    base_model = forms.CharField(
        max_length=1000, required=False, label="Base model",
        help_text="Training runs: empty for the config's model, 'preset', 'path:/abs/dir', or "
                  "an earlier run's checkpoint, 'run:<run id>[@<step>]'.")
    tags = forms.CharField(
        max_length=800, required=False,
        help_text="Optional labels to filter the runs table by, separated by commas or spaces "
                  "(up to 16; letters, digits, '-', '_', '.'). Fixed once launched.")
    pool = forms.ChoiceField(required=False, help_text="Default: the kind's usual pool.")
    priority = forms.IntegerField(min_value=-100, max_value=100, initial=0)
    config = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 16, "spellcheck": "false", "class": "code"}),
        initial="{}", help_text="JSON; unknown keys are rejected with the field's name.")

    def __init__(self, *args: Any, team: Team, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from apps.projects.models import Project

        self.team = team
        self.fields["project"].choices = [
            (p.slug, p.name or p.slug)
            for p in Project.objects.filter(team=team).order_by("slug")]
        self.fields["kind"].choices = [(k, k) for k in available_kinds()]
        self.fields["datasets"].choices = _dataset_choices(team)
        self.fields["environment"].choices = _environment_choices(team)
        self.fields["pool"].choices = [("", "Default")] + list(Pool.choices)
        for name, field in self.fields.items():
            field.widget.attrs.setdefault("id", f"id_{name}")
            if field.help_text:
                field.widget.attrs["aria-describedby"] = f"help_{name}"

    def clean_config(self) -> dict[str, Any]:
        raw = self.cleaned_data["config"].strip() or "{}"
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                f"Not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from exc
        if not isinstance(value, dict):
            raise forms.ValidationError("The config must be a JSON object ({...}).")
        return value

    def clean_tags(self) -> list[str]:
        """Split only; run_launch checks each tag so the form and the API refuse alike."""
        return [t for t in self.cleaned_data["tags"].replace(",", " ").split() if t]

    def launch(self, *, actor: Actor, preview: bool) -> Launch | None:
        """The launch (a preview creates nothing), or None with the API's errors attached to
        fields."""
        if not self.is_valid():
            return None
        data = self.cleaned_data
        document = {
            "project": data["project"], "kind": data["kind"], "config": data["config"],
            "name": data["name"], "pool": data["pool"] or None,
            "priority": data["priority"] or 0, "datasets": list(data["datasets"]),
            "environment": data["environment"] or None, "tags": data["tags"],
            # Only passed when given, so kinds without a base model never see it.
            **({"base_model": data["base_model"].strip()}
               if data.get("base_model", "").strip() else {}),
        }
        try:
            return run_launch(actor=actor, team=self.team, document=document, preview=preview)
        except InvalidInput as exc:
            self._attach(exc)
            return None

    def mark_invalid(self) -> None:
        """Point assistive tech at each field's error text."""
        for name in self.errors:
            if name in self.fields:
                attrs = self.fields[name].widget.attrs
                attrs["aria-invalid"] = "true"
                attrs["aria-describedby"] = " ".join(
                    filter(None, [attrs.get("aria-describedby"), f"err_{name}"]))

    def _attach(self, exc: InvalidInput) -> None:
        details = getattr(exc, "details", None) or {}
        placed = False
        for key, messages in details.items():
            field = key.split(".", 1)[0]
            if field not in self.fields:
                continue
            texts = messages if isinstance(messages, list) else [messages]
            if field == "config" and "." in key and len(details) > 1:
                texts = [f"{key.split('.', 1)[1]}: {m}" for m in texts]
            else:  # the API's sentence names the problem better than a bare value
                texts = [exc.message]
            for text in texts:
                if str(text) not in self.errors.get(field, []):
                    self.add_error(field, str(text))
            placed = True
        if not placed:
            self.add_error(None, exc.message)


def initial_from_run(run: Run) -> dict[str, Any]:
    """Clone: the form prefilled with a run's frozen document (datasets by slug)."""
    return {
        "project": run.project.slug,
        "kind": run.kind,
        "name": f"{run.name or run.kind}-clone",
        "datasets": [pin.dataset_version.dataset.slug for pin in run.pins.all()],
        "environment": (run.environment_version.environment.slug
                        if run.environment_version_id else ""),
        "pool": run.pool,
        "priority": run.priority,
        "tags": ", ".join(run.tags or []),
        "config": json.dumps(run.config, indent=2, sort_keys=True),
    }


def initial_from_preset(key: str) -> dict[str, Any] | None:
    preset = PRESETS.get(key)
    if preset is None:
        return None
    return {"kind": preset["kind"], "name": preset["name"],
            "config": json.dumps(preset["config"], indent=2, sort_keys=True)}
