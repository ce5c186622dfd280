"""Pinned datasets as warm-start data: record shapes, templates, and the SFT and DPO phases."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.rl.losses import token_logprobs
from workers.rl.model import build_policy
from workers.rl.pinned_data import (
    PinnedDataError,
    PreferencePair,
    check_roles,
    load_pinned,
    record_role,
    render,
    template_fields,
)
from workers.rl.sinks import JsonlSink, read_jsonl
from workers.rl.spec import SpecError, parse_spec
from workers.rl.tokenizer import load_tokenizer
from workers.rl.trainer import train

TINY = {"preset": {"num_layers": 1, "num_experts": 4, "hidden_size": 32,
                   "moe_intermediate_size": 32}}


def test_each_record_shape_has_its_role():
    assert record_role({"prompt": "p", "chosen": "a", "rejected": "b"}) == "preference"
    assert record_role({"prompt": "p", "completion": "c"}) == "sft"
    assert record_role({"prompt": "p", "answer": "4"}) == "sft"
    assert record_role({"question": "q", "answer": "4", "uid": "x"}) == "sft"
    assert record_role({"prompt": "p", "completion": ""}) is None  # empty text teaches nothing
    assert record_role({"text": "t"}) is None
    assert record_role({"text": "t"}, templated=True) == "sft"
    assert record_role(["not", "a", "record"]) is None


def test_load_pinned_maps_fields_and_counts_each_dataset():
    data = load_pinned({
        "synth@v1": [{"question": "2+2?", "answer": "4", "uid": "a"}],
        "sft@v3": [{"prompt": "1+1=", "completion": "2"}, {"prompt": "3+0=", "answer": "3"}],
        "prefs@v2": [{"prompt": "5-1=", "chosen": "4", "rejected": "6"}],
    })
    assert data.sft == [("2+2?", "4"), ("1+1=", "2"), ("3+0=", "3")]
    assert data.preference == [PreferencePair("5-1=", "4", "6")]
    assert data.sources == {"synth@v1": ("sft", 1), "sft@v3": ("sft", 2),
                            "prefs@v2": ("preference", 1)}
    assert data.corpus() == ["2+2?4", "1+1=2", "3+0=3", "5-1=4", "5-1=6"]


def test_a_record_of_another_shape_names_its_dataset_and_index():
    with pytest.raises(PinnedDataError, match=r"dataset mixed@v1, record 2: a sft record"):
        load_pinned({"mixed@v1": [{"prompt": "a", "completion": "b"},
                                  {"prompt": "c", "completion": "d"},
                                  {"prompt": "e", "chosen": "f", "rejected": "g"}]})
    with pytest.raises(PinnedDataError, match=r"record 0: an SFT dataset has"):
        load_pinned({"rows@v1": [{"text": "x"}]})
    with pytest.raises(PinnedDataError, match="holds no records"):
        load_pinned({"empty@v1": []})


def test_templates_read_nested_fields_only():
    record = {"problem": {"expression": "7 + 3"}, "answer": "10", "tags": ["a", "b"]}
    assert render("{problem[expression]}=", record) == "7 + 3="
    assert render("{tags[1]}:{answer:>4}", record) == "b:  10"
    assert template_fields("{problem[expression]} {answer}") == ["problem[expression]", "answer"]
    for bad in ("{answer.__class__}", "{}", "{0}", "plain text", "{answer:{width}}", "{a"):
        with pytest.raises(ValueError):
            template_fields(bad)
    data = load_pinned({"synth@v1": [record]}, prompt_template="{problem[expression]}=",
                       completion_template="{answer}")
    assert data.sft == [("7 + 3=", "10")]
    with pytest.raises(PinnedDataError, match=r"record 0: the SFT template reads a field"):
        load_pinned({"synth@v1": [{"answer": "1"}]}, prompt_template="{problem[expression]}=",
                    completion_template="{answer}")


def test_spec_checks_templates_and_roles_check_phases():
    with pytest.raises(SpecError, match="set both"):
        parse_spec({"sft": {"prompt_template": "{q}"}})
    with pytest.raises(SpecError, match="must be a record field"):
        parse_spec({"sft": {"prompt_template": "{q.x}", "completion_template": "{a}"}})
    check_roles({"a@v1": "sft"}, sft_steps=1, sft_environment=True, preference_steps=0)
    with pytest.raises(PinnedDataError, match="pins SFT dataset"):
        check_roles({"a@v1": "sft"}, sft_steps=0, sft_environment=True, preference_steps=0)
    with pytest.raises(PinnedDataError, match="pins preference dataset"):
        check_roles({"p@v1": "preference"}, sft_steps=0, sft_environment=True,
                    preference_steps=0)
    with pytest.raises(PinnedDataError, match="pins no preference dataset"):
        check_roles({}, sft_steps=0, sft_environment=True, preference_steps=3)
    with pytest.raises(PinnedDataError, match="nothing to imitate"):
        check_roles({}, sft_steps=3, sft_environment=False, preference_steps=0)


def _mean_logp(model, tok, prompts: list[str], completions: list[str]) -> float:
    """Mean per-sequence summed log-probability of completions (+EOS) after their prompts."""
    total = 0.0
    for prompt, completion in zip(prompts, completions, strict=True):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(p) - 1 : -1]
        total += float(token_logprobs(logits, ids[:, len(p):]).sum())
    return total / len(prompts)


def _spec(tmp_path, **sections):
    data = {"model": TINY, "rollout": {"group_size": 2, "max_new_tokens": 2},
            "trainer": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4,
                        "zero_stage": 0},
            "checkpoint": {"dir": str(tmp_path / "ckpt")}, "output": {"stdout": False}}
    data.update(sections)
    return parse_spec(data)


def test_sft_imitates_the_pinned_pairs(tmp_path):
    prompts = [f"{a} plus {b} is" for a in range(3) for b in range(3)]
    completions = [f" {a + b}" for a in range(3) for b in range(3)]
    pinned = load_pinned({"words@v1": [{"prompt": p, "completion": c}
                                       for p, c in zip(prompts, completions, strict=True)]})
    spec = _spec(tmp_path, sft={"steps": 40, "batch_size": 8, "lr": 1e-2, "environment": False})
    train(spec, JsonlSink(tmp_path / "m.jsonl"), pinned=pinned)
    folder = tmp_path / "ckpt" / "sft"
    tok = load_tokenizer(folder)
    # The tokenizer was trained on the pinned texts too: no unknown pieces in them.
    assert tok.unk_token_id not in tok(prompts[0] + completions[0])["input_ids"]
    start = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
    tuned = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    before, after = (_mean_logp(m, tok, prompts, completions) for m in (start, tuned))
    assert after > before + 2.0, (before, after)


def test_the_preference_phase_moves_the_policy_towards_chosen_completions(tmp_path):
    prompts = [f"{a} and {b}" for a in range(4) for b in range(4)]
    chosen = ["yes" if (a + b) % 2 == 0 else "no" for a in range(4) for b in range(4)]
    rejected = ["no" if c == "yes" else "yes" for c in chosen]
    pinned = load_pinned({"prefs@v1": [
        {"prompt": p, "chosen": c, "rejected": r}
        for p, c, r in zip(prompts, chosen, rejected, strict=True)]})
    spec = _spec(tmp_path, sft={"steps": 0},
                 preference={"steps": 30, "batch_size": 8, "lr": 1e-2, "beta": 0.5})
    train(spec, JsonlSink(tmp_path / "m.jsonl"), pinned=pinned)
    folder = tmp_path / "ckpt" / "preference"
    tok = load_tokenizer(folder)
    start = build_policy(spec.model, len(tok), tok.pad_token_id, tok.eos_token_id)
    tuned = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)

    def margin(model) -> float:
        return (_mean_logp(model, tok, prompts, chosen)
                - _mean_logp(model, tok, prompts, rejected))

    assert margin(tuned) > margin(start) + 0.5, (margin(start), margin(tuned))
    metrics = [r["metrics"] for r in read_jsonl(tmp_path / "m.jsonl") if r["kind"] == "metrics"]
    accuracy = [m["preference/accuracy"] for m in metrics if "preference/accuracy" in m]
    assert len(accuracy) == 4 and accuracy[-1] > 0.5  # steps 0, 10, 20, 29
    assert any("preference (DPO) warm start done after 30 steps on 16 pairs" in r["message"]
               for r in read_jsonl(tmp_path / "m.jsonl") if r["kind"] == "event")


def test_a_run_refuses_pinned_data_its_phases_would_ignore(tmp_path):
    pinned = load_pinned({"prefs@v1": [{"prompt": "a", "chosen": "b", "rejected": "c"}]})
    with pytest.raises(PinnedDataError, match="preference.steps is 0"):
        train(_spec(tmp_path), pinned=pinned)
