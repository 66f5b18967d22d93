"""The host's side of a captured decode step's attention plan (flashinfer_attention.DecodeAttention).

The page table is padded to the graph's batch (DecodePages), kept and advanced a token at a time (DecodeTable,
Replays); KeptPlan says when flashinfer's plan would come out the same; PlanCopy waits before a plan rewrites
the pinned buffer the last one is still copied from. No flashinfer import, so the CPU tests run all of it."""

import numpy as np
import torch

from services.llm.attention import SeqSlice


class DecodePages:
    """A step's page table padded to a batch; block tables, only appended to or replaced, converted as they grow."""

    def __init__(self):
        self.arrays: dict[int, tuple[list[int], np.ndarray]] = {}  # id(block table) -> (table, array)

    def __call__(self, slices: list[SeqSlice], block_size: int, batch: int, pad_page: int):
        """-> (indptr [batch + 1], page ids [indptr[-1]] int32, last page lengths [batch], new tokens' slots [batch]);
        padding rows hold one token of `pad_page` and write to its first slot."""
        indptr, last, slots, parts, kept = [0], [], [], [], {}
        for s in slices:
            table = s.block_table
            got = self.arrays.get(id(table))
            if got is None or got[0] is not table or len(got[1]) != len(table):
                got = table, np.asarray(table, dtype=np.int32)
            kept[id(table)] = got  # holding the table keeps its id from naming another list
            total = s.cached + s.n
            pages = -(-total // block_size)
            parts.append(got[1][:pages])
            indptr.append(indptr[-1] + pages)
            used = total - (pages - 1) * block_size
            last.append(used)
            slots.append(table[pages - 1] * block_size + used - 1)
        self.arrays = kept
        pad = batch - len(slices)
        indptr += [indptr[-1] + 1 + i for i in range(pad)]
        parts.append(np.full(pad, pad_page, dtype=np.int32))
        return indptr, np.concatenate(parts), last + [1] * pad, slots + [pad_page * block_size] * pad


class DecodeTable:
    """A decode plan's page table and slots (`rows` real rows, then padding), kept and advanced a token at a time.

    Each small array operation costs the host, so a step does few: last pages' lengths and slots are one array,
    advanced by one addition; a row fills a page every `block_size` steps at its own phase, so the rows due a page
    are looked up (`due`) rather than searched for, and their new pages go in by one concatenation."""

    def __init__(self, slices: list[SeqSlice], indptr: np.ndarray, indices: np.ndarray, last: np.ndarray,
                 slots: np.ndarray, block_size: int):
        self.rows, self.indptr, self.indices, self.block_size = len(slices), indptr, indices, block_size
        self.ends = np.empty((2, len(last)), dtype=np.int64)  # [last page lengths, new tokens' slots]
        self.ends[0], self.ends[1] = last, slots
        n = self.rows
        self.pages = np.diff(indptr[:n + 1]).tolist()
        # due[a % block_size]: the rows whose last page is full at advance a
        self.due: list[list[int]] = [[] for _ in range(block_size)]
        for i, length in enumerate(last[:n].tolist()):
            self.due[(block_size - length + 1) % block_size].append(i)
        self.advances = 0
        # Lets a reader tell the table it read from the same one a page longer in the rows of `grown_from`
        self.version, self.grown_from = 0, []

    @property
    def last(self) -> np.ndarray:
        return self.ends[0]

    @property
    def slots(self) -> np.ndarray:
        return self.ends[1]

    @property
    def kv_lens(self) -> np.ndarray:
        """Each row's keys, the new one included (int32, for flashinfer's plan)."""
        return ((np.diff(self.indptr) - 1) * self.block_size + self.ends[0]).astype(np.int32)

    def advance(self, slices: list[SeqSlice]) -> bool:
        """Each real row one token on (the same `slices`, in order); False, unchanged, where a full page has no next."""
        a, block_size = self.advances + 1, self.block_size
        full = self.due[a % block_size]
        if full:
            tables = [slices[i].block_table for i in full]
            pages = [self.pages[i] for i in full]
            if any(len(t) <= p for t, p in zip(tables, pages)):
                return False
            new = [t[p] for t, p in zip(tables, pages)]
        self.advances = a
        self.ends[:, :self.rows] += 1
        if full:
            self._grow(full, pages, new)
        return True

    def _grow(self, full: list[int], pages: list[int], new: list[int]) -> None:
        """Rows `full` (ascending, of `pages` pages) each get a page of `new` after their last."""
        ids = np.array(new, dtype=self.indices.dtype)
        parts, at = [], 0
        for j, cut in enumerate(self.indptr[[i + 1 for i in full]].tolist()):
            parts += (self.indices[at:cut], ids[j:j + 1])
            at = cut
        parts.append(self.indices[at:])
        self.indices = np.concatenate(parts)
        if len(full) <= 4:
            for i in full:
                self.indptr[i + 1:] += 1
        else:
            self.indptr[1:] += np.cumsum(np.bincount(full, minlength=len(self.indptr) - 1), dtype=self.indptr.dtype)
        self.ends[0, full] = 1
        self.ends[1, full] = ids.astype(np.int64) * self.block_size
        for i in full:
            self.pages[i] += 1
        self.version, self.grown_from = self.version + 1, pages


class Replays:
    """Whether a replay takes the last one's rows one token on; the engine calls forget() after any other step."""

    def __init__(self):
        self._last = None  # (graph size, first row's position, sequences)

    def forget(self) -> None:
        self._last = None

    def steady(self, b: int, work: list) -> bool:
        """For a replay of `work` in the graph of size `b`, about to run (and remembered)."""
        seqs, last = [w.seq for w in work], self._last
        self._last = b, work[0].start, seqs
        return last is not None and last[:2] == (b, work[0].start - 1) and last[2] == seqs


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class KeptPlan:
    """Whether a direct decode plan would repeat the last one's schedule, so neither it nor its copy need run.

    flashinfer 0.6.13's scheduler (fa2, CUDA-graph mode, at most 16 query heads a KV head) reads only each row's
    page count; it picks the smallest chunk C whose tiles, sum(ceil(pages / C)), fit `max_tiles`, by binary search.
    If every row has at least its old pages and the same tiles at C, C still fits and no smaller chunk does (tiles
    never fall as rows grow), so the plan would write the same. C moves only as rows grow past it."""

    def __init__(self, max_tiles: int):
        self.max_tiles = max_tiles
        self.pages = self.tiles = None
        self.chunk = 0
        self.kept = self.plans = 0

    def forget(self) -> None:
        self.pages = None

    def keeps(self, pages: np.ndarray) -> bool:
        p = self.pages
        same = (p is not None and len(pages) == len(p) and (pages >= p).all()
                and np.array_equal(-(-pages // self.chunk), self.tiles))
        self.kept += same
        return same

    def grows(self, pages: list[int]) -> bool:
        """Whether rows of `pages` pages, each one page longer now, keep the schedule: none began a new chunk."""
        same = self.pages is not None and all(p % self.chunk for p in pages)
        self.kept += same
        return same

    def planned(self, pages: np.ndarray, chunk: int) -> None:
        """A plan ran for rows of `pages`, choosing chunks of `chunk` pages."""
        self.plans += 1
        self.pages, self.chunk = pages, chunk
        self.tiles = -(-pages // chunk) if chunk > 0 else None
        if self.tiles is None or self.tiles.sum() > self.max_tiles:  # not the search's answer
            self.pages = None


class PlanCopy:
    """A flashinfer plan copies its schedule to the device from its wrapper's pinned buffer, which the next plan
    rewrites. Queued behind running work, the copy may not have run when the host, ahead of the device, plans again:
    the step would attend by the next one's schedule (an illegal memory access). So a plan waits for the last copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.pending = False
        self.waits = 0  # plans that found the last copy still queued

    def wait(self) -> None:
        """Before a plan."""
        if self.pending:
            if not self.event.query():
                self.waits += 1
                self.event.synchronize()
            self.pending = False

    def record(self) -> None:
        """After a plan, whose copy is queued on the current stream."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
            self.pending = True
