"""The thinker's decode steps as CUDA graphs, and the host's part of each replay.

Each graph loads its host values from pinned memory, takes rows whose input is the last replay's draw from
`carry` on the device, and writes its draws to pinned memory: a steady step is a launch and an event, no copies."""

import numpy as np
import torch

from services.llm.context import step_context
from services.llm.decode import DecodeGraphs
from services.llm.graphs import ladder
from services.llm.host import Laps, device_view
from services.llm.sampling import CANDIDATES, sample_tensors
from services.llm.scheduler import Work


class TokenGraphs:
    """Per batch size: ids and positions in; layer-0 embeddings, the talker's states, logits and draws out."""

    def __init__(self, engine, max_batch: int):
        self.device = engine.device
        cuda = self.device.type == "cuda"
        model, moe, accept_layer = engine.model, engine.moe, engine.accept_layer
        self.carry = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # the last replay's draws
        # Each size's draws in pinned memory, a row per staging turn, and an event after each turn's replay
        self.drawn_host = {b: torch.zeros(2, b, dtype=torch.long, pin_memory=cuda) for b in ladder(max_batch)}
        drawn_out = {b: device_view(h, self.device) for b, h in self.drawn_host.items()}
        self.done = {b: [torch.cuda.Event() if cuda else None for _ in range(2)] for b in self.drawn_host}

        def body(b: int, inputs, attention):
            inputs.staging.load()
            # src: the last replay's row whose draw is the input (-1: the id)
            (ids, pos, top_k, seeds, counters, src), (temps, top_p) = inputs.ints, inputs.floats
            ids = torch.where(src >= 0, self.carry[src.clamp(min=0)], ids)
            with step_context(attention, moe):
                embeds = model.model.embed_tokens(ids)
                hidden, captured = model(embeds, pos.float().expand(3, -1), capture_layer=accept_layer)
                logits = model.lm_head(hidden)
            drawn = sample_tensors(logits, temps, top_k, top_p, seeds, counters, CANDIDATES)
            self.carry[:b].copy_(drawn)
            drawn_out[b].index_copy_(0, inputs.staging.turn_device, drawn[None])
            inputs.staging.turned()
            return embeds, captured, logits, drawn

        def init(ints, floats):
            ints[5] = -1

        self.graphs = DecodeGraphs(engine, max_batch, 6, 2, body, init, loaded=True)
        self._rows: dict[int, tuple] = {}  # each size's host rows of positions and settings, kept between steps
        # The last replay's draws in host memory, read after `last_done`, which its staging buffer's next fill waits for
        self.last_drawn_host, self.last_done, self.last_staging = None, None, None
        self._rows_of, self._drawn_rows = {}, {}  # views cut to a step's rows, made once: each is a torch call

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def forget(self) -> None:
        self.graphs.forget()

    def replay(self, work: list[Work], ids, counters: list[int], laps: Laps, src: list[int] | None = None) -> tuple:
        """Replays `work` -> (input embeddings, accept-layer states, logits, draws), valid until the next replay."""
        n = len(work)
        b = self.graphs.size_for(n)
        ints, floats = self.graphs.fill(b)
        # Padding rows keep whatever the buffer held: they touch only the scratch block
        ints[0, :n] = ids
        ints[5, :n] = -1 if src is None else src
        steady = self.graphs.steady(b, work)  # positions advanced and settings kept
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
        self.graphs.send(b, work, steady)
        laps.lap("plan")
        out = self.graphs.replay(b)
        cut = self._rows_of.get((b, n))
        if cut is None or cut[0] is not out:
            cut = self._rows_of[b, n] = out, tuple(t[:n] if t is not None else None for t in out)
        inputs = self.graphs.inputs[b]
        turn = inputs.staging.turn ^ 1  # the staging buffer this replay loads
        done = self.done[b][turn]
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))
        inputs.staging.fence(done)
        drawn = self._drawn_rows.get((b, turn, n))
        if drawn is None:
            drawn = self._drawn_rows[b, turn, n] = self.drawn_host[b][turn, :n]
        self.last_drawn_host, self.last_done, self.last_staging = drawn, done, inputs.staging
        laps.lap("launch")
        return cut[1]
