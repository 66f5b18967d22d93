"""The shared layers' fused forms against their plain ones."""

import torch

from services.llm.layers import MLP, fuse_projections_


def test_a_fused_mlp_equals_the_plain_one():
    """gate and up in one GEMM, the residual added in the down GEMM: what the separate projections give. The
    fused form adds into the residual itself (the layer's own, read by nothing after) and returns it."""
    torch.manual_seed(0)
    mlp = MLP(32, 48)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    plain, plain_res = mlp(x), mlp(x, residual)
    fuse_projections_(torch.nn.ModuleList([mlp]))
    assert mlp.gate_up_weight is not None and mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    torch.testing.assert_close(mlp(x), plain)
    consumed = residual.clone()
    out = mlp(x, consumed)
    torch.testing.assert_close(out, plain_res)
    assert out is consumed  # added into in place: no copy of the residual first
    torch.testing.assert_close(mlp(x[None], residual[None])[0], plain_res)  # not a matrix: the plain form


def test_a_moe_block_with_a_shared_expert_adds_the_residual_once():
    """The talker's block: routed experts (the residual added in their kernels) plus the gated shared expert."""
    from types import SimpleNamespace

    from services.llm.context import step_context
    from services.talker.model import SharedExpertMoE

    torch.manual_seed(0)
    moe = SharedExpertMoE(SimpleNamespace(hidden_size=16, num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2,
                                          norm_topk_prob=True, shared_expert_intermediate_size=12))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    fuse_projections_(moe)
    x, residual = torch.randn(6, 16), torch.randn(6, 16)
    with step_context(None, "loop"):
        out, alone = moe(x, residual), moe(x)
        logits = x @ moe.gate.weight.t()
        weights, ids = logits.softmax(-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = torch.zeros_like(x)
        for t in range(6):
            for w, e in zip(weights[t], ids[t]):
                gate, up = (x[t] @ moe.experts.gate_up_proj[e].t()).chunk(2)
                routed[t] += w * (torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e].t()
        shared = torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    torch.testing.assert_close(alone, routed + shared, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, residual + routed + shared, rtol=1e-5, atol=1e-5)
