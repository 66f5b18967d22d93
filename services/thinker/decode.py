"""The thinker's decode steps as CUDA graphs, one per batch size of a ladder, and the host's part of each replay.

A graph reads its step's host values from one device buffer filled by one copy a step (StepInputs): the token ids,
positions and draw settings, then the decode attention's slots and page table (DecodeAttention, planned into the
same buffer). A replay of the last one's rows one token on (the steady state of a decode loop) advances what it
sent last instead of rebuilding it from each request.
"""

import numpy as np
import torch

from services.llm import sampling
from services.llm.attention import SeqSlice
from services.llm.context import step_context
from services.llm.host import Laps, StepInputs
from services.llm.sampling import CANDIDATES
from services.llm.scheduler import Work


class DecodeGraphs:
    """`graphs` (CapturedGraphs): for each batch size up to `max_batch`, token ids and positions in; layer-0
    embeddings, the talker's states, logits and the tokens drawn out. `inputs` and `attention` by size are what
    each graph reads; `body` is what each one records (bench.streams runs it on streams of its own)."""

    def __init__(self, engine, max_batch: int, scratch: int, scale: float, heads: int, workspace):
        from services.llm.decode_plan import Replays
        from services.llm.flashinfer_attention import DecodeAttention, split_kv
        from services.llm.graphs import CapturedGraphs, ladder

        sizes = ladder(max_batch)
        # Each size's inputs, sent by one copy a step: ids, positions, top-k, seed, draw counter; temperature, top-p;
        # then its attention's slots and page table (their buffers are the graph's), planned all padding for capture.
        self.inputs, self.attention = {}, {}
        for b in sizes:
            inputs = self.inputs[b] = StepInputs(5, 2, b, engine.device, DecodeAttention.nbytes(b, engine.cache))
            self.attention[b] = DecodeAttention(
                engine.cache, scale, heads, b, scratch, workspace, engine.decode_tensor_cores,
                split_kv(b, engine.decode_split_kv_max_batch), engine.decode_direct_plan, inputs.staging,
                inputs.extra_offset, engine.decode_keep_plans)
            inputs.fill()
            inputs.send(self.attention[b].plan([]).sent)
        draw = sampling.OPS["sample_tensors"]  # compiled with the layers (compile: true)
        model, moe, accept_layer = engine.model, engine.moe, engine.accept_layer

        def body(b: int):
            (ids, pos, top_k, seeds, counters), (temps, top_p) = self.inputs[b].ints, self.inputs[b].floats
            with step_context(self.attention[b], moe):
                embeds = model.model.embed_tokens(ids)
                hidden, captured = model(embeds, pos.float().expand(3, -1), capture_layer=accept_layer)
                logits = model.lm_head(hidden)
            return embeds, captured, logits, draw(logits, temps, top_k, top_p, seeds, counters, CANDIDATES)

        self.body = body
        self.device = engine.device
        # Whether a replay is the last one's rows a token on (forget(): a step ran outside the graphs); each size's
        # host rows of positions and settings
        self.replays, self._rows = Replays(), {}
        self.graphs = CapturedGraphs(sizes, body, engine.device)

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    def forget(self) -> None:
        """A step ran outside the graphs: the next replay is not the last one's rows a token on."""
        self.replays.forget()

    def replay(self, work: list[Work], ids, counters: list[int], laps: Laps) -> tuple:
        """The graph for `work` (its input ids: a device tensor, or host values; its rows' draw counters), replayed.
        Returns (input embeddings, accept-layer states, logits, tokens drawn), valid until the next replay."""
        n = len(work)
        b = self.graphs.size_for(n)
        inputs = self.inputs[b]
        ints, floats = inputs.fill()
        # Padding rows keep what the buffer last held for them (settings and ids of earlier rows, or zeros): they
        # only touch the scratch block, and their outputs are dropped.
        device_ids = isinstance(ids, torch.Tensor)
        if not device_ids:
            ints[0, :n] = ids
        # The last replay's rows one token on (the same sequences, nothing else run between): positions advanced
        # and settings kept, the page table advanced, not rebuilt (DecodeAttention.plan).
        steady = self.replays.steady(b, work)
        int_rows, float_rows = self._rows.setdefault(b, (np.zeros((3, b), np.int64), np.zeros((2, b), np.float32)))
        if steady:
            int_rows[0, :n] += 1
        else:  # positions, top-k, seeds; temperatures, top-p
            params = [w.seq.owner.params for w in work]
            int_rows[:, :n] = ([w.start + w.seq.owner.rope_delta for w in work], [p.top_k for p in params],
                               [p.seed & (2**63 - 1) for p in params])
            float_rows[:, :n] = [p.temperature for p in params], [p.top_p for p in params]
        ints[1:4, :n] = int_rows[:, :n]
        ints[4, :n] = counters
        floats[:, :n] = float_rows[:, :n]
        laps.lap("inputs")
        attention = self.attention[b].plan([SeqSlice(w.seq.blocks, w.start, 1) for w in work], steady)
        inputs.send(attention.sent)  # the rows above, the slots and, planned directly, the page table: one copy
        if device_ids:  # the pending step's tokens, copied on the device after the buffer's copy lands
            inputs.ints[0, :n] = ids
        laps.lap("plan")
        out = self.graphs.replay(b)
        laps.lap("launch")
        return out
