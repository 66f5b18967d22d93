"""The encoder's towers at full size on one GPU (seeded random weights, bf16): our varlen attention against
transformers' own SDPA path, on the benchmark's media."""

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_full_size_towers_with_varlen_attention_track_transformers_sdpa(tmp_path):
    """Two 512x512 images, a 256x256 one (unequal items: the padded path), 7 s and 3 s clips: the engine's one
    batched step through varlen attention against transformers' towers (their SDPA) one call per item: every
    embedding within bf16's rounding. The time of each prints."""
    from bench.workloads import image_png
    from services.encoder.engine import EncodeJob, Encoder, Item
    from services.model.build import build_full_skeleton
    from services.model.load import load_component
    from services.preprocess.media import PixelNorm, Preprocessor
    from services.runtime.config import Limits, ModelConfig

    model_dir = build_full_skeleton(tmp_path / "model")
    pre = Preprocessor(model_dir, Limits())
    pcm = (np.random.default_rng(0).standard_normal(16000 * 7) * 0.1).astype(np.float32)
    feats = [pre.image(image_png(s, n)) for s, n in ((0, 512), (1, 512), (2, 256))]
    feats += [pre._audio(pcm[:n], 16000, "audio") for n in (16000 * 7, 16000 * 3)]
    items = [Item(f.kind, torch.from_numpy(f.values), f.grid_thw) for f in feats]
    engine = Encoder(ModelConfig(path=str(model_dir), load_format="random"), "cuda:0", graphs=False)
    args = (model_dir, "cuda:0", torch.bfloat16, "random", 0)
    vision, audio, norm = load_component("vision", *args), load_component("audio", *args), PixelNorm(model_dir)

    def per_item():
        out = []
        for item in items:
            values = item.values.to("cuda:0")
            if item.kind == "audio":
                h = audio(values.to(torch.bfloat16), feature_lens=torch.tensor([values.shape[1]], device="cuda:0"))
                out.append([h.last_hidden_state])
            else:
                r = vision(norm(values, torch.bfloat16), grid_thw=torch.tensor([item.grid_thw], device="cuda:0"))
                out.append([r.pooler_output, *r.deepstack_features])
        return out

    runs = {"transformers per item": per_item,
            "engine": lambda: [[e.embeds, *e.deepstack] for _, enc in engine.step([EncodeJob(items)]) for e in enc]}
    out = {}
    with torch.no_grad():
        for name, run in runs.items():
            run()  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out[name] = run()
            torch.cuda.synchronize()
            print(f"{name}: {1000 * (time.perf_counter() - t0):.1f} ms for {len(items)} items")
    for f, x, y in zip(feats, out["transformers per item"], out["engine"]):
        assert x[0].shape == y[0].shape == (f.num_tokens, x[0].shape[1]) and len(x) == len(y)
        for a, b in zip(x, y):
            rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
            assert rel < 2e-2, (f.kind, rel)


def test_vision_graphs_give_the_eager_towers_embeddings(tmp_path):
    """The vision tower replayed from CUDA graphs (one 512x512 image captured at start, two of them once seen
    twice) gives the eager tower's embeddings and DeepStack features, bit for bit or within bf16's rounding, step
    after step; a 256x256 image beside them runs eagerly until its list recurs. Times print."""
    from bench.workloads import image_png
    from services.encoder.engine import EncodeJob, Encoder, Item
    from services.model.build import build_full_skeleton
    from services.preprocess.media import Preprocessor
    from services.runtime.config import Limits, ModelConfig

    model_dir = build_full_skeleton(tmp_path / "model")
    pre = Preprocessor(model_dir, Limits())
    feats = [pre.image(image_png(s, n)) for s, n in ((0, 512), (1, 512), (2, 256))]
    items = [Item(f.kind, torch.from_numpy(f.values), f.grid_thw) for f in feats]
    model = ModelConfig(path=str(model_dir), load_format="random")
    eager = Encoder(model, "cuda:0", graphs=False)
    graphed = Encoder(model, "cuda:0")
    graphed.warm()
    graphs = graphed.vision_graphs.graphs
    assert len(graphs.graphs) == 1  # the warm-up's one 512x512 image
    for step, jobs in enumerate([[items[:1]], [items[:2]], [items[:2]], [items[:2]], [items[2:]], [items[:1]]]):
        want = [e for _, enc in eager.step([EncodeJob(j) for j in jobs]) for e in enc]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = [e for _, enc in graphed.step([EncodeJob(j) for j in jobs]) for e in enc]
        torch.cuda.synchronize()
        print(f"step {step}: {len(got)} images in {1000 * (time.perf_counter() - t0):.1f} ms, "
              f"{graphs.replays} replays so far")
        for x, y in zip(want, got):
            for a, b in zip([x.embeds] + x.deepstack, [y.embeds] + y.deepstack):
                rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
                assert rel < 1e-2, (step, rel)
    # replayed: the warm-up's own step, steps 0 and 5 (one image, captured at start), steps 2 and 3 (two images,
    # captured at their second sighting)
    assert graphs.replays == 5 and len(graphs.graphs) == 2
