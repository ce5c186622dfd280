"""``make run``: start the platform on its embedded defaults and run the demo job.

Migrates, makes sure a demo login, team and project exist, starts the web server
(uvicorn, ASGI), a Celery worker for all three queues (with beat for lease sweeps) and
this host's node agent (workers/agent.py) — restarting the worker or the agent, with
backoff, whenever one exits (workers/supervise.py; only the web's exit stops ``up``) —,
uploads the bundled dataset through the API, launches a ``profile`` run, waits for it,
then runs the pipeline demo through the same API: synthesise an arithmetic batch, spot-check
it as the admin (scripted; ``--no-auto-review`` leaves it to a person) so it becomes a dataset
version, QC the arithmetic environment, SFT (environment references + the reviewed batch) +
GRPO the tiny MoE on it, and evaluate the final checkpoint against the base model, printing
both scores and the lineage that links them. Then it keeps serving until Ctrl-C.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from apps.core.actor import Actor
from apps.projects.models import Project
from apps.teams.models import Membership, Role, Team
from apps.teams.services import personal_token_create, worker_token_create
from config.celery import QUEUES
from workers.client import CrucibleClient, node_name
from workers.protocol import node_queue
from workers.supervise import Child, CriticalExit, Supervisor

DEMO_DATA = settings.BASE_DIR / "deploy" / "demo" / "arithmetic.jsonl"

# The pipeline demo, sized for a CPU laptop: one-digit sums (100 problems, 20 held out), the
# tiny 4-layer MoE warm-started by SFT on the references, then 60 GRPO steps (8 prompts x 8
# completions), long enough that the held-out reward (sampled every 10 steps) rises during RL
# beyond the SFT warm start; the run summary splits the gain into SFT and RL.
DEMO_ENV = {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 20}}
DEMO_SYNTHESIS: dict[str, Any] = {
    "dataset": "arithmetic-synth", "batch_name": "demo arithmetic batch",
    "synthesis": {"name": "demo arithmetic", "seed": 1, "workers": 1,
                  "generators": [{"kind": "math", "count": 24, "topics": ["arithmetic"],
                                  "difficulties": [1, 2]}]},
}
DEMO_MODEL = {"preset": {"num_layers": 4}}
DEMO_TRAIN: dict[str, Any] = {
    "model": DEMO_MODEL,
    "rollout": {"group_size": 8, "max_new_tokens": 3},
    "sft": {"steps": 120, "batch_size": 32},
    "trainer": {"steps": 60, "prompts_per_step": 8, "micro_batch_size": 32, "zero_stage": 0,
                "lr": 5e-4, "eval_every": 10, "eval_samples": 8},
    "checkpoint": {"every": 0},
}
# The reviewed synthesis batch joins the SFT warm start: its records' expression and exact
# answer, written the way the environment asks ("7 + 3 - 2=" -> "8").
DEMO_SFT_TEMPLATES = {"prompt_template": "{problem[expression]}=",
                      "completion_template": "{answer}"}
DEMO_EVAL = {"samples_per_task": 1, "k": [1],
             "sampling": {"max_tokens": 3, "temperature": 0.0}}


def worker_queues(node: str) -> str:
    """The queues this host's worker consumes: every pool's, and its node's own (where the
    scheduler sends runs it placed on this node)."""
    return ",".join([*QUEUES, node_queue(node)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _Watch(threading.Thread):
    """Polls the supervisor every second while the demo runs in the main thread; a critical
    child's exit (the web) sets ``exited`` with ``why``."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__(name="up-supervisor", daemon=True)
        self.supervisor = supervisor
        self.stop, self.exited = threading.Event(), threading.Event()
        self.why = ""

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.supervisor.poll()
            except CriticalExit as exc:
                self.why = f"the {exc.child.name} process exited (status {exc.code})"
                self.exited.set()
                return


class Command(BaseCommand):
    help = ("Start web + worker on the embedded defaults, run the demo profile job, then the "
            "pipeline demo (synthesis, QC, SFT + GRPO, evaluation before/after).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--exit-after-demo", action="store_true",
                            help="Stop everything once the demo run finishes (for tests).")
        parser.add_argument("--skip-pipeline", action="store_true",
                            help="Only the profile job: no synthesis, QC, training or eval.")
        parser.add_argument("--no-auto-review", action="store_true",
                            help="Leave the synthesised batch in the review queue for a person "
                                 "(training then runs without it) instead of the admin's "
                                 "scripted spot-check.")

    def handle(self, *args: Any, **opts: Any) -> None:
        call_command("migrate", interactive=False, verbosity=0)
        password = self._demo_login()
        team = self._demo_team()
        base_url = f"http://{opts['host']}:{opts['port']}"
        _, user_token = personal_token_create(
            actor=Actor.system(), user=get_user_model().objects.get(username="admin"),
            name="make-run",
        )
        _, worker_token = worker_token_create(actor=Actor.system(), team=None, name="local-pool")

        # The agent registers this host under its node name and the worker claims under the
        # same name and consumes the node's queue (where the scheduler sends runs it placed
        # here): one name for both.
        node = node_name()
        env = {**os.environ, "CRUCIBLE_API_URL": base_url, "CRUCIBLE_WORKER_TOKEN": worker_token,
               "CRUCIBLE_VAR_DIR": str(settings.VAR_DIR), "CRUCIBLE_NODE_NAME": node,
               "OBJECT_STORE_URL": settings.OBJECT_STORE_URL, "PYTHONUNBUFFERED": "1"}
        # Sandbox sessions (agent workspaces, /api/v1/teams/<team>/sandbox-sessions) are kept
        # by a session host: `up` runs one here unless CRUCIBLE_SESSION_HOST_URL names another
        # (without one every session call answers 503).
        session_bind = ""
        if not os.environ.get("CRUCIBLE_SESSION_HOST_URL"):
            session_bind = f"127.0.0.1:{_free_port()}"
            env["CRUCIBLE_SESSION_HOST_URL"] = f"http://{session_bind}"
            env["CRUCIBLE_SESSION_HOST_TOKEN"] = (os.environ.get("CRUCIBLE_SESSION_HOST_TOKEN")
                                                  or secrets.token_hex(16))
        logs = settings.VAR_DIR / "logs"
        logs.mkdir(exist_ok=True)
        # The web is critical (nothing works without it: `up` stops and says so); the
        # worker (with beat) and the agent are restarted when they exit, with backoff: a
        # Redis outage makes a busy Celery 5.7 worker exit after its task (kombu's
        # restore_unacked bug), and runs launched afterwards would wait for no one.
        supervisor = Supervisor(on_restart=lambda child, code: self.stdout.write(
            f"{child.name} exited (status {code}); restarting it (see "
            f"{logs / (child.name + '.log')})"))
        self._child(supervisor, "web", [
            sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", opts["host"],
            "--port", str(opts["port"]), "--log-level", "warning"], env, logs, critical=True)
        self._child(supervisor, "worker", [
            sys.executable, "-m", "celery", "-A", "config.celery", "worker", "-B", "-Q",
            worker_queues(node), "-c", "2", "--loglevel", "INFO", "-s",
            str(settings.VAR_DIR / "celerybeat-schedule")], env, logs)
        # This host's node agent: its capacity in the inventory (the /cluster/ page), and the
        # dead-worker reports that requeue a killed worker's run at once.
        self._child(supervisor, "agent", [sys.executable, "-m", "workers.agent"], env, logs)
        if session_bind:
            self._child(supervisor, "session-host", [
                sys.executable, "-m", "workers.sandbox.session_host", "--bind", session_bind],
                env, logs)
        # Children run in sessions of their own (see workers.supervise), so SIGTERM (a
        # process manager stopping `up`) must stop them here, as Ctrl-C does.
        signal.signal(signal.SIGTERM, _interrupt)
        supervisor.start()
        watcher = _Watch(supervisor)
        watcher.start()
        try:
            self._wait_healthy(base_url, watcher)
            run = self._demo_run(base_url, user_token, team)
            self._announce(base_url, password, run, logs, user_token)
            if run["status"] != "succeeded" and opts["exit_after_demo"]:
                raise CommandError(f"demo run ended {run['status']}: {run['error']}")
            if not opts["skip_pipeline"]:
                self._pipeline(base_url, user_token, team, review=not opts["no_auto_review"])
            if opts["exit_after_demo"]:
                return
            watcher.exited.wait()
            raise CommandError(f"{watcher.why}; see var/logs/")
        except KeyboardInterrupt:
            self.stdout.write("\nstopping…")
        finally:
            watcher.stop.set()
            watcher.join(timeout=5)
            supervisor.stop()

    def _child(self, supervisor: Supervisor, name: str, cmd: list[str], env: dict[str, str],
               logs: Path, *, critical: bool = False) -> None:
        self.stdout.write(f"starting {name}: logs in {logs / (name + '.log')}")
        supervisor.add(Child(name, cmd, env=env, cwd=settings.BASE_DIR,
                             log_path=logs / f"{name}.log", critical=critical))

    def _wait_healthy(self, base_url: str, watcher: _Watch) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if watcher.exited.is_set():
                raise CommandError(f"{watcher.why} at start; see var/logs/")
            try:
                if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise CommandError(f"web server did not answer on {base_url} within 60 s")

    def _demo_login(self) -> str:
        """An ``admin`` superuser; its password is generated once and kept in var/."""
        secret_file = settings.VAR_DIR / "admin-password.txt"
        User = get_user_model()
        if secret_file.exists() and User.objects.filter(username="admin").exists():
            return secret_file.read_text().strip()
        password = secrets.token_urlsafe(12)
        user = User.objects.filter(username="admin").first()
        if user is None:
            user = User.objects.create_superuser("admin", "admin@localhost", password)
        else:
            user.set_password(password)
            user.save()
        secret_file.write_text(password + "\n")
        secret_file.chmod(0o600)
        return password

    def _demo_team(self) -> Team:
        user = get_user_model().objects.get(username="admin")
        team, _ = Team.objects.get_or_create(slug="demo", defaults={"name": "Demo team"})
        Membership.objects.get_or_create(team=team, user=user, defaults={"role": Role.OWNER})
        Project.objects.get_or_create(team=team, slug="arithmetic",
                                      defaults={"name": "Arithmetic"})
        return team

    def _demo_run(self, base_url: str, token: str, team: Team) -> dict[str, Any]:
        records = [json.loads(line) for line in DEMO_DATA.read_text().splitlines() if line]
        with CrucibleClient(base_url, token) as client:
            if not any(d["slug"] == "arithmetic" for d in
                       client.paginate(f"teams/{team.slug}/datasets")):
                client.create_dataset(team.slug, "arithmetic", "arithmetic",
                                      "Bundled demo: arithmetic prompts with answers")
            version = client.upload_version(team.slug, "arithmetic", records,
                                            message="bundled demo data")
            self.stdout.write(f"dataset arithmetic v{version['number']} "
                              f"{version['digest'][:12]}: {version['record_count']} records")
            run = client.launch_run(team.slug, project="arithmetic", kind="profile",
                                    name="profile arithmetic", datasets=["arithmetic"],
                                    config={"progress_every": 50})
            self.stdout.write(f"launched profile run {run['id']}; waiting for the worker…")
            return client.wait_for_run(team.slug, run["id"], timeout=180)

    def _wait(self, client: CrucibleClient, team: str, run: dict[str, Any],
              what: str, timeout: float = 900) -> dict[str, Any]:
        self.stdout.write(f"  {what}: run {run['id']} ({run['kind']}, pool {run['pool']})…")
        done = client.wait_for_run(team, run["id"], timeout=timeout)
        if done["status"] != "succeeded":
            raise CommandError(f"{what} ended {done['status']}: {done['error']}")
        return done

    def _review(self, client: CrucibleClient, team: str, batch_id: str) -> dict[str, Any]:
        """The admin's scripted spot-check of the batch's sampled records: each is claimed,
        then accepted when every stage of its verification trail passed, else rejected naming
        the failed check. Returns the batch as decided (accepted: with its dataset version).
        A stand-in for a person, so that `make run` shows the whole path; --no-auto-review
        leaves the batch to a human reviewer."""
        batch: dict[str, Any] = client.get(f"teams/{team}/batches/{batch_id}")
        while batch["status"] in ("pending_review", "resampling"):
            items = list(client.paginate(f"teams/{team}/review-items", batch=batch_id,
                                         status="open"))
            if not items:
                break
            for item in items:
                path = f"teams/{team}/review-items/{item['id']}"
                client.request("POST", f"{path}/claim")
                failed = [f"{c.get('stage')}: {c.get('check')}" for c in item["trail"] or []
                          if not c.get("ok")]
                if not item["trail"]:
                    failed = ["no verification trail"]
                verdict = {"verdict": "reject", "reason": "; ".join(failed)} if failed else {
                    "verdict": "accept"}
                batch = client.request("POST", f"{path}/verdict", json=verdict)["batch"]
        return batch

    def _pipeline(self, base_url: str, token: str, team: Team, *, review: bool = True) -> None:
        """Synthesise → review → QC → SFT (with the reviewed batch) + GRPO → evaluate the final
        checkpoint vs the base."""
        t = team.slug
        self.stdout.write("pipeline demo: synthesis → review → QC → SFT + GRPO → evaluation")
        with CrucibleClient(base_url, token) as client:
            if not any(d["slug"] == DEMO_SYNTHESIS["dataset"]
                       for d in client.paginate(f"teams/{t}/datasets")):
                client.create_dataset(t, DEMO_SYNTHESIS["dataset"], "arithmetic",
                                      "Synthesised arithmetic problems (reviewed batches)")
            synth = client.launch_run(t, project="arithmetic", kind="synthesize",
                                      name="synthesise arithmetic", config=DEMO_SYNTHESIS)
            envs = f"teams/{t}/environments"
            if not any(e["slug"] == "arithmetic" for e in client.paginate(envs)):
                client.request("POST", envs, json={"slug": "arithmetic",
                                                   "project": "arithmetic"})
            version = client.request("POST", f"{envs}/arithmetic/versions",
                                     json={"spec": DEMO_ENV})
            ref = f"arithmetic@v{version['number']}"
            qc = client.request("POST", f"{envs}/arithmetic/versions/v{version['number']}/qc",
                                json={"name": f"QC {ref}"})
            self._wait(client, t, synth, "synthesis")
            report = client.run_report(t, synth["id"])
            self.stdout.write(f"    {report['records']} verified records, {report['rejected']} "
                              f"rejected → review batch {report['batch']} "
                              f"({base_url}/t/{t}/review/)")
            pinned: list[str] = []
            train_cfg: dict[str, Any] = DEMO_TRAIN
            if review:
                decided = self._review(client, t, report["batch"])
                items = decided["items"]
                if decided["status"] == "accepted":
                    made = decided["version"]
                    pinned = [f"{DEMO_SYNTHESIS['dataset']}@v{made['number']}"]
                    train_cfg = {**DEMO_TRAIN,
                                 "sft": {**DEMO_TRAIN["sft"], **DEMO_SFT_TEMPLATES}}
                self.stdout.write(
                    f"    review (admin's scripted spot-check): {items.get('accepted', 0)} "
                    f"accepted, {items.get('rejected', 0)} rejected → batch {decided['status']}"
                    + (f" → dataset {pinned[0]} joins the SFT warm start" if pinned else ""))
            self._wait(client, t, qc, f"QC of {ref}")
            checked = client.get(f"{envs}/arithmetic/versions/v{version['number']}")
            summary = checked["qc_report"].get("summary", {})
            self.stdout.write(f"    QC {checked['qc_status']}: {summary.get('tasks')} tasks, "
                              f"{summary.get('quarantined')} quarantined")
            train = client.launch_run(t, project="arithmetic", kind="train",
                                      name="SFT + GRPO on arithmetic", environments=[ref],
                                      datasets=pinned, base_model="preset", config=train_cfg)
            self._wait(client, t, train, "SFT + GRPO training")
            base = client.launch_run(t, project="arithmetic", kind="eval", name="eval: base",
                                     environment=ref, base_model="preset",
                                     config={**DEMO_EVAL, "model": DEMO_MODEL})
            final = client.launch_run(t, project="arithmetic", kind="eval",
                                      name="eval: final checkpoint", environment=ref,
                                      base_model=f"run:{train['id']}", config=DEMO_EVAL)
            scores = {}
            for label, run in (("base", base), ("final", final)):
                self._wait(client, t, run, f"evaluation of the {label} model")
                scores[label] = client.run_report(t, run["id"])["summary"]
            names = {synth["id"]: "synthesize run", qc["id"]: "qc run",
                     train["id"]: "train run", final["id"]: "eval run"}
            graph = client.lineage(t, f"run:{final['id']}")
            metrics_url = f"teams/{t}/runs/{train['id']}/metrics"
            available = client.get(metrics_url, max_points=1)["names"]
            wanted = [n for n in ("eval/reward_before_sft", "eval/reward_mean")
                      if n in available]
            heldout = client.get(metrics_url, name=wanted, max_points=1000) if wanted else {}
        self.stdout.write("lineage of the final evaluation (GET /api/v1/teams/"
                          f"{t}/lineage?artifact=run:{final['id']}):")
        for edge in graph["edges"]:
            source, target = (self._node(edge[end], names) for end in ("source", "target"))
            self.stdout.write(f"    {source} --{edge['relation']}--> {target}")
        self.stdout.write(self._held_out(heldout, train_cfg))
        lines = [f"  {label:<5} pass@1={s['pass_at']['1']:.3f} mean_reward="
                 f"{s['mean_reward']:.3f} ({s['tasks']} held-out tasks)"
                 for label, s in scores.items()]
        self.stdout.write("evaluation runs before/after training (greedy, temperature 0):\n"
                          + "\n".join(lines)
                          + f"\n  train run page: {base_url}/t/{t}/runs/{train['id']}/")

    @staticmethod
    def _held_out(metrics: dict[str, Any], cfg: dict[str, Any]) -> str:
        """The training run's own held-out curve: before SFT, RL step 0, every 10 steps."""
        series = {s["name"]: s["points"] for s in metrics.get("series", [])}
        before = series.get("eval/reward_before_sft") or []
        curve = series.get("eval/reward_mean") or []
        trainer = cfg["trainer"]
        head = (f"held-out reward during training (eval/reward_mean, {trainer['eval_samples']}"
                " samples per prompt at temperature 1.0):")
        if not curve:
            return head + "\n  (not reported)"
        steps = "  ".join(f"{p['step']}: {p['last']:.3f}" for p in curve)
        start, end = curve[0]["last"], curve[-1]["last"]
        parts = [f"  RL steps  {steps}"]
        if before:
            sft = start - before[0]["last"]
            parts.append(f"  before SFT {before[0]['last']:.3f} → after SFT {start:.3f} "
                         f"(SFT {sft:+.3f}) → after RL {end:.3f} (RL {end - start:+.3f})")
        else:
            parts.append(f"  RL start {start:.3f} → end {end:.3f} (RL {end - start:+.3f})")
        return head + "\n" + "\n".join(parts)

    @staticmethod
    def _node(node: dict[str, str], names: dict[str, str]) -> str:
        ident, kind = str(node["id"]), node["type"]
        label = names.get(ident, "run") if kind == "run" else kind.replace("_", " ")
        return f"{label} {ident[:8] if kind in ('run', 'report') else ident[:12]}"

    def _announce(self, base_url: str, password: str, run: dict[str, Any], logs: Path,
                  token: str) -> None:
        team = "demo"
        lines = [
            "",
            f"Crucible is running at {base_url}/  (login: admin / {password})",
            f"  API token for scripts (admin's, shown once): export CRUCIBLE_TOKEN={token}"
            f" CRUCIBLE_API_URL={base_url}",
            "    (more: python manage.py token create --user admin --name <label>)",
            f"  demo run {run['id']}: {run['status']}"
            + (f" — {run['error']}" if run["error"] else ""),
            f"  run page: {base_url}/t/{team}/runs/{run['id']}/",
            f"  report:  {base_url}/api/v1/teams/{team}/runs/{run['id']}/report",
            f"  events:  {base_url}/api/v1/teams/{team}/runs/{run['id']}/events",
            f"  metrics: {base_url}/api/v1/teams/{team}/runs/{run['id']}/metrics",
            f"  API docs: {base_url}/api/v1/docs    admin: {base_url}/admin/    "
            f"cluster: {base_url}/cluster/",
            f"  logs: {logs}/   Ctrl-C stops everything.",
            "",
        ]
        self.stdout.write("\n".join(lines))
