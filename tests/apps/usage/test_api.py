"""``/api/v1/teams/<team>/usage`` and ``…/usage/runs/<id>`` over real rows (tests/apps/usage/
world.py has the hand-computed timeline), tenant isolation and the 400s for bad windows."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from apps.runs.selectors import run_goodput
from apps.usage.selectors import window
from tests.apps.usage.world import RATES, build
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db
URL = "/api/v1/teams/acme/usage"
WINDOW = "?from=2026-03-02&to=2026-03-03&group=day"


@pytest.fixture
def world(project, qa, other_team, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "COST_PER_GPU_HOUR": RATES,
                         "COST_CURRENCY": "EUR"}
    rival = ProjectFactory(team=other_team, slug="theirs")
    return build(project, qa, rival)


def test_team_usage_by_hand(viewer, world):
    response = viewer.client.get(URL + WINDOW)
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["from"], body["to"], body["group"], body["currency"]) == (
        "2026-03-02T00:00:00Z", "2026-03-04T00:00:00Z", "day", "EUR")
    total = body["total"]
    assert total["gpu_hours"] == pytest.approx({
        "allocated": 102, "useful": 80, "startup": 1.6, "restart": 3.2,
        "lost_preemption": 16, "lost_failure": 0, "held": 1.2,
        "idle_learner": 20, "idle_generators": 40})
    # 12.75 h x 16 cores for the GPU run, 4 core-hours of CPU-only work
    assert total["cpu_hours"]["allocated"] == pytest.approx(204 + 4)
    assert total["gpu_hours_by_type"] == pytest.approx({"H100": 102})
    assert total["goodput"] == pytest.approx(80 / 102)
    # 102 GPU-h x 2.5 + 4 CPU-only core-hours x 0.05 (the GPU node's cores come with it)
    assert total["cost"].pop("unpriced_gpu_hours") == {}
    assert total["cost"] == pytest.approx({"gpu": 255, "cpu": 0.2, "total": 255.2})
    days = {d["day"]: d for d in body["days"]}
    assert list(days) == ["2026-03-02", "2026-03-03"]
    assert days["2026-03-02"]["gpu_hours"]["allocated"] == pytest.approx(32)
    assert days["2026-03-02"]["gpu_hours"]["useful"] == pytest.approx(29.6)
    assert days["2026-03-02"]["gpu_hours"]["idle_learner"] == pytest.approx(7.4)
    assert days["2026-03-02"]["cpu_hours"]["allocated"] == pytest.approx(4 * 16 + 4)
    assert days["2026-03-03"]["gpu_hours"]["allocated"] == pytest.approx(70)
    assert days["2026-03-03"]["gpu_hours"]["useful"] == pytest.approx(50.4)
    assert days["2026-03-03"]["gpu_hours"]["lost_preemption"] == pytest.approx(16)
    # the two runs that held something, newest first; never the rival's nor the unrun one
    assert [r["name"] for r in body["runs"]] == ["qc-cpu", "grpo-preempted"]
    assert body["runs"][1]["gpu_hours"]["allocated"] == pytest.approx(102)
    assert body["runs"][0]["cost"]["total"] == pytest.approx(0.2)
    assert [r["redone_steps"] for r in body["runs"]] == [0, 20]


def test_a_window_clips_what_runs_held(member, world):
    body = member.client.get(URL + "?from=2026-03-03T00:00:00Z&to=2026-03-03T01:00:00Z").json()
    # 00:00-01:00 on day 2: attempt 1 is running useful steps on 8 GPUs
    assert body["total"]["gpu_hours"]["allocated"] == pytest.approx(8)
    assert body["total"]["gpu_hours"]["useful"] == pytest.approx(8)
    assert [d["day"] for d in body["days"]] == ["2026-03-03"]
    assert [r["name"] for r in body["runs"]] == ["grpo-preempted"]
    empty = member.client.get(URL + "?from=2026-01-01&to=2026-01-31").json()
    assert empty["runs"] == [] and empty["total"]["goodput"] is None
    assert len(empty["days"]) == 31 and empty["total"]["cost"]["total"] == 0


def test_run_usage_over_its_life_matches_its_goodput(member, world):
    gpu = world["gpu"]
    body = member.client.get(f"{URL}/runs/{gpu.pk}").json()
    assert body["id"] == str(gpu.pk) and body["project"] == "main"
    assert body["gpu_hours"]["lost_preemption"] == pytest.approx(16)
    assert body["redone_steps"] == 20  # reached 70, the next attempt resumed from 50
    assert body["cost"]["total"] == pytest.approx(255)
    # One function for both: the run's goodput timeline times its 8 GPUs.
    g = run_goodput(gpu)
    assert body["gpu_hours"]["useful"] == pytest.approx(8 * g.useful / 3600)
    assert body["gpu_hours"]["lost_preemption"] == pytest.approx(8 * g.preemption / 3600)


def test_a_gpu_type_without_a_rate_is_unpriced_not_free(member, world, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "COST_PER_GPU_HOUR": {"cpu": 0.05}}
    body = member.client.get(URL + WINDOW).json()
    assert body["total"]["cost"]["gpu"] == 0
    assert body["total"]["cost"]["unpriced_gpu_hours"] == pytest.approx({"H100": 102})


def test_other_teams_get_404_everywhere(outsider, member, world):
    for url in (URL + WINDOW, f"{URL}/runs/{world['gpu'].pk}"):
        response = outsider.client.get(url)
        assert response.status_code == 404, url
        assert response.json() == {"code": "not_found", "message": "Team 'acme' not found."}
    # the rival's run through acme's URL, a missing run and a malformed id: 404 alike
    for run_id in (world["rival"].pk, "0" * 32, "not-a-uuid"):
        assert member.client.get(f"{URL}/runs/{run_id}").status_code == 404
    # the rival team's own usage shows only its run
    rival = outsider.client.get("/api/v1/teams/rival/usage" + WINDOW).json()
    assert [r["name"] for r in rival["runs"]] == ["rival-run"]


@pytest.mark.parametrize("query, words", [
    ("?from=yesterday", "'from' must be a date"),
    ("?to=2026-13-01", "'to' must be a date"),
    ("?from=2026-03-05&to=2026-03-01", "must be before"),
    ("?from=2024-01-01&to=2026-01-01", "at most 366 days"),
    ("?group=week", "'group' must be one of day"),
])
def test_bad_windows_are_400_with_a_reason(member, world, query, words):
    response = member.client.get(URL + query)
    assert response.status_code == 400
    assert words in response.content.decode()


def test_writes_are_not_allowed(member, world):
    assert member.client.post(URL, {}, format="json").status_code == 405


def test_the_default_window_is_the_last_seven_days():
    now = datetime(2026, 3, 10, 15, 30, tzinfo=UTC)
    start, end, group = window({}, now=now)
    assert (start, end, group) == (datetime(2026, 3, 4, tzinfo=UTC), now, "day")
    # a date "to" means the end of that day
    start, end, _ = window({"to": "2026-03-10"}, now=now)
    assert (start, end) == (datetime(2026, 3, 4, tzinfo=UTC), datetime(2026, 3, 11, tzinfo=UTC))


def test_the_schema_documents_the_usage_endpoints(member):
    schema = member.client.get("/api/v1/schema?format=json").json()
    paths = schema["paths"]
    listed = paths["/api/v1/teams/{team}/usage/"]["get"]
    assert {p["name"] for p in listed["parameters"]} >= {"from", "to", "group"}
    assert "/api/v1/teams/{team}/usage/runs/{run}/" in paths
