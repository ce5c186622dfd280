"""``make run``'s command on a fresh var/ folder: it must start web + worker, run the
demo profile job to success, print the URL and login, then run the pipeline demo
(synthesis → review → QC → SFT + GRPO → evaluation) and print the scores before and after
training and the lineage from the synthesis run to the final evaluation."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from apps.runs.management.commands.up import DEMO_TRAIN

# Synthesis, QC, training and two evaluations after the profile job: minutes on a loaded
# machine, hence a longer limit than the default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_runs_the_demo_job_on_embedded_defaults(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "OBJECT_STORE_URL",
                        "CRUCIBLE_SESSION_HOST_URL")}
    env["CRUCIBLE_VAR_DIR"] = str(tmp_path / "var")
    port = _free_port()
    result = subprocess.run(
        [sys.executable, "manage.py", "up", "--port", str(port), "--exit-after-demo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"Crucible is running at http://127.0.0.1:{port}/" in out
    assert "login: admin / " in out
    assert ": succeeded" in out
    assert (tmp_path / "var" / "crucible.sqlite3").exists()
    # Each run writes under its own prefix, teams/<team id>/runs/<run id>/.
    assert any((tmp_path / "var" / "objects" / "teams").glob("*/runs/*/profile.json"))

    # The pipeline demo, every stage through the API and the worker.
    assert re.search(r"\d+ verified records, \d+ rejected → review batch [0-9a-f-]{36}", out)
    assert re.search(r"review \(admin's scripted spot-check\): 24 accepted, 0 rejected → batch "
                     r"accepted → dataset arithmetic-synth@v1 joins the SFT warm start", out), out
    assert "QC passed: 100 tasks, 0 quarantined" in out
    # The lineage of the final evaluation reaches back to the synthesis run.
    for link in (r"synthesize run \S+ --produced--> dataset version \S+",
                 r"dataset version \S+ --input--> train run \S+",
                 r"environment version \S+ --environment--> train run \S+",
                 r"train run \S+ --produced--> checkpoint \S+",
                 r"checkpoint \S+ --base_model--> eval run \S+"):
        assert re.search(link, out), (link, out[-3000:])
    # The training run's own held-out curve, split into the SFT and the RL gains.
    assert re.search(r"before SFT [0-9.]+ → after SFT [0-9.]+ \(SFT [+-][0-9.]+\) → after RL "
                     r"[0-9.]+ \(RL [+-][0-9.]+\)", out), out[-3000:]
    # A script's first API token, printed once (only its hash is stored).
    token = re.search(r"export CRUCIBLE_TOKEN=(crc_\S+) CRUCIBLE_API_URL=http://127\.0\.0\.1:"
                      rf"{port}\b", out)
    assert token, out[-3000:]
    database = sqlite3.connect(tmp_path / "var" / "crucible.sqlite3")
    # This host's node agent registered it in the inventory (the /cluster/ page).
    assert database.execute("SELECT COUNT(*) FROM scheduling_node").fetchone() == (1,)
    # The session host that serves sandbox sessions came up beside the web.
    assert "starting session-host" in out
    assert "session host on" in (tmp_path / "var" / "logs" / "session-host.log").read_text()
    assert f"cluster: http://127.0.0.1:{port}/cluster/" in out
    digest = hashlib.sha256(token.group(1).encode()).hexdigest()
    assert database.execute("SELECT COUNT(*) FROM teams_apitoken WHERE key_hash = ? AND "
                            "kind = 'personal' AND revoked_at IS NULL", (digest,)).fetchone() \
        == (1,)
    # The train run stored samples for the run page's viewer: every step, with the RL fields.
    train = re.search(r"SFT \+ GRPO training: run ([0-9a-f-]{36}) ", out)
    assert train, out[-3000:]
    rows = database.execute(
        "SELECT step, prompt, completion, reward, advantage, weight_version, finish_reason "
        "FROM runs_sample WHERE run_id = ?", (train.group(1).replace("-", ""),)).fetchall()
    steps = DEMO_TRAIN["trainer"]["steps"]
    assert sorted({r[0] for r in rows}) == list(range(1, steps + 1)), rows[:5]
    assert all(r[1] and r[3] is not None and r[4] is not None
               and r[5] == r[0] - 1 and r[6] in ("stop", "length") for r in rows), rows[:5]
    database.close()
    scores = dict(re.findall(r"^  (base|final) +pass@1=([0-9.]+) ", out, re.MULTILINE))
    assert set(scores) == {"base", "final"}, out[-3000:]
    # SFT + GRPO from the random-init base must answer some held-out sums.
    assert float(scores["final"]) > float(scores["base"]), scores
