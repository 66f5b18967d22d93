"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget. Running sequences go first (a decode is one token; a prompt goes in chunks),
then waiting ones, oldest first, as far as the budget and the KV blocks allow. When blocks run out, the
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later. A held sequence
(its reader fell behind) keeps its blocks and gets no rows until it is let go."""

from collections import deque
from dataclasses import dataclass, field

from services.llm.kv_cache import BlockAllocator


@dataclass(eq=False)
class SeqState:
    """A sequence as the scheduler sees it; `tokens` grows as the engine appends what it samples."""
    tokens: list[int]
    owner: object = None  # the engine's request
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    held: bool = False  # skipped by steps, blocks kept

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


@dataclass(slots=True)
class Work:
    seq: SeqState
    start: int  # first token of this step's rows
    n: int


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_tokens: int, max_seqs: int):
        self.allocator, self.block_size = allocator, block_size
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.preemptions = 0

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def remove(self, seq: SeqState) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks, seq.computed = [], 0

    def hold(self, owner, on: bool) -> None:
        """Holds (or lets go) the sequence of `owner`: steps skip it and it keeps its blocks."""
        for seq in (*self.running, *self.waiting):
            if seq.owner is owner:
                seq.held = on

    def _blocks_for(self, seq: SeqState, n: int) -> int:
        return max(0, -(-(seq.computed + n) // self.block_size) - len(seq.blocks))

    def _preempt(self, seq: SeqState) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks, seq.computed = [], 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[Work]:
        budget, work, bs, preempted = self.max_tokens, [], self.block_size, self.preemptions
        # Runs per sequence every step: a sequence needing no block costs a few integer operations, no calls
        for seq in list(self.running):
            if preempted != self.preemptions and seq not in self.running:  # preempted earlier this step
                continue
            if seq.held:
                continue
            computed = seq.computed
            n = min(len(seq.tokens) - computed, budget)
            if n <= 0:  # nothing new yet (a talker between frames), or no budget left
                continue
            need = -(-(computed + n) // bs) - len(seq.blocks)
            if need > 0:
                while not self.allocator.can_allocate(need):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq not in self.running:
                    continue
                seq.blocks += self.allocator.allocate(need)
            work.append(Work(seq, computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.pending, budget)
            need = self._blocks_for(seq, n)
            if not self.allocator.can_allocate(need):
                if not self.running and not work:
                    raise MemoryError(f"a sequence needs {need} KV blocks, the cache has {self.allocator.num_blocks}")
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.blocks += self.allocator.allocate(need)
            work.append(Work(seq, seq.computed, n))
            budget -= n
        return work

    def advance(self, work: list[Work]) -> None:
        for w in work:
            w.seq.computed = w.start + w.n
