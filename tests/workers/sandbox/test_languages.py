"""Every language runs a program that reads stdin, and compile errors come back as CE."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from workers.sandbox import Engine, languages
from workers.sandbox.languages import Language, ToolchainMissing
from workers.sandbox.scoring import calls_request, score, values_equal
from workers.sandbox.spec import CallCase, ExecutionResult, Status

from .programs import ADDERS

# Each program reads one integer and prints twice its value.
DOUBLERS = {
    "python": "n = int(input())\nprint(n * 2)\n",
    "c": '#include <stdio.h>\nint main(void){int n; if(scanf("%d",&n)!=1) return 2;'
         ' printf("%d\\n", n*2); return 0;}\n',
    "cpp": "#include <iostream>\nint main(){int n; std::cin >> n;"
           " std::cout << n*2 << std::endl;}\n",
    "javascript": "const n = parseInt(require('fs').readFileSync(0, 'utf8'));\n"
                  "console.log(n * 2);\n",
    "typescript": "declare function require(m: string): any;\n"
                  "const n: number = parseInt(require('fs').readFileSync(0, 'utf8'));\n"
                  "console.log(n * 2);\n",
    "bash": "read n\necho $((n * 2))\n",
    "rust": "use std::io::Read;\nfn main(){ let mut s = String::new();"
            " std::io::stdin().read_to_string(&mut s).unwrap();"
            " let n: i64 = s.trim().parse().unwrap(); println!(\"{}\", n * 2); }\n",
    "java": "import java.util.Scanner;\npublic class Main { public static void main(String[] a) {"
            " Scanner s = new Scanner(System.in); System.out.println(s.nextInt() * 2); } }\n",
    "go": "package main\nimport \"fmt\"\n"
          "func main(){ var n int; fmt.Scan(&n); fmt.Println(n * 2) }\n",
    "ruby": "n = gets.to_i\nputs n * 2\n",
    "php": "<?php\n$n = intval(trim(fgets(STDIN)));\necho $n * 2, \"\\n\";\n",
    "lua": "local n = io.read('n')\nprint(math.tointeger(n * 2))\n",
}

BROKEN = {
    "c": "int main(void){ return undefined_name; }\n",
    "cpp": "int main(){ undefined_name(); }\n",
    "typescript": "const x: number = 'not a number';\n",
    "rust": "fn main(){ let x: i32 = \"s\"; }\n",
    "java": "public class Main { public static void main(String[] a) { int x = \"s\"; } }\n",
    "go": "package main\nfunc main(){ var x int = \"s\" }\n",
}


def _require(language: str) -> None:
    try:
        languages.get(language)
    except ToolchainMissing as exc:
        pytest.skip(str(exc))


def test_at_least_eight_languages_are_known() -> None:
    assert len(languages.LANGUAGE_TABLE) >= 8
    assert set(DOUBLERS) == set(languages.LANGUAGE_TABLE)


@pytest.mark.parametrize("language", sorted(DOUBLERS))
def test_language_runs_a_program_with_stdin(
    run: Callable[..., ExecutionResult], language: str
) -> None:
    _require(language)
    result = run(language, DOUBLERS[language], stdin="21\n")
    assert result.status == Status.OK, (result.message, result.stderr)
    assert result.stdout.strip() == "42"
    assert result.exit_code == 0
    assert result.wall_ms > 0 and result.peak_memory_bytes > 0
    if languages.LANGUAGE_TABLE[language].compile:
        assert result.compile is not None and result.compile.status == Status.OK


@pytest.mark.parametrize("language", sorted(BROKEN))
def test_compile_error_is_ce_with_the_compilers_message(
    run: Callable[..., ExecutionResult], language: str
) -> None:
    _require(language)
    result = run(language, BROKEN[language])
    assert result.status == Status.CE
    assert result.compile is not None and result.compile.status == Status.CE
    diagnostics = (result.compile.stderr + result.compile.stdout).strip()
    assert "main." in diagnostics.lower()  # the compiler points at the source file
    assert diagnostics[:60] in result.message


def test_missing_toolchain_names_what_to_install(tmp_path) -> None:
    fake = Language("cobol", "main.cob", ("cobc",), requires=(str(tmp_path / "cobc"),),
                    install_hint="apt-get install gnucobol")
    with pytest.raises(ToolchainMissing, match="apt-get install gnucobol"):
        languages.get("cobol", {"cobol": fake})


def test_a_root_only_toolchain_is_not_usable(tmp_path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "cc").write_text("")
    (private / "cc").chmod(0o755)
    private.chmod(0o700)
    lang = Language("x", "x", ("x",), requires=(str(private / "cc"),))
    assert lang.missing() == [str(private / "cc")]


def test_runtime_error_reports_exit_code_and_stderr(run: Callable[..., ExecutionResult]) -> None:
    result = run("python", "import sys\nprint('partial')\nsys.exit(3)\n")
    assert result.status == Status.RE
    assert result.exit_code == 3 and result.signal is None
    assert result.stdout == "partial\n"

    crash = run("c", "#include <signal.h>\nint main(void){ raise(SIGSEGV); return 0; }\n")
    assert crash.status == Status.RE
    assert crash.signal == 11

    high = run("python", "raise SystemExit(137)\n")
    assert (high.status, high.exit_code, high.signal) == (Status.RE, 137, None)
    assert run("bash", "exit 255").exit_code == 255


# (language, program exiting with 130, program killed by a signal, that signal)
EXIT_VS_SIGNAL = [
    ("python", "import sys\nsys.exit(130)\n",
     "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", 15),
    ("python", "import os\nprint('x', flush=True)\nos._exit(130)\n",
     "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", 9),
    ("c", "#include <stdlib.h>\nint main(void){ exit(130); }\n",
     "#include <signal.h>\nint main(void){ raise(SIGINT); return 0; }\n", 2),
    ("bash", "exit 130\n", "kill -TERM $$\n", 15),
    ("javascript", "process.exit(130);\n", "process.kill(process.pid, 'SIGTERM');\n", 15),
    ("ruby", "exit 130\n", "Process.kill('TERM', Process.pid)\nsleep 5\n", 15),
    ("php", "<?php exit(130);\n", "<?php\nwhile (true) { usleep(1000); }\n", None),
    ("lua", "os.exit(130)\n", "os.execute('kill -TERM $PPID')\nwhile true do end\n", None),
]


@pytest.mark.parametrize(("language", "exits", "killed", "signal_no"), EXIT_VS_SIGNAL,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(EXIT_VS_SIGNAL)])
def test_exit_status_129_to_192_is_not_mistaken_for_a_signal(
    run: Callable[..., ExecutionResult], language: str, exits: str, killed: str, signal_no: int
) -> None:
    _require(language)
    exited = run(language, exits)
    assert (exited.status, exited.exit_code, exited.signal) == (Status.RE, 130, None)
    assert exited.message == "exit code 130"
    if signal_no is None:  # no portable way for the program to signal itself
        return
    died = run(language, killed)
    assert (died.status, died.exit_code, died.signal) == (Status.RE, None, signal_no)
    assert died.message == f"killed by signal {signal_no}"


def test_a_program_starts_with_no_signal_blocked_or_ignored(
    run: Callable[..., ExecutionResult]
) -> None:
    """Whatever the engine's own process had (here: SIGINT and SIGUSR1 blocked in the calling
    thread, SIGQUIT ignored; Ray's child processes block SIGINT), the program starts clean:
    exec keeps both, and a program whose raise(SIGINT) was blocked "exited 0" (seen in CI)."""
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR1})
    old_quit = signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        seen = run("bash", "grep -E '^Sig(Blk|Ign):' /proc/self/status\n")
        died = run("python", "import os, signal, time\n"
                             "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                             "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(2)\n")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGQUIT, old_quit)
    assert seen.stdout.split() == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16], seen.stdout
    assert (died.status, died.signal) == (Status.RE, signal.SIGINT)


def test_a_forked_child_exiting_does_not_end_the_run(run: Callable[..., ExecutionResult]) -> None:
    code = ("import os, sys, time\nif os.fork() == 0:\n    sys.exit(3)\n"
            "os.wait()\ntime.sleep(0.05)\nprint('parent finished')\nsys.exit(5)\n")
    result = run("python", code)
    assert (result.stdout, result.exit_code) == ("parent finished\n", 5)


ADD_CALLS = [
    CallCase(function="add", args=[2, 3], expected=5),
    CallCase(function="add", args=[[1, "x"], [2.5]], expected=[1, "x", 2.5]),
    CallCase(function="add", args=[0.1, 0.2], expected=0.3, comparison="tolerant"),
    CallCase(function="add", args=[1, 1], expected=3),  # wrong on purpose: 2 != 3
]


@pytest.mark.parametrize("language", sorted(ADDERS))
def test_call_cases_are_graded_by_value_by_the_supervisor(engine: Engine, language: str) -> None:
    _require(language)
    result = engine.execute(calls_request(language, ADDERS[language], ADD_CALLS))
    assert [c.passed for c in result.calls] == [True, True, True, False], result
    assert result.calls[3].got == "2" and result.calls[3].error == "wrong result"
    assert score(result) == 0.75 and result.verdict == "failed"
    assert result.verdict_detail == "add: wrong result (returned 2)"
    missing = engine.execute(calls_request(language, ADDERS[language],
                                           [CallCase(function="sub", args=[1, 1], expected=0)]))
    assert not missing.calls[0].passed and "raise" in missing.calls[0].error


def test_values_are_compared_on_plain_data() -> None:
    assert values_equal(1, 1.0) and values_equal([1, (2, 3)], [1, [2, 3]])
    assert not values_equal(True, 1) and not values_equal(1, True)
    assert not values_equal("1", 1) and not values_equal(None, 0)
    assert values_equal({"a": [1]}, {"a": [1]}) and not values_equal({"a": 1}, {"b": 1})
    assert not values_equal([1, 2], [1, 2, 3])
    assert values_equal(0.1 + 0.2, 0.3, tolerant=True) and not values_equal(0.1 + 0.2, 0.3)
    assert values_equal(float("nan"), float("nan")) and not values_equal(float("nan"), 1.0)
    assert not values_equal({1, 2}, [1, 2])  # a set is not a list
