"""synthesize(): reproducible batches, stage statistics, progress, and code items in the sandbox."""

from __future__ import annotations

import json

import pytest

from workers.synthesis import Progress, SynthesisError, parse_config, synthesize
from workers.synthesis.code_stage import run_code_stage
from workers.synthesis.code_tasks import CodeBuilt
from workers.synthesis.items import CodeTask, code_outcome

MATH = {"seed": 11, "workers": 1, "generators": [
    {"kind": "math", "count": 27},
    {"kind": "adversarial", "count": 9, "topics": ["linear", "system", "gcd"]},
]}


@pytest.fixture(scope="module")
def math_batch():
    seen: list[Progress] = []
    batch = synthesize(parse_config(MATH), seen.append)
    return batch, seen


def test_same_seed_and_config_give_byte_identical_records(math_batch) -> None:
    batch, _ = math_batch
    again = synthesize(parse_config({**MATH, "workers": 2}))  # through the process pool
    assert again.jsonl() == batch.jsonl()
    def same(manifest: dict) -> str:
        return json.dumps({k: v for k, v in manifest.items() if k != "config"}, sort_keys=True)

    assert same(again.manifest) == same(batch.manifest)
    other = synthesize(parse_config({**MATH, "seed": 12, "generators": MATH["generators"][:1]}))
    assert other.jsonl() != batch.jsonl()


def test_manifest_counts_every_stage_and_ends_at_the_records(math_batch) -> None:
    batch, seen = math_batch
    m = batch.manifest
    assert [s["stage"] for s in m["stages"]] == ["generate", "syntax", "logic", "dedup_exact",
                                                 "dedup_near"]
    assert m["stages"][0]["in"] == m["candidates"] == 36
    for before, after in zip(m["stages"], m["stages"][1:], strict=False):
        assert after["in"] == before["passed"]
        assert before["rejected"] == sum(before["reasons"].values())
    assert m["stages"][-1]["passed"] == m["record_count"] == len(batch.records)
    assert len(batch.records) + len(batch.rejected) == 36
    assert set(m["diversity"]) == {"distinct_1", "distinct_2", "distinct_3"}
    assert 0 < m["diversity"]["distinct_1"] <= m["diversity"]["distinct_3"] <= 1
    assert {r["topic"] for r in batch.records} >= {"arithmetic", "primes", "integral"}
    assert seen[-1] == Progress("done", len(batch.records), 36)
    assert any(p.stage == "math" and p.done == p.total == 36 for p in seen)


def test_records_carry_generator_seed_params_and_trail(math_batch) -> None:
    batch, _ = math_batch
    for record in batch.records:
        prov = record["provenance"]
        assert {"generator", "seed", "params"} <= set(prov)
        assert [c["stage"] for c in record["verification"]] == ["generate", "syntax", "logic",
                                                                "dedup"]
        assert all(c["ok"] for c in record["verification"])
    variants = [r for r in batch.records if r["provenance"]["generator"].startswith("adversarial")]
    assert variants and all("parent" in r["provenance"] for r in variants)
    assert {r["provenance"]["generator"].rsplit("/", 1)[1] for r in variants} == {
        "rename", "renumber", "distract"}


def test_duplicates_are_removed_with_reasons() -> None:
    # one topic and difficulty, many items: the small space of gcd questions repeats
    batch = synthesize(parse_config({"seed": 1, "workers": 1, "generators": [
        {"kind": "math", "count": 60, "topics": ["primes"], "difficulties": [1]}]}))
    stages = {s["stage"]: s for s in batch.manifest["stages"]}
    assert stages["dedup_exact"]["reasons"].get("dedup:exact", 0) > 0
    texts = [r["question"] for r in batch.records]
    assert len(texts) == len(set(texts))
    dup = next(r for r in batch.rejected if r["rejected"]["stage"] == "dedup_exact")
    assert "same text as item" in dup["rejected"]["detail"]


def test_code_items_get_outputs_from_the_reference_and_pass_the_oracle(engine) -> None:
    seen: list[Progress] = []
    config = parse_config({"seed": 3, "generators": [
        {"kind": "code", "count": 3, "families": ["caesar", "lis", "coin_change"],
         "difficulties": [2], "tests_per_item": 2},
        {"kind": "adversarial", "source": "code", "count": 2, "families": ["kth_smallest"],
         "perturbations": ["renumber", "distract"], "tests_per_item": 2}]})
    batch = synthesize(config, seen.append, engine=engine)
    assert len(batch.records) == 5, batch.rejected
    for record in batch.records:
        assert all(t["expected_stdout"].strip() for t in record["tests"])
        checks = [c["check"] for c in record["verification"]]
        assert checks[-3:] == ["reference_ran", "oracle_agrees", "unique"]
    assert any(p.stage == "code" and p.done == p.total == 5 for p in seen)


def test_a_wrong_reference_or_a_crash_is_rejected_in_the_logic_stage(engine) -> None:
    out, built = code_outcome(CodeTask(0, 0, "max_subarray", 1, 5, 3))
    assert built is not None
    wrong = CodeBuilt(built.statement, "import sys\nprint(max(map(int, sys.stdin.read()"
                      ".split()[1:])))\n", built.oracle, built.inputs)
    crash = CodeBuilt(built.statement, "raise SystemExit(3)\n", built.oracle, built.inputs)
    out2, _ = code_outcome(CodeTask(1, 0, "max_subarray", 1, 5, 3))
    run_code_stage([(out, wrong), (out2, crash)], engine, 2, lambda n: None)
    assert out.reason == "logic:oracle_disagrees", out.trail
    assert out2.reason == "logic:reference_failed" and "RE" in out2.detail


def test_code_without_a_sandbox_fails_clearly(monkeypatch) -> None:
    import workers.synthesis.code_stage as code_stage

    monkeypatch.setattr(code_stage, "sandbox_unavailable", lambda: "no bubblewrap here")
    with pytest.raises(SynthesisError, match="need the sandbox engine: no bubblewrap here"):
        synthesize(parse_config({"generators": [{"kind": "code", "count": 1}]}))
