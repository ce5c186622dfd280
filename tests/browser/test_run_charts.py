"""The run page in a real browser, as a W&B user reads it: charts with true axes (a series
flat within 1e-7 of 1.0, a 1e-8 loss, 9,892–12,754 tokens/s), values on hover, a synced
crosshair and zoom, smoothing, log y, x as time, CSV/PNG export, a run summary whose numbers
reconcile, and a header that follows the run live — with no console error and no
Content-Security-Policy violation on the way."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from apps.core.actor import Actor
from apps.runs.models import Run
from apps.teams.models import Role
from apps.teams.services import worker_token_create
from tests.factories import (
    MembershipFactory,
    ProjectFactory,
    TeamFactory,
    UserFactory,
    put_run_object,
)
from workers.client import CrucibleClient

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
PASSWORD = "pw-for-tests-1"
WAIT = 15_000
STEPS = 50
TRAIN_CONFIG = {"model": {"preset": {"num_layers": 2}}, "sft": {"steps": 20},
                "trainer": {"steps": STEPS, "eval_samples": 4, "zero_stage": 0},
                "checkpoint": {"every": 0}}


def watch_console(page) -> list[str]:
    """Console errors and uncaught exceptions (a CSP violation is a console error)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"{page.url}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"{e} {e.stack}"))
    return errors


def login(browser, server: str, username: str, width: int = 1440):
    page = browser.new_page(viewport={"width": width, "height": 900}, accept_downloads=True)
    errors = watch_console(page)
    page.goto(f"{server}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/t/**")
    return page, errors


def train_run(project, name: str = "grpo-tiny") -> Run:
    from apps.runs import services
    from apps.runs.validation import plan_run

    plan = plan_run(team=project.team, project=project.slug, kind="train", name=name,
                    config=TRAIN_CONFIG, base_model="preset")
    return services.create_run(actor=Actor.system(), team_id=project.team_id, plan=plan)


def points(steps: range, t0: float) -> list[dict]:
    out = []
    for s in steps:
        wall = t0 + 2.0 * s
        values = {
            "reward_mean": 0.2 + 0.5 * s / STEPS + 0.05 * math.sin(s),
            "loss": 1e-8 * (1 + 0.5 * math.cos(s / 3)),
            "ratio_max": 1.0 + 1e-7 * math.sin(s),
            "train_tokens_per_s": 9892 + (12754 - 9892) * ((s * 37) % STEPS) / (STEPS - 1),
            "kl": 0.001 * s - 0.01,
        }
        out += [{"name": k, "step": s, "value": v, "wall_time": wall}
                for k, v in values.items()]
    return out


@pytest.fixture
def lab(transactional_db):
    user = UserFactory(username="alice")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=Role.MEMBER)
    project = ProjectFactory(team=team, slug="math", name="Math")
    return {"user": user, "team": team, "project": project}


def axis(page, metric: str) -> dict:
    """What uPlot drew on a chart's y axis: range, tick labels, gutter width, and the width
    the widest label needs in the axis font."""
    return page.evaluate("""(metric) => {
        const u = document.querySelector(`figure.chart[data-metric="${metric}"]`).__plot;
        const ax = u.axes[1];
        const ctx = document.createElement("canvas").getContext("2d");
        ctx.font = "12px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
        const labels = ax._values || [];
        return {min: u.scales.y.min, max: u.scales.y.max, labels,
                gutter: ax._size, need: Math.max(0, ...labels.map((l) => ctx.measureText(l).width)),
                xmin: u.scales.x.min, xmax: u.scales.x.max, xlabels: u.axes[0]._values || []};
    }""", metric)


def test_run_page_charts_summary_and_live_header(asgi_server, browser, lab):
    run = train_run(lab["project"])
    _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="pool")
    page, errors = login(browser, asgi_server, "alice")
    with CrucibleClient(asgi_server, worker_token) as client:
        session = client.claim("gpu", "gpu-node-1", run_id=str(run.pk))
        session.set_status("running")
        t0 = 1_760_000_000.0
        session.log_metrics(points(range(0, 30), t0)
                            + [{"name": "eval/reward_before_sft", "step": 0, "value": 0.05},
                               {"name": "eval/reward_mean", "step": 0, "value": 0.30,
                                "wall_time": t0},
                               {"name": "lr", "step": 0, "value": 0.001, "wall_time": t0}])
        session.log_metrics([{"name": f"moe/layer{layer}/expert{e}_tokens", "step": s,
                              "value": float(10 + (e * 7 + s + layer) % 13)}
                             for s in range(30) for layer in range(2) for e in range(4)])
        session.add_samples([
            {"step": 29, "prompt": "3+3=", "completion": "6", "reward": 1.0,
             "reward_components": {"correct": 1.0}, "advantage": 0.5, "weight_version": 28,
             "finish_reason": "stop"},
            {"step": 29, "prompt": "4+4=", "completion": "9", "reward": 0.0,
             "reward_components": {"correct": 0.0}, "advantage": -0.5, "weight_version": 28,
             "finish_reason": "length"},
            {"step": 18, "prompt": "5+5=", "completion": "10", "reward": 1.0,
             "reward_components": {"correct": 1.0}, "advantage": 0.0, "weight_version": 17,
             "finish_reason": "stop"},
        ])
        page.goto(f"{asgi_server}/t/lab/runs/{run.pk}/")
        page.wait_for_selector("body[data-charts-ready]", timeout=WAIT)
        page.wait_for_selector("#live-indicator.on", timeout=WAIT)
        page.evaluate("window.__noReload = true")
        assert "step 29/50" in page.locator("#summary-progress").inner_text()
        assert page.locator("#run-status").inner_text() == "running"
        assert page.locator("#run-head button.danger").inner_text() == "Cancel run"

        # 1. Near-constant series: a flat line with a sensible range, labels that differ.
        ratio = axis(page, "ratio_max")
        assert ratio["min"] < 1.0 < ratio["max"] and ratio["max"] - ratio["min"] >= 0.01
        assert len(ratio["labels"]) >= 2 and len(set(ratio["labels"])) == len(ratio["labels"])
        # 2. True axis labels: the gutter fits the widest label; SI prefix; tiny values in
        # scientific notation with adjacent ticks distinct.
        tokens = axis(page, "train_tokens_per_s")
        assert all(label.endswith("k") for label in tokens["labels"] if label != "0")
        assert tokens["gutter"] >= tokens["need"] + 10
        read = [float(label[:-1]) * 1e3 for label in tokens["labels"]]
        assert min(read) <= 10_000 and max(read) >= 12_000  # 9,892–12,754, not 0,000–3,000
        assert tokens["min"] <= 9892 and tokens["max"] >= 12754
        loss = axis(page, "loss")
        assert all("e-" in label for label in loss["labels"] if label != "0")
        assert len(set(loss["labels"])) == len(loss["labels"]) >= 2
        # A single point is drawn as a point, its value in the caption.
        assert "0.001" in page.locator('figure.chart[data-metric="lr"] .last-value').inner_text()

        # 3. Hover: a tooltip with the value, legend values, the crosshair on every chart.
        over = page.locator('figure.chart[data-metric="reward_mean"] .u-over')
        over.scroll_into_view_if_needed()
        box = over.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        tip = page.locator('figure.chart[data-metric="reward_mean"] .chart-tip')
        tip.wait_for(state="visible", timeout=WAIT)
        assert "reward_mean:" in tip.inner_text() and "step" in tip.inner_text()
        other = page.locator('figure.chart[data-metric="kl"] .u-legend .u-series').nth(1)
        assert other.locator(".u-value").inner_text() not in ("", "—", "--")
        assert page.evaluate("""() => {
            const u = document.querySelector('figure.chart[data-metric="kl"]').__plot;
            return u.cursor.idx != null && u.cursor.left > 0; }""")

        # 6. Live: new steps grow the charts and the summary; the header follows the status.
        session.log_metrics(points(range(30, STEPS + 1), t0)
                            + [{"name": "eval/reward_mean", "step": STEPS, "value": 0.55,
                                "wall_time": t0 + 2 * STEPS}])
        page.wait_for_function(
            "() => document.querySelector('figure.chart[data-metric=\"reward_mean\"]')"
            f".dataset.points === '{STEPS + 1}'", timeout=WAIT)
        page.wait_for_function("() => document.getElementById('summary-progress')"
                               ".textContent.includes('step 50/50')", timeout=WAIT)
        uri = put_run_object(run, "checkpoints/final.tar", b"checkpoint bytes")
        session.add_checkpoint(STEPS, uri, {"eval/reward_mean": 0.55, "loss": 1e-8,
                                            **{f"m{i}": i for i in range(50)}})
        session.set_status("succeeded")
        page.wait_for_function(
            "() => document.getElementById('run-status').textContent === 'succeeded'", timeout=WAIT)
        page.wait_for_selector('#checkpoints tr[data-step="50"]', timeout=WAIT)
    assert page.evaluate("window.__noReload") is True
    # No stale "Cancel run": the header is rendered again once the status has changed.
    page.wait_for_selector("#run-head button.danger", state="detached", timeout=WAIT)
    assert "attempt 1" in page.locator("#run-attempt").inner_text()
    assert page.locator("#attempts").count() == 1

    # Expert counters feed one heatmap per layer, not 8 line charts; samples sort.
    assert page.locator("figure.heatmap").count() == 2
    assert page.locator('figure.chart[data-metric^="moe/"]').count() == 0
    assert page.locator("table.samples td.reward").first.inner_text() == "1.000"
    # RL samples show what the update made of them.
    assert page.locator("table.samples td.advantage").first.inner_text() == "0.500"
    assert "length" in page.locator("table.samples tbody tr").nth(1).inner_text()
    page.select_option("#s-sort", "reward")
    page.wait_for_function(
        "() => document.querySelector('table.samples td.reward')?.textContent === '0.000'",
        timeout=WAIT)

    # 4. The summary reconciles with the charts: held-out before SFT → RL start → end, the
    # gain split by phase, training reward first vs last.
    held = page.locator("#summary-heldout").inner_text()
    assert "0.050 before SFT" in held and "0.300 at RL step 0" in held
    assert "0.550 at step 50" in held
    verdict = page.locator("#summary-verdict").inner_text()
    assert "SFT +0.250" in verdict and "RL +0.250" in verdict
    assert "→" in page.locator("#summary-reward").inner_text()
    assert "100 s" in page.locator("#run-summary").inner_text() or \
        "steps/s" in page.locator("#run-summary").inner_text()

    # 7. Checkpoints: key metrics only (not 52 columns), a download link through the API.
    headers = page.locator("#checkpoints thead th").all_inner_texts()
    assert "eval/reward_mean" in headers and "m7" not in headers
    with page.expect_download() as dl:
        page.click('#checkpoints a[download]')
    assert Path(dl.value.path()).read_bytes() == b"checkpoint bytes"
    page.select_option("#ckpt-keys", ["m7", "loss"])
    page.wait_for_function(
        "() => [...document.querySelectorAll('#checkpoints thead th')]"
        ".some(th => th.textContent === 'm7')",
        timeout=WAIT)

    # 5. Controls: smoothing draws the raw series faint under the EMA.
    page.locator("#cc-smoothing").fill("0.8")
    page.wait_for_function("""() => {
        const u = document.querySelector('figure.chart[data-metric="reward_mean"]').__plot;
        return u.series.length === 3 && u.series[1].label.endsWith('(raw)'); }""", timeout=WAIT)
    smoothed = page.evaluate("""() => {
        const u = document.querySelector('figure.chart[data-metric="reward_mean"]').__plot;
        return [u.data[1].slice(-5), u.data[2].slice(-5)]; }""")
    assert smoothed[0] != smoothed[1]
    over = page.locator('figure.chart[data-metric="reward_mean"] .u-over')
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.4)
    tip.wait_for(state="visible", timeout=WAIT)
    assert "(raw " in tip.inner_text()
    DOCS.mkdir(exist_ok=True)
    page.evaluate("document.querySelector('.topbar').style.position = 'static'")
    page.screenshot(path=str(DOCS / "run-page.png"), full_page=True)

    # Log y: positive series go logarithmic, the one with values <= 0 says why it cannot.
    page.check("#cc-log")
    page.wait_for_selector('figure.chart.log-y[data-metric="train_tokens_per_s"]', timeout=WAIT)
    assert page.locator('figure.chart.no-log[data-metric="kl"]').count() == 1
    page.uncheck("#cc-log")
    # x as relative time: labels in seconds or minutes from the run's first point.
    page.select_option("#cc-x", "relative")
    page.wait_for_function("""() => {
        const u = document.querySelector('figure.chart[data-metric="reward_mean"]').__plot;
        return (u.axes[0]._values || []).some((v) => /(s|m)$/.test(v)); }""", timeout=WAIT)
    rel = axis(page, "reward_mean")
    assert rel["xmin"] == 0 and rel["xmax"] == pytest.approx(2.0 * STEPS)
    page.select_option("#cc-x", "step")

    # Zoom one chart by dragging: every chart follows; Reset zoom restores them all.
    over = page.locator('figure.chart[data-metric="kl"] .u-over')
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 20, steps=5)
    page.mouse.up()
    zoomed = axis(page, "reward_mean")
    assert 0 < zoomed["xmin"] < zoomed["xmax"] < STEPS
    assert axis(page, "loss")["xmin"] == pytest.approx(zoomed["xmin"])
    page.click("[data-action=reset-zoom]")
    assert axis(page, "loss")["xmin"] == 0 and axis(page, "loss")["xmax"] == STEPS

    # Samples per step through the form's own GET (as without JavaScript).
    page.goto(f"{asgi_server}/t/lab/runs/{run.pk}/?step=18#samples-h")
    page.wait_for_selector("table.samples")
    assert page.locator("#s-step").input_value() == "18"
    rows = page.locator("table.samples tbody tr")
    assert rows.count() == 1 and "5+5=" in rows.first.inner_text()
    page.wait_for_selector("body[data-charts-ready]", timeout=WAIT)

    # Export: CSV with a header row and every step; PNG bytes.
    with page.expect_download() as dl:
        page.click('figure.chart[data-metric="reward_mean"] button:text("CSV")')
    lines = Path(dl.value.path()).read_text().splitlines()
    assert lines[0].startswith("step,reward_mean") and len(lines) == STEPS + 2
    with page.expect_download() as dl:
        page.click('figure.chart[data-metric="reward_mean"] button:text("PNG")')
    assert Path(dl.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert errors == []


def test_csp_header_and_no_inline_script(asgi_server, browser, lab):
    """Every page is served with a strict CSP, and the pages still work under it."""
    import httpx

    page, errors = login(browser, asgi_server, "alice")
    response = httpx.get(f"{asgi_server}/accounts/login/")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "unsafe-eval" not in policy and "object-src 'none'" in policy
    for path in ("/t/lab/", "/t/lab/team/", "/t/lab/launch/", "/api/v1/docs"):
        page.goto(f"{asgi_server}{path}")
        page.wait_for_load_state("networkidle")
        inline = page.evaluate("""() => [...document.scripts].filter((s) => !s.src &&
            !['application/json'].includes(s.type)).length""")
        handlers = page.evaluate("""() => [...document.querySelectorAll('*')].filter((el) =>
            [...el.attributes].some((a) => a.name.startsWith('on'))).length""")
        assert (inline, handlers) == (0, 0), path
    page.goto(f"{asgi_server}/api/v1/docs")
    page.wait_for_selector(".swagger-ui .info", timeout=WAIT)  # Swagger UI runs under the CSP
    # (it sets style attributes, so its page alone allows inline styles; never scripts)
    docs = httpx.get(f"{asgi_server}/api/v1/docs").headers["content-security-policy"]
    assert "script-src 'self';" in docs + ";" and "'unsafe-inline'" in docs
    # The team switcher navigates without an inline handler.
    other = TeamFactory(slug="other", name="Other")
    MembershipFactory(team=other, user=lab["user"], role=Role.VIEWER)
    page.goto(f"{asgi_server}/t/lab/")
    page.select_option("#team-switcher", "other")
    page.wait_for_url(f"{asgi_server}/t/other/")
    assert errors == []


def test_axis_helpers_never_repeat_a_label(asgi_server, browser, lab):
    """The cases the issue saw, through the page's own charts.js: ticks of a ~1e-8 loss read
    '0, 0, 0, -0' and of a 0.001-wide range '0.001, 0.001, 0.001'; a flat series froze."""
    run = train_run(lab["project"])
    page, errors = login(browser, asgi_server, "alice")
    page.goto(f"{asgi_server}/t/lab/runs/{run.pk}/")
    page.wait_for_selector("body[data-charts-ready]", timeout=WAIT)
    got = page.evaluate("""() => {
        const c = Crucible.charts;
        const labels = (lo, hi) => c.formatTicks(c.linearTicks(lo, hi, 5));
        return {
            tiny: labels(-1.2e-8, 1.3e-8), milli: labels(0.00095, 0.00115),
            flat: c.dataRange(1 - 1e-7, 1 + 1e-7), zero: c.dataRange(0, 0),
            big: labels(9892, 12754), neg: labels(-0.02, 0.05),
            value: [c.formatValue(1.0000001), c.formatValue(-0.0), c.formatValue(12754.3)],
        };
    }""")
    for key in ("tiny", "milli", "big", "neg"):
        labels = got[key]
        assert len(labels) >= 2 and len(set(labels)) == len(labels), (key, labels)
        assert "-0" not in labels, (key, labels)
    assert "0" in got["tiny"] and all("e-" in x for x in got["tiny"] if x != "0")
    assert got["flat"][0] < 0.99 and got["flat"][1] > 1.01
    assert got["zero"] == [-1, 1]
    assert got["value"] == ["1.0000001", "0", "12754.3"]
    assert errors == []
