"""Loading components: both expert layouts, strictness, and the seeded random format."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.load import COMPONENTS, init_full_model_, load_component, load_config


def test_components_equal_transformers_from_pretrained(tiny_model, hf_model):
    refs = {"thinker": hf_model.thinker, "vision": hf_model.thinker.visual, "audio": hf_model.thinker.audio_tower,
            "talker": hf_model.talker, "code2wav": hf_model.code2wav}
    for name in COMPONENTS:
        ours, ref = load_component(name, tiny_model).state_dict(), refs[name].state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in ours.items()), name


def test_fused_layout_and_sharded_checkpoints_load(tiny_model, tmp_path):
    """The tiny checkpoint is saved per expert (like the released one); rewrite it fused and in two shards."""
    from services.model.load import fuse_experts

    tensors = load_file(str(tiny_model / "model.safetensors"))
    assert any(".experts.0.gate_proj.weight" in k for k in tensors)
    fused = fuse_experts(tensors)
    keys = sorted(fused)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for f, ks in shards.items():
        save_file({k: fused[k].contiguous() for k in ks}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    for name in ("thinker", "talker"):
        a, b = load_component(name, tiny_model).state_dict(), load_component(name, tmp_path).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_missing_a_tensor_is_an_error(tiny_model, tmp_path):
    tensors = load_file(str(tiny_model / "model.safetensors"))
    del tensors["talker.codec_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(ValueError, match="missing.*codec_head"):
        load_component("talker", tmp_path)


def test_random_format_is_seeded_and_matches_the_whole_model(tiny_model):
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration(load_config(tiny_model)).eval()
    init_full_model_(full, seed=3)
    refs = {"thinker": full.thinker, "vision": full.thinker.visual, "audio": full.thinker.audio_tower, "talker": full.talker,
            "code2wav": full.code2wav}
    for name, ref in refs.items():
        ours = load_component(name, tiny_model, load_format="random", seed=3).state_dict()
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ours.items()), name
    other = load_component("talker", tiny_model, load_format="random", seed=4).state_dict()
    assert not torch.equal(other["codec_head.weight"], refs["talker"].state_dict()["codec_head.weight"])


def test_random_language_models_are_initialised_as_for_training(tiny_model):
    """The thinker's and talker's random weights: token embeddings ~ N(0, 1) and each decoder layer's residual output
    projections at 1 / sqrt(2 x layers) of the 1/fan_in every other matrix gets (bench/routing.py: with all at
    1/fan_in, requests with prompts of few token types chose the same experts)."""
    import math

    cfg = load_config(tiny_model)
    thinker = load_component("thinker", tiny_model, load_format="random", seed=1)
    text = cfg.thinker_config.text_config
    layer = thinker.model.layers[0]
    assert abs(thinker.model.embed_tokens.weight.std().item() - 1) < 0.05
    scale = 1 / math.sqrt(2 * text.num_hidden_layers)
    o_proj = layer.self_attn.o_proj.weight
    assert abs(o_proj.std().item() * math.sqrt(o_proj.shape[1]) / scale - 1) < 0.15
    down = layer.mlp.experts.down_proj
    assert abs(down.std().item() * math.sqrt(down.shape[-1]) / scale - 1) < 0.1
    q_proj = layer.self_attn.q_proj.weight  # not a residual output: 1/fan_in as before
    assert abs(q_proj.std().item() * math.sqrt(q_proj.shape[1]) - 1) < 0.1
