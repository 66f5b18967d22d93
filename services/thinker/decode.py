"""The thinker's decode steps as CUDA graphs, one per batch size of a ladder, and the host's part of each replay.

A graph reads its step's host values from one device buffer filled by one copy a step (StepInputs): the token ids,
positions and draw settings, then the decode attention's slots and page table (DecodeAttention, planned into the
same buffer). A replay of the last one's rows one token on (the steady state of a decode loop) advances what it
sent last instead of rebuilding it from each request.

`mapped_io`: each graph loads that buffer itself from pinned host memory, takes the rows whose input is the last
replay's token from that replay's draws on the device (`carry`), and writes its own draws to pinned host memory, all
inside the graph: a steady step is then the graph's launch and an event, where it was also a copy in, an event for
it, a kernel for the carried tokens and a copy out.
"""

import numpy as np
import torch

from services.llm import sampling
from services.llm.attention import DecodeSlices
from services.llm.context import step_context
from services.llm.host import Laps, StepInputs, device_view
from services.llm.sampling import CANDIDATES
from services.llm.scheduler import Work


class DecodeGraphs:
    """`graphs` (CapturedGraphs): for each batch size up to `max_batch`, token ids and positions in; layer-0
    embeddings, the talker's states, logits and the tokens drawn out. `inputs` and `attention` by size are what
    each graph reads; `body` is what each one records (bench.streams runs it on streams of its own, mapped_io off:
    a body that loads its inputs also flips the turn its replays take)."""

    def __init__(self, engine, max_batch: int, scratch: int, scale: float, heads: int, workspace,
                 mapped_io: bool = False, copies: int = 1):
        from services.llm.decode_plan import Replays
        from services.llm.flashinfer_attention import DecodeAttention, split_kv
        from services.llm.graphs import CapturedGraphs, ladder

        sizes = ladder(max_batch)
        self.mapped_io, self.device = mapped_io, engine.device
        cuda = self.device.type == "cuda"
        # Each size's inputs, sent by one copy a step (or loaded by its graph: mapped_io): ids, positions, top-k, seed,
        # draw counter, the row of the last replay whose draw is the row's input (-1: the id sent); temperature,
        # top-p; then its attention's slots and page table (their buffers are the graph's), planned all padding for
        # capture (into both staging buffers where the graph loads them: each is its turn's).
        self.inputs, self.attention = {}, {}
        for b in sizes:
            nbytes = DecodeAttention.nbytes(b, engine.cache)
            inputs = self.inputs[b] = StepInputs(6, 2, b, self.device, nbytes, mapped_io)
            self.attention[b] = DecodeAttention(
                engine.cache, scale, heads, b, scratch, workspace, engine.decode_tensor_cores,
                split_kv(b, engine.decode_split_kv_max_batch), engine.decode_direct_plan, inputs.staging,
                inputs.extra_offset, engine.decode_keep_plans)
            for _ in range(2 if mapped_io else 1):
                ints, _ = inputs.fill()
                ints[5] = -1
                inputs.send(self.attention[b].plan([]).sent)
        # mapped_io: the last replay's draws (any size's); each size's draws in pinned host memory, a row a turn, and
        # an event after each turn's replay
        self.carry = torch.zeros(max(sizes), dtype=torch.long, device=self.device) if mapped_io else None
        self.drawn_host = {b: torch.zeros(2, b, dtype=torch.long, pin_memory=cuda) for b in sizes} if mapped_io else {}
        drawn_out = {b: device_view(h, self.device) for b, h in self.drawn_host.items()}
        self.done = {b: [torch.cuda.Event() if cuda else None for _ in range(2)] for b in self.drawn_host}
        draw = sampling.OPS["sample_tensors"]  # compiled with the layers (compile: true)
        model, moe, accept_layer, linear = engine.model, engine.moe, engine.accept_layer, engine.triton_linear
        # Every row's noise hashed (the engine seeds unseeded requests itself): no generator state in the graphs
        hashed_noise = engine.decode_hashed_noise

        def body(b: int):
            inputs = self.inputs[b]
            if mapped_io:
                inputs.staging.load()
            (ids, pos, top_k, seeds, counters, src), (temps, top_p) = inputs.ints, inputs.floats
            if mapped_io:
                ids = torch.where(src >= 0, self.carry[src.clamp(min=0)], ids)
            with step_context(self.attention[b], moe, linear):
                embeds = model.model.embed_tokens(ids)
                hidden, captured = model(embeds, pos.float().expand(3, -1), capture_layer=accept_layer)
                logits = model.lm_head(hidden)
            drawn = draw(logits, temps, top_k, top_p, seeds, counters, CANDIDATES, not hashed_noise)
            if mapped_io:
                self.carry[:b].copy_(drawn)
                drawn_out[b].index_copy_(0, inputs.staging.turn_device, drawn[None])
                inputs.staging.turned()
            return embeds, captured, logits, drawn

        self.body = body
        # Whether a replay is the last one's rows a token on (forget(): a step ran outside the graphs); each size's
        # host rows of positions and settings
        self.replays, self._rows = Replays(), {}
        # mapped_io, after each replay: its rows' draws in host memory, read after `last_done`, an event its staging
        # buffer's next fill waits for (`last_staging`, told once the caller has waited: Staging.reached)
        self.last_drawn_host, self.last_done, self.last_staging = None, None, None
        # Each graph's outputs cut to a step's rows, and each size's row of draws in host memory cut to them: views
        # made once (a view is a torch call, several microseconds a step on the lent machines' CPUs)
        self._rows_of, self._drawn_rows = {}, {}
        self.graphs = CapturedGraphs(sizes, body, self.device, copies)

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    def forget(self) -> None:
        """A step ran outside the graphs: the next replay is not the last one's rows a token on."""
        self.replays.forget()

    def replay(self, work: list[Work], ids, counters: list[int], laps: Laps, src: list[int] | None = None) -> tuple:
        """The graph for `work` (its input ids: a device tensor, or host values; its rows' draw counters), replayed.
        Returns (input embeddings, accept-layer states, logits, tokens drawn) of `work`'s rows, valid until the next
        replay.
        mapped_io: `ids` are host values, and `src` (if any) each row's row in the last replay whose draw is its
        input instead (-1: its id); those draws must be in `carry` (the last replay's, or the caller's copy)."""
        n = len(work)
        b = self.graphs.size_for(n)
        inputs = self.inputs[b]
        ints, floats = inputs.fill()
        # Padding rows keep what the buffer last held for them (settings and ids of earlier rows, or zeros): they
        # only touch the scratch block, and their outputs are dropped.
        device_ids = isinstance(ids, torch.Tensor)
        if device_ids and self.mapped_io:
            raise ValueError("a graph that loads its inputs takes its ids from the host or from `carry` (src)")
        if not device_ids:
            ints[0, :n] = ids
        ints[5, :n] = -1 if src is None else src
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
        attention = self.attention[b].plan(DecodeSlices(work), steady)
        inputs.send(attention.sent)  # the rows above, the slots and, planned directly, the page table: one copy
        if device_ids:  # the pending step's tokens, copied on the device after the buffer's copy lands
            inputs.ints[0, :n] = ids
        laps.lap("plan")
        out = self.graphs.replay(b)
        cut = self._rows_of.get((b, n))  # made again where the graph gave other outputs (another of its copies)
        if cut is None or cut[0] is not out:
            cut = self._rows_of[b, n] = out, tuple(t[:n] if t is not None else None for t in out)
        rows = cut[1]
        if self.mapped_io:
            turn = inputs.staging.turn ^ 1  # the staging buffer this replay loads, and its row of drawn_host
            done = self.done[b][turn]
            if done is not None:
                done.record(torch.cuda.current_stream(self.device))
            inputs.staging.fence(done)
            drawn = self._drawn_rows.get((b, turn, n))
            if drawn is None:
                drawn = self._drawn_rows[b, turn, n] = self.drawn_host[b][turn, :n]
            self.last_drawn_host, self.last_done, self.last_staging = drawn, done, inputs.staging
        laps.lap("launch")
        return rows
