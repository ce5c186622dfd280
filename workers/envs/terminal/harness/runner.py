# The trusted test runner of terminal tasks. Not imported by the host: its source is sent to
# `/usr/bin/python3 -I -S` inside a sandbox session on stdin, with the tests and a nonce, so
# nothing of it is a file the workspace could replace. Standard library only (the sandbox's
# system Python has no pytest).
#
# What the workspace cannot do to it (docs/agents.md, "Hidden tests"):
# - -I -S: no PYTHON* variables, no site (so no sitecustomize/usercustomize/.pth), no cwd or
#   script directory on sys.path; a finder refuses any module that would load from /work.
# - it makes itself non-dumpable first, so other processes of the session (same uid) can
#   neither ptrace it nor open /proc/<pid>/fd or /proc/<pid>/mem;
# - its verdict goes out on a close-on-exec duplicate of the original stdout, while fds 1 and 2
#   are pointed at a scratch file before any test runs: programs the tests start (the
#   candidate's) inherit the scratch file, never the verdict pipe;
# - the verdict carries the nonce the host sent on stdin; the host takes nothing else.
import ctypes
import json
import os
import signal
import sys
import time
import traceback

WORK = "/work"


def _guard_imports():
    import importlib.abc
    import importlib.machinery

    class NoWorkspaceImports(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            where = [getattr(spec, "origin", None) or "",
                     *(getattr(spec, "submodule_search_locations", None) or [])]
            if spec is not None and any(str(w).startswith(WORK) for w in where):
                raise ImportError(f"hidden tests may not import workspace code ({name}); "
                                  "run the program as a subprocess instead")
            return None

    sys.path[:] = [p for p in sys.path if p and not p.startswith(WORK)]
    sys.meta_path.insert(0, NoWorkspaceImports())


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run(msg):
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4, off
    verdict_fd = os.dup(1)
    os.set_inheritable(verdict_fd, False)
    log_path = f"/tmp/.crucible-test-output-{os.getpid()}"
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - for the process' life
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    _guard_imports()
    os.chdir(WORK)
    per_test = float(msg.get("per_test_s") or 60)
    signal.signal(signal.SIGALRM, _alarm)
    modules, results = [], []
    for name, source in sorted(msg["tests"].items()):  # every test compiled before any runs
        namespace = {"__name__": name[:-3], "__file__": "/grader/" + name}
        try:
            exec(compile(source, "/grader/" + name, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - a module that fails to load fails its tests
            results.append({"test": name, "outcome": "error",
                            "message": f"{type(exc).__name__}: {exc}"})
            continue
        modules.append((name, namespace))
    for name, namespace in modules:
        for key, fn in list(namespace.items()):
            if not (key.startswith("test") and callable(fn)
                    and getattr(fn, "__module__", None) == name[:-3]):
                continue
            started = time.monotonic()
            outcome, message = "passed", ""
            signal.setitimer(signal.ITIMER_REAL, per_test)
            try:
                fn()
            except _Timeout:
                outcome, message = "failed", f"timed out after {per_test:.0f} s"
            except AssertionError as exc:
                outcome = "failed"
                message = "".join(traceback.format_exception(exc)[-3:])[-2000:]
            except BaseException as exc:  # noqa: BLE001 - SystemExit from a test is a failure
                outcome = "error"
                message = "".join(traceback.format_exception(exc)[-3:])[-2000:]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            results.append({"test": f"{name}::{key}", "outcome": outcome,
                            "message": message,
                            "seconds": round(time.monotonic() - started, 3)})
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 8000))
        output = f.read().decode(errors="replace")
    verdict = json.dumps({"nonce": msg["nonce"], "results": results, "output": output})
    data = verdict.encode() + b"\n"
    while data:
        data = data[os.write(verdict_fd, data):]
    os._exit(0)


run(MSG)  # type: ignore[name-defined]  # noqa: F821 - the bootstrap gives MSG
