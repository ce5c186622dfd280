"""Int8 weight-only serving (`serve --int8`, workers/inference/quantize.py): per-row
quantisation against hand-computed values, every quantised matmul of a tiny Qwen3-MoE within
its stated error bound, the model's logits close to the float model's, weights smaller, and the
server answering with --int8 alone and with speculative decoding."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.workers.inference.conftest import KEY
from workers.inference import quantize as qz
from workers.inference import start_server
from workers.inference.__main__ import main as serve_main
from workers.inference.continuous import ContinuousBatcher
from workers.inference.engine import (
    EngineOptions,
    Policy,
    SamplingParams,
    SpeculativeBatcher,
    make_batcher,
)


def test_quantize_rows_hand_computed():
    w = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0], [2.54, 1.0, -0.01]])
    q, scale = qz.quantize_rows(w)
    # row 0: max 1.27 -> scale 0.01; row 1: zeros -> scale 1; row 2: max 2.54 -> scale 0.02
    assert torch.allclose(scale, torch.tensor([0.01, 1.0, 0.02]))
    assert q.dtype == torch.int8
    assert q.tolist() == [[50, -127, 0], [0, 0, 0], [127, 50, 0]]  # -0.5 rounds to 0
    assert torch.allclose(qz.dequantize_rows(q, scale),
                          torch.tensor([[0.5, -1.27, 0.0], [0, 0, 0], [2.54, 1.0, 0.0]]))

def test_quantize_rows_symmetric_and_within_half_step():
    w = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(0))
    q, scale = qz.quantize_rows(w)
    assert scale.shape == (3, 16)
    assert torch.equal(qz.quantize_rows(-w)[0], -q)
    assert (qz.dequantize_rows(q, scale) - w).abs().le(scale[..., None] / 2 + 1e-7).all()

def _tiny(model_dir):
    return Policy(model_dir, device="cpu")

@pytest.fixture(scope="module")
def pair(model_dir):
    torch.set_num_threads(1)
    base = _tiny(model_dir)
    quant = Policy(model_dir, device="cpu", int8=True)
    return base, quant

def test_every_projection_and_expert_is_int8(pair):
    base, quant = pair
    layers = base.model.config.num_hidden_layers
    # q, k, v, o per layer and the output head; one experts module per layer
    assert quant.int8 == {"linear": 4 * layers + 1, "experts": layers}
    assert qz.is_quantized(quant.model) and not qz.is_quantized(base.model)
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.model.modules())

def test_each_quantised_matmul_within_its_bound(pair):
    """Feed every quantised module the input it sees in the int8 model and compare with the
    float module it replaced: the difference stays within `error_bound` (weights rounded by
    at most half a step, bf16 kernel inputs and output)."""
    base, quant = pair
    floats = dict(base.model.named_modules())
    seen: list[tuple[str, tuple]] = []

    def keep(name):
        return lambda _m, args, _out: seen.append((name, tuple(a.detach() for a in args)))

    hooks = [m.register_forward_hook(keep(n)) for n, m in quant.model.named_modules()
             if isinstance(m, qz.Int8Linear | qz.Int8Experts)]
    ids = torch.tensor([[5, 9, 13, 21, 8, 3, 17, 30, 11, 4]]) % quant.vocab_size
    with torch.no_grad():
        quant.model(input_ids=ids)
    for h in hooks:
        h.remove()
    assert {n for n, _ in seen} == {n for n, m in quant.model.named_modules()
                                   if isinstance(m, qz.Int8Linear | qz.Int8Experts)}
    checked = 0
    with torch.no_grad():
        for name, args in seen:
            mod, ref = dict(quant.model.named_modules())[name], floats[name]
            if isinstance(mod, qz.Int8Linear):
                diff = (mod(*args) - ref(*args)).abs()
                assert (diff <= qz.error_bound(args[0], mod.qweight, mod.scale)).all(), name
                checked += 1
                continue
            hidden, index, weights = args
            for e in torch.unique(index).tolist():  # each routed expert's two matmuls
                token, _ = torch.where(index == e)
                x = hidden[token]
                w_gu, w_d = ref.gate_up_proj[e], ref.down_proj[e]
                got = qz.int8_linear(x, mod.gate_up_q[e], mod.gate_up_scale[e])
                bound = qz.error_bound(x, mod.gate_up_q[e], mod.gate_up_scale[e])
                assert ((got - x @ w_gu.T).abs() <= bound).all(), (name, e)
                g, u = got.chunk(2, dim=-1)
                h = ref.act_fn(g) * u
                got_d = qz.int8_linear(h, mod.down_q[e], mod.down_scale[e])
                bound_d = qz.error_bound(h, mod.down_q[e], mod.down_scale[e])
                assert ((got_d - h @ w_d.T).abs() <= bound_d).all(), (name, e)
                checked += 2
    assert checked > 10

def test_int8_logits_close_to_float(pair):
    """Whole-model tolerance: each quantised matmul errs by at most about 1/254 + 2·2^-8 of
    max|w|·|x|_1 (half an int8 step per weight, bf16 kernel inputs and output); to first order
    the errors of the matmuls on a token's path add up (q/k/v, o, experts' two per layer and
    the head), so the logits may move by that many times that fraction of their scale."""
    base, quant = pair
    layers = base.model.config.num_hidden_layers
    per_matmul = 1 / 254 + 2 * qz.BF16_U
    path = 4 * layers + 1
    ids = torch.tensor([[5, 9, 13, 21, 8, 3, 17, 30, 11, 4],
                        [7, 7, 2, 40, 12, 6, 19, 1, 33, 25]]) % base.vocab_size
    with torch.no_grad():
        ref = base.model(input_ids=ids).logits
        got = quant.model(input_ids=ids).logits
    scale = ref.abs().amax(dim=-1, keepdim=True)
    assert ((got - ref).abs() <= path * per_matmul * scale).all()
    assert not torch.equal(got, ref)  # the weights really changed

def test_weights_take_less_memory(pair):
    base, quant = pair
    before, after = qz.weight_bytes(base.model), qz.weight_bytes(quant.model)
    # projections and experts drop from 4 bytes to 1 (+ a 4-byte scale per row); the
    # embedding table, norms and router stay float32
    assert after < 0.6 * before

def test_int8_takes_the_static_engine(pair, model_dir):
    base, quant = pair
    assert isinstance(make_batcher(base, 4), ContinuousBatcher)
    b = make_batcher(quant, 4)
    try:
        assert not isinstance(b, ContinuousBatcher)
        out = b.submit([[5, 9, 3]], 1, SamplingParams(0.0, 1.0, 6), None).result()
        assert len(out[0][0].token_ids) >= 1
    finally:
        b.close()
    with pytest.raises(ValueError, match="int8 weights"):
        make_batcher(quant, 4, EngineOptions(engine="continuous"))

def test_int8_composes_with_speculative_decoding(pair):
    """Speculative greedy decoding of the int8 model gives the int8 model's own greedy output
    (the guesses are checked by the quantised target)."""
    _, quant = pair
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=16)
    prompt = [t % quant.vocab_size for t in (5, 9, 13, 21, 5, 9, 13, 21, 5, 9)]
    plain = make_batcher(quant, 4, EngineOptions(engine="static"))
    spec = make_batcher(quant, 4, EngineOptions(ngram_draft=2, num_speculative_tokens=3))
    try:
        assert isinstance(spec, SpeculativeBatcher)
        want = plain.submit([prompt], 1, params, None).result()[0][0].token_ids
        got = spec.submit([prompt], 1, params, None).result()[0][0].token_ids
        assert got == want
    finally:
        plain.close()
        spec.close()

def test_server_serves_int8(model_dir):
    torch.set_num_threads(1)
    with start_server(model_dir, name="tiny-int8", api_key=KEY, int8=True) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0)
        out = client.completions.create(model="tiny-int8", prompt="3+4=", max_tokens=5,
                                        temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert out.usage.completion_tokens >= 1
        health = httpx.get(srv.url.removesuffix("/v1") + "/health").json()
        assert health["weights"] == "int8"

def test_serve_refuses_int8_off_cpu(model_dir, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the refusal is for a device without one")
    with pytest.raises((ValueError, RuntimeError)):
        Policy(model_dir, device="cuda", int8=True)
    assert serve_main(["serve", "--model", str(model_dir), "--int8", "--device", "cuda",
                       "--port", "0"]) == 2
    assert "--int8 quantises for CPU serving" in capsys.readouterr().err

def test_quantize_model_refuses_a_model_without_weights_to_quantise():
    with pytest.raises(ValueError, match="nothing|no linear"):
        qz.quantize_model(torch.nn.Sequential(torch.nn.ReLU()))
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert qz.quantize_model(lin) == {"linear": 1, "experts": 0}


def test_eval_run_serving_settings_reach_the_served_model(model_dir):
    """An eval run of a served variant (config `serving`, written by variant creation) has the
    eval worker serve the int8, speculative model, not the plain checkpoint."""
    from workers.adapters.eval import serve_options
    from workers.rl.spec import EvalRunConfig

    torch.set_num_threads(1)
    cfg = EvalRunConfig.model_validate({
        "model": {"source": "path", "path": str(model_dir)},
        "serving": {"int8": True, "ngram_draft": 2, "num_speculative_tokens": 3}})
    options = serve_options(cfg, None, None, None)  # type: ignore[arg-type]  # no draft to fetch
    with start_server(model_dir, name="policy", **options) as srv:
        assert srv.openai_app.policy.int8 is not None
        health = httpx.get(srv.url.removesuffix("/v1") + "/health").json()
        assert health["weights"] == "int8"
        assert health["speculative"]["method"] == "ngram"
        assert health["speculative"]["num_speculative_tokens"] == 3
