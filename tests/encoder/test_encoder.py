"""The encoder engine: one tower call per step for every request's media, through our varlen attention, equals
transformers' own towers called per item."""

import numpy as np
import torch

from references import png, wav
from references import model_config
from services.encoder.engine import EncodeJob, Encoder, Item
from services.preprocess.media import PixelNorm, Preprocessor, open_image
from services.runtime.config import Limits


def transformers_embeds(model_dir, items: list[Item]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each item through transformers' own tower (its SDPA attention), one call per item."""
    from services.model.load import load_component

    vision, audio = load_component("vision", model_dir), load_component("audio", model_dir)
    norm, out = PixelNorm(model_dir), []
    with torch.no_grad():
        for item in items:
            if item.kind == "audio":
                lens = torch.tensor([item.values.shape[1]])
                out.append((audio(item.values, feature_lens=lens).last_hidden_state, []))
            else:
                r = vision(norm(item.values, torch.float32), grid_thw=torch.tensor([item.grid_thw]))
                out.append((r.pooler_output, list(r.deepstack_features)))
    return out


def test_the_engines_batched_towers_equal_transformers_per_item(tiny_model):
    """Images of four sizes, a video and clips of three lengths (windows of unequal length), two requests in one
    step: the engine's one call per tower gives the embeddings and DeepStack features transformers' towers give
    each item alone, in order, each as many rows as its tokens."""
    pre = Preprocessor(tiny_model, Limits())
    feats = [pre.image(png(1, 64, 48)), pre.image(png(2, 64, 48)), pre.image(png(3, 96, 64)), pre.image(png(4, 32, 32)),
             pre.video([png(5 + i, 64, 64) for i in range(3)], 2.0),
             pre.audio_file(wav(8, 1.0)), pre.audio_file(wav(9, 2.5)), pre.audio_file(wav(10, 7.0))]
    items = [Item(f.kind, torch.from_numpy(f.values), f.grid_thw) for f in feats]
    engine = Encoder(model_config(tiny_model))
    got = [e for _, enc in engine.step([EncodeJob(items[:5]), EncodeJob(items[5:])]) for e in enc]
    for (embeds, deepstack), y, f in zip(transformers_embeds(tiny_model, items), got, feats):
        assert len(y.embeds) == f.num_tokens
        torch.testing.assert_close(y.embeds, embeds, rtol=1e-5, atol=1e-6)
        assert len(deepstack) == len(y.deepstack)
        for dx, dy in zip(deepstack, y.deepstack):
            torch.testing.assert_close(dy, dx, rtol=1e-5, atol=1e-6)


def test_varlen_attention_equals_one_sdpa_call_per_item():
    """The towers' attention over packed items: items of equal length as one batch, unequal ones padded with
    their padding masked, each equal to SDPA over that item alone; the layout made once per cu_seqlens."""
    import torch.nn.functional as F

    from services.encoder import attention

    gen = torch.Generator().manual_seed(0)
    for lengths in ([16, 16, 16], [16, 5, 30, 1], [7]):
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(1, 4, sum(lengths), 8, generator=gen) for _ in range(3))
        out, _ = attention.varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths))
        assert out.shape == (1, sum(lengths), 4, 8)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            want = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3).transpose(1, 2)
            torch.testing.assert_close(out[:, a:b], want, rtol=1e-5, atol=1e-6)
        if len(set(lengths)) > 1:  # the next layer of the same call lays its items out as this one did
            layout = attention._layouts.last
            assert layout[0] is cu
            attention.varlen_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths))
            assert attention._layouts.last is layout
    try:
        attention.varlen_attention(None, q, k, v, scaling=0.3)
        raise AssertionError("packed items without their boundaries were attended")
    except ValueError as e:
        assert "cu_seqlens" in str(e)


def test_pixels_normalised_where_the_encoder_runs_equal_the_processors(tiny_model):
    """Preprocessing hands on the resized image's bytes (uint8 patches, a quarter of float32's); the encoder's
    normalisation gives the floats transformers' image processor gives, to float32 rounding."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre, norm = Preprocessor(tiny_model, Limits()), PixelNorm(tiny_model)
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_model)
    for data in (png(1, 64, 48), png(7, 300, 200)):
        f = pre.image(data)
        assert f.values.dtype == np.uint8
        expected = processor(images=[open_image(data, Limits(), "x")], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(norm(torch.from_numpy(f.values), torch.float32), expected, rtol=0, atol=1e-6)
    floats = torch.randn(4, 1536)
    assert torch.equal(norm(floats, torch.float32), floats)  # already normalised: passed through


def test_image_patches_are_the_processors_own_bytes(tiny_model):
    """Images are resized and patched here in uint8 (not by transformers' processor, whose float pass took half an
    image's preprocessing): the same patches and grid as the processor without rescale and normalisation, for
    sizes kept, shrunk to the grid, grown to its minimum and cut past its maximum, and for grey, RGBA and JPEG
    inputs."""
    import io

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = Preprocessor(tiny_model, Limits(max_image_pixels=1 << 26))
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_model)
    rng = np.random.default_rng(3)

    def encoded(array: np.ndarray, mode: str, fmt: str = "PNG") -> bytes:
        buf = io.BytesIO()
        Image.fromarray(array, mode).save(buf, format=fmt)
        return buf.getvalue()

    images = [png(1, 512, 512), png(2, 333, 517), png(3, 64, 48), png(4, 20, 30), png(5, 4000, 3600), png(6, 640, 480, "JPEG"),
              encoded(rng.integers(0, 256, (97, 131), dtype=np.uint8), "L"),
              encoded(rng.integers(0, 256, (120, 80, 4), dtype=np.uint8), "RGBA")]
    for data in images:
        got = pre.image(data)
        out = processor(images=[open_image(data, Limits(max_image_pixels=1 << 26), "x")], do_rescale=False,
                        do_normalize=False, return_tensors="np")
        assert got.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
        assert got.values.dtype == np.uint8 and np.array_equal(got.values, out["pixel_values"].astype(np.uint8))
        assert got.num_tokens == int(np.prod(got.grid_thw)) // 4


def test_audio_too_short_for_one_window_is_refused_by_name(tiny_model):
    """Between one hop (160 samples) and half a window (200) the extractor itself failed with a RuntimeError."""
    import pytest

    from services.runtime.errors import InvalidArgument

    pre = Preprocessor(tiny_model, Limits())
    with pytest.raises(InvalidArgument, match="too short"):
        pre.audio_pcm(np.zeros(180, dtype="<i2").tobytes(), 16000, "s16le", 1)
    assert pre.audio_pcm(np.zeros(201, dtype="<i2").tobytes(), 16000, "s16le", 1).feature_length == 1


def test_vision_plans_give_what_the_tower_derives_itself(tiny_model):
    """The vision tower's grid-derived inputs made once per list of grids (services.encoder.plans): its outputs
    with them are the outputs it gives deriving them itself (images of three sizes and a video, with either
    attention); with varlen attention such a call reads nothing back from its tensors; plans are kept per list."""
    from services.encoder.attention import use_varlen_attention
    from services.encoder.plans import VisionPlans
    from services.model.load import load_component

    pre = Preprocessor(tiny_model, Limits())
    feats = [pre.image(png(1, 64, 48)), pre.image(png(3, 96, 64)), pre.video([png(5 + i, 64, 64) for i in range(3)], 2.0),
             pre.image(png(2, 64, 48))]
    pixels = torch.cat([PixelNorm(tiny_model)(torch.from_numpy(f.values), torch.float32) for f in feats])
    grids = tuple(tuple(f.grid_thw) for f in feats)
    for attention in ("sdpa", "varlen"):
        tower = load_component("vision", tiny_model).requires_grad_(False)
        if attention == "varlen":
            use_varlen_attention(tower)
        plans = VisionPlans(tower, torch.device("cpu"), size=2)
        with torch.no_grad():
            want = tower(pixels, grid_thw=torch.tensor(grids))
            plan = plans(grids)
            if attention == "varlen":
                assert isinstance(plan["max_seqlen"], int)
                reads = []
                def read(*args, **kwargs):  # noqa: E306
                    reads.append(args)
                    raise AssertionError("a planned call read a value back from a tensor")
                with mock_host_reads(read):
                    got = tower(pixels, **plan)
                assert not reads
            else:
                got = tower(pixels, **plan)
        assert torch.equal(got.pooler_output, want.pooler_output)
        assert all(torch.equal(a, b) for a, b in zip(got.deepstack_features, want.deepstack_features))
    assert plans(grids) is plan and plans.made == 1  # kept: the same plan for the same grids
    plans(grids[:1]), plans(grids[1:2])  # two more lists: the oldest of three goes (size 2)
    assert plans.made == 3 and grids not in plans.plans and plans(grids[:1]) is plans.plans[grids[:1]]


def mock_host_reads(read):
    """Every way a tensor's value reaches Python (item, tolist, int, float, bool) calls `read` instead."""
    from contextlib import ExitStack
    from unittest import mock

    stack = ExitStack()
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        stack.enter_context(mock.patch.object(torch.Tensor, name, read))
    return stack
