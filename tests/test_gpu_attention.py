"""Captured decode attention through flashinfer, either kernel (its tensor-core path, its keys split or not:
`decode_split_kv_max_batch`, and its CUDA-core decode kernel: `decode_tensor_cores`), against the PyTorch
reference attention over the same paged cache."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tensor_cores,split_kv", [(True, True), (True, False), (False, True)])
def test_decode_attention_matches_the_reference_in_a_graph(tensor_cores, split_kv):
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
        need = -(-(n + 1) // bs)
        tables.append(free[:need])
        free = free[need:]
    slices = [SeqSlice(t, n, 1) for t, n in zip(tables, lengths)]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda:0")
    attn = DecodeAttention(cache, dim ** -0.5, heads, batch, 256, workspace, tensor_cores, split_kv)
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
    n = len(slices)
    q[:n].normal_()
    k[:n].normal_()
    v[:n].normal_()
    attn.plan(slices)
    graph.replay()
    torch.cuda.synchronize()
    ref = TorchAttention(cache, dim ** -0.5).plan(slices)
    want = ref.forward(1, q[:n].clone(), k[:n].clone(), v[:n].clone(), written=True).float()  # keys written by the replay
    got = out[:n].float()
    err = ((got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))).max().item()
    print(f"tensor cores {tensor_cores}, keys split {split_kv}: relative L2 against the reference, worst row {err:.4f}")
    assert err < 0.02  # bf16 inputs, float32 accumulation either way
