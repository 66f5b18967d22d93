"""Captured decode attention through flashinfer's tensor-core kernels, planned through its wrapper or directly (with
plans kept), against the PyTorch reference attention over the same paged cache."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def capture(attn, heads: int, kv_heads: int, dim: int, layer: int):
    """`attn` (a DecodeAttention) planned all padding and its forward over `layer` captured in a CUDA graph, as the
    engines capture it, after a warm-up on a side stream. -> (graph, q, k, v, out): the graph's inputs and output."""
    q = torch.zeros(attn.batch, heads, dim, dtype=torch.bfloat16, device="cuda:0")
    k = torch.zeros(attn.batch, kv_heads, dim, dtype=torch.bfloat16, device="cuda:0")
    v = torch.zeros_like(k)
    attn.plan([])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.forward(layer, q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = attn.forward(layer, q, k, v)
    return graph, q, k, v, out


def schedule(wrapper) -> dict[str, list[int]]:
    """What a split decode plan of flashinfer 0.6.13 (PrefillPlan, CUDA-graph mode) wrote into `wrapper`'s pinned
    int workspace for the kernels to read, by name: each CTA's request and tiles (as many as its valid mask holds
    ones; the rest of their room is what earlier plans left, which the kernels skip), the output and merge row
    pointers, the chunk of keys, the total rows and the valid mask."""
    info = [int(x) for x in wrapper._plan_info]  # PrefillPlanInfo::ToVector
    padded, rows = info[0], info[1]
    buf = wrapper._pin_memory_int_workspace_buffer

    def ints(offset: int, n: int) -> list[int]:
        return buf[offset:offset + 4 * n].view(torch.int32).tolist()

    mask = buf[info[12]:info[12] + padded].tolist()
    ctas = sum(mask)
    assert mask == [1] * ctas + [0] * (padded - ctas), "a valid mask is its CTAs' ones, then padding"
    return {"request": ints(info[4], ctas), "qo_tile": ints(info[5], ctas), "kv_tile": ints(info[6], ctas),
            "merge_indptr": ints(info[7], rows + 1), "o_indptr": ints(info[8], rows + 1), "chunk": ints(info[9], 1),
            "total_rows": ints(info[2], 1), "mask": mask}


@pytest.mark.parametrize("direct", [False, True])
def test_decode_attention_matches_the_reference_in_a_graph(direct, monkeypatch):
    from services.llm import flashinfer_attention
    from services.llm.attention import SeqSlice, TorchAttention
    from services.llm.flashinfer_attention import WORKSPACE_BYTES, DecodeAttention
    from services.llm.kv_cache import KVCache

    if not direct:  # another flashinfer than the one the direct plan knows: every plan through the wrapper
        monkeypatch.setattr(flashinfer_attention, "DIRECT_PLAN_VERSION", "none")
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
    attn = DecodeAttention(cache, dim ** -0.5, heads, batch, 256, workspace)
    attn.kept = None  # every plan run: the kept plans have a test of their own below
    wrapper_plans = []
    plan = attn.wrapper.plan
    attn.wrapper.plan = lambda *a, **kw: wrapper_plans.append(1) or plan(*a, **kw)
    graph, q, k, v, out = capture(attn, heads, kv_heads, dim, 1)
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
        print(f"direct plan {direct}: relative L2 against the "
              f"reference, worst row {err:.4f}")
        assert err < 0.02  # bf16 inputs, float32 accumulation either way
    # flashinfer's wrapper planned the capture alone where the plans are direct, every step otherwise
    assert len(wrapper_plans) == (1 if direct else 3), wrapper_plans


def test_a_step_planned_behind_a_busy_device_attends_by_its_own_plan_not_the_next_ones():
    """Two prompt steps planned and launched while the device still runs earlier work (held busy by a sleep kernel),
    as a talker's steps go out ahead of a GPU it shares: the first step's schedule reaches the device by a copy
    queued behind that work, out of the wrapper's pinned buffer the second plan rewrites (PlanCopy makes it wait).
    Each step must attend as the reference does over its own sequences."""
    from services.llm.attention import SeqSlice, TorchAttention
    from services.llm.flashinfer_attention import FlashInferAttention
    from services.llm.kv_cache import KVCache

    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 16, 2, 128, 16  # the talker's heads
    cache = KVCache.allocate(1, 128, bs, kv_heads, dim, torch.bfloat16, "cuda:0")
    cache.k.normal_()
    cache.v.normal_()
    first = [SeqSlice(list(range(0, 4)), 0, 40), SeqSlice(list(range(4, 13)), 100, 30), SeqSlice(list(range(13, 48)), 500, 1)]
    second = [SeqSlice(list(range(48, 96)), 0, 700)]
    attention = FlashInferAttention(cache, dim ** -0.5, heads)
    q, kv = torch.randn(40, heads, dim, device="cuda:0").bfloat16(), torch.randn(40, kv_heads, dim, device="cuda:0").bfloat16()
    attention.plan(first[:1]).forward(0, q, kv, kv)  # its kernels loaded (or compiled) first
    torch.cuda.synchronize()
    steps = []
    torch.cuda._sleep(1_000_000_000)  # about half a second of the device busy before anything below runs
    for slices in (first, second):
        rows = sum(s.n for s in slices)
        q = torch.randn(rows, heads, dim, dtype=torch.bfloat16, device="cuda:0")
        k = torch.randn(rows, kv_heads, dim, dtype=torch.bfloat16, device="cuda:0")
        v = torch.randn_like(k)
        steps.append((slices, q, k, v, attention.plan(slices).forward(0, q, k, v)))
    assert attention.copy.waits == 1  # the second plan found the first one's copy still queued
    torch.cuda.synchronize()
    for slices, q, k, v, got in steps:
        want = TorchAttention(cache, dim ** -0.5).plan(slices).forward(0, q, k, v, written=True).float()
        err = ((got.float() - want).norm() / want.norm()).item()
        print(f"{len(slices)} sequences, {q.shape[0]} rows: relative L2 against the reference {err:.4f}")
        assert err < 0.02


@pytest.mark.parametrize("heads, kv_heads, batch, rows, shortest, longest, steps", [
    (32, 4, 32, 32, 490, 560, 300),  # the thinker's heads, a full graph
    (16, 2, 4, 3, 20, 60, 120),  # the talker's, three requests and a padding row
])
def test_a_kept_decode_plan_is_the_one_flashinfer_makes_again_and_covers_every_key(heads, kv_heads, batch, rows,
                                                                                    shortest, longest, steps):
    """`rows` sequences of `shortest` to `longest` tokens decoding `steps` more in a graph of `batch`, planned directly
    with plans kept (KeptPlan): whenever a plan is kept, flashinfer's own plan for the same rows (on a second wrapper)
    writes the schedule the kept one last wrote (every entry its kernels read: schedule()); and at every step each row
    attends to its newest key (made to dominate its scores), which a schedule whose tiles stop short of the row's end
    would miss."""
    from services.llm.attention import SeqSlice
    from services.llm.flashinfer_attention import WORKSPACE_BYTES, DecodeAttention
    from services.llm.kv_cache import KVCache

    torch.manual_seed(0)
    dim, bs = 128, 16
    # Two runs of `rows` new sequences each, as an engine serves one batch after another: the second's plans are
    # kept or not against the first's
    lengths = [torch.randint(shortest, longest, (rows,)).tolist() for _ in range(2)]
    need = [-(-(n + steps + 1) // bs) for run in lengths for n in run]
    cache = KVCache.allocate(1, sum(need) + 1, bs, kv_heads, dim, torch.bfloat16, "cuda:0")
    cache.k.normal_()
    cache.v.normal_()
    starts = [sum(need[:i]) for i in range(len(need))]
    blocks = [list(range(s, s + n)) for s, n in zip(starts, need)]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda:0")
    attn = DecodeAttention(cache, dim ** -0.5, heads, batch, sum(need), workspace)
    fresh = DecodeAttention(cache, dim ** -0.5, heads, batch, sum(need), torch.zeros_like(workspace))
    fresh.kept = None  # flashinfer's own plan for every step, to compare the kept ones with
    fresh.plan([])
    graph, q, k, v, out = capture(attn, heads, kv_heads, dim, 0)
    compared = 0
    for run in range(2):
        runs_blocks = blocks[run * rows:(run + 1) * rows]
        tables = [b[:-(-(n + 1) // bs)] for b, n in zip(runs_blocks, lengths[run])]  # grown a block at a time
        for step in range(steps):
            for t, b, n in zip(tables, runs_blocks, lengths[run]):
                if len(t) * bs < n + step + 1:
                    t.append(b[len(t)])
            slices = [SeqSlice(t, n + step, 1) for t, n in zip(tables, lengths[run])]
            u = torch.randn(batch, kv_heads, dim, device="cuda:0")
            q.copy_(u.repeat_interleave(heads // kv_heads, dim=1))
            k.copy_(4 * u)  # q.k about 4 x 128 against about +-11 for the others: after scaling, e^45 against e^1
            v.normal_()
            kept = attn.kept.kept
            attn.plan(slices, steady=step > 0)
            graph.replay()
            if attn.kept.kept > kept:
                fresh.plan(slices)
                assert [int(x) for x in attn.wrapper._plan_info] == [int(x) for x in fresh.wrapper._plan_info]
                assert schedule(attn.wrapper) == schedule(fresh.wrapper), (run, step)
                compared += 1
            want = v.float().repeat_interleave(heads // kv_heads, dim=1)
            cos = torch.nn.functional.cosine_similarity(out.float()[:rows], want[:rows], dim=-1)
            assert cos.min().item() > 0.99, (run, step, cos.min().item())
    print(f"{2 * steps} steps: {attn.kept.plans} plans run, {attn.kept.kept} kept, chunk {attn.kept.chunk} pages")
    assert compared == attn.kept.kept > steps and attn.kept.plans >= 2 and attn.advanced > steps
