"""The encoder engine: one tower call per step for every request's media equals one call per item."""

import torch

from references import png, wav
from services.encoder.reference import EncodeJob, Item, ReferenceEncoder
from services.preprocess.media import Preprocessor
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
