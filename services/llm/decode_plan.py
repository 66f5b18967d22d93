"""The host's side of a captured decode step's attention plan, for DecodeAttention
(services/llm/flashinfer_attention.py): the page table padded to the graph's batch (DecodePages), kept between
plans and advanced a token at a time (DecodeTable, Replays), whether flashinfer's plan would come out the same
(KeptPlan), and the wait before a plan rewrites the pinned buffer its last one is still being copied from
(PlanCopy). None of it imports flashinfer, so the CPU tests run all of it (PlanCopy's CUDA event through a
stand-in)."""

import numpy as np
import torch

from services.llm.attention import SeqSlice


class DecodePages:
    """A decode step's page table (flashinfer's indptr, page ids, last pages' lengths) padded to a batch, each
    sequence's block table turned into an array once and again only when it grows (a block every block_size
    tokens) or is replaced (preempted, freed): rebuilt from the lists every step, a step of 32 requests of 2k
    tokens converted 4,096 ids (bench/results/host-lists-cpu-3af9a3e.json). A table is only ever appended to or
    replaced by a new list (services.llm.scheduler), so its length says whether its array is current."""

    def __init__(self):
        self.arrays: dict[int, tuple[list[int], np.ndarray]] = {}  # id(block table) -> (the table, its array)

    def __call__(self, slices: list[SeqSlice], block_size: int, batch: int, pad_page: int):
        """-> (indptr [batch + 1] list, page ids [indptr[-1]] int32 array, last page lengths [batch] list, the
        KV slot of each sequence's one new token [batch] list): rows past `slices` each hold one page,
        `pad_page`, one token long, and write to its first slot."""
        indptr, last, slots, parts, kept = [0], [], [], [], {}
        for s in slices:
            table = s.block_table
            got = self.arrays.get(id(table))
            if got is None or got[0] is not table or len(got[1]) != len(table):
                got = table, np.asarray(table, dtype=np.int32)
            kept[id(table)] = got  # holding the table: its id names no other list meanwhile
            total = s.cached + s.n
            pages = -(-total // block_size)
            parts.append(got[1][:pages])
            indptr.append(indptr[-1] + pages)
            used = total - (pages - 1) * block_size
            last.append(used)
            slots.append(table[pages - 1] * block_size + used - 1)
        self.arrays = kept  # the tables of sequences gone from the batch are let go
        pad = batch - len(slices)
        indptr += [indptr[-1] + 1 + i for i in range(pad)]
        parts.append(np.full(pad, pad_page, dtype=np.int32))
        return indptr, np.concatenate(parts), last + [1] * pad, slots + [pad_page * block_size] * pad


class DecodeTable:
    """A decode plan's page table and slots as arrays (`rows` real rows, then padding), kept for the next plan and
    advanced a token at a time.

    A decode step's host work is dozens of small array operations, each a few microseconds on the lent H200s' CPUs
    (bench/results/hostprof-1xh200-bf16-b32-68d9c4c.json: advance took 81 us a step as 30 of them), so a step does
    as few as it can: each row's last page's length and its new token's slot are one array, one addition a step
    for every row; and a row's page fills every `block_size` steps at a phase of its own, so the rows due a page at
    a step are looked up (`due`), not searched for, and their new pages go in by one concatenation."""

    def __init__(self, slices: list[SeqSlice], indptr: np.ndarray, indices: np.ndarray, last: np.ndarray,
                 slots: np.ndarray, block_size: int):
        self.rows, self.indptr, self.indices, self.block_size = len(slices), indptr, indices, block_size
        self.ends = np.empty((2, len(last)), dtype=np.int64)  # last pages' lengths; each row's new token's KV slot
        self.ends[0], self.ends[1] = last, slots
        n = self.rows
        self.pages = np.diff(indptr[:n + 1]).tolist()  # each real row's page count
        # The rows whose last page is full at the advance a (due[a % block_size]): a row of last page length l
        # fills it block_size - l advances on, then every block_size advances
        self.due: list[list[int]] = [[] for _ in range(block_size)]
        for i, length in enumerate(last[:n].tolist()):
            self.due[(block_size - length + 1) % block_size].append(i)
        self.advances = 0
        # How many times the page ids grew, and the page counts the rows of the last growth had before it: what reads
        # the table can tell it is the one it read, or that one a page longer in those rows
        self.version, self.grown_from = 0, []

    @property
    def last(self) -> np.ndarray:
        return self.ends[0]

    @property
    def slots(self) -> np.ndarray:
        return self.ends[1]

    @property
    def kv_lens(self) -> np.ndarray:
        """Each row's keys, its new one's too (int32, as flashinfer's plan takes them)."""
        return ((np.diff(self.indptr) - 1) * self.block_size + self.ends[0]).astype(np.int32)

    def advance(self, slices: list[SeqSlice]) -> bool:
        """Each real row one token on (`slices`: the same sequences, in order): in its last page, or where that page
        is full, in the first slot of the next block of its table, inserted in the page ids. False (nothing changed)
        where a full page's table has no next block. Only full pages' tables are read."""
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
        """Rows `full` (ascending), of `pages` pages, each one page more, `new`, after its last: its first slot."""
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
    """Whether a decode replay takes the last one's rows one token on (what DecodeAttention.plan's `steady` vouches
    for): the same graph size and sequences in the same order, its first row one position further, and no other
    step run between (the engine calls forget() for those)."""

    def __init__(self):
        self._last = None  # (graph size, first row's position, sequences) of the last replay

    def forget(self) -> None:
        self._last = None

    def steady(self, b: int, work: list) -> bool:
        """For a replay of `work` (scheduler Work rows) in the graph of size `b`, about to run; remembered as the last."""
        seqs, last = [w.seq for w in work], self._last
        self._last = b, work[0].start, seqs
        return last is not None and last[:2] == (b, work[0].start - 1) and last[2] == seqs


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors: flashinfer's split decode plan fills two CTAs on each."""
    return torch.cuda.get_device_properties(device).multi_processor_count


class KeptPlan:
    """Whether a direct decode plan would give the schedule the last one gave, so it need not run (nor its copy to
    the device). flashinfer 0.6.13's scheduler (PrefillSplitQOKVIndptr, fa2, CUDA-graph mode, one query tile a row:
    at most 16 query heads a KV head) reads nothing of a row but its page count, and the kernels read each row's
    length from the page table the step sends. The plan takes the smallest chunk of C pages (a binary search) whose
    tiles, the sum of ceil(pages / C), fit `max_tiles` (two CTAs a multiprocessor, per KV head), and cuts each row
    into its tiles. Where every row has at least the pages it had at the last plan and the same tiles at that C, C
    still fits and no smaller chunk does (a row's tiles at a chunk never fall as it grows): the search ends at C
    again, the tiles are the same, and so is everything the plan writes. C moves only as the rows grow past it, so
    a decode loop runs a plan every few dozen steps."""

    def __init__(self, max_tiles: int):
        self.max_tiles = max_tiles
        self.pages = self.tiles = None  # at the last plan
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
        """Whether rows that had `pages` pages at the last check, now each one page longer (every other row as it
        was), give the same schedule: where none of them began a chunk anew (p % chunk)."""
        same = self.pages is not None and all(p % self.chunk for p in pages)
        self.kept += same
        return same

    def planned(self, pages: np.ndarray, chunk: int) -> None:
        """A plan ran for rows of `pages`, choosing chunks of `chunk` pages."""
        self.plans += 1
        self.pages, self.chunk = pages, chunk
        self.tiles = -(-pages // chunk) if chunk > 0 else None
        if self.tiles is None or self.tiles.sum() > self.max_tiles:  # not the search's answer: not kept
            self.pages = None


class PlanCopy:
    """The copy a flashinfer plan queues of its schedule (each request's tiles and output rows) to the device, out of
    a pinned host buffer of its wrapper's own (`_pin_memory_int_workspace_buffer`), which the wrapper's next plan
    rewrites: that plan first waits for the copy to have run. Queued behind the work the device is still running,
    the copy may not have run when the host plans again, where steps go out ahead of the device (overlapped frame
    steps beside prompts, chunked prompts replayed from graphs): the step would then attend by the next one's
    schedule. In the mesh on one H200 that was an illegal memory access in the talker at 32 speech requests
    (bench/results/1xh200-mesh-speech-54d542c.json); launched one by one (CUDA_LAUNCH_BLOCKING) it never came."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.pending = False  # a plan's copy was queued and not yet seen done
        self.waits = 0  # plans that found the last one's copy still queued

    def wait(self) -> None:
        """Before a plan: the last plan's copy has run."""
        if self.pending:
            if not self.event.query():
                self.waits += 1
                self.event.synchronize()
            self.pending = False

    def record(self) -> None:
        """After a plan: its copy is queued on the current stream."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
            self.pending = True
