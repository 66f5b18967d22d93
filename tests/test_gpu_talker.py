"""The native talker at full size on one GPU (seeded random weights, bf16): the code predictor's frame
replayed from its CUDA graph gives what the same frame gives run eagerly."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_captured_predictor_frame_equals_the_eager_one(tmp_path):
    from services.model.build import build_full_skeleton
    from services.talker.engine import NativeTalker

    engine = NativeTalker(build_full_skeleton(tmp_path / "model"), "cuda:0", torch.bfloat16, "random", 0, kv_blocks=256,
                          max_seqs=16, moe="grouped", cuda_graph_max_batch=8)
    assert engine.cp_graphs is not None and engine.cp_graphs.size_for(3) == 4
    vocab = engine.talker.get_input_embeddings().num_embeddings

    def fill():
        engine.cp_ints.zero_()
        engine.cp_floats.zero_()
        engine.cp_hidden.zero_()
        engine.cp_ints[:, :3] = torch.tensor([[5, 900, vocab - 1030], [50, 50, 50], [0, 7, 9], [0, 32, 64]])
        engine.cp_floats[:, :3] = torch.tensor([[0.0, 0.9, 1.0], [1.0, 0.8, 0.8]])
        engine.cp_hidden[:3] = torch.randn(3, engine.cp_hidden.shape[1], generator=torch.Generator().manual_seed(0)).cuda()

    with torch.no_grad():
        fill()
        codes, embeds = (t.clone() for t in engine._predict_body(4))
        fill()
        g_codes, g_embeds = engine.cp_graphs.replay(4)
    assert torch.equal(g_codes[:3], codes[:3])  # greedy and seeded rows alike
    torch.testing.assert_close(g_embeds[:3], embeds[:3], rtol=0, atol=0)
