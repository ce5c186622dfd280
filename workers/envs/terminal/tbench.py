"""Import tasks in Terminal-Bench's layout, where the sandbox has what their environment needs.

A Terminal-Bench task is a directory: `task.yaml` (`instruction`, or the older `descriptions`
list; `max_agent_timeout_sec`, `max_test_timeout_sec`, `difficulty`, `category`, `tags`),
`solution.sh`, `run-tests.sh` (installs pytest, runs `tests/`), `tests/*.py`, a `Dockerfile`
and a `docker-compose.yaml`. Its environment is a container image; ours is a sandbox session
(the host's Debian userland, Python 3.11, no network, nothing installed at run time). So a task
is **accepted** only when its image adds nothing the sandbox lacks:

- `FROM` a plain Python, Debian or Ubuntu base (Terminal-Bench's `t-bench/python-3-*` and
  `ubuntu-*` bases included), then only `WORKDIR`, `COPY`/`ADD` of the task's own files into the
  work directory (they become the initial workspace) and `CMD`/`ENTRYPOINT` (unused: the
  session is the container). Any `RUN` (an install), `ENV`, `USER`, a URL or `--from` source,
  or a copy of the tests or solution refuses the task.
- one compose service, no extra containers, ports or networks.
- tests that are plain functions (no pytest fixtures or `pytest.*` helpers: the sandbox's
  Python has no pytest, and the grader's runner is stdlib-only), and a `run-tests.sh` that
  installs nothing but pytest.
- a `solution.sh` (the reference; `solution.yaml`'s interactive keystrokes are refused).

The work directory (`/app` in Terminal-Bench) is `/work` in a session: the importer rewrites
that path in the instruction, tests, solution and copied text files. Every refusal names its
reason.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import re
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workers.envs.terminal.task import TerminalTask, TerminalTaskError, parse_task

BASES = re.compile(
    r"^(ghcr\.io/laude-institute/t-bench/(python-3-\d+|ubuntu-\d+-\d+)"
    r"|(docker\.io/)?(library/)?(python|debian|ubuntu))(:[\w.-]+)?(@sha256:[0-9a-f]+)?$")
MAX_FILE = 8 << 20
PYTEST_INSTALL = re.compile(r"\b(pip3?|uv)\s+(pip\s+)?(install|add)\b(.*)")


class TaskRefused(ValueError):
    """A task this sandbox cannot host, with the reason."""


@dataclass
class ImportReport:
    accepted: list[TerminalTask] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (task id, reason)

    def as_json(self) -> dict[str, Any]:
        return {"accepted": [t.id for t in self.accepted],
                "refused": [{"task": t, "reason": r} for t, r in self.refused]}


def _instructions(lines: list[str]) -> list[tuple[str, str]]:
    """Dockerfile instructions (keyword, arguments), continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in lines:
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    if buf:
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _under(workdir: str, dest: str) -> str:
    """The workspace-relative directory or path of a COPY destination."""
    path = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    norm = "/" + "/".join(parts)
    root = workdir.rstrip("/") or "/"
    if norm != root and not norm.startswith(root.rstrip("/") + "/"):
        raise TaskRefused(f"the Dockerfile copies to {dest}, outside the work directory {workdir}")
    return norm[len(root):].lstrip("/")


def _read_dockerfile(task_dir: Path) -> tuple[str, dict[str, bytes], str]:
    """(work directory, files copied into it by path, base image)."""
    path = task_dir / "Dockerfile"
    if not path.is_file():
        raise TaskRefused("no Dockerfile")
    base, workdir = "", "/"
    copies: list[tuple[str, str, bool]] = []  # (source, destination, destination is a dir)
    for keyword, args in _instructions(path.read_text().splitlines()):
        if keyword == "FROM":
            image = args.split()[0] if args else ""
            if not BASES.match(image):
                raise TaskRefused(f"base image {image!r}: the sandbox provides a Debian userland "
                                  "with Python 3.11, not this image")
            base = image
        elif keyword == "WORKDIR":
            workdir = args if args.startswith("/") else f"{workdir.rstrip('/')}/{args}"
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(args)
            if any(w.startswith("--") for w in words):
                raise TaskRefused(f"{keyword} {args}: flags (--from, --chown...) are not "
                                  "supported")
            if len(words) < 2:
                raise TaskRefused(f"{keyword} {args}: needs a source and a destination")
            dest = words[-1]
            into_dir = (len(words) > 2 or dest.endswith("/") or dest in (".", "..")
                        or dest.rstrip("/") == workdir.rstrip("/"))
            for src in words[:-1]:
                copies.append((src, dest, into_dir))
        elif keyword in ("CMD", "ENTRYPOINT"):
            continue
        elif keyword == "RUN":
            raise TaskRefused(f"the Dockerfile runs `{args[:80]}` (the sandbox installs "
                              "nothing at build time)")
        else:
            raise TaskRefused(f"the Dockerfile uses {keyword} {args[:60]}, which the sandbox "
                              "cannot reproduce")
    if not base:
        raise TaskRefused("the Dockerfile has no FROM")
    files: dict[str, bytes] = {}
    for src, dest, into_dir in copies:
        if "://" in src:
            raise TaskRefused(f"the Dockerfile fetches {src} (no network)")
        source = (task_dir / src).resolve()
        if task_dir.resolve() not in (source, *source.parents):
            raise TaskRefused(f"the Dockerfile copies {src}, outside the task directory")
        found = [source] if source.is_file() else sorted(p for p in source.rglob("*")
                                                         if p.is_file())
        if not source.exists():
            raise TaskRefused(f"the Dockerfile copies {src}, which the task does not have")
        for f in found:
            rel = f.relative_to(task_dir.resolve())
            if rel.parts[0] in ("tests", "solution.sh", "solution.yaml", "run-tests.sh"):
                raise TaskRefused(f"the Dockerfile copies {rel} into the workspace (the tests "
                                  "or the solution would be visible to the agent)")
            if f.is_symlink() or f.stat().st_size > MAX_FILE:
                raise TaskRefused(f"{rel}: a link or a file larger than {MAX_FILE} bytes")
            if source.is_file():
                target = _under(workdir, f"{dest.rstrip('/')}/{f.name}" if into_dir else dest)
            else:
                target = _under(workdir, f"{dest.rstrip('/')}/{f.relative_to(source)}")
            data = f.read_bytes()
            # text files name the work directory too (a program opening /app/data.csv)
            with contextlib.suppress(UnicodeDecodeError):
                data = _rewrite(data.decode(), workdir).encode()
            files[target] = data
    return workdir, files, base


def _check_compose(task_dir: Path) -> None:
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        path = task_dir / name
        if path.is_file():
            break
    else:
        return
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TaskRefused(f"{name} does not parse: {exc}") from None
    services = doc.get("services") or {}
    if not isinstance(services, dict) or len(services) != 1:
        names = ", ".join(services) if isinstance(services, dict) else "?"
        raise TaskRefused(f"{name} defines {len(services)} services ({names}); the sandbox is "
                          "one workspace with no network between containers")
    (service,) = services.values()
    extra = set(service or {}) - {"build", "image", "container_name", "command", "environment",
                                  "volumes"}
    if extra:
        raise TaskRefused(f"{name}: the service needs {', '.join(sorted(extra))}")
    if any(key in doc for key in ("networks", "volumes", "secrets")):
        raise TaskRefused(f"{name} declares top-level networks, volumes or secrets")
    env = service.get("environment") or []
    keys = [e.split("=")[0] for e in env] if isinstance(env, list) else list(env)
    if set(keys) - {"TEST_DIR"}:
        raise TaskRefused(f"{name} sets environment variables the sandbox does not: "
                          f"{', '.join(sorted(set(keys) - {'TEST_DIR'}))}")


def _check_run_tests(task_dir: Path) -> None:
    path = task_dir / "run-tests.sh"
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        if re.search(r"\b(apt-get|apt|apk|yum|dnf)\s+(-\S+\s+)*(install|add)\b", line):
            raise TaskRefused(f"run-tests.sh installs system packages: {line.strip()[:80]}")
        m = PYTEST_INSTALL.search(line)
        if m:
            wanted = [w for w in shlex.split(m.group(4)) if not w.startswith("-")]
            others = [w for w in wanted if not re.match(r"^pytest([=<>~!].*)?$", w)]
            if others:
                raise TaskRefused(f"the tests need packages the sandbox lacks: "
                                  f"{', '.join(others)}")


def _plain_tests(name: str, source: str) -> str:
    """The test source with an unused `import pytest` dropped; refused if it uses pytest."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise TaskRefused(f"tests/{name} does not parse: {exc.msg} (line {exc.lineno})") \
            from None
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "pytest"
            or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "pytest"]
    if uses:
        raise TaskRefused(f"tests/{name} uses pytest helpers (fixtures, marks, raises); the "
                          "grader's runner runs plain test functions")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                node.name.startswith("test") and (node.args.args or node.args.kwonlyargs):
            raise TaskRefused(f"tests/{name}: {node.name} takes fixtures "
                              f"({', '.join(a.arg for a in node.args.args)})")
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            raise TaskRefused(f"tests/{name}: test classes ({node.name}) are not supported")
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["pytest"]:
            lines[node.lineno - 1] = "\n"
    return "".join(lines)


def _archive(files: dict[str, bytes]) -> str:
    """The copied files as a tar archive (base64): binary files travel as they are."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def _rewrite(text: str, workdir: str) -> str:
    if workdir in ("/", "/work"):
        return text
    return re.sub(re.escape(workdir.rstrip("/")) + r"(?=/|\b|$)", "/work", text)


def import_task_dir(task_dir: Path, task_id: str | None = None,
                    split: str = "train") -> TerminalTask:
    """One Terminal-Bench task as a TerminalTask, or TaskRefused with the reason."""
    task_id = task_id or task_dir.name
    meta_path = task_dir / "task.yaml"
    if not meta_path.is_file():
        raise TaskRefused("no task.yaml")
    try:
        meta = yaml.safe_load(meta_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TaskRefused(f"task.yaml does not parse: {exc}") from None
    if not isinstance(meta, dict):
        raise TaskRefused("task.yaml is not a mapping")
    instruction = meta.get("instruction")
    if not instruction and isinstance(meta.get("descriptions"), list):
        instruction = next((d.get("description") for d in meta["descriptions"]
                            if isinstance(d, dict) and d.get("key", "base") == "base"), None)
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskRefused("task.yaml has no instruction")
    workdir, files, base = _read_dockerfile(task_dir)
    _check_compose(task_dir)
    _check_run_tests(task_dir)
    if (task_dir / "solution.yaml").is_file() and not (task_dir / "solution.sh").is_file():
        raise TaskRefused("the solution is solution.yaml (interactive keystrokes); only "
                          "solution.sh is supported")
    solution = task_dir / "solution.sh"
    tests_dir = task_dir / "tests"
    if not tests_dir.is_dir():
        raise TaskRefused("no tests/ directory")
    tests: dict[str, str] = {}
    for f in sorted(tests_dir.rglob("*")):
        if f.is_dir():
            continue
        if f.suffix != ".py" or f.parent != tests_dir:
            raise TaskRefused(f"tests/{f.relative_to(tests_dir)}: the tests carry files other "
                              "than top-level .py modules")
        tests[f.name] = _rewrite(_plain_tests(f.name, f.read_text()), workdir)
    if not any(n.startswith("test") for n in tests):
        raise TaskRefused("tests/ has no test_*.py module")
    record: dict[str, Any] = {
        "id": task_id, "instruction": _rewrite(instruction.strip(), workdir),
        "archive_b64": _archive(files) if files else None,
        "hidden_tests": tests, "split": split,
        "reference": _rewrite(solution.read_text(), workdir) if solution.is_file() else None,
        "metadata": {"source": "terminal-bench", "base_image": base, "workdir": workdir,
                     **{k: str(meta[k]) for k in ("difficulty", "category") if k in meta}},
    }
    if isinstance(meta.get("max_agent_timeout_sec"), int | float):
        record["time_budget_s"] = float(meta["max_agent_timeout_sec"])
    if isinstance(meta.get("max_test_timeout_sec"), int | float):
        record["test_timeout_s"] = float(meta["max_test_timeout_sec"])
    try:
        return parse_task(record)
    except TerminalTaskError as exc:
        raise TaskRefused(str(exc)) from None


def import_tasks(root: Path) -> ImportReport:
    """Every task directory under `root` (a Terminal-Bench `tasks/` folder)."""
    report = ImportReport()
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            report.accepted.append(import_task_dir(task_dir))
        except TaskRefused as exc:
            report.refused.append((task_dir.name, str(exc)))
        except (OSError, UnicodeDecodeError) as exc:  # one unreadable task spoils no other
            report.refused.append((task_dir.name, f"could not read the task: {exc}"))
    return report
