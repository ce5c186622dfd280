"""Objective, tokenizer, model loading, rollouts and sinks."""

import io
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.reporting import Reporter
from workers.rl.losses import token_logprobs
from workers.rl.model import ModelDirError, build_policy, check_model_dir
from workers.rl.objectives import Example, build_objective, exact_match
from workers.rl.rollout import HFRollout, cut_at_stop, position_ids, top_p_filter
from workers.rl.sinks import JsonlSink, MultiSink, StdoutSink, read_jsonl
from workers.rl.spec import ArithmeticSpec, ModelSpec, RolloutSpec


def test_arithmetic_split_is_disjoint_and_reward_is_exact_match(objective):
    assert len(objective.eval) == 20 and len(objective.train) == 80
    assert not {e.prompt for e in objective.eval} & {e.prompt for e in objective.train}
    ex = [Example("3+4=", "7")] * 4
    rewards, parts = exact_match(ex, ["7", "7\n1+1=2", "8", " 7 "])
    assert rewards == [1.0, 1.0, 0.0, 1.0] and parts["is_number"] == [1.0] * 4
    mult = build_objective(ArithmeticSpec(ops=["*"], eval_size=5))
    assert all(str(eval(e.prompt[:-1])) == e.reference for e in mult.train)
    with pytest.raises(ValueError, match="eval_size"):
        build_objective(ArithmeticSpec(max_operand=1, eval_size=4))


def test_tokenizer_splits_digits_and_round_trips(tokenizer):
    assert tokenizer.tokenize("12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    ids = tokenizer("12+7=19", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "12+7=19"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_model_dir_errors_name_what_is_missing(tmp_path, tiny_model, tokenizer):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelDirError, match="no config.json"):
        check_model_dir(tmp_path / "m")
    tiny_model.config.save_pretrained(tmp_path / "m")
    with pytest.raises(ModelDirError, match="no weights"):
        build_policy(ModelSpec(source="path", path=str(tmp_path / "m")), 0, 0, 0)


def test_hf_checkpoint_round_trip(tmp_path, tiny_model, tokenizer):
    tiny_model.save_pretrained(tmp_path / "m")
    loaded = build_policy(ModelSpec(source="path", path=str(tmp_path / "m")), 0, 0, 0)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = tiny_model(input_ids=ids).logits
    assert torch.equal(loaded(input_ids=ids).logits, ref)
    assert torch.equal(plain(input_ids=ids).logits, ref)
    # the preset really is a Qwen3-MoE with routed experts
    assert loaded.config.model_type == "qwen3_moe" and loaded.config.num_experts == 8


def test_preset_is_seeded_and_initialised(tokenizer):
    a = build_policy(ModelSpec(), len(tokenizer), 0, 1)
    b = build_policy(ModelSpec(), len(tokenizer), 0, 1)
    c = build_policy(ModelSpec(seed=1), len(tokenizer), 0, 1)
    for (name, pa), pb, _pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb)
    experts = dict(a.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.std() > 0  # not left as uninitialised/zero memory
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(),
                                                          strict=True))


def test_rollout_logprobs_match_trainer_rescoring(tiny_model, tokenizer):
    backend = HFRollout(tiny_model, tokenizer)
    spec = RolloutSpec(max_new_tokens=5, group_size=2)
    prompts = ["1+2=", "13+4=", "9+9=", "5+0="]
    batch = backend.generate(prompts, spec, torch.Generator().manual_seed(0))
    assert batch.completion_ids.shape == batch.logprobs.shape == batch.completion_mask.shape
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=mask,
                            position_ids=position_ids(mask)).logits
    p = batch.prompt_ids.shape[1]
    rescored = token_logprobs(logits[:, p - 1 : -1], batch.completion_ids)
    diff = ((rescored - batch.logprobs) * batch.completion_mask).abs().max()
    assert diff < 1e-4
    again = backend.generate(prompts, spec, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, batch.completion_ids)
    # nothing is sampled after eos: the mask closes and pads follow
    for row, m in zip(batch.completion_ids, batch.completion_mask, strict=True):
        ends = (row == tokenizer.eos_token_id).nonzero()
        if len(ends):
            assert m[ends[0, 0] + 1 :].sum() == 0


def test_rollout_stop_strings_and_temperature(tiny_model, tokenizer):
    backend = HFRollout(tiny_model, tokenizer)
    spec = RolloutSpec(max_new_tokens=6, stop=["1"], temperature=0.7)
    batch = backend.generate(["2+2="] * 16, spec, torch.Generator().manual_seed(1))
    assert all("1" not in t for t in batch.texts)
    assert cut_at_stop("12\n3", ["\n"]) == ("12", True)
    assert cut_at_stop("12", ["\n"]) == ("12", False)


def test_top_p_filter():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert torch.allclose(top_p_filter(probs, 0.7), torch.tensor([[0.625, 0.375, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sinks(tmp_path):
    path = tmp_path / "m.jsonl"
    out = io.StringIO()
    sink = MultiSink(JsonlSink(path), StdoutSink(out))
    assert isinstance(sink, Reporter)
    sink.log(1, {"loss": 0.5, "reward_mean": math.nan})
    sink.event("warning", "step skipped", {"step": 1})
    sink.checkpoint(2, "file:///x", {"loss": 0.4})
    recs = read_jsonl(path)
    assert [r["kind"] for r in recs] == ["metrics", "event", "checkpoint"]
    assert recs[0]["metrics"] == {"loss": 0.5, "reward_mean": None}  # still valid JSON
    assert json.loads(path.read_text().splitlines()[2])["uri"] == "file:///x"
    assert "step     1 loss=0.5" in out.getvalue() and "[warning] step skipped" in out.getvalue()
