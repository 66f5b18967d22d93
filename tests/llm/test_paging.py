"""The host-side paging that the flashinfer backends hand to their kernels (CPU: no kernel runs here), the
ladder of captured batch sizes, and the turns their copies take (CapturedGraphs, with a stand-in torch.cuda)."""

import types

import pytest
import torch

from services.llm.attention import SeqSlice, TorchAttention, kv_slots
from services.llm.flashinfer_attention import _page_table, _slots
from services.llm.graphs import ladder
from services.llm.kv_cache import KVCache


def test_slots_and_page_table_agree_with_the_reference_backend():
    cache = KVCache.allocate(1, 32, 4, 1, 8, torch.float32, "cpu")
    slices = [SeqSlice([7, 3, 9], 0, 10), SeqSlice([1, 30, 2, 5], 9, 1), SeqSlice([12], 2, 2), SeqSlice([4, 6], 4, 4)]
    ref = TorchAttention(cache, 1.0).plan(slices).slot_mapping.tolist()
    assert _slots(slices, 4) == ref
    indptr, indices, last = _page_table(slices, 4)
    assert indptr == [0, 3, 6, 7, 9]
    assert indices == [7, 3, 9, 1, 30, 2, 12, 4, 6]
    assert last == [2, 2, 4, 4]  # keys held in each sequence's last page, this step's included


def test_ladder_covers_every_batch_up_to_its_maximum():
    assert ladder(1) == [1]
    assert ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = ladder(200)
    assert sizes[-1] == 200 and sizes == sorted(set(sizes))
    assert all(b - a <= 32 for a, b in zip(sizes, sizes[1:]))


def test_compiled_projection_writes_keys_and_values_in_place_for_every_layer():
    """pre_attention with a backend's kv_slots, compiled: each layer's keys and values land in that layer's
    slots and nowhere else, and one compiled graph serves every layer past the first (the cache view's offset
    is symbolic: 48 layers must not mean 48 compilations, past the recompile limit and back to eager)."""
    from torch._dynamo.utils import counters

    from services.llm.layers import pre_attention

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(pre_attention, dynamic=True)
    layers, heads, kv_heads, d, hidden = 12, 4, 2, 8, 32
    cache = KVCache.allocate(layers, 20, 4, kv_heads, d, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randn((heads + 2 * kv_heads) * d, hidden, generator=g)
    slots = torch.tensor([3, 17, 40, 79])
    for layer in range(layers):
        x = torch.randn(4, hidden, generator=g)
        kv = kv_slots(cache, layer, slots)
        q, k, v = compiled(x, torch.ones(hidden), w, torch.ones(d), torch.ones(d), torch.ones(4, d), torch.zeros(4, d),
                           1e-6, heads, kv_heads, d, kv)
        assert torch.equal(kv[0][slots], k) and torch.equal(kv[1][slots], v)
        written = torch.zeros(cache.k.shape[1] * cache.k.shape[2], dtype=torch.bool)
        written[slots] = True
        assert not kv[0][~written].any() and not kv[1][~written].any()
    assert counters["stats"]["unique_graphs"] <= 2


def test_dense_attention_shares_kv_heads_and_masks_like_plain_softmax():
    """The code predictor's dense cache: 8 query heads over 2 kv heads, a first step of 2 rows, single rows
    after it, and a 3-row step after 2 cached (the masked case), each against softmax(q k^T) v written out."""
    from services.llm.attention import DenseAttention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, t = 3, 8, 2, 16, 8
    att = DenseAttention(torch.zeros(1, b, t, kv_heads, d), torch.zeros(1, b, t, kv_heads, d), d ** -0.5)
    keys, values = torch.zeros(b, 0, kv_heads, d), torch.zeros(b, 0, kv_heads, d)
    cached = 0
    for step, n in enumerate((2, 1, 1, 3)):
        q, k, v = (torch.randn(b * n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
        att.at(b, cached, n)
        if step % 2:  # as the projection's kernel writes them: into the rows kv_slots names
            from services.llm.attention import write_kv

            write_kv(att.kv_slots(0), k, v)
            out = att.forward(0, q, k, v, written=True)
        else:
            out = att.forward(0, q, k, v)
        keys, values = torch.cat([keys, k.view(b, n, kv_heads, d)], 1), torch.cat([values, v.view(b, n, kv_heads, d)], 1)
        kk, vv = keys.repeat_interleave(heads // kv_heads, 2), values.repeat_interleave(heads // kv_heads, 2)
        scores = torch.einsum("bnhd,bthd->bhnt", q.view(b, n, heads, d), kk) * d ** -0.5
        future = torch.arange(cached + n)[None, :] > torch.arange(cached, cached + n)[:, None]
        ref = torch.einsum("bhnt,bthd->bnhd", scores.masked_fill(future, float("-inf")).softmax(-1), vv)
        torch.testing.assert_close(out, ref.reshape(b * n, heads, d))
        cached += n


def test_decode_page_tables_follow_their_growing_and_replaced_block_tables():
    """flashinfer's decode plan: the page table DecodePages makes (each sequence's blocks kept as an array until
    its table grows or is replaced) and its new tokens' slots equal those built from the lists every step, padding
    rows included, over steps whose sequences grow by a block, are replaced by new tables (preempted), leave and
    come back."""
    import random

    import numpy as np

    from services.llm.decode_plan import DecodePages

    rng = random.Random(0)
    pages, bs, batch, scratch = DecodePages(), 4, 8, 999
    tables = {i: [rng.randrange(500) for _ in range(3)] for i in range(6)}
    lengths = {i: 4 * len(t) - rng.randrange(4) for i, t in tables.items()}
    for step in range(60):
        live = sorted(rng.sample(sorted(tables), rng.randint(0, 6)))
        slices = [SeqSlice(tables[i], lengths[i] - 1, 1) for i in live]
        indptr, ids, last, slots = pages(slices, bs, batch, scratch)
        want_ptr, want_ids, want_last = _page_table(slices, bs)
        pad = batch - len(slices)
        assert indptr == want_ptr + [want_ptr[-1] + 1 + i for i in range(pad)]
        assert ids.dtype == np.int32 and ids.tolist() == want_ids + [scratch] * pad
        assert last == want_last + [1] * pad
        assert slots == _slots(slices, bs) + [scratch * bs] * pad  # each new token's slot; padding at the scratch block
        for i in live:  # each sequence moves on a token; a new block when its last one is full
            lengths[i] += 1
            if lengths[i] > bs * len(tables[i]):
                tables[i] += [rng.randrange(500)]
        if step % 7 == 3:  # one sequence preempted and recomputed: a new table of other blocks
            i = rng.choice(sorted(tables))
            tables[i] = [rng.randrange(500) for _ in range(len(tables[i]))]


def test_one_op_max_is_builtins_max():
    """flashinfer's plans take the longest sequence with max() over a CPU tensor; one_op_max, put in their modules'
    globals, gives what builtins.max gives (a 0-d tensor of the largest element for a 1-d tensor) and passes every
    other use through, refusals included."""
    import types

    from services.llm.flashinfer_attention import one_op_max, quick_max

    lens = torch.tensor([7, 300, 12, 300, 5], dtype=torch.int32)
    got = one_op_max(lens)
    assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.item() == max(lens).item() == 300
    assert one_op_max(torch.tensor([4])).item() == 4
    assert one_op_max([3, 9, 2]) == 9 and one_op_max(5, 128) == 128 and one_op_max([], default=-1) == -1
    assert one_op_max(["a", "bb"], key=len) == "bb"
    for empty in (torch.tensor([]), []):
        with pytest.raises(ValueError):
            one_op_max(empty)
    module = types.SimpleNamespace()
    quick_max(module)
    assert module.max is one_op_max


class _FakeCuda:
    """What graphs.Graphs asks of torch.cuda, on the CPU: streams that do nothing, and graphs that record the body's
    outputs at capture and count their replays, in pools named by their first graph."""
    made = 0

    class CUDAGraph:
        def __init__(self):
            self.replays = 0
            _FakeCuda.made += 1
            self.name = f"pool{_FakeCuda.made}"

        def pool(self):
            return self.name

        def replay(self):
            self.replays += 1

    class _Null:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def wait_stream(self, other):
            pass

    pools: list = []  # each capture's pool argument

    class graph(_Null):
        def __init__(self, graph, pool=None, **kwargs):
            _FakeCuda.pools.append(pool)
            graph.name = pool or graph.name  # a graph captured into a pool hands out that pool

    Stream = stream = _Null

    @staticmethod
    def current_stream(device=None):
        return _FakeCuda._Null()

    @staticmethod
    def synchronize(device=None):
        pass


def test_a_ladder_records_each_size_once_largest_first_in_one_pool(monkeypatch):
    """Each size's body run twice outside the graph, then recorded, the largest first; every graph after the first
    in the first one's pool; a replay returns the outputs its capture made; a batch takes the smallest size over it."""
    from services.llm import graphs

    monkeypatch.setattr(graphs, "torch", types.SimpleNamespace(cuda=_FakeCuda, no_grad=torch.no_grad, device=torch.device))
    _FakeCuda.pools.clear()
    runs = []

    def body(b):
        runs.append(b)
        return (torch.full((b,), float(len(runs))),)

    ladder = graphs.Ladder([1, 4, 2], body, torch.device("cpu"))
    assert runs == [4, 4, 4, 2, 2, 2, 1, 1, 1] and ladder.sizes == [1, 2, 4] and ladder.max_batch == 4
    first = ladder.graphs.graphs[4][0].name
    assert _FakeCuda.pools == [None, first, first] and ladder.graphs.pool == first  # one pool: the first graph's
    assert ladder.replay(4)[0].tolist() == [3.0] * 4 and ladder.replay(1)[0].tolist() == [9.0]
    assert ladder.replay(4)[0].tolist() == [3.0] * 4 and ladder.replays == 3
    assert [ladder.size_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
