"""Decode steps as CUDA graphs, one per batch size of a ladder, and the host's part of each replay.

A graph reads its host values and the attention's page table from one buffer sent by one copy a step (or, `loaded`,
loaded by the graph from pinned memory); a steady replay advances the last page table rather than rebuilding it."""

from typing import Callable

from services.llm.attention import DecodeSlices
from services.llm.decode_plan import Replays
from services.llm import graphs
from services.llm.host import StepInputs


class DecodeGraphs:
    """`body(b, inputs, attention)` recorded for each batch size b; `init(ints, floats)` sets what padding rows read."""

    def __init__(self, engine, max_batch: int, ints: int, floats: int, body: Callable, init: Callable | None = None,
                 loaded: bool = False, keep_plans: bool = True):
        from services.llm.flashinfer_attention import DecodeAttention

        sizes = graphs.ladder(max_batch)
        self.device, self.loaded = engine.device, loaded
        cache, text = engine.cache, engine.text_config
        self.inputs, self.attention = {}, {}
        for b in sizes:
            inputs = self.inputs[b] = StepInputs(ints, floats, b, self.device, DecodeAttention.nbytes(b, cache), loaded)
            self.attention[b] = DecodeAttention(cache, text.head_dim ** -0.5, text.num_attention_heads, b,
                                                engine.scratch_block, engine.workspace, inputs.staging, inputs.extra_offset,
                                                keep_plans)
            for _ in range(2):  # an all-padding plan in both staging buffers: a loading graph reads either
                ints_, floats_ = inputs.fill()
                if init is not None:
                    init(ints_, floats_)
                inputs.send(self.attention[b].plan([]).sent)
        self.steady_rows = Replays()
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
        """A step ran outside the graphs."""
        self.steady_rows.forget()

    def fill(self, b: int):
        """Numpy views (ints [I, b], floats [F, b]) of the staging buffer size `b` sends next."""
        return self.inputs[b].fill()

    def steady(self, b: int, work: list) -> bool:
        """Whether a replay of `work` in graph `b` takes the last one's rows one token on."""
        return self.steady_rows.steady(b, work)

    def send(self, b: int, work: list, steady: bool) -> None:
        """Plans the attention for `work` into the filled staging buffer, then sends it by one copy (or leaves it)."""
        attention = self.attention[b].plan(DecodeSlices(work), steady)
        self.inputs[b].send(attention.sent)

    def replay(self, b: int) -> tuple:
        return self.graphs.replay(b)
