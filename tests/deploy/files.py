"""Readers shared by the deployment tests: a small Dockerfile parser, the compose file with its
variables interpolated, the repository's own environment-variable names."""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
COMPOSE = DEPLOY / "compose.yaml"
ENV_EXAMPLE = DEPLOY / ".env.example"
K8S = DEPLOY / "k8s"


# -- Dockerfiles ------------------------------------------------------------------------------

@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.path.name} has no stage {name!r}")

    def resolve(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: self.global_args.get(m.group(1) or m.group(2), m.group(0)), text)

    def parent(self, stage: Stage) -> Stage | None:
        base = self.resolve(stage.base)
        return next((s for s in self.stages if s.name == base), None)

    def chain(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        out = [stage]
        while (parent := self.parent(out[-1])) is not None:
            out.append(parent)
        return out

    def effective(self, stage: Stage, keyword: str) -> Instruction | None:
        """The instruction in force in the image of ``stage`` (USER, HEALTHCHECK, CMD…)."""
        for s in self.chain(stage):
            found = s.all(keyword)
            if found:
                return found[-1]
        return None


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Instructions with their continuation lines joined and comments dropped."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        out.append((start, " ".join(p for p in buf if p)))
        buf = []
    if buf:
        raise ValueError("a Dockerfile ends inside a continued line")
    return out


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{path.name}:{number}: {keyword} before the first FROM")
            key, _, value = args.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, args, number))
    return Dockerfile(path, global_args, stages)


def copy_sources(instruction: Instruction) -> list[str]:
    """A COPY's source paths (empty for COPY --from=…, which copies from another stage)."""
    words = shlex.split(instruction.args)
    if any(w.startswith("--from") for w in words):
        return []
    words = [w for w in words if not w.startswith("--")]
    return words[:-1]


def exec_form(args: str) -> list[str] | None:
    """``["a", "b"]`` as a list, None for the shell form."""
    args = args.strip()
    if not args.startswith("["):
        return None
    return yaml.safe_load(args)


# -- compose ----------------------------------------------------------------------------------

VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: {line!r} is not KEY=value"
            values[key.strip()] = value.strip()
    return values


def compose_variables(text: str) -> set[str]:
    return {m.group(1) for m in VAR.finditer(text)}


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?message} against ``values``."""
    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = values.get(name)
        if op in (":-", "-"):
            return value if value else (arg or "")
        if op in (":?", "?") and not value:
            return f"<{name} unset>"
        return value or ""
    return VAR.sub(sub, text)


def load_compose(values: dict[str, str] | None = None) -> dict:
    text = COMPOSE.read_text()
    if values is not None:
        text = interpolate(text, values)
    return yaml.safe_load(text)


# -- what Crucible reads ----------------------------------------------------------------------

def repo_env_names() -> set[str]:
    """Upper-case string constants in config/, apps/ and workers/ (every variable Crucible reads
    is named by one), plus the variables the images' own scripts read."""
    names: set[str] = set()
    for folder in ("config", "apps", "workers"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", node.value):
                    names.add(node.value)
    for script in DOCKER.glob("*.sh"):
        names |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", script.read_text()))
    return names


def celery_queues() -> tuple[str, ...]:
    """config.celery.QUEUES, read without importing it (that would touch var/)."""
    tree = ast.parse((ROOT / "config" / "celery.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "QUEUES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("config/celery.py defines no QUEUES")
