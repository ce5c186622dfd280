"""``/t/<team>/usage/`` rendered by Django (the browser test drives it in chromium): the
world's hand-computed figures, 404 for non-members, and a bad window named on the page."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.apps.usage.world import RATES, build

pytestmark = pytest.mark.django_db
PAGE = "/t/acme/usage/"


def browser_for(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


@pytest.fixture
def world(project, qa, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "COST_PER_GPU_HOUR": RATES}
    return build(project, qa)


def figure(html: str, id_: str) -> str:
    found = re.search(rf'id="{id_}"[^>]*>([^<]*)<', html)
    assert found is not None, id_
    return found.group(1)


def test_the_page_shows_the_totals_days_and_runs(viewer, world):
    response = browser_for(viewer).get(PAGE + "?from=2026-03-02&to=2026-03-03")
    assert response.status_code == 200
    html = response.content.decode()
    assert figure(html, "total-allocated") == "102.00"
    assert figure(html, "total-useful") == "80.00"
    assert figure(html, "total-goodput") == "78.4%"
    assert figure(html, "total-lost-preemption") == "16.00"
    assert figure(html, "total-startup") == "1.60 / 3.20"
    assert figure(html, "total-idle") == "20.00 / 40.00"
    assert figure(html, "total-cost") == "255.20 USD"
    assert 'value="2026-03-02"' in html and 'value="2026-03-03"' in html
    day = html[html.index('data-day="2026-03-03"'):]
    assert re.search(r'class="num allocated">([^<]*)<', day).group(1) == "70.00"
    assert f'data-run="{world["gpu"].pk}"' in html and "never-ran" not in html
    assert 'id="usage-chart-data"' in html


def test_a_bad_window_is_named_on_the_page(member, world):
    response = browser_for(member).get(PAGE + "?from=2026-03-05&to=2026-03-01")
    assert response.status_code == 200  # the form shown again with its error
    assert 'id="usage-total"' not in response.content.decode()
    assert "must be before" in figure(response.content.decode(), "usage-error")


def test_non_members_get_404(outsider, world):
    assert browser_for(outsider).get(PAGE).status_code == 404
