"""Our M-RoPE layout against transformers' get_rope_index, bit for bit, over random prompts."""

import types

import numpy as np
import pytest
import torch

from services.model.positions import Layout, mrope_positions, tokens_from_config
from services.model.load import load_config
from services.model.spec import OmniSpec, audio_tokens


@pytest.mark.parametrize("seed", range(4))
def test_matches_get_rope_index(tiny_model, seed):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Hf,
        _get_feat_extract_output_lengths,
    )

    th = load_config(tiny_model).thinker_config
    hf = types.SimpleNamespace(config=th, spatial_merge_size=2,
                               get_llm_pos_ids_for_vision=lambda *a: Hf.get_llm_pos_ids_for_vision(None, *a))
    tok = tokens_from_config(OmniSpec.load(tiny_model).thinker)
    rng = np.random.default_rng(seed)
    for _ in range(60):
        ids, grids, vgrids, spg, mels = [], [], [], [], []
        for _ in range(rng.integers(0, 5)):
            ids += rng.integers(0, 250, rng.integers(0, 6)).tolist()
            kind = rng.integers(0, 3)
            if kind == 0:
                g = (1, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4)))
                grids.append(g)
                ids += [th.vision_start_token_id] + [th.image_token_id] * (g[1] * g[2] // 4) + [th.vision_end_token_id]
            elif kind == 1:
                g = (int(rng.integers(1, 4)), 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3)))
                vgrids.append(g)
                spg.append(float(rng.choice([2.0, 0.5, 2 / 3])))
                ids += [th.vision_start_token_id] + [th.video_token_id] * (g[0] * g[1] * g[2] // 4) + [th.vision_end_token_id]
            else:
                mels.append(int(rng.integers(50, 400)))
                n = audio_tokens(mels[-1])
                assert n == int(_get_feat_extract_output_lengths(torch.tensor(mels[-1]), 50))
                ids += [th.audio_start_token_id] + [th.audio_token_id] * n + [th.audio_end_token_id]
        ids += rng.integers(0, 250, rng.integers(1, 6)).tolist()
        t = torch.tensor([ids])
        ref, ref_delta = Hf.get_rope_index(
            hf, t, torch.tensor(grids) if grids else None, torch.tensor(vgrids) if vgrids else None, torch.ones_like(t),
            False, torch.tensor(mels) if mels else None, torch.tensor(spg) if spg else None)
        layout = Layout(grids, vgrids, spg, [audio_tokens(m) for m in mels])
        pos, delta = mrope_positions(ids, layout, tok)
        assert torch.equal(torch.from_numpy(pos), ref[:, 0].float())
        assert delta == pytest.approx(float(ref_delta), abs=1e-4)


def test_layout_that_does_not_match_the_placeholders_is_refused(tiny_model):
    spec = OmniSpec.load(tiny_model)
    th = spec.thinker
    ids = [1, th["vision_start_token_id"]] + [th["image_token_id"]] * 4 + [th["vision_end_token_id"], 2]
    with pytest.raises(ValueError, match="disagree"):
        mrope_positions(ids, Layout(image_grid_thw=[(1, 4, 8)]), tokens_from_config(th))
