"""One candidate item: how it is generated and verified, and the outcome that travels back.

Math items (plain and adversarial) are pure CPU work: `run_math_tasks` runs a chunk of them in a
pool process. Code items need the sandbox and are finished by `code_stage`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from . import adversarial
from .code_tasks import FAMILIES, CodeBuilt
from .math_topics import TOPICS, Built, Degenerate
from .math_verify import Check, verify


@dataclass
class Outcome:
    """A candidate and where it stopped. `stage` is None while it passes every stage so far."""

    index: int
    generator: int
    record: dict[str, Any]
    trail: list[dict[str, Any]] = field(default_factory=list)
    stage: str | None = None
    reason: str | None = None
    detail: str = ""

    def reject(self, stage: str, reason: str, detail: str) -> Outcome:
        self.stage, self.reason, self.detail = stage, reason, detail
        self.trail.append({"stage": stage, "ok": False, "check": reason, "detail": detail})
        return self

    def passed(self, stage: str, check: str, detail: str = "") -> None:
        self.trail.append({"stage": stage, "ok": True, "check": check, "detail": detail})

    def add_checks(self, checks: list[Check]) -> Outcome:
        for c in checks:
            if c.ok:
                self.passed(c.stage, c.check, c.detail)
            else:
                self.reject(c.stage, c.check, c.detail)
        return self


@dataclass(frozen=True)
class MathTask:
    index: int
    generator: int
    topic: str
    difficulty: int
    seed: int
    perturbation: str | None = None
    fallback: str | None = None
    """Used when `perturbation` cannot apply (renaming a problem without variables)."""


def _math_record(topic: str, d: int, built: Built, provenance: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "math", "topic": topic, "difficulty": d, "question": built.question,
            "answer": built.answer, "problem": built.problem, "provenance": provenance}


def math_outcome(task: MathTask) -> Outcome:
    """Generate (and perturb) one math item, then verify it."""
    topic = TOPICS[task.topic]
    rng = random.Random(task.seed)
    label = f"math/{task.topic}"
    out = Outcome(task.index, task.generator, {
        "kind": "math", "topic": task.topic, "difficulty": task.difficulty,
        "provenance": {"generator": label, "seed": task.seed}})
    try:
        params = topic.sample(rng, task.difficulty)
        built = topic.build(params)
    except Degenerate as exc:
        return out.reject("generate", "generate:degenerate", str(exc))
    provenance: dict[str, Any] = {"generator": label, "seed": task.seed, "params": params}
    if task.perturbation is None:
        out.record = _math_record(task.topic, task.difficulty, built, provenance)
        out.passed("generate", "built", "answer by construction")
        return out.add_checks(verify(task.topic, built.question, built.answer, built.problem))
    # adversarial: the parent must verify first, then the variant is verified again
    parent_checks = verify(task.topic, built.question, built.answer, built.problem)
    parent = {"question": built.question, "answer": built.answer, "params": params}
    provenance = {"generator": f"adversarial/{label}/{task.perturbation}", "seed": task.seed,
                  "parent": parent}
    out.record = _math_record(task.topic, task.difficulty, built, provenance)
    if not parent_checks[-1].ok:
        return out.reject("generate", "generate:parent_unverified", parent_checks[-1].detail)
    try:
        try:
            variant, detail = perturb_math(task.perturbation, task.topic, params, built, rng)
        except adversarial.NotApplicable:
            if task.fallback is None:
                raise
            variant, detail = perturb_math(task.fallback, task.topic, params, built, rng)
            provenance["generator"] = f"adversarial/{label}/{task.fallback}"
    except adversarial.NotApplicable as exc:
        return out.reject("generate", "generate:not_applicable", str(exc))
    except Degenerate as exc:
        return out.reject("generate", "generate:degenerate", f"perturbed: {exc}")
    provenance.update(params=detail.pop("params"), perturbation=detail)
    out.record = _math_record(task.topic, task.difficulty, variant, provenance)
    out.passed("generate", "perturbed", task.perturbation)
    return out.add_checks(verify(task.topic, variant.question, variant.answer, variant.problem))


def perturb_math(perturbation: str, topic: str, params: dict[str, Any], built: Built,
                 rng: random.Random) -> tuple[Built, dict[str, Any]]:
    build = TOPICS[topic].build
    if perturbation == "rename":
        new, detail = adversarial.rename(params, rng)
        return build(new), {**detail, "params": new}
    if perturbation == "renumber":
        new, detail = adversarial.renumber(params, rng)
        return build(new), {**detail, "params": new}
    text, detail = adversarial.distract(built.question, rng)
    return Built(text, built.answer, built.problem), {**detail, "params": params}


def run_math_tasks(tasks: list[MathTask]) -> tuple[list[Outcome], float]:
    """A pool worker's unit of work, with the CPU seconds it took (load-independent figure)."""
    started = time.process_time()
    outcomes = [math_outcome(t) for t in tasks]
    return outcomes, time.process_time() - started


# -- code -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeTask:
    index: int
    generator: int
    family: str
    difficulty: int
    seed: int
    tests: int
    perturbation: str | None = None
    fallback: str | None = None


def code_outcome(task: CodeTask) -> tuple[Outcome, CodeBuilt | None]:
    """Generate one code task and run stage 1 (everything compiles); the sandbox does the rest."""
    family = FAMILIES[task.family]
    rng = random.Random(task.seed)
    label = f"code/{task.family}"
    provenance: dict[str, Any] = {"generator": label, "seed": task.seed}
    out = Outcome(task.index, task.generator, {"kind": "code", "family": task.family,
                                               "difficulty": task.difficulty,
                                               "provenance": provenance})
    try:
        params = family.sample(rng, task.difficulty)
        built = family.build(params, task.tests)
        provenance["params"] = params
        if task.perturbation is not None:
            provenance.update(generator=f"adversarial/{label}/{task.perturbation}",
                              parent={"question": built.statement, "params": params})
            try:
                built, detail = _perturb_code(task.perturbation, task, params, built, rng)
            except adversarial.NotApplicable:
                if task.fallback is None:
                    raise
                built, detail = _perturb_code(task.fallback, task, params, built, rng)
                provenance["generator"] = f"adversarial/{label}/{task.fallback}"
            provenance.update(params=detail.pop("params"), perturbation=detail)
    except adversarial.NotApplicable as exc:
        return out.reject("generate", "generate:not_applicable", str(exc)), None
    except Degenerate as exc:
        return out.reject("generate", "generate:degenerate", str(exc)), None
    out.record.update(question=built.statement, language="python", reference=built.reference,
                      tests=[{"stdin": s, "expected_stdout": None} for s in built.inputs])
    out.passed("generate", "built" if task.perturbation is None else "perturbed",
               task.perturbation or "")
    for name, source in (("reference", built.reference), ("oracle", built.oracle)):
        try:
            compile(source, f"<{name}>", "exec")
        except SyntaxError as exc:
            return out.reject("syntax", "syntax:does_not_compile", f"{name}: {exc}"), None
    if not built.statement.strip() or not built.inputs:
        return out.reject("syntax", "syntax:empty", "statement and tests are required"), None
    out.passed("syntax", "compiled", "reference and oracle compile")
    return out, built


def _perturb_code(perturbation: str, task: CodeTask, params: dict[str, Any], built: CodeBuilt,
                  rng: random.Random) -> tuple[CodeBuilt, dict[str, Any]]:
    family = FAMILIES[task.family]
    if perturbation == "rename":
        raise adversarial.NotApplicable("code tasks have no variable to rename")
    if perturbation == "renumber":
        new, detail = adversarial.renumber(params, rng)
        return family.build(new, task.tests), {**detail, "params": new}
    text, detail = adversarial.distract(built.statement, rng)
    return CodeBuilt(text, built.reference, built.oracle, built.inputs), {**detail,
                                                                         "params": params}
