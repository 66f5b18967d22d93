"""The few-row projections' Triton kernel (services/llm/triton_linear.py) on the GPU, at the shape it takes (the
thinker's output projection, its tiles), against cuBLAS, eagerly and replayed from a CUDA graph; and inside the
compiled output-projection piece the thinker's decode graphs run (layers.post_attention, fused)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_partials_track_cublas_in_and_out_of_a_graph():
    from services.llm import fusion, layers, triton_linear

    fusion.fuse()
    gen = torch.Generator("cuda").manual_seed(0)
    (n, k), = triton_linear.TILES  # the shapes measured to gain: the thinker's output projection alone
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) / k ** 0.5
    norm_w = torch.rand(n, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    for rows in (1, 8, 13, 32, 64):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        res = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
        ref = F.linear(x, w)
        got = triton_linear.linear(x, w)
        # float32 sums rounded once, as cuBLAS's: the same bf16 value or its neighbour, give or take what summing in
        # another order moves a float32 sum (about 2^-24 of its terms' magnitudes, times the square root of K)
        mag = x.float().abs() @ w.float().abs().T
        tol = ref.float().abs() * 2 ** -7 + mag * 2 ** -16
        assert got.dtype == torch.bfloat16 and ((got.float() - ref.float()).abs() <= tol).all(), rows
        piece = lambda: layers.post_attention(res, x, w, norm_w, 1e-6)  # noqa: E731
        eager = piece()
        want = res + ref  # cuBLAS's product, rounded to bf16, then added
        tol = (ref.float().abs() + res.float().abs()) * 2 ** -6 + mag * 2 ** -16  # a bf16 step of either addend's size
        assert ((eager[0].float() - want.float()).abs() <= tol).all(), rows
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            piece()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = piece()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager)), rows
