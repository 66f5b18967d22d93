"""The thinker's captured decode path, host side, on the CPU: the step's inputs (StepInputs) and its attention's
slots and page table sent by one copy (a shared Staging), the page table planned through flashinfer's wrapper or
directly (decode_direct_plan), overlapped launches reading the pending step's tokens, and draws inside the step.

flashinfer and CUDA graphs do not run here, so a stand-in takes flashinfer's place: its wrapper fills the page table
buffers as flashinfer's plan does and attends over the paged cache by reading them back (the reference attention
over the same pages), and the decode "graph" is its body run eagerly on each replay. The real kernels and graphs are
tests/test_gpu_attention.py's and tests/test_gpu_thinker.py's (marked gpu). What this checks is everything the
host puts in the device buffers the graph reads: with any of it wrong, the tokens leave transformers' greedy ones.
"""

import sys

import pytest
import torch

from references import native_thinker, thinker_seq
from stand_ins import chunk_pages, eager_graphs, stand_in_flashinfer
from test_thinker_engine import CASES, N, expected, reference, run_staggered  # noqa: F401 (fixtures)

from services.thinker.decode import TokenGraphs
from services.thinker.engine import NativeThinker


def captured(tiny_model, monkeypatch, max_batch: int, direct: bool = True, **engine_args) -> NativeThinker:
    """A native thinker on the CPU with decode "graphs" up to `max_batch` through the stand-ins."""
    stand_in_flashinfer(monkeypatch, direct)
    eager_graphs(monkeypatch)
    engine = native_thinker(tiny_model, **engine_args)
    engine.decode = TokenGraphs(engine, max_batch)
    engine.decode.graphs.graphs.attention = engine.decode.graphs.attention
    return engine


def run_together(engine, seqs: list) -> None:
    for s in seqs:
        engine.add(s)
    while any(not s.done for s in seqs):
        engine.step([s for s in seqs if not s.done])
    for s in seqs:
        engine.free(s)


@pytest.mark.parametrize("arrivals", ["staggered", "together", "preempted"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("plan", ["wrapper", "as served"])
def test_captured_decode_host_path_gives_transformers_greedy_tokens(tiny_model, reference, expected, monkeypatch,
                                                                     overlap, plan, arrivals):
    """Four requests arriving a step apart (their first steps mixed with others' prompts, eager; the rest in decode
    graphs of 1, 2 and 4 rows) or together, their KV pages 4 tokens long so the page tables grow every few steps
    (rebuilt; between, a step of the same rows advances the last one's table and positions); planned directly (as
    served: every plan after the capture's skips the wrapper, and a plan whose schedule would not change is not run:
    the stand-in checks that its tiles still cover every row) or through the wrapper (another flashinfer). Each
    graph loads its inputs from the staging buffer of its turn, takes the pending step's tokens from the last
    graph's draws, and writes its own to the host, where the overlapped steps read them."""
    # preempted: a cache of 24 blocks, too few for all four, so some are preempted and recomputed, and graphs of
    # four run two or three rows over a cache nearly full (their padding rows' pages on top of every block)
    cache = {"kv_blocks": 24, "max_batched_tokens": 9} if arrivals == "preempted" else {}
    direct = plan != "wrapper"
    engine = captured(tiny_model, monkeypatch, 4, direct, overlap=overlap, block_size=4, step_graphs=0, **cache)
    seqs = [thinker_seq(reference, case, N) for case in CASES.values()]
    (run_staggered if arrivals != "together" else run_together)(engine, seqs)
    for name, seq in zip(CASES, seqs):
        assert seq.generated == expected[name], name
    attention = engine.decode.graphs.attention
    wrappers = [a.wrapper for a in attention.values()]
    replays = engine.decode.replays
    assert replays > N // 2
    assert sum(a.advanced for a in attention.values()) >= N // 2 - 2
    if arrivals == "preempted":
        assert engine.scheduler.preemptions > 0
    kept = [a.kept for a in attention.values() if a.kept is not None]
    assert len(kept) == (len(attention) if direct else 0)
    skipped = sum(k.kept for k in kept)
    before = len(wrappers) if direct else 0  # each graph's second staging buffer planned direct for capture
    assert sum(w.direct_plans for w in wrappers) == (replays - skipped + before if direct else 0)
    if direct:
        assert skipped >= N // 2 and sum(k.plans for k in kept) == sum(w.direct_plans for w in wrappers)
    assert all(w.wrapper_plans == 1 for w in wrappers) if direct else sum(w.wrapper_plans for w in wrappers) > N
    if overlap:
        assert engine.overlapped >= N // 2
    assert engine.scheduler.allocator.used == 0 and not engine.states


@pytest.mark.parametrize("direct", [False, True])
def test_a_graph_of_few_rows_over_a_full_cache_has_room_for_its_padding_pages(monkeypatch, direct):
    """Two sequences holding every block of the cache, in a graph of four: their pages and one scratch page for
    each padding row, more page ids than the cache has blocks, all land in the page table."""
    from services.llm.attention import SeqSlice
    from services.llm.flashinfer_attention import DecodeAttention
    from services.llm.kv_cache import KVCache

    stand_in_flashinfer(monkeypatch, direct)
    cache = KVCache.allocate(1, 9, 4, 2, 8, torch.float32, "cpu")  # 8 blocks and the scratch one
    attention = DecodeAttention(cache, 1.0, 2, 4, 8, None).plan([])
    attention.plan([SeqSlice([0, 2, 4, 6], 15, 1), SeqSlice([1, 3, 5, 7], 15, 1)])  # 16 tokens each: 4 blocks
    assert attention.indptr.tolist() == [0, 4, 8, 9, 10]
    assert attention.indices[:10].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 8]
    assert attention.last.tolist() == [4, 4, 1, 1] and attention.slot_mapping.tolist() == [27, 31, 32, 32]
    assert attention.wrapper.direct_plans == direct


def test_a_replay_is_steady_only_for_the_last_ones_rows_one_token_on():
    from services.llm.decode_plan import Replays
    from services.llm.scheduler import SeqState, Work

    a, b = SeqState(tokens=[]), SeqState(tokens=[])
    replays = Replays()
    assert not replays.steady(4, [Work(a, 10, 1), Work(b, 20, 1)])  # nothing before it
    assert replays.steady(4, [Work(a, 11, 1), Work(b, 21, 1)])
    assert not replays.steady(4, [Work(a, 11, 1), Work(b, 21, 1)])  # not a token on
    assert not replays.steady(4, [Work(b, 22, 1), Work(a, 12, 1)])  # other rows first
    assert not replays.steady(8, [Work(b, 23, 1), Work(a, 13, 1)])  # another graph
    assert not replays.steady(8, [Work(b, 24, 1)])  # fewer rows
    assert replays.steady(8, [Work(b, 25, 1)])
    replays.forget()  # a step outside the graphs
    assert not replays.steady(8, [Work(b, 26, 1)])


class LoggedEvent:
    """A CUDA event's part PlanCopy uses, logging each call; its copy shows as not yet run `busy` times."""

    def __init__(self, log: list, busy: int):
        self.log, self.busy = log, busy

    def record(self, stream=None):
        self.log.append("record")

    def query(self) -> bool:
        self.log.append("query")
        self.busy -= 1
        return self.busy < 0

    def synchronize(self):
        self.log.append("synchronize")


@pytest.mark.parametrize("which", ["prefill", "decode", "decode-direct"])
def test_each_plan_waits_for_the_last_plans_copy_before_rewriting_its_buffer(monkeypatch, which):
    """flashinfer's plan copies its schedule to the device out of a pinned buffer of the wrapper's own, which the next
    plan rewrites: each plan first waits (where the copy has not run yet) for the last one's, then marks its own. Without
    it a step launched ahead of the device attended by the next step's schedule (an illegal memory access in the talker
    at 32 speech requests through the mesh on one H200)."""
    from services.llm.attention import SeqSlice
    from services.llm.flashinfer_attention import DecodeAttention, FlashInferAttention
    from services.llm.kv_cache import KVCache

    stand_in_flashinfer(monkeypatch, which != "decode")
    log = []

    class PrefillWrapper:
        def __init__(self, workspace, layout):
            pass

        def plan(self, *args, **kwargs):
            log.append("plan")

    sys.modules["flashinfer"].BatchPrefillWithPagedKVCacheWrapper = PrefillWrapper
    cache = KVCache.allocate(1, 9, 4, 2, 8, torch.float32, "cpu")
    if which == "prefill":
        attention = FlashInferAttention(cache, 1.0, 2, workspace=torch.zeros(1))
    else:
        attention = DecodeAttention(cache, 1.0, 2, 4, 8, None).plan([])
        attention.kept = None  # every plan run: this is about their copies
        wrapper = attention.wrapper
        plan, module_plan = wrapper.plan, wrapper._cached_module.plan
        wrapper.plan = lambda *a, **kw: log.append("plan") or plan(*a, **kw)
        wrapper._cached_module.plan = lambda *a: log.append("plan") or module_plan(*a)
    attention.copy.event = LoggedEvent(log, busy=1)  # as on a GPU: the first copy still queued at the second plan
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for tokens in (5, 6, 7):
        attention.plan([SeqSlice([0, 1], tokens, 1)])
    assert log == ["plan", "record", "query", "synchronize", "plan", "record", "query", "plan", "record"]
    assert attention.copy.waits == 1


@pytest.mark.parametrize("batch,max_tiles", [(32, 66), (8, 16), (5, 8)])
def test_a_kept_plan_is_the_one_flashinfer_would_make_again(batch, max_tiles):
    """KeptPlan against flashinfer's choice of chunk (chunk_pages): rows growing a page every 16 steps or so, now and
    then one replaced by a shorter sequence. Whenever it keeps the last plan, a new one would have chosen the same
    chunk and given every row the same tiles; and it keeps most steps' plans."""
    import numpy as np

    from services.llm.decode_plan import KeptPlan

    rng = np.random.default_rng(batch)
    kept = KeptPlan(max_tiles)

    def plan(pages):
        chunk = chunk_pages(pages.tolist(), 16, max_tiles)
        kept.planned(pages.copy(), chunk)
        return chunk

    pages = rng.integers(8, 200, batch)
    chunk, keeps, shorter = plan(pages), 0, 0
    for _ in range(2000):
        pages = pages + (rng.random(batch) < 1 / 16)
        if rng.random() < 0.02:  # a row's sequence replaced by a shorter one
            row = rng.integers(batch)
            pages[row] = rng.integers(1, pages[row] + 1)
            shorter += 1
        if kept.keeps(pages):
            keeps += 1
            assert chunk_pages(pages.tolist(), 16, max_tiles) == chunk
            assert (-(-pages // chunk) == kept.tiles).all()
        else:
            chunk = plan(pages)
    assert shorter > 20 and keeps > 1500 and kept.kept == keeps and kept.plans == 2001 - keeps
    # A row shorter than it was at the plan, its tiles the same: a smaller chunk may fit now, and would be chosen
    two = KeptPlan(3)
    two.planned(np.array([10, 10]), chunk_pages([10, 10], 128, 3))  # 128-token pages: chunks from one page up
    assert two.chunk == 10 and chunk_pages([10, 5], 128, 3) == 5 and not two.keeps(np.array([10, 5]))
    assert two.keeps(np.array([10, 10]))
    fresh = KeptPlan(max_tiles)
    assert not fresh.keeps(pages)  # nothing planned yet


def test_a_plan_kept_as_rows_grow_a_page_is_the_one_a_full_check_keeps():
    """KeptPlan.grows (some rows a page longer than at the last check, which kept or made the plan) agrees with
    keeps() over the whole table, step after step of growth, at every chunk: a row that fills its last chunk exactly
    and grows a page has one tile more, so the plan is not kept."""
    import numpy as np

    from services.llm.decode_plan import KeptPlan

    rng = np.random.default_rng(7)
    outcomes = set()
    for _ in range(400):
        pages = rng.integers(1, 60, rng.integers(1, 12))
        chunk = int(rng.integers(1, 12))
        quick, full = KeptPlan(10_000), KeptPlan(10_000)
        quick.planned(pages.copy(), chunk)
        full.planned(pages.copy(), chunk)
        now = pages.copy()
        for _ in range(6):
            rows = np.flatnonzero(rng.random(len(now)) < 0.3)
            before = now[rows].tolist()
            now = now.copy()
            now[rows] += 1
            same = quick.grows(before)
            assert same == full.keeps(now), (pages.tolist(), chunk, before)
            outcomes.add(same)
            if not same:
                break
    assert outcomes == {True, False}


def test_a_table_advanced_a_token_at_a_time_equals_one_built_afresh():
    """DecodeTable.advance against DecodePages: nine rows of staggered lengths (five of them due a page at the same
    steps, the other four one or two at a time: both ways of growing), 4-token pages, 40 steps each a token on
    (a block appended to a table as its last page fills, one table two blocks ahead of need); each step's page ids,
    pointers, last pages' lengths, slots and key counts as a fresh build gives them. A full page whose table has
    no next block is not advanced."""
    import numpy as np

    from services.llm.attention import SeqSlice
    from services.llm.decode_plan import DecodePages, DecodeTable

    bs, batch, scratch = 4, 12, 999
    lengths = [3, 4, 5, 9, 16, 7, 11, 15, 19]  # tokens cached before the first step's one
    tables = [list(range(100 * i, 100 * i + -(-(n + 1) // bs))) for i, n in enumerate(lengths)]
    tables[1] += [150, 151]  # blocks ahead of need: not pages until the row reaches them

    def build(slices):
        indptr, indices, last, slots = DecodePages()(slices, bs, batch, scratch)
        return DecodeTable(slices, np.array(indptr, dtype=np.int32), indices, np.array(last, dtype=np.int32),
                      np.array(slots, dtype=np.int64), bs)

    t = build([SeqSlice(tb, n, 1) for tb, n in zip(tables, lengths)])
    grew = many = 0
    for step in range(1, 41):
        for tb, n in zip(tables, lengths):
            if len(tb) * bs < n + step + 1:
                tb.append(tb[-1] + 1)
        slices = [SeqSlice(tb, n + step, 1) for tb, n in zip(tables, lengths)]
        due = int((t.last[:len(slices)] == bs).sum())
        grew, many = grew + (due > 0), many + (due > 4)
        assert t.advance(slices)
        want = build(slices)
        for name in ("indptr", "indices", "last", "slots", "kv_lens"):
            assert getattr(t, name).tolist() == getattr(want, name).tolist(), (step, name)
    assert grew >= 20 and many >= 5
    short = [SeqSlice([7], 3, 1)]  # its one page full after this token: the next has no block
    t = build(short)
    before = (t.indices.tolist(), t.last.tolist())
    assert not t.advance([SeqSlice([7], 4, 1)]) and (t.indices.tolist(), t.last.tolist()) == before
