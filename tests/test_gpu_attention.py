"""Captured decode attention through flashinfer, either kernel (its tensor-core path, its keys split or not:
`decode_split_kv_max_batch`, planned through flashinfer's wrapper or directly: `decode_direct_plan`, and its
CUDA-core decode kernel: `decode_tensor_cores`), against the PyTorch reference attention over the same paged cache."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tensor_cores,split_kv,direct", [(True, True, False), (True, False, False), (False, True, False),
                                                          (True, True, True), (True, False, True)])
def test_decode_attention_matches_the_reference_in_a_graph(tensor_cores, split_kv, direct):
    from services.llm.attention import SeqSlice, TorchAttention
    from services.llm.flashinfer_attention import WORKSPACE_BYTES, DecodeAttention
    from services.llm.kv_cache import KVCache

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, batch = 32, 4, 128, 16, 8  # the thinker's heads; a graph of 8 holding 5 rows
    cache = KVCache.allocate(2, 257, bs, kv_heads, dim, torch.bfloat16, "cuda:0")
    cache.k.normal_()
    cache.v.normal_()
    lengths = (1, 17, 300, 512, 1000)  # tokens cached before this step's one
    tables, free = [], list(range(256))
    for n in lengths:
        need = -(-(n + 10) // bs)  # room for the second step, 9 tokens on
        tables.append(free[:need])
        free = free[need:]
    slices = [SeqSlice(t, n, 1) for t, n in zip(tables, lengths)]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda:0")
    attn = DecodeAttention(cache, dim ** -0.5, heads, batch, 256, workspace, tensor_cores, split_kv, direct)
    wrapper_plans = []
    plan = attn.wrapper.plan
    attn.wrapper.plan = lambda *a, **kw: wrapper_plans.append(1) or plan(*a, **kw)
    q = torch.zeros(batch, heads, dim, dtype=torch.bfloat16, device="cuda:0")
    k = torch.zeros(batch, kv_heads, dim, dtype=torch.bfloat16, device="cuda:0")
    v = torch.zeros_like(k)
    attn.plan([])  # captured all padding, as the engines capture it
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.forward(1, q, k, v)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = attn.forward(1, q, k, v)
    # Two steps: the sequences as above, then three of them a few tokens on (a direct plan's second staging buffer).
    later = [SeqSlice(t, n + 9, 1) for t, n in zip(tables[1:4], lengths[1:4])]
    for step in (slices, later):
        n = len(step)
        q[:n].normal_()
        k[:n].normal_()
        v[:n].normal_()
        attn.plan(step)
        graph.replay()
        torch.cuda.synchronize()
        ref = TorchAttention(cache, dim ** -0.5).plan(step)
        want = ref.forward(1, q[:n].clone(), k[:n].clone(), v[:n].clone(), written=True).float()  # keys written by the replay
        got = out[:n].float()
        err = ((got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))).max().item()
        print(f"tensor cores {tensor_cores}, keys split {split_kv}, direct plan {direct}: relative L2 against the "
              f"reference, worst row {err:.4f}")
        assert err < 0.02  # bf16 inputs, float32 accumulation either way
    # flashinfer's wrapper planned the capture alone where the plans are direct, every step otherwise
    assert len(wrapper_plans) == (1 if direct else 3), wrapper_plans
