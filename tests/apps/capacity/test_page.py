"""``/t/<team>/capacity/`` rendered by Django: the form with its defaults, a plan posted
by a viewer (tables with the numbers), the htmx answer (the planner block alone), a plan
linked by query string, and errors shown on the field they concern."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from workers.capacity import PRESETS

pytestmark = pytest.mark.django_db
PAGE = "/t/acme/capacity/"


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_form_with_defaults_and_the_nav_tab(viewer):
    html = signed_in(viewer.user).get(PAGE).content.decode()
    assert "<h1>Capacity planner</h1>" in html
    assert f'href="{PAGE}" aria-current="page">Capacity</a>' in html
    assert '<option value="qwen3-30b-a3b" selected>' in html
    assert 'name="concurrency" value="32"' in html and 'name="context" value="32768"' in html
    assert 'id="layouts"' not in html  # nothing planned yet
    assert "no checkpoints in this team yet" in html


def test_a_viewer_posts_a_plan_and_sees_the_tables(viewer):
    response = signed_in(viewer.user).post(PAGE, {
        "source": "preset", "preset": "qwen3-30b-a3b", "gpu": "H100-80GB",
        "concurrency": "32", "context": "32768", "dtype": "bf16", "kv_dtype": "bf16",
        "headroom": "0.1", "prefill_chunk": "8192", "max_gpus": "64"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "<strong>4 × H100-80GB</strong>: TP 4" in html
    # weights 61,064,245,248 B; KV 98,304 B per token, 3.22 GB per 32k sequence, 103 GB
    for row, value in (("weights", "61.06 GB"), ("kv-token", "98.30 KB"),
                       ("kv-sequence", "3.22 GB"), ("kv-total", "103.1 GB"),
                       ("activations", "373.3 MB"), ("logits", "19.45 MB")):
        assert f'<tr data-row="{row}">' in html
        assert value in html.split(f'<tr data-row="{row}">')[1].split("</tr>")[0]
    assert '<tr data-dtype="int4"><th scope="row">int4</th><td class="num">16.22 GB' in html
    assert 'data-layout="tp4-epoff" class="recommended"' in html
    assert "each head&#x27;s cache is held by 2 GPUs" in html  # TP 8 over 4 KV heads


def test_htmx_gets_the_planner_block_alone(member):
    response = signed_in(member.user).post(
        PAGE, {"source": "config", "config": json.dumps(PRESETS["qwen3-8b"]),
               "gpu": "H200-141GB", "concurrency": "8", "context": "8192"},
        HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert html.startswith('<div id="planner"') and "<html" not in html
    assert "<strong>1 × H200-141GB</strong>: TP 1" in html
    assert 'id="params-total">8.19 B<' in html


def test_a_plan_can_be_linked(viewer):
    html = signed_in(viewer.user).get(
        PAGE + "?preset=qwen3-235b-a22b&gpu=H200-141GB&concurrency=32&context=32768"
    ).content.decode()
    assert "<strong>8 × H200-141GB</strong>" in html
    assert 'id="params-active">22.19 B<' in html


@pytest.mark.parametrize(("form", "words"), [
    ({"source": "config", "config": "{not json"}, "Not valid JSON"),
    ({"source": "config", "config": "[1]"}, "The config must be a JSON object"),
    ({"source": "config", "config": json.dumps({"hidden_size": 64})},
     "config.num_hidden_layers is missing"),
    ({"source": "preset", "preset": "qwen3-8b", "concurrency": "0"},
     "greater than or equal to 1"),
    ({"source": "checkpoint", "checkpoint": "checkpoint:424242"},
     "matches no checkpoint in team"),
])
def test_errors_show_on_the_form(member, form, words):
    html = signed_in(member.user).post(PAGE, {"concurrency": "4", "context": "64", **form}
                                       ).content.decode()
    assert words in html.replace("&#x27;", "'")
    assert 'id="layouts"' not in html


def test_outsider_gets_404(outsider, team):
    assert signed_in(outsider.user).get(PAGE).status_code == 404
