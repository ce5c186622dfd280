"""PID 1 of a sandbox session: runs the commands the host sends, one at a time, and reports.

Runs inside the session's sandbox (`python3 -I -S`, standard library only) as the namespace's
init, so nothing inside can kill it (`kill -9 -1` spares PID 1) and it reaps every orphan.
It makes itself non-dumpable first: a command (same uid) then cannot open /proc/1/fd or
/proc/1/mem, so it cannot reach the host's request and reply pipes. Those pipes are moved off
fds 0 and 1, which become /dev/null; commands get fresh pipes of their own and inherit nothing
else.

Frames both ways: 4-byte big-endian length, then JSON. Requests: {"op": "exec", "cmd", "stdin"
(base64), "timeout_ms", "output_bytes", "env", "background"}, {"op": "killall"}, {"op":
"ping"}. Commands run as `bash -c cmd` in /work, in a process group of their own. (Raising
their oom_score_adj would make the OOM killer spare the agent, but /proc/self/oom_score_adj is
not writable inside the user namespace; the OOM killer picks the largest process, and a
session whose agent dies anyway reports LOST.)
"""

import base64
import contextlib
import ctypes
import json
import os
import select
import signal
import struct
import sys
import time

PR_SET_DUMPABLE = 4
SHELL = "/bin/bash"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)

REQ = os.dup(0)
REP = os.dup(1)
os.set_inheritable(REQ, False)
os.set_inheritable(REP, False)
_null = os.open("/dev/null", os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
os.close(_null)

exited = {}  # pid -> wait status of children we started and have reaped
background = set()


def reap():
    """Reap every dead child (orphans re-parented to PID 1 included), keeping our own's status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        background.discard(pid)
        exited[pid] = status


def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(REQ, n - len(buf))
        if not chunk:
            sys.exit(0)  # the host closed the session
        buf += chunk
    return buf


def reply(obj):
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(REP, view):]


def spawn(cmd, env, stdin_fd, out_fd, err_fd):
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.dup2(stdin_fd, 0)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.closerange(3, 1 << 16)
            os.chdir("/work")
            os.execve(SHELL, [SHELL, "-c", cmd], env)
        except BaseException as exc:
            os.write(2, b"session agent: cannot run the command: %s\n" % str(exc).encode())
        finally:
            os._exit(127)
    return pid


def kill_group(pgid):
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.001)
        reap()


def run(req):
    env = dict(os.environ)
    env.update(req.get("env") or {})
    stdin = base64.b64decode(req.get("stdin") or "")
    if req.get("background"):
        null = os.open("/dev/null", os.O_RDWR)
        try:
            pid = spawn(req["cmd"], env, null, null, null)
        except OSError as exc:
            return {"error": "spawn", "errno": exc.errno, "message": str(exc)}
        finally:
            os.close(null)
        background.add(pid)
        return {"pid": pid}
    cap = int(req.get("output_bytes", 1 << 20))
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    try:
        pid = spawn(req["cmd"], env, in_r, out_w, err_w)
    except OSError as exc:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        return {"error": "spawn", "errno": exc.errno, "message": str(exc)}
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    deadline = start + req.get("timeout_ms", 10_000) / 1000
    bufs = {out_r: bytearray(), err_r: bytearray()}
    truncated = {out_r: False, err_r: False}
    open_fds = [out_r, err_r]
    pending = memoryview(stdin)
    writers = [in_w] if pending else []
    if not pending:
        os.close(in_w)
    timed_out = over = False
    status = None
    exit_seen = None
    while True:
        reap()
        if status is None and pid in exited:
            status = exited.pop(pid)
            exit_seen = time.monotonic()
        now = time.monotonic()
        # done once the command exited and its pipes are closed (or held open only by
        # something it left in the background: give those 50 ms, then stop reading)
        if status is not None and (not open_fds or now - exit_seen > 0.05):
            break
        if now >= deadline and status is None:
            timed_out = True
            break
        r, w, _ = select.select(open_fds, writers, [], min(max(deadline - now, 0), 0.02))
        for fd in w:
            try:
                pending = pending[os.write(fd, pending[:65536]):]
            except OSError:
                pending = memoryview(b"")
            if not pending:
                writers.remove(fd)
                os.close(fd)
        for fd in r:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            room = cap - len(bufs[out_r]) - len(bufs[err_r])
            bufs[fd] += chunk[:max(room, 0)]
            if len(chunk) > room:
                truncated[fd] = over = True
        if over:
            break
    if status is None:
        kill_group(pid)
        for _ in range(1000):
            reap()
            if pid in exited:
                status = exited.pop(pid)
                break
            time.sleep(0.001)
    for fd in open_fds + writers:
        os.close(fd)
    code = sig = None
    if status is not None:
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
    return {
        "exit_code": code, "signal": sig, "timed_out": timed_out, "output_exceeded": over,
        "stdout": base64.b64encode(bytes(bufs[out_r])).decode(),
        "stderr": base64.b64encode(bytes(bufs[err_r])).decode(),
        "stdout_truncated": truncated[out_r], "stderr_truncated": truncated[err_r],
        "wall_ms": int((time.monotonic() - start) * 1000),
    }


reply({"ready": True})
while True:
    (size,) = struct.unpack(">I", read_exact(4))
    request = json.loads(read_exact(size))
    op = request.get("op")
    if op == "exec":
        reply(run(request))
    elif op == "killall":
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
        time.sleep(0.01)
        reap()
        background.clear()
        reply({"ok": True})
    else:
        reap()
        reply({"ok": True, "background": sorted(background)})
