# Warm-sandbox bootstrap for Python: started before a request exists, it blocks on the control
# pipe, then runs /work/main.py as __main__ (optionally followed by tests and under a tracer) and
# reports on the feedback pipe, each line prefixed with the per-execution nonce. It reports the
# exit status itself (EXIT <code>), on every way out Python code has, os._exit included, so an
# exit(130) is exact; a process that reports nothing died of a signal, which bwrap's status
# (128 + N) then tells. Only the original process reports: a forked child unwinding through
# this code (sys.exit in a child) must not end the run or claim the verdict.
# Only built-in or already-loaded modules here: every import is paid for by every sandbox
# (json alone would cost more CPU than the rest of the bootstrap). The host sends marshal data.
import builtins
import marshal
import posix  # not os: with -S, os (and posixpath, stat, ...) is not loaded yet
import sys


def _boot(ctl_fd, feedback_fd):
    # Start-up is over: the host may count this sandbox as ready (nothing else reads this line).
    posix.write(feedback_fd, b"READY\n")
    chunks = []
    while True:
        chunk = posix.read(ctl_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    posix.close(ctl_fd)
    msg = marshal.loads(b"".join(chunks))
    nonce = msg["nonce"]
    me = posix.getpid()

    def report(kind, payload=""):
        if posix.getpid() != me:
            return
        data = f"{nonce} {kind} {payload}\n".encode()
        while data:
            data = data[posix.write(feedback_fd, data):]

    real_exit = posix._exit

    def _exit(status):
        # os._exit skips everything below: report first (unflushed output is lost, as it would
        # be anyway). os is not imported yet (-S), so `from posix import *` picks this up.
        if isinstance(status, int):
            report("EXIT", str(status & 0xFF))
        real_exit(status)

    posix._exit = _exit

    posix.chdir("/work")
    sys.argv = ["main.py", *msg.get("argv", [])]
    # -S skipped site (start-up cost); keep what it would have added for system packages.
    sys.path[:0] = ["/work"]
    sys.path += ["/usr/local/lib/python3/dist-packages", "/usr/lib/python3/dist-packages"]
    main = type(sys)("__main__")
    main.__file__ = "/work/main.py"
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    with open("/work/main.py", encoding="utf-8") as fh:
        source = fh.read()
    tests = msg.get("tests")
    tracer = _Tracer(msg["trace"]) if msg.get("trace") else None
    code = 0
    try:
        program = compile(source, "/work/main.py", "exec")
        test_code = compile(tests, "/work/tests.py", "exec") if tests is not None else None
        if tracer:
            sys.settrace(tracer.global_trace)
        try:
            exec(program, main.__dict__)
        finally:
            sys.settrace(None)
        if test_code is not None:
            exec(test_code, main.__dict__)
            _finish()
            report("PASS")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter would
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if tracer:
            tracer.exception(exc, tb)
        code = 1
    if tracer:
        import json

        report("TRACE", json.dumps(tracer.result()))
    _finish()
    # The exit status goes out before the interpreter's slow finalisation, which is skipped:
    # the supervisor ends the run as soon as it reads this line.
    report("EXIT", str(code))
    real_exit(code)


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish():
    """What interpreter shutdown would do: join threads, run atexit, flush."""
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib is not worth its import time here
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stdout must not hide the exit status
            pass


class _Tracer:
    """Line path, local snapshots and the stack at an exception, capped in events and bytes."""

    def __init__(self, opts):
        self.max_events = opts.get("max_events", 2000)
        self.max_bytes = opts.get("max_bytes", 256 << 10)
        self.snapshot = opts.get("snapshot_locals", True)
        self.max_repr = opts.get("max_repr", 80)
        self.events = []
        self.size = 0
        self.truncated = False
        self.exc = None
        self.stack = []

    def _locals(self, frame):
        out = {}
        for key, value in list(frame.f_locals.items())[:20]:
            if key.startswith("__"):
                continue
            try:
                text = repr(value)
            except Exception:  # noqa: BLE001 - a broken __repr__ must not break the trace
                text = "<unrepresentable>"
            out[key] = text if len(text) <= self.max_repr else text[: self.max_repr - 3] + "..."
        return out

    def _add(self, event, frame, with_locals):
        if self.truncated:
            return
        item = [event, frame.f_code.co_name, frame.f_lineno]
        if with_locals and self.snapshot:
            item.append(self._locals(frame))
        size = len(repr(item))
        if len(self.events) >= self.max_events or self.size + size > self.max_bytes:
            self.truncated = True
            sys.settrace(None)
            return
        self.size += size
        self.events.append(item)

    def global_trace(self, frame, event, arg):
        if self.truncated or frame.f_code.co_filename != "/work/main.py":
            return None
        self._add("call", frame, True)
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if self.truncated:
            return None
        if event == "line":
            self._add("line", frame, True)
        elif event == "return":
            self._add("return", frame, False)
        elif event == "exception":
            self._add("exception", frame, True)
        return self.local_trace

    def exception(self, exc, tb):
        self.exc = f"{type(exc).__name__}: {exc}"[:1000]
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename in ("/work/main.py", "/work/tests.py"):
                self.stack.append([frame.f_code.co_name, tb.tb_lineno, self._locals(frame)])
            tb = tb.tb_next

    def result(self):
        return {"events": self.events, "truncated": self.truncated, "exception": self.exc,
                "stack": self.stack}


_boot(int(sys.argv[1]), int(sys.argv[2]))
del _boot
