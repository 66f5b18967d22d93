"""Stand-ins for flashinfer and CUDA graphs, so the host side of the captured decode paths runs on the CPU: a
wrapper that fills the page-table buffers as flashinfer's plan does and attends by reading them back, and "graphs"
whose replay runs their body. The real kernels and graphs are the GPU tests' (marked gpu)."""

import sys
import types

import torch

from services.llm import graphs


STAND_IN_SMS = 4  # the stand-in device's multiprocessors (sm_count): a split plan's tiles fit 8 CTAs a KV head


def chunk_pages(pages: list[int], page_size: int, max_tiles: int) -> int:
    """flashinfer 0.6.13's choice of a split decode plan's chunk of pages (PrefillBinarySearchKVChunkSize under CUDA
    graphs, one query tile a row): the least chunk from 128 tokens up whose tiles fit `max_tiles`, or the longest row."""
    low, high = max(128 // page_size, 1), max(max(pages), 1)
    while low < high:
        mid = (low + high) // 2
        if sum(-(-max(p, 1) // mid) for p in pages) > max_tiles:
            low = mid + 1
        else:
            high = mid
    return low


class StandInWrapper:
    """flashinfer 0.6.13's BatchDecodeWithPagedKVCacheWrapper as DecodeAttention uses it, run in PyTorch. Its module's
    plan chooses the chunk of pages as flashinfer's does and writes it where flashinfer's schedule holds it; run()
    checks that the rows' lengths in the page table are ones the last plan's tiles cover."""

    def __init__(self, workspace, layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                 paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        assert layout == "NHD" and use_cuda_graph
        self.indptr, self.indices, self.last = paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer
        # What DecodeAttention's direct plan checks and passes through
        self._backend, self._jit_module, self.is_cuda_graph_enabled = "fa2", None, True
        self._float_workspace_buffer = self._int_workspace_buffer = workspace
        self._pin_memory_int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)
        self.tiles = None  # each row's tiles at the last direct plan (None: planned through the wrapper)
        self._cached_module = types.SimpleNamespace(plan=self._module_plan)
        self.wrapper_plans = self.direct_plans = 0

    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, q_data_type=None, kv_data_type=None,
             sm_scale=None, **_):
        # flashinfer copies the three arrays into the buffers it was given, and keeps the lengths for its plan
        self.indptr[:len(indptr)].copy_(indptr)
        self.indices[:len(indices)].copy_(indices)
        self.last[:len(last)].copy_(last)
        self.scale, self.page_size, self.heads = sm_scale, page_size, heads
        self.kv_lens = ((indptr[1:] - indptr[:-1] - 1) * page_size + last).tolist()
        self.tiles = None
        self.wrapper_plans += 1

    def _module_plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_lens, rows, batch, heads, kv_heads,
                     page_size, graph, head_dim_qk, head_dim_vo, causal, window, fixed_split, no_split, ctas):
        assert rows == batch == len(qo_indptr) - 1 == len(kv_lens) and graph and not causal and page_size == self.page_size
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        self.chunk = 2**31 - 1 if no_split else chunk_pages(pages, page_size, 2 * STAND_IN_SMS // kv_heads)
        self.tiles = [-(-p // self.chunk) for p in pages]
        info = [0] * 15
        info[9] = 16  # the offset of the chunk (tokens) in the schedule's pinned copy
        self._pin_memory_int_workspace_buffer[16:20].view(torch.int32)[0] = self.chunk * page_size if not no_split else -1
        self.direct_plans += 1
        return info

    def run(self, q, kv):
        k_cache, v_cache = kv
        indptr, indices, last = self.indptr.tolist(), self.indices.tolist(), self.last.tolist()
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            pages = indices[indptr[i]:indptr[i + 1]]
            n = (len(pages) - 1) * self.page_size + last[i]
            if self.tiles is None:
                assert n == self.kv_lens[i], (i, n, self.kv_lens[i])  # the page table sent is the one planned
            else:  # the last plan's tiles cover the row's keys
                assert -(-len(pages) // self.chunk) == self.tiles[i], (i, len(pages), self.chunk, self.tiles[i])
            k = k_cache[pages].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            v = v_cache[pages].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            weights = torch.einsum("hd,nhd->hn", q[i].float(), k.float()).mul(self.scale).softmax(-1)
            out[i] = torch.einsum("hn,nhd->hd", weights, v.float()).to(q.dtype)
        return out


class EagerLadder:
    """graphs.Ladder whose "graph" of each size is its body run when replayed (outputs valid until the next replay,
    as a graph's). With `attention` (DecodeAttention by size), each replay first checks that every row's new token
    goes to the slot after its last cached one: the last page's slot at the last page's length."""

    def __init__(self, sizes, body, device):  # no executables here: every replay is the body's run
        self.sizes, self.body, self.replays, self.attention = sorted(sizes), body, 0, {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, b: int) -> tuple:
        if b in self.attention:
            a = self.attention[b]
            if a.table.loaded:  # what the graph loads first (again in its body)
                a.table.load()
            last_pages = a.indices[a.indptr[1:].long() - 1].long()
            bs = a.cache.block_size
            assert a.slot_mapping.tolist() == (last_pages * bs + a.last - 1).tolist()
        self.replays += 1
        return self.body(b)


def eager_graphs(monkeypatch) -> None:
    """Every graph ladder of the engines run as its bodies (EagerLadder)."""
    monkeypatch.setattr(graphs, "Ladder", EagerLadder)


def stand_in_flashinfer(monkeypatch, direct: bool = True) -> None:
    """flashinfer's decode wrapper as StandInWrapper; `direct` off: a version the direct plan does not know."""
    from services.llm import flashinfer_attention

    fake = types.SimpleNamespace(__version__="0.6.13", BatchDecodeWithPagedKVCacheWrapper=StandInWrapper,
                                 decode=types.SimpleNamespace(), prefill=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_attention, "sm_count", lambda device: STAND_IN_SMS)
    if not direct:
        monkeypatch.setattr(flashinfer_attention, "DIRECT_PLAN_VERSION", "none")
