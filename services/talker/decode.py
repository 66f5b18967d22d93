"""The talker's frame steps as CUDA graphs, one per batch size of a ladder, and the host's part of each replay.

A frame step takes one input row per request (its last frame's code embeddings and the text that frame adds) at
positions equal on the three M-RoPE rows, and gives the talker's states and codec logits, and, where every row's
settings allow it, the next frames' first codes drawn inside the graph. Its host values go by one copy a step
(StepInputs): positions and the draw's settings, then the decode attention's slots and page table (DecodeAttention,
planned into the same buffer). A replay of the last one's requests one input on advances the page table it sent last
instead of rebuilding it.
"""

import torch

from services.llm import sampling
from services.llm.attention import DecodeSlices
from services.llm.context import step_context
from services.llm.host import Laps, StepInputs
from services.llm.sampling import CANDIDATES
from services.talker.predictor import GREEDY


def draw_first(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor, suppress: torch.Tensor,
               no_eos: torch.Tensor, eos: torch.Tensor, temps, top_k, top_p, seeds, counters) -> torch.Tensor:
    """The engine's `_sample_first` with every per-row setting a tensor, for a graph: the repetition penalty where
    `seen` [B, V] (1.0: none), the suppressed codes [V] and the end code [V] where `no_eos` [B], then sample_tensors
    over the best CANDIDATES. A row gets the code `_sample_first` gives it (the engine's _first_drawable rows)."""
    x = logits.float()
    pen = penalty[:, None]
    x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
    x = x.masked_fill(suppress[None, :] | ((no_eos[:, None] != 0) & eos[None, :]), float("-inf"))
    return sampling.OPS["sample_tensors"](x, temps, top_k, top_p, seeds, counters, CANDIDATES)


class FrameGraphs:
    """`graphs` (CapturedGraphs): for each batch size of `sizes`, the rows of `x` in; the talker's states, codec
    logits and (with `draws`) first codes out. `inputs` and `attention` by size are what each graph reads; `seen` is
    the mask of codes drawn its draws read (the engine's, as it was at capture)."""

    def __init__(self, engine, sizes: list[int], scratch: int, text, draws: bool):
        from services.llm.decode_plan import Replays
        from services.llm.flashinfer_attention import DecodeAttention, split_kv
        from services.llm.graphs import CapturedGraphs

        device, talker, moe = engine.device, engine.talker, engine.moe
        self.device, self.draws = device, draws
        self.x = torch.zeros(sizes[-1], text.hidden_size, dtype=engine.dtype, device=device)
        self.seen = engine.seen  # a step draws in the graphs only while this is still the engine's mask
        vocab = talker.codec_head.out_features
        suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        suppress[engine.suppress] = True
        eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        eos[engine.codec_eos] = True
        # Each size's inputs from the host, sent by one copy a step: positions; the first codes' draw: per row its
        # slot in `seen` (padding: the spare last row), top-k, seed, counter, whether the end code is banned;
        # temperature, top-p, repetition penalty; then its attention's slots and page table (their buffers are the
        # graph's), planned all padding for capture.
        self.inputs, self.attention = {}, {}
        for b in sizes:
            inputs = self.inputs[b] = StepInputs(6, 3, b, device, DecodeAttention.nbytes(b, engine.cache))
            self.attention[b] = DecodeAttention(
                engine.cache, text.head_dim ** -0.5, text.num_attention_heads, b, scratch, engine.workspace,
                engine.decode_tensor_cores, split_kv(b, engine.decode_split_kv_max_batch), engine.decode_direct_plan,
                inputs.staging, inputs.extra_offset, engine.decode_keep_plans)
            for _ in range(2):  # both staging buffers: what rows not drawn in the graph read until a step fills them
                ints, floats = inputs.fill()
                ints[1], floats[:] = len(self.seen) - 1, 1.0
                inputs.send(self.attention[b].plan([]).sent)

        def body(b: int):
            (pos, slots, top_k, seeds, counters, no_eos), (temps, top_p, pen) = self.inputs[b].ints, self.inputs[b].floats
            with step_context(self.attention[b], moe):
                hidden = talker.model(self.x[:b], pos.float().expand(3, -1))
                logits = talker.codec_head(hidden)
            if not draws:
                return hidden, logits
            return hidden, logits, draw_first(logits, self.seen[slots], pen, suppress, no_eos, eos, temps, top_k, top_p,
                                              seeds, counters)

        self.body = body
        self.replays = Replays()  # whether a replay is the last one's requests an input on (forget(): a step between)
        self.graphs = CapturedGraphs(sizes, body, device)

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    def forget(self) -> None:
        """A step ran outside the graphs: the next replay is not the last one's requests an input on."""
        self.replays.forget()

    def replay(self, work: list, x: torch.Tensor, draw: list | None, laps: Laps) -> tuple:
        """The graph for `work` (scheduler Work rows, one pending input each; `x` [n, D] their inputs), replayed.
        `draw`: each row's (request, slot in `seen`) where the graph's draw stands for every row's, else None.
        Returns the states [n, D] and logits [n, V], and with `draw`, the first codes drawn [n] and the rows' slots
        on the device; valid until the next replay."""
        n = len(work)
        b = self.graphs.size_for(n)
        self.x[:n] = x
        inputs = self.inputs[b]
        ints, floats = inputs.fill()
        ints[0] = [w.start + w.seq.owner.rope_delta for w in work] + [0] * (b - n)
        if draw:
            pad = [0] * (b - n)
            params = [s.params for s, _ in draw] + [GREEDY] * (b - n)  # padding rows: greedy, on the spare row of `seen`
            ints[1:] = ([slot for _, slot in draw] + [len(self.seen) - 1] * (b - n), [p.top_k for p in params],
                        [p.seed & (2**63 - 1) for p in params], [len(s.frames) + s.frames_unread for s, _ in draw] + pad,
                        [int(p.ignore_eos) for p in params])
            floats[:] = [p.temperature for p in params], [p.top_p for p in params], [p.repetition_penalty for p in params]
        laps.lap("inputs")
        # The last replay's requests one input on (nothing else run between): its page table advanced, not rebuilt
        attention = self.attention[b].plan(DecodeSlices(work), self.replays.steady(b, work))
        inputs.send(attention.sent)  # the rows above, the slots and, planned directly, the page table: one copy
        laps.lap("plan")
        hidden, logits, *code0 = self.graphs.replay(b)
        laps.lap("launch")
        return hidden[:n], logits[:n], (code0[0][:n], inputs.ints[1, :n]) if draw else None
