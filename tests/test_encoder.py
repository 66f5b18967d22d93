"""The encoder engine: one tower call per step for every request's media equals one call per item."""

import numpy as np
import torch

from references import png, wav
from services.encoder.reference import EncodeJob, Item, ReferenceEncoder
from services.preprocess.media import PixelNorm, Preprocessor, open_image
from services.runtime.config import Limits


def test_batched_towers_equal_one_call_per_item(tiny_model):
    pre = Preprocessor(tiny_model, Limits())
    feats = [pre.image(png(1, 64, 48)), pre.audio_file(wav(2, 1.0)), pre.image(png(3, 96, 64)),
             pre.video([png(4 + i, 64, 64) for i in range(3)], 2.0), pre.audio_file(wav(5, 2.5))]
    items = [Item(f.kind, torch.from_numpy(f.values), f.grid_thw) for f in feats]
    jobs = lambda: [EncodeJob(items[:2]), EncodeJob(items[2:])]  # noqa: E731 - two requests in one step
    one, many = ReferenceEncoder(tiny_model), ReferenceEncoder(tiny_model, batch=True)
    for (_, a), (_, b) in zip(one.step(jobs()), many.step(jobs())):
        for x, y in zip(a, b):
            assert x.embeds.shape == y.embeds.shape and len(x.deepstack) == len(y.deepstack)
            torch.testing.assert_close(y.embeds, x.embeds, rtol=1e-5, atol=1e-6)
            for dx, dy in zip(x.deepstack, y.deepstack):
                torch.testing.assert_close(dy, dx, rtol=1e-5, atol=1e-6)
    assert [len(e.embeds) for _, enc in many.step(jobs()) for e in enc] == [f.num_tokens for f in feats]


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
    on_cpu = Preprocessor(tiny_model, Limits(), pixels="float32").image(data)  # the A/B's other side
    assert on_cpu.values.dtype == np.float32 and np.array_equal(on_cpu.values, norm(torch.from_numpy(f.values), torch.float32).numpy())
