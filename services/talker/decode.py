"""The talker's frame steps as CUDA graphs, and the host's part of each replay.

A frame step takes one input row per request, at positions equal on the three M-RoPE rows, and gives the talker's
states, codec logits and, where every row's settings allow it, the next first codes drawn inside the graph."""

import torch

from services.llm.context import step_context
from services.llm.decode import DecodeGraphs
from services.llm.host import Laps
from services.llm.sampling import CANDIDATES, sample_tensors
from services.talker.predictor import GREEDY


def draw_first(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor, suppress: torch.Tensor,
               no_eos: torch.Tensor, eos: torch.Tensor, temps, top_k, top_p, seeds, counters) -> torch.Tensor:
    """The engine's `_sample_first` with every setting a tensor, for a graph (the rows `_first_drawable` allows)."""
    x = logits.float()
    pen = penalty[:, None]
    x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
    x = x.masked_fill(suppress[None, :] | ((no_eos[:, None] != 0) & eos[None, :]), float("-inf"))
    return sample_tensors(x, temps, top_k, top_p, seeds, counters, CANDIDATES)


class FrameGraphs:
    """Per batch size: rows of `x` in; states, codec logits and first codes out (`seen`: the engine's at capture)."""

    def __init__(self, engine, max_batch: int):
        device, talker, moe = engine.device, engine.talker, engine.moe
        self.device = device
        self.x = torch.zeros(max_batch, engine.text_config.hidden_size, dtype=engine.dtype, device=device)
        self.seen = engine.seen
        vocab = talker.codec_head.out_features
        suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        suppress[engine.suppress] = True
        eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        eos[engine.codec_eos] = True

        def body(b: int, inputs, attention):
            (pos, slots, top_k, seeds, counters, no_eos), (temps, top_p, pen) = inputs.ints, inputs.floats
            with step_context(attention, moe):
                hidden = talker.model(self.x[:b], pos.float().expand(3, -1))
                logits = talker.codec_head(hidden)
            return hidden, logits, draw_first(logits, self.seen[slots], pen, suppress, no_eos, eos, temps, top_k, top_p,
                                              seeds, counters)

        def init(ints, floats):  # padding reads the spare row of `seen`
            ints[1], floats[:] = len(self.seen) - 1, 1.0

        # Plans not kept: with them, two identical runs of one engine drew different codes (docs/decisions.md)
        self.graphs = DecodeGraphs(engine, max_batch, 6, 3, body, init, keep_plans=False)

    @property
    def max_batch(self) -> int:
        return self.graphs.max_batch

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def forget(self) -> None:
        self.graphs.forget()

    def replay(self, work: list, x: torch.Tensor, draw: list | None, laps: Laps) -> tuple:
        """Replays `work` on `x` [n, D] -> states, logits and, with `draw`, (first codes, slots) until the next replay."""
        n = len(work)
        b = self.graphs.size_for(n)
        self.x[:n] = x
        ints, floats = self.graphs.fill(b)
        ints[0] = [w.start + w.seq.owner.rope_delta for w in work] + [0] * (b - n)
        if draw:
            pad = [0] * (b - n)
            params = [s.params for s, _ in draw] + [GREEDY] * (b - n)
            ints[1:] = ([slot for _, slot in draw] + [len(self.seen) - 1] * (b - n), [p.top_k for p in params],
                        [p.seed & (2**63 - 1) for p in params], [len(s.frames) + s.frames_unread for s, _ in draw] + pad,
                        [int(p.ignore_eos) for p in params])
            floats[:] = [p.temperature for p in params], [p.top_p for p in params], [p.repetition_penalty for p in params]
        laps.lap("inputs")
        self.graphs.send(b, work, self.graphs.steady(b, work))
        laps.lap("plan")
        hidden, logits, code0 = self.graphs.replay(b)
        laps.lap("launch")
        return hidden[:n], logits[:n], (code0[:n], self.graphs.inputs[b].ints[1, :n]) if draw else None
