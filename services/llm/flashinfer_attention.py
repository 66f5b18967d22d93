"""Attention over the paged KV cache through flashinfer (GPU).

`FlashInferAttention` serves any step: prefill chunks and decode tokens together, through the batch prefill
kernel over pages, planned once per step (causal, aligned to each sequence's end, so a chunk sees the
sequence's cached prefix). `DecodeAttention` serves a captured decode graph of a fixed batch size: its
buffers (page table, slots) keep their addresses, and `plan()` refills them before each replay.
Both take the step's keys and values in their slots (`kv_slots`), as `TorchAttention` does.
"""

import builtins

import numpy as np
import torch

from services.llm.attention import SeqSlice, kv_slots, write_kv
from services.llm.decode_plan import DecodePages, DecodeTable, KeptPlan, PlanCopy, sm_count
from services.llm.host import Staging, pinned, upload
from services.llm.kv_cache import KVCache

WORKSPACE_BYTES = 256 << 20
# The flashinfer whose wrapper's plan DecodeAttention's direct plan stands in for (its module's arguments as that
# version passes them); any other version plans through the wrapper.
DIRECT_PLAN_VERSION = "0.6.13"
# Where in that version's plan info (PrefillPlanInfo::ToVector) the offset of the chosen chunk of keys lies
CHUNK_OFFSET = 9


def _page_table(slices: list[SeqSlice], block_size: int):
    """flashinfer's page table for the sequences of a step (host lists): indptr, page ids, last page lengths."""
    indptr, indices, last = [0], [], []
    for s in slices:
        total = s.cached + s.n
        pages = -(-total // block_size)
        indices.extend(s.block_table[:pages])
        indptr.append(len(indices))
        last.append(total - (pages - 1) * block_size)
    return indptr, indices, last


def one_op_max(values, *rest, **kwargs):
    """builtins.max, but over a non-empty 1-d tensor its largest element from one torch op (a 0-d tensor, as
    builtins.max gives), not an unbind and a comparison op per element. flashinfer's wrappers (0.6.13) plan with
    `max(kv_lens_arr_host).item()` over a CPU tensor of every sequence's length: some 30 comparisons a decode step at
    32 requests (the unbind, gt and is_nonzero rows of bench/results/profile-1xh200-b32-decode-fp8a8-a7aa69a.txt)."""
    if not rest and not kwargs and isinstance(values, torch.Tensor) and values.dim() == 1 and values.numel():
        return values.max()
    return builtins.max(values, *rest, **kwargs)


def quick_max(*modules) -> None:
    """`max` in each module's globals is one_op_max: the name a module's code looks up before the builtin."""
    for module in modules:
        module.max = one_op_max


def _slots(slices: list[SeqSlice], block_size: int) -> list[int]:
    out = []
    for s in slices:
        table = s.block_table
        out.extend(table[p // block_size] * block_size + p % block_size for p in range(s.cached, s.cached + s.n))
    return out


class _Writer:
    def __init__(self, cache: KVCache):
        self.cache = cache

    def kv_slots(self, layer: int):
        return kv_slots(self.cache, layer, self.slot_mapping)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, written: bool):
        if not written:
            write_kv(self.kv_slots(layer), k, v)
        return self.cache.k[layer], self.cache.v[layer]


class FlashInferAttention(_Writer):
    def __init__(self, cache: KVCache, scale: float, heads: int, workspace: torch.Tensor | None = None):
        import flashinfer

        quick_max(flashinfer.decode, flashinfer.prefill)  # their plan()s' max over the sequences' lengths
        super().__init__(cache)
        self.scale, self.heads = scale, heads
        dev = cache.k.device
        self.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.copy = PlanCopy(dev)
        self.slot_mapping = None

    def plan(self, slices: list[SeqSlice]) -> "FlashInferAttention":
        bs = self.cache.block_size
        indptr, indices, last = _page_table(slices, bs)
        qo = [0]
        for s in slices:
            qo.append(qo[-1] + s.n)
        kv_heads, head_dim = self.cache.k.shape[3], self.cache.k.shape[4]
        i32 = torch.int32  # pinned: flashinfer's own copies to the device then wait for nothing (DecodeAttention.plan)
        self.copy.wait()
        self.wrapper.plan(pinned(qo, i32), pinned(indptr, i32), pinned(indices, i32), pinned(last, i32),
                          self.heads, kv_heads, head_dim, bs, causal=True, sm_scale=self.scale,
                          q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)
        self.copy.record()
        self.slot_mapping = upload(_slots(slices, bs), self.cache.k.device, torch.long)
        return self

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.wrapper.run(q, self.write(layer, k, v, written), out=out)


class DecodeAttention(_Writer):
    """One token per sequence for exactly `batch` sequences (rows past the real ones are padding: they write
    to and read from `scratch_block`, which no sequence owns), on flashinfer's tensor-core kernels, which in a
    graph split each sequence's keys over several CTAs and merge their partial outputs after.

    Planned directly (flashinfer DIRECT_PLAN_VERSION, after one plan through the wrapper has chosen its module),
    the page table goes by the caller's one copy and the module's plan is called as the wrapper would call it,
    its checks, conversions and copies skipped; a plan whose schedule would not change is not run (KeptPlan)."""

    def __init__(self, cache: KVCache, scale: float, heads: int, batch: int, scratch_block: int, workspace: torch.Tensor,
                 staging: Staging | None = None, offset: int = 0):
        import flashinfer

        quick_max(flashinfer.decode, flashinfer.prefill)  # their plan()s' max over the sequences' lengths
        super().__init__(cache)
        self.scale, self.heads, self.batch, self.scratch = scale, heads, batch, scratch_block
        dev = cache.k.device
        # The new tokens' KV slots and the page table's three arrays (indptr, last pages' lengths, page ids) side by
        # side in one buffer, at `offset` of a Staging: the slots go by its one copy a step, the page table too where
        # the plan is direct (flashinfer's own plan copies its arrays one by one). A caller's Staging (`staging`:
        # the step's other inputs before `offset`) is sent by the caller, `sent` bytes of it after each plan; one of
        # the attention's own is sent by plan().
        self.own = staging is None
        self.table = Staging(offset + self.nbytes(batch, cache), dev) if self.own else staging
        self.offset = offset
        self.slot_mapping = self.table.raw[offset:offset + 8 * batch].view(torch.int64)
        table = self.table.raw[offset + 8 * batch:offset + self.nbytes(batch, cache)].view(torch.int32)
        self.indptr, self.last, self.indices = table[:batch + 1], table[batch + 1:2 * batch + 1], table[2 * batch + 1:]
        self.sent = offset  # the bytes of `table` the last plan filled (from its start)
        # Each staging buffer's views of the same: slots (int64), page table (int32)
        self._host = [(buf[offset:offset + 8 * batch].view(np.int64),
                       buf[offset + 8 * batch:offset + self.nbytes(batch, cache)].view(np.int32)) for buf in self.table.buffers]
        self.pages = DecodePages()
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last)
        self.direct_plan = getattr(flashinfer, "__version__", "") == DIRECT_PLAN_VERSION
        self._planned_once = False
        self.copy = PlanCopy(dev)
        kv_heads = cache.k.shape[3]  # plans kept only where they are direct: KeptPlan reads the direct plan's schedule
        self.kept = KeptPlan(2 * sm_count(dev) // kv_heads) if self.direct_plan and heads // kv_heads <= 16 else None
        self._qo_indptr = torch.arange(batch + 1, dtype=torch.int32)  # one query row per sequence
        self._last_plan: DecodeTable | None = None
        # The table (and its version) whose page pointers and ids each staging buffer holds, and the one the kept plan
        # was last checked against
        self._written: list[tuple | None] = [None, None]
        self._checked: tuple | None = None
        self.advanced = 0  # plans that advanced the last one's table (steady)

    @staticmethod
    def nbytes(batch: int, cache: KVCache) -> int:
        """What a DecodeAttention of `batch` sequences over `cache` takes of a Staging: slots, then the page table,
        its page ids room for every block and a page for each padding row (the scratch block, again)."""
        return 8 * batch + 4 * (2 * batch + 1 + cache.k.shape[1] + batch)

    def plan(self, slices: list[SeqSlice], steady: bool = False) -> "DecodeAttention":
        """Page table and slots for `slices` (at most `batch`, one token each), padded to `batch`. With a caller's
        Staging, its current buffer (the caller's fill()) takes them, and the caller sends `sent` bytes of it.

        `steady`: the caller vouches that `slices` are the last plan's sequences in its order, each one token on
        (their block tables grown, not replaced): the last plan's table is then advanced a token (DecodeTable.advance),
        not rebuilt from the block tables."""
        if self.own:
            self.table.fill()
        host_slots, words = self._host[self.table.turn]
        t, bs, b = self._last_plan, self.cache.block_size, self.batch
        if steady and t is not None and t.rows == len(slices) and t.advance(slices):
            self.advanced += 1
        else:
            indptr, indices, last, slots = self.pages(slices, bs, b, self.scratch)
            t = self._last_plan = DecodeTable(slices, np.array(indptr, dtype=np.int32), indices,
                                              np.array(last, dtype=np.int32), np.array(slots, dtype=np.int64), bs)
        host_slots[:] = t.slots
        n = len(t.indices)  # the page table in the staging buffer too: a graph that loads it (Staging.loaded) reads all
        words[b + 1:2 * b + 1] = t.last
        if self._written[self.table.turn] != (t, t.version):  # page pointers and ids, unless this buffer has them
            words[:b + 1], words[2 * b + 1:2 * b + 1 + n] = t.indptr, t.indices
            self._written[self.table.turn] = t, t.version
        kv_heads, head_dim = self.cache.k.shape[3], self.cache.k.shape[4]
        if self._planned_once and self._direct(t, kv_heads, head_dim, bs):
            self.sent = self.offset + 8 * b + 4 * (2 * b + 1 + n)
        else:
            # The page ids go to the device here, without waiting: handed over from the host, flashinfer would
            # copy them with a blocking copy (a second device sync in the step). The page pointers and last
            # pages' lengths, which it reads on the host too, go in pinned memory: copied from pageable memory
            # they would make the host wait for the step still running (an overlapped step's launch would then
            # start only when the device is idle). Its copies fill the page table's device arrays, so the
            # Staging's copy stops before them (a graph that loads the staging buffer itself writes them again,
            # the same).
            pages = upload(t.indices, self.cache.k.device, torch.int32)
            if self.kept is not None:
                self.kept.forget()
            self.copy.wait()
            self.wrapper.plan(pinned(t.indptr, torch.int32), pages, pinned(t.last, torch.int32),
                              self.heads, kv_heads, head_dim, bs, q_data_type=self.cache.k.dtype,
                              kv_data_type=self.cache.k.dtype, sm_scale=self.scale)
            self.copy.record()
            self._planned_once = True
            self.sent = self.offset + 8 * b
        if self.own:
            self.table.send(self.sent)
        return self

    def _direct(self, t: "DecodeTable", kv_heads: int, head_dim: int, bs: int) -> bool:
        """The plan without flashinfer's wrapper (its fa2 tensor-core path): the page table goes by the Staging
        (plan() wrote it into the staging buffer), and the module's plan is called with the arguments the wrapper's
        plan gives it. False where it does not apply (the wrapper's plan then runs)."""
        w = self.wrapper
        if not (self.direct_plan and w._backend == "fa2" and w._jit_module is None and w.is_cuda_graph_enabled):
            return False
        b = self.batch
        if self.kept is not None and self.kept.pages is not None and self._checked is not None and self._checked[0] is t:
            # The table the last check kept or planned: as it was (kept again), or one page longer in some rows
            # (KeptPlan.grows), without reading all of it
            if self._checked[1] == t.version:
                self.kept.kept += 1
                return True
            if self._checked[1] == t.version - 1 and self.kept.grows(t.grown_from):
                self._checked = (t, t.version)
                return True
        pages = np.diff(t.indptr)
        self._checked = (t, t.version) if self.kept is not None else None
        if self.kept is not None and self.kept.keeps(pages):  # the schedule on the device already is this one's
            return True
        # As BatchDecodeWithPagedKVCacheWrapper.plan (0.6.13) calls it for fa2 on tensor cores: total rows and
        # batch (one query row each), heads, page size, CUDA-graph mode, head dims, not causal, no window, no fixed
        # split, whether to split the keys, no co-located CTAs. It reads the host arrays before it returns.
        self.copy.wait()
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer, self._qo_indptr,
            torch.from_numpy(t.indptr), torch.from_numpy(t.kv_lens), b, b, self.heads, kv_heads, bs, True, head_dim,
            head_dim, False, -1, -1, False, 0)
        self.copy.record()
        if self.kept is not None:  # the chunk of keys it chose (tokens), from its schedule's pinned copy
            at = int(w._plan_info[CHUNK_OFFSET])
            self.kept.planned(pages, int(w._pin_memory_int_workspace_buffer[at:at + 4].view(torch.int32)[0]) // bs)
        return True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False) -> torch.Tensor:
        return self.wrapper.run(q, self.write(layer, k, v, written))
