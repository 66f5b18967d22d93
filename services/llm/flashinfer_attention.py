"""Attention over the paged KV cache through flashinfer (GPU).

`FlashInferAttention` serves any step (prefill chunks and decode tokens together, causal from each sequence's
end, so a chunk sees its cached prefix). `DecodeAttention` serves a captured decode graph of fixed batch: its
page table and slots keep their addresses, and `plan()` refills them before each replay."""

import builtins

import numpy as np
import torch

from services.llm.attention import SeqSlice, kv_slots, write_kv
from services.llm.decode_plan import DecodePages, DecodeTable, KeptPlan, PlanCopy, sm_count
from services.llm.host import Staging, pinned, upload
from services.llm.kv_cache import KVCache

WORKSPACE_BYTES = 256 << 20
DIRECT_PLAN_VERSION = "0.6.13"  # the wrapper whose module call DecodeAttention repeats; others plan through it
CHUNK_OFFSET = 9  # of the chosen key chunk's offset in that version's plan info (PrefillPlanInfo::ToVector)


def _page_table(slices: list[SeqSlice], block_size: int):
    """-> (indptr, page ids, last page lengths) as host lists."""
    indptr, indices, last = [0], [], []
    for s in slices:
        total = s.cached + s.n
        pages = -(-total // block_size)
        indices.extend(s.block_table[:pages])
        indptr.append(len(indices))
        last.append(total - (pages - 1) * block_size)
    return indptr, indices, last


def one_op_max(values, *rest, **kwargs):
    """builtins.max, one op over a 1-d tensor: flashinfer's plans max() a CPU tensor, an op per element otherwise."""
    if not rest and not kwargs and isinstance(values, torch.Tensor) and values.dim() == 1 and values.numel():
        return values.max()
    return builtins.max(values, *rest, **kwargs)


def quick_max(*modules) -> None:
    """`max` in each module's globals, looked up before the builtin, becomes one_op_max."""
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

        quick_max(flashinfer.decode, flashinfer.prefill)
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
        i32 = torch.int32  # pinned: flashinfer's own copies then do not block
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
    """One token for each of exactly `batch` sequences on flashinfer's tensor-core kernels; padding rows write to and
    read from `scratch_block`, which no sequence owns.

    After one plan through the wrapper has chosen its module, plans are direct (DIRECT_PLAN_VERSION): the page table
    goes by the caller's one copy and the module's plan is called as the wrapper would, its checks and copies skipped;
    a plan whose schedule would not change is not run (KeptPlan)."""

    def __init__(self, cache: KVCache, scale: float, heads: int, batch: int, scratch_block: int, workspace: torch.Tensor,
                 staging: Staging | None = None, offset: int = 0, keep_plans: bool = True):
        import flashinfer

        quick_max(flashinfer.decode, flashinfer.prefill)
        super().__init__(cache)
        self.scale, self.heads, self.batch, self.scratch = scale, heads, batch, scratch_block
        dev = cache.k.device
        # Slots, then indptr, last pages' lengths and page ids, at `offset` of a Staging: one copy a step. A caller's
        # Staging is sent by the caller (`sent` bytes after each plan), the attention's own by plan().
        self.own = staging is None
        self.table = Staging(offset + self.nbytes(batch, cache), dev) if self.own else staging
        self.offset = offset
        self.slot_mapping = self.table.raw[offset:offset + 8 * batch].view(torch.int64)
        table = self.table.raw[offset + 8 * batch:offset + self.nbytes(batch, cache)].view(torch.int32)
        self.indptr, self.last, self.indices = table[:batch + 1], table[batch + 1:2 * batch + 1], table[2 * batch + 1:]
        self.sent = offset
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
        self.kept = (KeptPlan(2 * sm_count(dev) // kv_heads) if keep_plans and self.direct_plan and heads // kv_heads <= 16
                     else None)
        self._qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        self._last_plan: DecodeTable | None = None
        self._written: list[tuple | None] = [None, None]  # (table, version) each staging buffer holds
        self._checked: tuple | None = None  # (table, version) the kept plan was last checked against
        self.advanced = 0  # plans that advanced the last table (steady)

    @staticmethod
    def nbytes(batch: int, cache: KVCache) -> int:
        """Bytes of a Staging taken: slots, then the page table with room for every block and a page per padding row."""
        return 8 * batch + 4 * (2 * batch + 1 + cache.k.shape[1] + batch)

    def plan(self, slices: list[SeqSlice], steady: bool = False) -> "DecodeAttention":
        """Page table and slots for `slices` padded to `batch`, into the Staging's current buffer; `steady`: the last
        plan's sequences one token on, its table advanced rather than rebuilt."""
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
        n = len(t.indices)  # written even when the wrapper plans: a graph that loads the staging buffer reads all
        words[b + 1:2 * b + 1] = t.last
        if self._written[self.table.turn] != (t, t.version):
            words[:b + 1], words[2 * b + 1:2 * b + 1 + n] = t.indptr, t.indices
            self._written[self.table.turn] = t, t.version
        kv_heads, head_dim = self.cache.k.shape[3], self.cache.k.shape[4]
        if self._planned_once and self._direct(t, kv_heads, head_dim, bs):
            self.sent = self.offset + 8 * b + 4 * (2 * b + 1 + n)
        else:
            # Page ids uploaded here (flashinfer's copy of host ids blocks); indptr and lengths, which it also reads on
            # the host, pinned. Its copies fill the device table, so the Staging's copy stops before it.
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
        """The fa2 plan without the wrapper, the page table already in the Staging; False where it does not apply."""
        w = self.wrapper
        if not (self.direct_plan and w._backend == "fa2" and w._jit_module is None and w.is_cuda_graph_enabled):
            return False
        b = self.batch
        if self.kept is not None and self.kept.pages is not None and self._checked is not None and self._checked[0] is t:
            # The last checked table, unchanged or a page longer in some rows: no need to read all of it
            if self._checked[1] == t.version:
                self.kept.kept += 1
                return True
            if self._checked[1] == t.version - 1 and self.kept.grows(t.grown_from):
                self._checked = (t, t.version)
                return True
        pages = np.diff(t.indptr)
        self._checked = (t, t.version) if self.kept is not None else None
        if self.kept is not None and self.kept.keeps(pages):
            return True
        # As BatchDecodeWithPagedKVCacheWrapper.plan (0.6.13) calls it for fa2: rows, batch, heads, page size, graph
        # mode, head dims, not causal, no window, no fixed split, keys split, no co-located CTAs.
        self.copy.wait()
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer, self._qo_indptr,
            torch.from_numpy(t.indptr), torch.from_numpy(t.kv_lens), b, b, self.heads, kv_heads, bs, True, head_dim,
            head_dim, False, -1, -1, False, 0)
        self.copy.record()
        if self.kept is not None:  # the key chunk it chose, read from the schedule's pinned copy
            at = int(w._plan_info[CHUNK_OFFSET])
            self.kept.planned(pages, int(w._pin_memory_int_workspace_buffer[at:at + 4].view(torch.int32)[0]) // bs)
        return True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False) -> torch.Tensor:
        return self.wrapper.run(q, self.write(layer, k, v, written))
