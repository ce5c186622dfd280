# Warm-sandbox bootstrap for Python (runner.py prepends wire.py, the by-value codec, to this
# source). Started before a request exists, it blocks on the control pipe, then does one of:
#
#   run    run /work/main.py as __main__ (optionally under a tracer), as a plain program;
#   serve  the candidate side of a graded execution: load /work/main.py, send the names of its
#          callables to the driver over the link pipe, then answer calls by value until the
#          driver closes the pipe. It never sees the tests, and nothing it sends is trusted;
#   drive  the grader side, in its own sandbox under its own uid: run the task's trusted
#          prelude and its tests with the candidate's functions bound to proxies that call
#          across the link, compare on plain data here, and report the verdict on the feedback
#          pipe in a record carrying the verdict key (which the candidate never sees);
#   zygote the same driver for many executions of one grader key: it forks a fresh copy of
#          itself per execution (see _zygote), which costs far less than a new interpreter.
#
# Records on the feedback pipe are framed (magic, 4-byte length, payload), so nothing a program
# prints can be taken for one, and a record cannot be glued onto another. In run and serve mode
# the writer is the candidate's own process, so its records (READY, TRACE) carry nothing the
# verdict depends on; the exit status comes from the status waiter, PID 1 of the sandbox. Only
# the original process writes a TRACE (a forked child unwinding through this code must not).
# Only built-in or already-loaded modules here: every import is paid for by every sandbox.
import builtins
import marshal
import posix  # not os: with -S, os (and posixpath, stat, ...) is not loaded yet
import sys

_MAGIC = b"CRF1"


def _record(fd, body):
    data = _MAGIC + len(body).to_bytes(4, "big") + body
    while data:
        data = data[posix.write(fd, data):]


def _boot(ctl_fd, feedback_fd, link_in, link_out):
    # Start-up is over: the host may count this sandbox as ready.
    _record(feedback_fd, b"READY")
    chunks = []
    while True:
        chunk = posix.read(ctl_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    posix.close(ctl_fd)
    msg = marshal.loads(b"".join(chunks))
    mode = msg.get("mode", "run")
    if mode == "drive":
        _drive(msg, feedback_fd, link_in, link_out)
        return
    if mode == "zygote":
        _zygote(link_in)
        return
    for fd in (link_in, link_out):
        if fd >= 0 and mode != "serve":
            posix.close(fd)
    me = posix.getpid()

    def report(kind, payload=""):
        if posix.getpid() == me:
            _record(feedback_fd, f"{kind} {payload}".encode())

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
    tracer = _Tracer(msg["trace"]) if msg.get("trace") else None
    code = 0
    loaded = False
    try:
        program = compile(source, "/work/main.py", "exec")
        if tracer:
            sys.settrace(tracer.global_trace)
        try:
            exec(program, main.__dict__)
        finally:
            sys.settrace(None)
        loaded = True
        if mode == "serve":
            _serve(main.__dict__, link_in, link_out)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter would
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if tracer:
            tracer.exception(exc, tb)
        if mode == "serve" and not loaded:
            _send(link_out, ["loadfail", type(exc).__name__, str(exc)[:500]])
        code = 1
    if tracer:
        report("TRACE", dumps(tracer.result()))  # noqa: F821 - wire.py, prepended
    _finish()
    # The status waiter (PID 1, outside this process's reach) reports how this process ended;
    # the interpreter's slow finalisation is skipped.
    posix._exit(code)


def _send(fd, message):
    try:
        data = frame(dumps(message))  # noqa: F821 - wire.py, prepended
    except WireError as exc:  # noqa: F821
        data = frame(dumps(["error", str(exc)[:500]]))  # noqa: F821
    while data:
        data = data[posix.write(fd, data):]


def _serve(namespace, link_in, link_out):
    """Answer the driver's calls by value until it closes the link."""
    names = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("__"))
    _send(link_out, ["names", names])
    while True:
        body = read_frame(link_in, posix.read)  # noqa: F821 - wire.py, prepended
        if body is None:
            return
        try:
            op, name, args, kwargs = loads(body)  # noqa: F821
        except Exception as exc:  # noqa: BLE001 - a malformed request is answered, not fatal
            _send(link_out, ["error", f"bad request: {type(exc).__name__}"])
            continue
        fn = namespace.get(name) if op == "call" and type(name) is str else None
        if not callable(fn):
            _send(link_out, ["raise", "NameError", f"no function {str(name)[:80]!r} is defined"])
            continue
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the driver decides what an exception means
            _send(link_out, ["raise", type(exc).__name__, str(exc)[:500]])
            continue
        _send(link_out, ["ok", result])


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


# -- the driver ----------------------------------------------------------------------------------

class _Gone(Exception):
    """The candidate closed the link (it exited, crashed or was killed)."""


class _BadReply(Exception):
    """The candidate answered with something that is not a well-formed reply."""


class CandidateError(Exception):
    """An exception the candidate raised that is not a builtin exception type."""


def _drive(msg, feedback_fd, link_in, link_out):
    key = msg["key"]
    posix.chdir("/tmp")

    def verdict(kind, detail=""):
        # The key proves the record is this driver's: only it and the supervisor know it.
        _record(feedback_fd, f"VERDICT {key} {kind} {detail}".encode())

    last = []  # the latest call and its result, for feedback: inputs, never expected values

    def call(name, args, kwargs):
        last[:] = [name, args, kwargs, None]
        try:
            data = frame(dumps(["call", name, list(args), kwargs]))  # noqa: F821
        except WireError as exc:  # noqa: F821 - an argument the test built cannot cross
            raise TypeError(f"cannot pass to the candidate: {exc}") from None
        try:
            _send_raw(link_out, data)
        except OSError:  # EPIPE: the candidate is gone
            raise _Gone() from None
        try:
            body = read_frame(link_in, posix.read)  # noqa: F821
            if body is None:
                raise _Gone()
            reply = loads(body)  # noqa: F821
        except WireError as exc:  # noqa: F821
            raise _BadReply(str(exc)) from None
        if type(reply) is not list or not reply or reply[0] not in ("ok", "raise", "error"):
            raise _BadReply("not a reply")
        if reply[0] == "ok" and len(reply) == 2:
            last[3] = reply[1]
            return reply[1]
        if reply[0] == "raise" and len(reply) == 3 and type(reply[1]) is str:
            cls = getattr(builtins, reply[1], None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = CandidateError
            raise cls(str(reply[2])[:500])
        raise _BadReply(str(reply[1:])[:200])

    class Remote:
        """A candidate function: arguments and results cross by value."""

        __slots__ = ("__name__",)

        def __init__(self, name):
            self.__name__ = name

        def __call__(self, *args, **kwargs):
            return call(self.__name__, args, kwargs)

        def __repr__(self):
            return f"<candidate function {self.__name__}>"

    try:
        first = read_frame(link_in, posix.read)  # noqa: F821
        hello = loads(first) if first is not None else None  # noqa: F821
    except WireError:  # noqa: F821
        hello = ["bad"]
    if hello is None:
        verdict("exited", "the candidate exited before its functions could be called")
        posix._exit(0)
    if type(hello) is list and hello[:1] == ["loadfail"]:
        verdict("failed", f"the candidate raised {str(hello[1])[:80]} while loading")
        posix._exit(0)
    if not (type(hello) is list and len(hello) == 2 and hello[0] == "names"
            and type(hello[1]) is list):
        verdict("failed", "the candidate did not announce its functions")
        posix._exit(0)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        if msg.get("prelude"):
            exec(compile(msg["prelude"], "/grader/prelude.py", "exec"), namespace)
        tests = compile(msg.get("tests") or "", "/grader/tests.py", "exec")
    except BaseException as exc:  # noqa: BLE001 - the task's own code is broken
        verdict("driver_error", f"the task's grader code failed: {type(exc).__name__}")
        posix._exit(0)
    announced = [n for n in hello[1]
                 if type(n) is str and n.isidentifier() and not n.startswith("__")]
    # Names the tests must reach in the candidate even where the prelude defines them (a
    # HumanEval prompt's stub of the entry point); every other candidate name only where
    # neither the prelude nor the builtins define it, so a candidate's own `len` or a helper
    # the prelude provides (HumanEval's `poly`) never shadows what the tests rely on.
    for name in msg.get("bind") or ():
        namespace[name] = Remote(name)
    for name in announced:
        if name not in namespace and not hasattr(builtins, name):
            namespace[name] = Remote(name)
    try:
        exec(tests, namespace)
    except _Gone:
        verdict("exited", "the candidate exited while a test was calling it")
    except _BadReply as exc:
        verdict("failed", f"the candidate sent a malformed reply ({str(exc)[:120]})")
    except AssertionError as exc:
        verdict("failed", f"a test assertion failed{_test_line(exc)}{_last_call(last)}")
    except BaseException as exc:  # noqa: BLE001 - anything else the tests did not expect
        verdict("failed", f"{type(exc).__name__} in the tests{_test_line(exc)}{_last_call(last)}")
    else:
        verdict("passed")
    posix._exit(0)


def _zygote(sock_fd):
    """A driver that forks: each request on the socket (marshal data, with the execution's
    link fds and a verdict pipe passed as SCM_RIGHTS) gets a fresh copy of this process, which
    drives that one execution and exits, so no execution sees another's state. The parent only
    forks; it never runs test code. Only executions of one grader key (one environment) share a
    zygote, since its copies share its sandbox."""
    import _signal
    import _socket

    sock = _socket.socket(fileno=sock_fd)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)  # children are reaped by the kernel
    while True:
        try:
            data, ancdata, _, _ = sock.recvmsg(1 << 22, _socket.CMSG_SPACE(4 * 4))
        except OSError:
            break
        if not data:
            break
        fds = []
        for level, kind, payload in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(payload[i:i + 4], "little")
                        for i in range(0, len(payload) - len(payload) % 4, 4)]
        msg = marshal.loads(data)
        if "kill" in msg:
            try:  # noqa: SIM105 - contextlib is not worth its import time here
                posix.kill(int(msg["kill"]), 9)
            except OSError:
                pass
            continue
        if len(fds) != 3:
            for fd in fds:
                posix.close(fd)
            continue
        pid = posix.fork()
        if pid == 0:
            sock.close()
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            # Nobody reads the zygote's stdout: a test that prints must not fill the pipe.
            null = posix.open("/dev/null", posix.O_WRONLY)
            posix.dup2(null, 1)
            posix.dup2(null, 2)
            posix.close(null)
            link_in, link_out, verdict_fd = fds
            _record(verdict_fd, f"PID {posix.getpid()}".encode())
            _drive(msg, verdict_fd, link_in, link_out)
        for fd in fds:
            posix.close(fd)
    posix._exit(0)


def _send_raw(fd, data):
    while data:
        data = data[posix.write(fd, data):]


def _last_call(last):
    """'; last call: f(1, 2) returned 4': what the candidate was asked and answered."""
    if not last:
        return ""
    name, args, kwargs, result = last
    try:
        shown = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        text = f"; last call: {name}({shown}) returned {result!r}"
    except Exception:  # noqa: BLE001 - a value the grader cannot show is not worth failing on
        return ""
    return text if len(text) <= 300 else text[:297] + "..."


def _test_line(exc):
    """Where in the tests it failed: a line number, never the test's text."""
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "/grader/tests.py":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (tests line {line})" if line else ""


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
            if frame.f_code.co_filename == "/work/main.py":
                self.stack.append([frame.f_code.co_name, tb.tb_lineno, self._locals(frame)])
            tb = tb.tb_next

    def result(self):
        return {"events": self.events, "truncated": self.truncated, "exception": self.exc,
                "stack": self.stack}


_boot(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
del _boot
