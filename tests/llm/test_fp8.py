"""fp8 experts: quantisation round trips, the fp8 reference against a float reference of the same
quantised weights, and the thinker with fp8 experts against itself in full precision."""

import pytest
import torch
import torch.nn.functional as F

from services.llm import fp8
from services.llm.moe import Experts


@pytest.mark.parametrize("block", [None, 16])
def test_round_trip(block):
    w = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 448
    back = fp8.dequantize(q, scale, block)
    rel = (back - w).norm() / w.norm()
    assert rel < 0.04, rel  # e4m3 keeps 3 mantissa bits: a few percent
    assert ((back - w).abs() <= w.abs() * 2 ** -3 + 1e-9 + scale.max() * 2 ** -9).all()


def test_tokens_get_one_scale_each():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.0])[:, None]
    q, s = fp8.quantize_tokens(x)
    assert s.shape == (5, 1) and (q.float().abs().amax(-1)[:4] == 448).all()
    assert ((q.float() * s - x).norm(dim=-1)[:4] / x.norm(dim=-1)[:4] < 0.04).all()


@pytest.mark.parametrize("block", [None, 16])
def test_fp8_experts_equal_a_float_reference_of_the_same_quantised_weights(block):
    g = torch.Generator().manual_seed(1)
    e = Experts(32, 4, 16)
    with torch.no_grad():
        e.gate_up_proj.copy_(torch.randn(4, 32, 32, generator=g) * 0.2)
        e.down_proj.copy_(torch.randn(4, 32, 16, generator=g) * 0.2)
    x = torch.randn(9, 32, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    ours = fp8.Fp8Experts(e, block)(x, ids, weights)
    gate_up = fp8.dequantize(*fp8.quantize(e.gate_up_proj.detach(), block), block)
    down = fp8.dequantize(*fp8.quantize(e.down_proj.detach(), block), block)
    ref = torch.zeros_like(x)
    for t in range(9):  # token by token, written independently of the module
        for j in range(2):
            h = fp8.fake_quant_tokens(x[t:t + 1]) @ gate_up[ids[t, j]].T
            gate, up = h.chunk(2, dim=-1)
            ref[t] += (fp8.fake_quant_tokens(F.silu(gate) * up) @ down[ids[t, j]].T)[0] * weights[t, j]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_thinker_with_fp8_experts_stays_close(tiny_model):
    from references import native_thinker

    full, quant = native_thinker(tiny_model), native_thinker(tiny_model)
    assert fp8.quantize_experts_(quant.model) == len(quant.model.model.layers)
    x = torch.randn(7, full.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(7).float().expand(3, -1)
    from services.llm.attention import SeqSlice
    from services.llm.context import step_context

    outs = []
    for engine in (full, quant):
        with step_context(engine.attention.plan([SeqSlice(list(range(4)), 0, 7)]), "loop"):
            outs.append(engine.model(x, positions)[0])
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    # changed by quantisation, but only by its rounding: e4m3 leaves one experts layer about 5% off in relative L2,
    # and two layers compound it
    assert 0 < rel < 0.08, rel


def test_engines_serve_with_fp8_experts(tiny_model, hf_model):
    from references import Case, Reference, native_thinker, thinker_seq

    engine = native_thinker(tiny_model, fp8="channel")
    assert all(isinstance(layer.mlp.experts, fp8.Fp8Experts) for layer in engine.model.model.layers)
    seq = thinker_seq(Reference(tiny_model, hf_model), Case([("user", [("text", "Hello there")])]), 9)
    seq.params = seq.params.__class__(max_tokens=9, ignore_eos=True)
    engine.add(seq)
    while not seq.done:
        engine.step([seq])
    assert len(seq.generated) == 9 and seq.stop_reason == "length"
    with pytest.raises(ValueError, match="tiles"):
        native_thinker(tiny_model, fp8="block")  # the tiny experts are narrower than a 128 x 128 tile


def test_rows_by_expert_are_a_stable_argsort():
    from services.llm.moe import by_expert

    g = torch.Generator().manual_seed(0)
    for tokens, k, experts in ((1, 8, 128), (5, 2, 4), (300, 8, 128), (64, 6, 16)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        order, offs = by_expert(ids, experts)
        assert order.tolist() == ids.reshape(-1).argsort(stable=True).tolist()
        assert offs.tolist() == torch.bincount(ids.reshape(-1), minlength=experts).cumsum(0).tolist()


@pytest.mark.parametrize("block", [None, fp8.FP8_BLOCK])
def test_the_full_size_thinker_with_fp8_experts_fits_in_35_gb(block):
    """The real config's thinker, built on the meta device (no memory, no time): its weights, quantised as the
    engine quantises them, leave room for a second replica beside the talker on one H200."""
    from services.model.load import default_dtype, load_config
    from services.thinker.model import ThinkerModel

    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = ThinkerModel(load_config(None).thinker_config)

    def gb() -> float:
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9

    assert 60 < gb() < 63  # bf16: 30.5 B parameters
    assert fp8.quantize_experts_(model, block) == 48
    assert 31 < gb() < 35  # measured 32.2 GB (per channel)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model, tmp_path_factory):
    """The tiny model as a block-fp8 release would ship it: every projection of the thinker and the talker in
    e4m3 with float32 scales per 16 x 16 tile (`weight_scale_inv`), routers, norms and embeddings as they were."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("fp8") / "model"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (out / "config.json").write_text(json.dumps(config))
    tensors, quantised = {}, 0
    for path in sorted(out.glob("*.safetensors")):
        for key, t in load_file(path).items():
            proj = key.endswith("_proj.weight") and t.dim() == 2 and key.startswith(("thinker.model.", "talker.model."))
            if proj and t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0:
                q, scale = fp8.quantize(t.float().reshape(1, *t.shape), 16)
                tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = q[0], scale[0]
                quantised += 1
            else:
                tensors[key] = t
        path.unlink()
    save_file(tensors, str(out / "model.safetensors"))
    assert quantised > 20
    return out


def test_a_block_fp8_checkpoint_loads(tiny_model, fp8_checkpoint):
    """Dequantised where the model runs in 16/32 bits; with fp8 experts in tiles, the experts hold exactly the
    checkpoint's e4m3 values and scales (not quantised again); and the engines serve from it."""
    from safetensors.torch import load_file

    from services.model.load import checkpoint_fp8_block, dequantize_tiles, load_component
    from references import model_config
    from services.runtime.config import TalkerConfig, ThinkerConfig
    from services.talker.engine import NativeTalker
    from services.thinker.engine import NativeThinker

    assert checkpoint_fp8_block(fp8_checkpoint) == 16 and checkpoint_fp8_block(tiny_model) is None
    stored = load_file(str(fp8_checkpoint / "model.safetensors"))
    original = load_component("thinker", tiny_model).state_dict()
    lm = load_component("thinker", fp8_checkpoint).state_dict()
    key = "model.layers.1.self_attn.q_proj.weight"
    q, s = stored[f"thinker.{key}"], stored[f"thinker.{key.removesuffix('.weight')}.weight_scale_inv"]
    assert torch.equal(lm[key], dequantize_tiles(q, s, 16))
    assert 0 < (lm[key] - original[key]).norm() / original[key].norm() < 0.04  # what e4m3 costs

    engine = NativeThinker(model_config(fp8_checkpoint), ThinkerConfig(fp8="block"))
    experts = engine.model.model.layers[1].mlp.experts
    assert isinstance(experts, fp8.Fp8Experts) and experts.block == 16
    base = "thinker.model.layers.1.mlp.experts"
    assert torch.equal(experts.gate_up_proj[2].view(torch.uint8),
                       torch.cat([stored[f"{base}.2.gate_proj.weight"], stored[f"{base}.2.up_proj.weight"]]).view(torch.uint8))
    assert torch.equal(experts.down_proj_scale[3], stored[f"{base}.3.down_proj.weight_scale_inv"])
    talker = NativeTalker(model_config(fp8_checkpoint), TalkerConfig())  # the talker's experts dequantised at load
    assert not any(isinstance(m, fp8.Fp8Experts) for m in talker.talker.modules())

    from services.llm.sampling import SamplingParams
    from services.thinker.seq import ThinkerSeq

    seq = ThinkerSeq("fp8", torch.arange(5, 25), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add(seq)
    while not seq.done:
        engine.step([seq])
    assert len(seq.generated) == 4 and seq.stop_reason == "length"
