"""Our M-RoPE layout against transformers' get_rope_index, bit for bit, over random prompts."""

import types

import numpy as np
import pytest
import torch

from services.model.positions import Layout, mrope_positions, tokens_from_config
from services.model.load import load_config
from services.model.spec import OmniSpec, audio_tokens
from references import processor_expand


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


# -- a video with its sound (use_audio_in_video) ---------------------------------------------------------------

def _hf(tiny_model):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Hf,
    )

    th = load_config(tiny_model).thinker_config
    hf = types.SimpleNamespace(config=th, spatial_merge_size=2,
                               get_llm_pos_ids_for_vision=lambda *a: Hf.get_llm_pos_ids_for_vision(None, *a))
    return hf, lambda *a: Hf.get_rope_index(hf, *a)


def _random_prompt(rng, kinds, tokenizer, spgs):
    """A chat-template-like text with media placeholders of random sizes -> (text, grids, vgrids, spg, mels, sound
    per video), each video's kind drawn from `kinds` ("video": plain, "sound": with its sound)."""
    text, grids, vgrids, spg, mels, sound = "", [], [], [], [], []
    for _ in range(rng.integers(1, 5)):
        text += "".join(rng.choice(list("abcdefgh "), rng.integers(0, 6)))
        kind = rng.choice(["image", "audio", *kinds])
        if kind == "image":
            grids.append((1, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))))
            text += "<|vision_start|><|image_pad|><|vision_end|>"
        elif kind == "audio":
            mels.append(int(rng.integers(50, 400)))
            text += "<|audio_start|><|audio_pad|><|audio_end|>"
        else:
            vgrids.append((int(rng.integers(1, 5)), 2 * int(rng.integers(1, 6)), 2 * int(rng.integers(1, 6))))
            spg.append(float(rng.choice(spgs)))
            sound.append(kind == "sound")
            if kind == "sound":  # down to a token or two: a sound that ends before the frames' widths do
                mels.append(int(rng.integers(1, 400)))
            text += "<|vision_start|><|video_pad|><|vision_end|>"
    text += "".join(rng.choice(list("abcdefgh "), rng.integers(1, 6)))
    return text, grids, vgrids, spg, mels, sound


def _tensors(grids, vgrids, spg, mels):
    return (torch.tensor(grids) if grids else None, torch.tensor(vgrids) if vgrids else None,
            torch.tensor(mels) if mels else None, torch.tensor(spg) if spg else None)


@pytest.mark.parametrize("seed", range(3))
def test_videos_with_their_sound_match_the_processor_and_get_rope_index(tiny_model, seed):
    """Prompts of text, images, audio and videos with their sound: the interleaving is the processor's, the
    positions get_rope_index's with use_audio_in_video (fractional frame times included)."""
    from transformers import AutoTokenizer

    from services.model.positions import audio_in_video_order

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expand, (_, rope_index) = processor_expand(tokenizer), _hf(tiny_model)
    tok = tokens_from_config(OmniSpec.load(tiny_model).thinker)
    rng = np.random.default_rng(seed)
    for _ in range(40):
        text, grids, vgrids, spg, mels, _ = _random_prompt(rng, ["sound"], tokenizer, [2.0, 1.0, 0.5, 2 / 3, 0.3])
        expanded = expand(text, [audio_tokens(m) for m in mels], grids, vgrids, spg, True)
        ids = tokenizer(expanded)["input_ids"]
        # the video tokens between the markers, as our layout orders them
        at, order_i, audio_i = 0, 0, 0
        for s in np.flatnonzero(np.array(ids) == tok.vision_start):
            if ids[s + 1] != tok.audio_start:
                continue
            prior_audio = sum(1 for x in ids[:s] if x == tok.audio_start)
            order = audio_in_video_order(vgrids[order_i], spg[order_i], audio_tokens(mels[prior_audio]), 2, 13)
            assert ids[s + 2:s + 2 + len(order)] == [tok.audio if a else tok.video for a in order]
            order_i += 1
        assert order_i == len(vgrids)
        t = torch.tensor([ids])
        image, video, seqlens, seconds = _tensors(grids, vgrids, spg, mels)
        ref, ref_delta = rope_index(t, image, video, torch.ones_like(t), True, seqlens, seconds)
        layout = Layout(grids, vgrids, spg, [audio_tokens(m) for m in mels])
        pos, delta = mrope_positions(ids, layout, tok)
        assert torch.equal(torch.from_numpy(pos), ref[:, 0].float())
        assert delta == pytest.approx(float(ref_delta), abs=1e-4)
        assert np.array_equal(mrope_positions(ids, layout, tok, use_audio_in_video=True)[0], pos)


@pytest.mark.parametrize("seed", range(3))
def test_videos_with_and_without_sound_in_one_prompt(tiny_model, seed):
    """transformers takes use_audio_in_video for a whole request; ours is per video. A prompt mixing both is held,
    item by item, to get_rope_index under the flag each item's video asks for, each run starting where the one
    before ended (frame times exact in binary, so sums in either order agree)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expand, (_, rope_index) = processor_expand(tokenizer), _hf(tiny_model)
    tok = tokens_from_config(OmniSpec.load(tiny_model).thinker)
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        text, grids, vgrids, spg, mels, sound = _random_prompt(rng, ["video", "sound"], tokenizer, [2.0, 1.0, 0.5, 0.25])
        ids, refs, start, state = [], [], 0.0, [0, 0, 0]
        layout = Layout(grids, vgrids, spg, [audio_tokens(m) for m in mels])
        for piece in _split_items(text):
            lengths, pg, pv, ps, flag = _piece_media(piece, grids, vgrids, spg, mels, sound, state)
            piece_ids = tokenizer(expand(piece, lengths, pg, pv, ps, flag))["input_ids"]
            t = torch.tensor([piece_ids])
            image, video, seqlens, seconds = _tensors(pg, pv, ps, [mels[state[2] - 1]] if lengths else [])
            if image is None and video is None:
                ref = torch.arange(len(piece_ids)).float().expand(3, -1)
            else:
                ref = rope_index(t, image, video, torch.ones_like(t), flag, seqlens, seconds)[0][:, 0].float()
            refs.append(ref + start)
            start = float(refs[-1][:, -1].max()) + 1
            ids += piece_ids
        ref = torch.cat(refs, dim=1)
        pos, delta = mrope_positions(ids, layout, tok)
        assert torch.equal(torch.from_numpy(pos), ref)
        assert delta == pytest.approx(float(ref.max()) + 1 - len(ids), abs=1e-4)


def _split_items(text: str) -> list[str]:
    """`text` cut after each media item's end marker: one item (and the text before it) a piece, then the rest."""
    import re

    cuts = [m.end() for m in re.finditer(r"<\|vision_end\|>|<\|audio_end\|>", text)]
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if b > a]


@pytest.mark.parametrize("seed", range(3))
def test_the_talkers_positions_are_get_rope_index_without_the_flag(tiny_model, seed):
    """transformers' generate() gives its talker no use_audio_in_video: the talker's prompt, videos with their sound
    included, is laid out by get_rope_index's counts under False (refused where those counts find no item)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expand, (_, rope_index) = processor_expand(tokenizer), _hf(tiny_model)
    tok = tokens_from_config(OmniSpec.load(tiny_model).thinker)
    rng = np.random.default_rng(200 + seed)
    compared = 0
    for _ in range(40):
        text, grids, vgrids, spg, mels, sound = _random_prompt(rng, ["video", "sound"], tokenizer, [2.0, 1.0, 2 / 3])
        state = [0, 0, 0]
        ids = tokenizer("".join(expand(p, *_piece_media(p, grids, vgrids, spg, mels, sound, state))
                                for p in _split_items(text)))["input_ids"]
        t = torch.tensor([ids])
        image, video, seqlens, seconds = _tensors(grids, vgrids, spg, mels)
        layout = Layout(grids, vgrids, spg, [audio_tokens(m) for m in mels])
        try:
            ref, ref_delta = rope_index(t, image, video, torch.ones_like(t), False, seqlens, seconds)
        except (IndexError, RuntimeError):
            with pytest.raises(ValueError, match="disagree"):
                mrope_positions(ids, layout, tok, use_audio_in_video=False)
            continue
        pos, delta = mrope_positions(ids, layout, tok, use_audio_in_video=False)
        assert torch.equal(torch.from_numpy(pos), ref[:, 0].float())
        assert delta == pytest.approx(float(ref_delta), abs=1e-4)
        compared += 1
    assert compared > 20


def _piece_media(piece, grids, vgrids, spg, mels, sound, state):
    """The media of one piece of `_split_items`, taken in order (`state`: images, videos, audio taken so far)."""
    pg, pv, ps, pm, flag = [], [], [], [], False
    if "<|image_pad|>" in piece:
        pg, state[0] = [grids[state[0]]], state[0] + 1
    elif "<|video_pad|>" in piece:
        pv, ps, flag = [vgrids[state[1]]], [spg[state[1]]], sound[state[1]]
        if flag:
            pm, state[2] = [mels[state[2]]], state[2] + 1
        state[1] += 1
    elif "<|audio_pad|>" in piece:
        pm, state[2] = [mels[state[2]]], state[2] + 1
    return [audio_tokens(m) for m in pm], pg, pv, ps, flag
