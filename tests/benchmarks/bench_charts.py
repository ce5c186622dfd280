"""How long the run page takes to draw 50 charts of 10,000 points each, in a real browser.

Run from the repository root: `.venv/bin/python -m tests.benchmarks.bench_charts`
(`make bench-charts`). Needs Debian's chromium (/usr/bin/chromium) and the dev extras.

What it does:

1. A fresh SQLite database under var/bench/charts (migrated), a user, team and train run,
   and 50 series x 10,000 steps stored through the ingest service (as a worker's batches).
2. The real ASGI app (uvicorn, in a thread) and chromium (Playwright) logged in as that
   user; the run page opened with ``?points=10000``, so every chart draws every point.
3. The page's own timings (static/js/run_page.js, ``window.__crucibleCharts``): ``fetch_ms``
   from the request to the parsed metrics, ``draw_ms`` from there to all 50 charts built
   and painted (the next frame after the last one). Its peer, in the same page on the same
   data: 50 uPlot charts with uPlot's default axes and no plugins (what the page drew
   before), timed the same way. R repeats (page reloads), medians quoted.

Ends with (DESIGN.md "Benchmarks"):
    charts_draw_50x10k_ms: crucible=<ms> uplot_defaults=<ms> ratio=<c/u> target=<=1000
    charts_fetch_50x10k_ms: crucible=<ms>
Knobs (environment): BENCH_CHART_SERIES (50), BENCH_CHART_POINTS (10000), BENCH_REPEATS (5).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERIES = int(os.environ.get("BENCH_CHART_SERIES", "50"))
POINTS = int(os.environ.get("BENCH_CHART_POINTS", "10000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
VAR = ROOT / "var" / "bench" / "charts"
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "bench-charts-pw"

PEER_JS = """async () => {
    // uPlot with its defaults (axes, ranges, no plugins, no legend), same data, same sizes.
    const figures = [...document.querySelectorAll("figure.chart")];
    const host = document.createElement("div");
    document.getElementById("charts").appendChild(host);
    const t0 = performance.now();
    for (const fig of figures) {
        const u = fig.__plot;
        const box = document.createElement("div");
        host.appendChild(box);
        new uPlot({width: u.width, height: u.height, scales: {x: {time: false}},
                   legend: {show: false},
                   series: [{}, {stroke: "#2f55d4", width: 2}]}, [u.data[0], u.data[1]], box);
    }
    await new Promise((r) => requestAnimationFrame(() => setTimeout(r)));
    const ms = performance.now() - t0;
    host.remove();
    return ms;
}"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def setup_django() -> None:
    shutil.rmtree(VAR, ignore_errors=True)
    VAR.mkdir(parents=True)
    os.environ["CRUCIBLE_VAR_DIR"] = str(VAR)
    os.environ["CRUCIBLE_MAX_DOWNSAMPLE_POINTS"] = str(max(POINTS, 5000))
    # Writing 500,000 points through the service takes minutes on a loaded host: the fixture's
    # lease must outlive it (nothing heartbeats here).
    os.environ["CRUCIBLE_LEASE_SECONDS"] = "3600"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's loop shares this thread
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def make_run() -> str:
    import math

    from django.contrib.auth import get_user_model

    from apps.core.actor import Actor
    from apps.projects.models import Project
    from apps.runs import services
    from apps.runs.services import ingest_metrics
    from apps.runs.validation import plan_run
    from apps.teams.models import Membership, Role, Team

    user = get_user_model().objects.create_user("bench", password=PASSWORD)
    team = Team.objects.create(slug="bench", name="Bench")
    Membership.objects.create(team=team, user=user, role=Role.OWNER)
    project = Project.objects.create(team=team, slug="charts", name="Charts")
    plan = plan_run(team=team, project=project.slug, kind="train", name="50 charts",
                    config={"trainer": {"steps": POINTS}}, base_model="preset")
    run = services.create_run(actor=Actor.system(), team_id=team.pk, plan=plan)
    run = services.claim(actor=Actor.system(), pool=run.pool, worker_id="bench",
                         team_id=None, run_id=run.pk)
    t0 = time.time() - POINTS
    batch = max(1, 10_000 // SERIES)
    for seq, start in enumerate(range(0, POINTS, batch), start=1):
        rows = [{"name": f"metric_{k:02d}", "step": s,
                 "value": math.sin(s / (50 + k)) + k * 1e-3, "wall_time": t0 + s}
                for s in range(start, min(POINTS, start + batch)) for k in range(SERIES)]
        ingest_metrics(run=run, lease_id=run.lease_id, seq=seq, points=rows)
    return str(run.pk)


def serve() -> tuple[str, object]:
    import uvicorn

    from config.asgi import application

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def main() -> int:
    if not Path(CHROMIUM).exists():
        log("Debian's chromium is needed: apt-get install -y chromium")
        return 2
    setup_django()
    log(f"storing {SERIES} series x {POINTS} points…")
    run_id = make_run()
    base, server = serve()
    from playwright.sync_api import sync_playwright

    ours, peer, fetch = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(f"{base}/accounts/login/")
        page.fill("#id_username", "bench")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/t/**")
        for i in range(REPEATS):
            page.goto(f"{base}/t/bench/runs/{run_id}/?points={POINTS}")
            page.wait_for_selector("body[data-charts-ready]", timeout=300_000)
            got = page.evaluate("() => window.__crucibleCharts")
            if got["charts"] != SERIES or got["points"] != SERIES * POINTS:
                log(f"page drew {got['charts']} charts, {got['points']} points; expected "
                    f"{SERIES} and {SERIES * POINTS}")
                return 1
            peer_ms = page.evaluate(PEER_JS)
            ours.append(got["draw_ms"])
            fetch.append(got["fetch_ms"])
            peer.append(peer_ms)
            log(f"  {i + 1}/{REPEATS}: draw {got['draw_ms']:.0f} ms (uPlot defaults "
                f"{peer_ms:.0f} ms), fetch {got['fetch_ms']:.0f} ms")
        browser.close()
    server.should_exit = True
    c, u = statistics.median(ours), statistics.median(peer)
    print(f"charts_draw_{SERIES}x{POINTS // 1000}k_ms: crucible={c:.0f} uplot_defaults={u:.0f} "
          f"ratio={c / u:.2f} target=<=1000")
    print(f"charts_fetch_{SERIES}x{POINTS // 1000}k_ms: crucible={statistics.median(fetch):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
