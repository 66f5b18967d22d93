"""Decode steps as CUDA graphs over the paged KV cache, one per batch size of a ladder, and the host's part of
each replay.

A graph reads its step's host values from one device buffer filled by one copy a step (StepInputs): the model's
rows of ints and floats (ids or positions, draw settings), then the decode attention's slots and page table
(DecodeAttention, planned into the same buffer). `loaded`: each graph loads that buffer itself from pinned host
memory (its body calls `inputs.staging.load()` first and `turned()` last), so a steady step queues no copy. A
replay of the last one's rows one token on (the steady state of a decode loop) advances the page table it sent
last instead of rebuilding it from each request.
"""

from typing import Callable

from services.llm.attention import DecodeSlices
from services.llm.decode_plan import Replays
from services.llm import graphs
from services.llm.host import StepInputs


class DecodeGraphs:
    """`body(b, inputs, attention)` recorded for each batch size b up to `max_batch`; `init(ints, floats)` sets what
    padding rows read before a step first fills them (in both staging buffers)."""

    def __init__(self, engine, max_batch: int, ints: int, floats: int, body: Callable, init: Callable | None = None,
                 loaded: bool = False):
        from services.llm.flashinfer_attention import DecodeAttention

        sizes = graphs.ladder(max_batch)
        self.device, self.loaded = engine.device, loaded
        cache, text = engine.cache, engine.text_config
        self.inputs, self.attention = {}, {}
        for b in sizes:
            inputs = self.inputs[b] = StepInputs(ints, floats, b, self.device, DecodeAttention.nbytes(b, cache), loaded)
            self.attention[b] = DecodeAttention(cache, text.head_dim ** -0.5, text.num_attention_heads, b,
                                                engine.scratch_block, engine.workspace, inputs.staging, inputs.extra_offset)
            for _ in range(2):  # each staging buffer holds an all-padding plan (a loading graph reads either)
                ints_, floats_ = inputs.fill()
                if init is not None:
                    init(ints_, floats_)
                inputs.send(self.attention[b].plan([]).sent)
        self.steady_rows = Replays()  # whether a replay is the last one's rows a token on (forget(): a step between)
        self.graphs = graphs.Ladder(sizes, lambda b: body(b, self.inputs[b], self.attention[b]), self.device)

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def size_for(self, n: int) -> int:
        return self.graphs.size_for(n)

    def forget(self) -> None:
        """A step ran outside the graphs: the next replay is not the last one's rows a token on."""
        self.steady_rows.forget()

    def fill(self, b: int):
        """The numpy views (ints [I, b], floats [F, b]) of the staging buffer size `b` sends next."""
        return self.inputs[b].fill()

    def steady(self, b: int, work: list) -> bool:
        """Whether a replay of `work` (scheduler Work rows) in the graph of size `b`, about to run, takes the last
        one's rows one token on; remembered as the last."""
        return self.steady_rows.steady(b, work)

    def send(self, b: int, work: list, steady: bool) -> None:
        """The attention planned for `work` (one token a row; `steady`: as `steady()` said) into the filled staging
        buffer, then the rows, the slots and, planned directly, the page table sent by one copy (or left for the
        graph to load)."""
        attention = self.attention[b].plan(DecodeSlices(work), steady)
        self.inputs[b].send(attention.sent)

    def replay(self, b: int) -> tuple:
        return self.graphs.replay(b)
