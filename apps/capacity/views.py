"""``/t/<team>/capacity/``: the capacity planner as a page. The form is validated by the
API's own serializer (the same limits, the same words), and the plan is the API's
response rendered as tables. Computing writes nothing, so viewers may submit it."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from apps.capacity import selectors
from apps.capacity.serializers import PlanRequestSerializer
from apps.core.exceptions import InvalidInput
from apps.teams.models import Membership, Role, Team
from apps.teams.pages import page_context, team_page
from workers.capacity import GPUS, PRESETS
from workers.capacity.plan import (
    DEFAULT_HEADROOM,
    DEFAULT_MAX_GPUS,
    DEFAULT_PREFILL_CHUNK,
    KV_BYTES,
    WEIGHT_BYTES,
)

FIELDS = ("preset", "checkpoint", "config", "gpu", "concurrency", "context", "dtype",
          "kv_dtype", "headroom", "prefill_chunk", "max_gpus")
SOURCE_LABELS = {"preset": "a preset", "checkpoint": "a checkpoint", "config": "a config"}


def _select(choices: list[tuple[str, str]]) -> forms.CharField:
    return forms.CharField(required=False, widget=forms.Select(choices=choices))


class PlanForm(forms.Form):
    """Rendering and redisplay only: every value is checked by PlanRequestSerializer."""

    source = _select([(k, v) for k, v in SOURCE_LABELS.items()])
    preset = _select([(k, k) for k in PRESETS])
    checkpoint = _select([])
    config = forms.CharField(required=False, widget=forms.Textarea(attrs={
        "rows": 8, "placeholder": '{"hidden_size": 2048, "num_hidden_layers": 48, …}',
        "spellcheck": "false"}), label="Config JSON",
        help_text="A Hugging Face config.json")
    gpu = _select([(g.key, g.name) for g in GPUS.values()])
    gpu.label = "GPU type"
    concurrency = forms.CharField(required=False, widget=forms.NumberInput(attrs={"min": 1}),
                                  help_text="sequences decoded together")
    context = forms.CharField(required=False, widget=forms.NumberInput(attrs={"min": 1}),
                              label="Context length",
                              help_text="tokens per sequence (prompt + output)")
    dtype = _select([(d, d) for d in WEIGHT_BYTES])
    dtype.label = "Weight dtype"
    kv_dtype = _select([(d, d) for d in KV_BYTES])
    kv_dtype.label = "KV cache dtype"
    headroom = forms.CharField(required=False, widget=forms.NumberInput(attrs={
        "min": 0, "max": 0.9, "step": 0.01}), help_text="fraction of GPU memory kept free")
    prefill_chunk = forms.CharField(required=False, widget=forms.NumberInput(attrs={"min": 1}),
                                    label="Prefill chunk", help_text="tokens per prefill step")
    max_gpus = forms.CharField(required=False, widget=forms.NumberInput(attrs={"min": 1}),
                               label="Max GPUs")

    def __init__(self, *args: Any, checkpoints: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["checkpoint"]
        field.widget.choices = checkpoints or [("", "no checkpoints in this team yet")]


INITIAL = {"source": "preset", "preset": "qwen3-30b-a3b", "gpu": "H100-80GB",
           "concurrency": 32, "context": 32768, "dtype": "bf16", "kv_dtype": "bf16",
           "headroom": DEFAULT_HEADROOM, "prefill_chunk": DEFAULT_PREFILL_CHUNK,
           "max_gpus": DEFAULT_MAX_GPUS}


def _document(data: QueryDict, form: PlanForm) -> dict[str, Any] | None:
    """The API request the form describes: only the chosen model source, blank numbers
    left to the defaults; None (with the error on the form) when the JSON does not parse."""
    values = {k: str(data.get(k) or "").strip() for k in (*FIELDS, "source")}
    source = values["source"] or next((s for s in SOURCE_LABELS if values[s]), "preset")
    doc: dict[str, Any] = {k: values[k] for k in FIELDS
                           if k not in SOURCE_LABELS and values[k]}
    if source not in SOURCE_LABELS:
        form.add_error("source", "Choose a preset, a checkpoint or a config.")
        return None
    raw = values[source]
    if source == "config" and raw:
        try:
            doc["config"] = json.loads(raw)
        except json.JSONDecodeError as exc:
            form.add_error("config", f"Not valid JSON: {exc.msg} (line {exc.lineno}, column "
                                     f"{exc.colno}).")
            return None
        if not isinstance(doc["config"], dict):
            form.add_error("config", "The config must be a JSON object ({…}).")
            return None
    elif raw:
        doc[source] = raw
    return doc


def _add_errors(form: PlanForm, errors: Any, source: str) -> None:
    for field, messages in (errors.items() if isinstance(errors, dict) else []):
        target = source if field == "model" else field if field in form.fields else None
        if isinstance(messages, dict):  # config.<key>: [...]
            messages = [m for ms in messages.values() for m in ms]
        for message in (messages if isinstance(messages, list) else [messages]):
            form.add_error(target, str(message))


@team_page(write=Role.VIEWER)
@require_http_methods(["GET", "HEAD", "POST"])
def planner(request: HttpRequest, team: Team, membership: Membership) -> HttpResponse:
    """GET: the form (with query parameters, also their plan, so a plan can be linked);
    POST (htmx or not): the plan for the form. htmx gets the planner block alone."""
    data = request.POST if request.method == "POST" else request.GET
    checkpoints = selectors.checkpoint_choices(team)
    submitted = any(k in data for k in FIELDS)
    form = PlanForm(data if submitted else None, initial=INITIAL, checkpoints=checkpoints)
    result = None
    if submitted and form.is_valid():
        source = data.get("source") or "preset"
        doc = _document(data, form)
        if doc is not None:
            checked = PlanRequestSerializer(data=doc)
            if not checked.is_valid():
                _add_errors(form, checked.errors, source)
            else:
                try:
                    result = selectors.capacity_plan(team, checked.validated_data)
                except InvalidInput as exc:
                    form.add_error(source if source in form.fields else None, exc.message)
    # django-htmx's middleware sets request.htmx (HttpRequest's stubs do not know it).
    htmx = bool(getattr(request, "htmx", False))
    template = "capacity/_planner.html" if htmx else "capacity/planner.html"
    return render(request, template, page_context(
        request, team, membership, section="capacity", form=form, plan=result,
        checkpoints=checkpoints))
