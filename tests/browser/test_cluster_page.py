"""The cluster page in a real browser: the nodes with their GPU counts and states (a lost
one with its reason), reached from the nav; a staff user cordons a node with a reason and
sees the new state and the reason in place (htmx swap); the page fits 800 px; no console
error."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.scheduling import services
from apps.scheduling.models import Node
from apps.teams.models import Role
from tests.browser.test_dashboard import no_sideways_scroll, screenshot
from tests.browser.test_run_charts import login
from tests.factories import make_lab
from workers.protocol import NodeRegistration

pytestmark = pytest.mark.slow
WAIT = 15_000


def register(name: str, gpus: int, gpu_type: str = "H100") -> None:
    services.register_node(actor=Actor.system(), registration=NodeRegistration.model_validate(
        {"name": name, "pool": "gpu" if gpus else "cpu", "gpu_type": gpu_type if gpus else "",
         "gpu_count": gpus, "cpus": 32, "memory_mb": 262_144}))


@pytest.fixture
def cluster(transactional_db):
    lab = make_lab(Role.MEMBER)
    lab["user"].is_staff = True
    lab["user"].save(update_fields=["is_staff"])
    register("gpu-a1", 8)
    register("gpu-b2", 4, "L40S")
    register("cpu-1", 0)
    Node.objects.filter(name="gpu-b2").update(last_heartbeat_at="2026-01-01T00:00:00Z")
    assert services.sweep_lost_nodes() == ["gpu-b2"]
    return lab


def test_cluster_page_shows_nodes_and_staff_cordon_one(asgi_server, browser, cluster):
    page, errors = login(browser, asgi_server, "alice")
    page.click("header a:text('Cluster')")
    page.wait_for_url(f"{asgi_server}/cluster/")
    rows = page.locator("#nodes tbody tr")
    assert rows.count() == 3
    row = {name: page.locator(f'tr[data-node="{name}"]') for name in ("gpu-a1", "gpu-b2",
                                                                        "cpu-1")}
    assert [row[n].locator(".gpus").inner_text() for n in row] == ["8", "4", "0"]
    assert [row[n].locator(".gpu-slot").count() for n in row] == [8, 4, 0]
    assert row["gpu-a1"].locator(".state .badge").inner_text() == "ready"
    assert row["gpu-b2"].locator(".state .badge").inner_text() == "lost"
    assert "no heartbeat for" in row["gpu-b2"].locator(".reason").inner_text()
    assert "3 nodes, 12 GPUs; ready: 2 nodes, 8 GPUs" in page.inner_text("#cluster-totals")

    row["gpu-a1"].locator('input[name="reason"]').fill("ECC errors on GPU 2")
    row["gpu-a1"].locator('button[value="cordon"]').click()
    page.wait_for_selector('tr[data-node="gpu-a1"] .badge.node-cordoned', timeout=WAIT)
    cordoned = page.locator('tr[data-node="gpu-a1"]')
    assert cordoned.locator(".reason").inner_text() == "ECC errors on GPU 2"
    assert cordoned.locator('button[value="uncordon"]').count() == 1
    assert "gpu-a1 is cordoned." in page.inner_text("#cluster-nodes")
    assert Node.objects.get(name="gpu-a1").state == "cordoned"

    # The state survives a reload (it is the database's, not the swap's).
    page.reload()
    assert page.locator('tr[data-node="gpu-a1"] .state .badge').inner_text() == "cordoned"
    screenshot(page, "cluster.png")
    no_sideways_scroll(page)  # the table scrolls in its own box at 800 px
    assert errors == []
