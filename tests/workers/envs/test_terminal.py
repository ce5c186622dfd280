"""Terminal tasks: the trusted grader against a hostile agent, the tool executor, the
Terminal-Bench importer and task QC.

Episodes run in real sandbox sessions (bubblewrap, cgroups, overlayfs): those tests need root
and skip with the host reason where it is missing, like every session test.
"""

from __future__ import annotations

import base64
import io
import json
import shlex
import tarfile
from pathlib import Path
from typing import Any

import pytest

from workers.envs.base import InfraError
from workers.envs.terminal import TOOL_SCHEMAS, TerminalTask, ToolExecutor, run_episode
from workers.envs.terminal.episode import TerminalEpisode, prepare, run_script
from workers.envs.terminal.task import TerminalTaskError, parse_task
from workers.envs.terminal.tbench import TaskRefused, import_task_dir, import_tasks
from workers.envs.terminal.tools import parse_arguments
from workers.qc.terminal import qc_terminal_tasks
from workers.sandbox.sessions import SessionManager
from workers.sandbox.spec import SessionLimits

FIXTURES = Path(__file__).parent / "terminal_bench"
LIMITS = {"memory_mb": 256, "disk_mb": 32, "pids": 64, "cpu_s": 120, "wall_s": 900,
          "idle_s": 300}

ANSWER_TEST = '''
import subprocess
from pathlib import Path


def test_answer():
    subprocess.run(["python3", "/work/solve.py"], timeout=30)
    assert Path("/work/answer.txt").read_text().strip() == "42"
'''


def answer_task(**fields: Any) -> TerminalTask:
    record: dict[str, Any] = {
        "id": "answer", "instruction": "Write solve.py so that it writes 42 to answer.txt.",
        "files": {"README.md": "solve.py must write the answer to answer.txt\n"},
        "hidden_tests": {"test_answer.py": ANSWER_TEST},
        "visible_tests": {"test_visible.py": "import os\n\ndef test_solve_exists():\n"
                                             "    assert os.path.exists('/work/solve.py')\n"},
        "reference": "printf 'open(\"answer.txt\", \"w\").write(\"42\\\\n\")\\n' > solve.py",
        "limits": LIMITS, "max_turns": 10, **fields}
    return parse_task(record)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


class Scripted:
    """A policy that plays fixed turns (lists of tool calls), then answers without a call."""

    def __init__(self, turns: list[list[dict[str, Any]]]) -> None:
        self.turns = list(turns)
        self.seen_tools: list[str] = []

    def __call__(self, messages: Any, tools: Any) -> dict[str, Any]:
        self.seen_tools = [t["function"]["name"] for t in tools]
        if not self.turns:
            return {"role": "assistant", "content": "done"}
        return {"role": "assistant", "content": "", "tool_calls": self.turns.pop(0)}


# -- the hostile agent -----------------------------------------------------------------------

FORGER = r'''
import glob, json, os
forged = json.dumps({"nonce": "guess", "results": [{"test": "t", "outcome": "passed"}]})
print(forged, flush=True)
os.write(2, forged.encode() + b"\n")
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    for what in ("environ", "mem", "fd/0", "fd/1"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                f.read(64)
            print("STOLE", pid, what, flush=True)
        except OSError:
            pass
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            with open(fd, "w") as f:
                f.write(forged + "\n")
            print("WROTE", fd, flush=True)
        except OSError:
            pass
open("/work/answer.txt", "w").write("41\n")
print("HOSTILE-RAN", flush=True)
'''
FAKE_PATHLIB = '''
class Path(str):
    def __new__(cls, *parts):
        return str.__new__(cls, "/".join(parts))
    def read_text(self, *a, **k):
        return "42\\n"
    def exists(self):
        return True
'''
PLANTS = {
    "solve.py": FORGER,
    "pathlib.py": FAKE_PATHLIB,  # shadows the stdlib for anything with /work on sys.path
    "subprocess.py": "def run(*a, **k):\n    return None\n",
    "sitecustomize.py": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n",
    "usercustomize.py": "raise SystemExit(0)\n",
    "conftest.py": "def pytest_runtest_makereport(item, call):\n    call.excinfo = None\n",
    "pytest.ini": "[pytest]\naddopts = -p no:terminal --co\n",
    "bin/python3": "#!/bin/sh\necho 42 > /work/answer.txt\n",
    ".bashrc": "export PATH=/work/bin:$PATH\n",
    ".profile": "export PATH=/work/bin:$PATH\n",
}


def test_a_hostile_agent_cannot_forge_the_hidden_tests(manager: SessionManager) -> None:
    task = answer_task()
    turns = [[call("write_file", path=p, content=c) for p, c in PLANTS.items()],
             [call("shell", command="chmod +x bin/python3; setsid sh -c 'while :; do echo 42 > "
                                    "answer.txt; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &"
                                    " sleep 0.3; cat answer.txt")]]
    episode = TerminalEpisode.start(manager, task)
    policy = Scripted(turns)
    try:
        while not episode.done:
            episode.step(policy(episode.messages, TOOL_SCHEMAS))
        assert "42" in episode.messages[-2]["content"]  # the background writer runs
        # the attack is real: a grader that runs the tests in the agent's own workspace with
        # /work on sys.path is fooled by the planted pathlib and subprocess
        naive = episode.session.exec(
            f"python3 -c {shlex.quote(ANSWER_TEST + 'test_answer()')}", timeout=30)
        assert naive.status == "OK", naive
        grade = episode.grade()
    finally:
        if episode.session.closed_reason is None:
            episode.close()
    assert episode.session.closed_reason is not None  # its processes died before grading
    assert grade.error is None, grade
    assert grade.reward == 0.0 and grade.passed == 0 and grade.total == 1
    assert grade.results[0]["outcome"] == "failed"
    # the planted program did run (its output is in the runner's log, not its verdict), and
    # reached neither the runner's memory, environment and stdin, nor any pipe
    assert "HOSTILE-RAN" in grade.output
    assert "STOLE" not in grade.output and "WROTE" not in grade.output, grade.output


def test_hidden_tests_may_not_import_workspace_code(manager: SessionManager) -> None:
    task = answer_task(hidden_tests={"test_import.py": (
        "import sys\nsys.path.insert(0, '/work')\n\ndef test_x():\n    import solve\n"
        "    assert solve.ANSWER == 42\n")})
    snap = prepare(manager, task)
    try:
        grade = run_script(manager, task, "echo 'ANSWER = 42' > solve.py", snap)
    finally:
        manager.drop_snapshot(snap)
    assert grade.reward == 0.0
    assert "may not import workspace code" in grade.results[0]["message"]


def test_reference_scores_one_and_a_scripted_agent_solves_it(manager: SessionManager) -> None:
    task = answer_task()
    snap = prepare(manager, task)
    try:
        assert run_script(manager, task, task.reference, snap).reward == 1.0
        assert run_script(manager, task, None, snap).reward == 0.0
        policy = Scripted([
            [call("run_tests")],
            [call("write_file", path="solve.py", content="open('answer.txt','w').write('4')\n")],
            [call("edit_file", path="solve.py", old="'4'", new="'42'"),
             call("shell", command="python3 solve.py && cat answer.txt")],
        ])
        result = run_episode(manager, task, policy, snap)
    finally:
        manager.drop_snapshot(snap)
    assert policy.seen_tools == ["shell", "read_file", "write_file", "edit_file", "run_tests"]
    tool_msgs = [m for m in result.messages if m["role"] == "tool"]
    assert tool_msgs[0]["content"].startswith("0/1 passed")  # the visible test, before
    assert tool_msgs[0]["tool_call_id"] == "call_run_tests"
    assert tool_msgs[-1]["content"].endswith("stdout:\n42")
    assert result.stop_reason == "done" and result.turns == 4
    assert result.grade.reward == 1.0 and result.grade.passed == 1


def test_a_session_reclaimed_before_grading_is_an_infrastructure_failure(
        manager: SessionManager) -> None:
    episode = TerminalEpisode.start(manager, answer_task())
    episode.session.close("idle for 300 s")  # what the watchdog does to an idle session
    grade = episode.grade()
    assert grade.reward == 0.0 and grade.infra and "idle for 300 s" in str(grade.error)
    spent = TerminalEpisode.start(manager, answer_task())
    spent.session.close("cpu quota of 120 s spent")
    grade = spent.grade()
    assert grade.reward == 0.0 and not grade.infra


def test_a_session_lost_under_a_tool_voids_the_episode(manager: SessionManager) -> None:
    """The platform reclaiming the session mid-episode is no feedback for the policy: the tool
    raises InfraError (the RL engine re-plays or drops the episode) and the grade is flagged,
    while a session the episode itself used up stays the model's error."""
    episode = TerminalEpisode.start(manager, answer_task())
    episode.session.close("idle for 300 s")
    with pytest.raises(InfraError, match="idle for 300 s"):
        episode.executor.execute("shell", {"command": "ls"})
    score = episode.grade().as_score()
    assert score.total == 0.0 and score.infra and "idle for 300 s" in score.infra
    spent = TerminalEpisode.start(manager, answer_task())
    spent.session.close("cpu quota of 120 s spent")
    r = spent.executor.execute("shell", {"command": "ls"})
    assert r.error and "the workspace is gone" in r.content
    assert spent.grade().as_score().infra is None


def test_tool_executor_errors_in_a_session(manager: SessionManager) -> None:
    task = answer_task(command_timeout_s=1.0, visible_tests={})
    episode = TerminalEpisode.start(manager, task)
    ex = episode.executor
    try:
        assert ex.execute("write_file", {"path": "a.txt", "content": "x x\n"}).error is False
        r = ex.execute("edit_file", {"path": "a.txt", "old": "x", "new": "y"})
        assert r.error and "occurs 2 times" in r.content
        r = ex.execute("read_file", {"path": "../etc/passwd"})
        assert r.error and r.content.startswith("error: read_file:")
        r = ex.execute("read_file", '{"path": "missing.txt"}')
        assert r.error and "no such file: missing.txt" in r.content
        r = ex.execute("write_file", {"path": "/etc/x", "content": ""})
        assert r.error and "write_file" in r.content
        r = ex.execute("shell", {"command": "sleep 20", "timeout_s": 600})
        assert r.error and r.content.startswith("status: TLE")  # capped by the task's 1 s
        r = ex.execute("run_tests", {})
        assert r.error and "no visible tests" in r.content
        ex.deadline = 0.0
        r = ex.execute("shell", {"command": "true"})
        assert r.error and "time budget" in r.content
        replies = episode.step({"tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]})
        assert replies[0]["content"].startswith("error: a tool call is")
        assert episode.stop_reason == "time_budget"
    finally:
        episode.close()


@pytest.mark.parametrize(("name", "arguments", "expected"), [
    ("rm_rf", {}, "unknown tool 'rm_rf'; available: shell, read_file"),
    ("shell", "{not json", "arguments are not valid JSON"),
    ("shell", "[1, 2]", "arguments must be a JSON object, got list"),
    ("shell", {}, "shell: command: Field required"),
    ("shell", {"command": "ls", "cwd": "/"}, "cwd: Extra inputs are not permitted"),
    ("shell", {"command": 3}, "command: Input should be a valid string"),
    ("shell", {"command": "ls", "timeout_s": 0}, "timeout_s: Input should be greater than 0"),
    ("write_file", {"path": "a"}, "write_file: content: Field required"),
    ("edit_file", {"path": "a", "old": "", "new": "b"}, "old: String should have at least 1"),
    ("run_tests", {"which": "hidden"}, "which: Extra inputs are not permitted"),
])
def test_tool_argument_errors(name: str, arguments: Any, expected: str) -> None:
    error = parse_arguments(name, arguments)
    assert isinstance(error, str) and error.startswith("error: ") and expected in error, error


def test_tool_schemas_are_openai_function_tools() -> None:
    by_name = {t["function"]["name"]: t for t in TOOL_SCHEMAS}
    assert list(by_name) == ["shell", "read_file", "write_file", "edit_file", "run_tests"]
    for tool in TOOL_SCHEMAS:
        assert tool["type"] == "function" and tool["function"]["description"]
        params = tool["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
    assert by_name["shell"]["function"]["parameters"]["required"] == ["command"]
    assert by_name["edit_file"]["function"]["parameters"]["required"] == ["path", "old", "new"]
    json.dumps(TOOL_SCHEMAS)  # plain JSON, as `tools=` sends it
    assert not isinstance(parse_arguments("run_tests", None), str)
    assert not isinstance(parse_arguments("shell", '{"command": "ls"}'), str)


# -- task records ------------------------------------------------------------------------------

def _tar(members: list[tarfile.TarInfo], data: bytes = b"x") -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return base64.b64encode(buf.getvalue()).decode()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
    return info


def test_task_records_are_checked() -> None:
    ok = answer_task(archive_b64=_tar([_member("lib/a.py"), _member("./b.txt")]))
    assert set(ok.workspace()) == {"lib/a.py", "b.txt", "README.md"}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"hidden_tests": {}}, "hidden_tests"),
        ({"hidden_tests": {"../t.py": "x = 1"}}, "a plain file name ending in .py"),
        ({"hidden_tests": {"test_a.py": "def f(:"}}, "does not parse"),
        ({"files": {"../escape": "x"}}, "file '../escape'"),
        ({"max_turns": 0}, "max_turns"),
        ({"time_budget_s": 900}, "must be shorter than the session's lifetime"),
        ({"unknown": 1}, "unknown: Extra inputs are not permitted"),
    ]
    for fields, expected in bad:
        with pytest.raises(TerminalTaskError, match=expected):
            answer_task(**fields)
    for members, expected in [
        ([_member("link", tarfile.SYMTYPE, "/etc/shadow")], "not a regular file"),
        ([_member("../../etc/cron.d/x")], "archive member"),
        ([_member("/etc/passwd")], "archive member"),
    ]:
        with pytest.raises(TerminalTaskError, match=expected):
            answer_task(archive_b64=_tar(members)).workspace()
    with pytest.raises(TerminalTaskError, match="not base64"):
        answer_task(archive_b64="***").workspace()
    with pytest.raises(TerminalTaskError, match="not a tar archive"):
        answer_task(archive_b64=base64.b64encode(b"plain text").decode()).workspace()


# -- the Terminal-Bench importer -------------------------------------------------------------

def test_import_accepts_tasks_the_sandbox_can_host_and_refuses_the_rest() -> None:
    report = import_tasks(FIXTURES)
    accepted = {t.id: t for t in report.accepted}
    assert sorted(accepted) == ["fix-csv-total", "hello-world"]
    refused = dict(report.refused)
    assert sorted(refused) == ["needs-numpy", "uses-fixtures", "web-with-redis"]
    assert "runs `pip install numpy==2.2.0`" in refused["needs-numpy"]
    assert "2 services (client, redis)" in refused["web-with-redis"]
    assert "test_out takes fixtures (tmp_path)" in refused["uses-fixtures"]
    hello = accepted["hello-world"]
    assert hello.instruction.startswith("Create a file called hello.txt")
    assert 'Path("/work/hello.txt")' in hello.hidden_tests["test_outputs.py"]
    assert hello.time_budget_s == 360.0 and hello.test_timeout_s == 60.0
    assert hello.reference is not None and "hello.txt" in hello.reference
    assert hello.metadata["base_image"].startswith("ghcr.io/laude-institute/t-bench/python-3")
    fix = accepted["fix-csv-total"]
    assert "/work/src/total.py" in fix.instruction  # the older `descriptions` form
    assert "import pytest" not in fix.hidden_tests["test_outputs.py"]  # unused: dropped
    files = fix.workspace()
    assert sorted(files) == ["data.csv", "src/total.py"]
    assert b'open("/work/data.csv")' in files["src/total.py"]  # the work directory, rewritten
    json.dumps(report.as_json())


def _task_dir(root: Path, dockerfile: str = "FROM python:3.12-slim\nWORKDIR /app\n",
              **files: str) -> Path:
    task = root / "t"
    (task / "tests").mkdir(parents=True)
    contents = {"task.yaml": "instruction: do it\n", "Dockerfile": dockerfile,
                "solution.sh": "echo ok\n",
                "tests/test_outputs.py": "def test_ok():\n    assert True\n", **files}
    for rel, text in contents.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


@pytest.mark.parametrize(("dockerfile", "files", "expected"), [
    ("FROM node:20\n", {}, "base image 'node:20'"),
    ("FROM python:3.12\nENV X=1\n", {}, "uses ENV X=1"),
    ("FROM python:3.12\nRUN apt-get update && \\\n    apt-get install -y git\n", {},
     "runs `apt-get update &&"),
    ("FROM python:3.12\nWORKDIR /app\nCOPY tests/ /app/tests/\n", {}, "copies tests/"),
    ("FROM python:3.12\nWORKDIR /app\nCOPY a.txt /etc/a.txt\n", {"a.txt": "x"},
     "outside the work directory"),
    ("FROM python:3.12\nWORKDIR /app\nCOPY missing.txt .\n", {}, "does not have"),
    ("FROM python:3.12\nADD https://x.invalid/a.tgz .\n", {}, "fetches https://"),
    ("FROM python:3.12\nCOPY --from=build /a /b\n", {}, "flags (--from"),
    (None, {"run-tests.sh": "pip install pytest requests\n"}, "packages the sandbox lacks: "
                                                              "requests"),
    (None, {"tests/data.json": "{}"}, "files other than top-level .py"),
    (None, {"tests/test_outputs.py": "import pytest\n\n@pytest.mark.slow\ndef test_a():\n"
                                     "    pass\n"}, "uses pytest helpers"),
    (None, {"task.yaml": "author: x\n"}, "no instruction"),
    (None, {"task.yaml": "- a list\n"}, "task.yaml is not a mapping"),
    (None, {"tests/test_outputs.py": "def test_a(:\n"}, "tests/test_outputs.py does not parse"),
    (None, {"docker-compose.yaml": "services:\n  client:\n    build: .\n    ports: ['80:80']\n"},
     "the service needs ports"),
])
def test_import_refusals_name_the_reason(tmp_path: Path, dockerfile: str | None,
                                         files: dict[str, str], expected: str) -> None:
    task = _task_dir(tmp_path, **({"dockerfile": dockerfile} if dockerfile else {}), **files)
    with pytest.raises(TaskRefused, match=None) as refused:
        import_task_dir(task)
    assert expected in str(refused.value), str(refused.value)


def test_an_unreadable_task_is_refused_and_the_others_imported(tmp_path: Path) -> None:
    good = _task_dir(tmp_path)
    bad = tmp_path / "bad"
    (bad / "tests").mkdir(parents=True)
    (bad / "task.yaml").write_bytes(b"instruction: \xff\xfe\n")
    report = import_tasks(tmp_path)
    assert [t.id for t in report.accepted] == [good.name]
    assert report.refused[0][0] == "bad" and "could not read the task" in report.refused[0][1]


def test_solution_yaml_is_refused(tmp_path: Path) -> None:
    task = _task_dir(tmp_path, **{"solution.yaml": "- command: echo ok\n"})
    (task / "solution.sh").unlink()
    with pytest.raises(TaskRefused, match="solution.yaml"):
        import_task_dir(task)


# -- QC of terminal tasks ----------------------------------------------------------------------

def test_qc_reference_passes_untouched_fails_two_runs_agree(manager: SessionManager) -> None:
    imported = {t.id: t for t in import_tasks(FIXTURES).accepted}
    small = SessionLimits(**LIMITS)
    tasks = [imported["hello-world"].model_copy(update={"limits": small}),
             imported["fix-csv-total"].model_copy(update={"limits": small}),
             answer_task(id="wrong-reference", reference="echo 41 > answer.txt"),
             answer_task(id="always-passes",
                         hidden_tests={"test_t.py": "def test_t():\n    assert True\n"}),
             answer_task(id="flaky", reference="true", hidden_tests={"test_f.py": (
                 "import os\n\nfor _i in range(40):\n    exec(f'def test_{_i}():\\n'\n"
                 "         '    assert os.urandom(1)[0] % 2 == 0\\n')\n")}, split="eval")]
    report = qc_terminal_tasks(manager, tasks, repeats=2)
    by_id = {t["task_id"]: t for t in report["tasks"]}
    for good in ("hello-world", "fix-csv-total"):
        assert by_id[good]["status"] == "ok", by_id[good]
        assert by_id[good]["reference_rewards"] == [1.0, 1.0]
        assert by_id[good]["untouched_reward"] == 0.0 and by_id[good]["deterministic"]
    assert [r["check"] for r in by_id["wrong-reference"]["reasons"]] == ["reference_fails"]
    assert "test_answer.py::test_answer: failed" in by_id["wrong-reference"]["reasons"][0][
        "detail"]
    assert [r["check"] for r in by_id["always-passes"]["reasons"]] == ["untouched_passes"]
    assert "nondeterministic" in [r["check"] for r in by_id["flaky"]["reasons"]]  # 1 - 2^-40
    assert not by_id["flaky"]["deterministic"]
    assert report["blocked"] and report["quarantined_ids"] == [
        t["task_id"] for t in report["tasks"] if t["status"] == "quarantined"]
    assert report["summary"]["by_reason"]["reference_fails"] >= 1
    json.dumps(report)
    # the two good tasks alone pass QC
    assert qc_terminal_tasks(manager, tasks[:2], repeats=2)["passed"]
    assert ToolExecutor  # re-exported for callers (the package's public surface)


def test_a_qc_run_on_a_terminal_environment_version(manager: SessionManager) -> None:
    """What a `qc` run's adapter calls: the stored spec (here read from a dataset version's
    records) to a crucible.qc.terminal/1 report; a record that is not a task blocks the
    version naming the record, and nothing raises."""
    from workers.envs.spec import DatasetRef
    from workers.qc.run import run_qc_spec
    from workers.qc.spec import QcSpec

    good = answer_task(id="good").model_dump(mode="json")
    wrong = answer_task(id="wrong", reference="echo 41 > answer.txt").model_dump(mode="json")
    ref = DatasetRef(dataset="tasks", version=1, digest="a" * 64)
    spec = {"env": {"source": "terminal", "dataset": ref.model_dump()}}
    report = run_qc_spec(spec, QcSpec(repeats=2, quarantine_threshold=0.5),
                         resolve_dataset=lambda r: [good, wrong])
    assert report["schema"] == "crucible.qc.terminal/1" and report["passed"], report
    assert report["quarantined_ids"] == ["wrong"]
    assert report["summary"]["tasks"] == 2 and report["timings"]["total_s"] > 0
    strict = run_qc_spec(spec, QcSpec(repeats=1, quarantine_threshold=0.1),
                         resolve_dataset=lambda r: [good, wrong])
    assert strict["blocked"] and "1 of 2 tasks quarantined" in strict["block_reasons"][0]
    broken = run_qc_spec(spec, QcSpec(), resolve_dataset=lambda r: [good, {"id": "x"}])
    assert broken["blocked"] and "dataset record 2" in broken["block_reasons"][0]
    json.dumps(report)


def test_a_terminal_environment_is_not_loaded_as_plain_tasks() -> None:
    from workers.envs.load import load_environment

    spec = {"env": {"source": "terminal",
                    "tasks": [answer_task(id="t").model_dump(mode="json")]}}
    with pytest.raises(ValueError, match="train on it through load_objective"):
        load_environment(spec)
