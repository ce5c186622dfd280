"""Results, limits, unit tests through the test driver, stdin/stdout cases, traces, batches,
pool."""

from __future__ import annotations

from collections.abc import Callable

from workers.sandbox import Engine, EngineConfig, ExecutionRequest
from workers.sandbox.process import parse_status
from workers.sandbox.scoring import assert_request, humaneval_request, score, stdio_request
from workers.sandbox.spec import ExecutionResult, Limits, Status, StdioCase, TraceOptions

Run = Callable[..., ExecutionResult]


def test_ok_result_carries_output_and_measurements(run: Run) -> None:
    result = run("python", "import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    assert result.status == Status.OK
    assert (result.stdout, result.stderr) == ("out\n", "err\n")
    assert result.exit_code == 0 and result.signal is None
    assert not result.stdout_truncated and not result.stderr_truncated
    assert result.peak_memory_bytes > 0


def test_argv_and_extra_files_reach_the_program(run: Run) -> None:
    code = "import sys\nprint(sys.argv[1:], open('data/in.txt').read())\n"
    result = run("python", code, argv=["a", "b"], files={"data/in.txt": "hello"})
    assert result.stdout == "['a', 'b'] hello\n"


def test_output_is_truncated_to_the_limit(run: Run) -> None:
    result = run("python", "print('x' * 100000)\n", limits=Limits(output_bytes=1000))
    assert result.status == Status.OLE
    assert result.stdout_truncated
    assert len(result.stdout) == 1000


def test_stdio_cases_compile_once_and_compare_each(engine: Engine) -> None:
    code = "#include <stdio.h>\nint main(void){double a,b; scanf(\"%lf %lf\",&a,&b);" \
           " printf(\"%.9f\\n\", a/b); return 0;}\n"
    cases = [
        StdioCase(stdin="1 3", expected_stdout="0.333333333\n"),
        StdioCase(stdin="2 3", expected_stdout="0.6666666", comparison="tolerant"),
        StdioCase(stdin="1 4", expected_stdout="0.3"),
    ]
    result = engine.execute(stdio_request("c", code, cases))
    assert [c.passed for c in result.cases] == [True, True, False]
    assert result.compile is not None and result.compile.status == Status.OK
    assert score(result) == 2 / 3


def test_stdio_cases_in_python_use_separate_sandboxes(engine: Engine) -> None:
    code = "import os\nn = int(input())\nprint(n + len(os.listdir('.')))\n"
    cases = [StdioCase(stdin="1", expected_stdout="2"), StdioCase(stdin="5", expected_stdout="6")]
    result = engine.execute(stdio_request("python", code, cases))
    assert [c.passed for c in result.cases] == [True, True]


def test_assert_tests_pass_and_fail(engine: Engine) -> None:
    good = engine.execute(assert_request("python", "def add(a, b):\n    return a + b\n",
                                         "assert add(2, 3) == 5\n"))
    assert good.tests_passed is True and score(good) == 1.0
    bad = engine.execute(assert_request("python", "def add(a, b):\n    return a - b\n",
                                        "assert add(2, 3) == 5\n"))
    assert bad.tests_passed is False and bad.status == Status.RE
    # The assertion failed in the test driver's process, not the candidate's: its verdict says
    # so (with the tests' line number, never their text) and the candidate's stderr is its own.
    assert bad.verdict == "failed" and good.verdict == "passed"
    assert "a test assertion failed (tests line 1)" in bad.message
    assert "assert" not in bad.stderr


def test_javascript_assert_tests_run_in_the_driver(engine: Engine) -> None:
    tests = "const assert = require('assert');\nassert.strictEqual(add(2, 3), 5);\n"
    code = "function add(a, b) { return a + b; }"
    good = engine.execute(assert_request("javascript", code, tests))
    assert good.tests_passed is True
    early = engine.execute(assert_request(
        "javascript", "function add(a, b) { return a - b; }\nprocess.exit(0);", tests))
    assert early.tests_passed is False and score(early) == 0.0


def test_humaneval_style_check_program(engine: Engine) -> None:
    prompt = "def inc(x):\n    \"\"\"Add one.\"\"\"\n"
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"
    assert score(engine.execute(humaneval_request(prompt, "    return x + 1\n", test, "inc"))) == 1
    assert score(engine.execute(humaneval_request(prompt, "    return x\n", test, "inc"))) == 0


def test_trace_records_lines_locals_and_the_stack_at_an_exception(run: Run) -> None:
    code = "def f(x):\n    y = x * 2\n    return 10 // (y - 6)\n\nf(3)\n"
    result = run("python", code, trace=TraceOptions())
    trace = result.trace
    assert trace is not None and result.status == Status.RE
    assert trace.exception is not None and trace.exception.startswith("ZeroDivisionError")
    lines = [(e.function, e.line) for e in trace.events if e.event == "line"]
    assert ("f", 2) in lines and ("f", 3) in lines
    assert trace.stack[-1].function == "f" and trace.stack[-1].locals["y"] == "6"
    assert "ZeroDivisionError" in trace.render()


def test_trace_is_capped_in_events(run: Run) -> None:
    result = run("python", "for i in range(100000):\n    pass\n",
                 trace=TraceOptions(max_events=50))
    assert result.status == Status.OK
    assert result.trace is not None and result.trace.truncated
    assert len(result.trace.events) <= 50


def test_batch_keeps_order_under_concurrency(engine: Engine) -> None:
    requests = [ExecutionRequest(language="python", code=f"print({i} * {i})") for i in range(8)]
    results = engine.execute_batch(requests, concurrency=3)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


def test_warm_sandboxes_are_single_use() -> None:
    with Engine(EngineConfig(pool_size=1, warm_languages=("python",))) as eng:
        assert eng.warm_up("python")
        first = eng.execute(ExecutionRequest(
            language="python", code="open('/tmp/left', 'w').write('x')\nopen('left', 'w')\n"))
        second = eng.execute(ExecutionRequest(
            language="python", code="import os\nprint(os.path.exists('/tmp/left'),"
                                    " os.path.exists('left'), os.getpid())\n"))
    assert first.status == Status.OK
    assert second.stdout.split()[:2] == ["False", "False"]


def test_warm_up_waits_until_the_pooled_interpreters_have_started() -> None:
    import select

    with Engine(EngineConfig(pool_size=2, warm_languages=("python",))) as eng:
        assert eng.warm_up("python")
        pool = eng._pools[("python", "plain")]
        for warm in list(pool._ready):
            # the bootstrap's READY line is already waiting on the feedback pipe
            poller = select.poll()
            poller.register(warm.proc.feedback_r, select.POLLIN)
            assert poller.poll(0)
        result = eng.execute(ExecutionRequest(language="python", code="print('READY')"))
    assert result.status == Status.OK and result.stdout == "READY\n"


def test_missing_toolchain_is_a_sandbox_error_not_an_exception(engine: Engine) -> None:
    from workers.sandbox import languages

    saved = languages.LANGUAGE_TABLE["bash"]
    languages.LANGUAGE_TABLE["bash"] = languages.Language(
        "bash", "main.sh", ("/nonexistent/bash",), requires=("/nonexistent/bash",),
        install_hint="apt-get install bash")
    try:
        result = engine.execute(ExecutionRequest(language="bash", code="echo hi"))
    finally:
        languages.LANGUAGE_TABLE["bash"] = saved
    assert result.status == Status.SANDBOX_ERROR
    assert "apt-get install bash" in result.message


def test_large_stdin_is_streamed_and_unread_stdin_is_harmless(run: Run) -> None:
    data = "".join(f"{i}\n" for i in range(200_000))  # ~1.3 MB, far beyond a pipe buffer
    echoed = run("python", "import sys\nsys.stdout.write(sys.stdin.read())\n", stdin=data,
                 limits=Limits(output_bytes=4 << 20))
    assert echoed.status == Status.OK and echoed.stdout == data
    ignored = run("c", "int main(void){ return 0; }\n", stdin=data)
    assert ignored.status == Status.OK


def test_module_level_entry_points() -> None:
    from workers.sandbox import execute, execute_batch

    assert execute(ExecutionRequest(language="python", code="print(6 * 7)")).stdout == "42\n"
    results = execute_batch([ExecutionRequest(language="bash", code=f"echo {i}") for i in range(3)])
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]


def test_status_records_are_parsed_only_when_well_formed() -> None:
    assert parse_status("EXIT", "130") == (130, None)
    assert parse_status("SIGNAL", "11") == (None, 11)
    assert parse_status("EXIT", "256") == (0, None)  # status & 0xFF
    for kind, value in (("EXIT", "x"), ("EXIT", ""), ("SIGNAL", "0"), ("SIGNAL", "300"),
                        ("PASS", "0"), ("EXIT", "0000")):
        assert parse_status(kind, value) is None, (kind, value)


def test_a_grader_keys_drivers_are_fresh_copies_and_a_hung_one_is_killed(engine: Engine) -> None:
    """Executions of one grader key share a zygote that forks each driver: what one
    execution's tests leave behind (a builtin, a module attribute) is gone in the next, and a
    driver stuck in its own tests is killed without taking the zygote down."""
    code = "def add(a, b):\n    return a + b\n"
    taint = ("import builtins, math\nbuiltins.LEFT_BEHIND = 1\nmath.pi = 3\n"
             "assert add(1, 2) == 3\n")
    check = ("import builtins, math\nassert not hasattr(builtins, 'LEFT_BEHIND')\n"
             "assert math.pi > 3.14\nassert add(2, 2) == 4\n")
    first = engine.execute(assert_request("python", code, taint, grader_key="k-fresh"))
    second = engine.execute(assert_request("python", code, check, grader_key="k-fresh"))
    assert first.verdict == second.verdict == "passed", (first, second)
    hung = engine.execute(assert_request("python", code, "while True:\n    pass\n",
                                         Limits(wall_ms=800), grader_key="k-fresh"))
    assert hung.tests_passed is False and hung.verdict == "timeout"
    after = engine.execute(assert_request("python", code, "assert add(1, 1) == 2\n",
                                          grader_key="k-fresh"))
    assert after.verdict == "passed", after
