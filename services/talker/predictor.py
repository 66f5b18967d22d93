"""The code predictor's frame for a batch: from each talker state and first code, the other codes and every
code's embedding, over fixed buffers so one graph per batch size records the whole frame. Every request runs
the same positions each frame, so the keys sit in a dense cache, a row per request."""

import torch

from services.llm import graphs
from services.llm.attention import DenseAttention
from services.llm.context import step_context
from services.llm.host import Laps, StepInputs
from services.llm.sampling import SamplingParams, sample_tensors
from services.talker.seq import PREDICTOR_SAMPLING

GREEDY = SamplingParams()


class PredictorFrames:
    def __init__(self, talker, config, hidden_size: int, groups: int, max_seqs: int, dtype: torch.dtype,
                 device: torch.device, moe: str, laps: Laps):
        """`config`: the code predictor's."""
        self.talker, self.groups, self.device, self.moe, self.laps = talker, groups, device, moe, laps
        shape = (config.num_hidden_layers, max_seqs, groups, config.num_key_value_heads, config.head_dim)
        self.attention = DenseAttention(torch.zeros(shape, dtype=dtype, device=device),
                                        torch.zeros(shape, dtype=dtype, device=device), config.head_dim ** -0.5)
        self.hidden = torch.zeros(max_seqs, hidden_size, dtype=dtype, device=device)  # the talker's last states
        # code 0, top-k, seed, counter base; temperature, top-p
        self.inputs = StepInputs(4, 2, max_seqs, device)
        self.ints, self.floats = self.inputs.ints, self.inputs.floats
        self.top_k = PREDICTOR_SAMPLING.top_k or config.vocab_size  # the widest top-k a row may use
        with torch.no_grad():  # rotary tables [G, D], the same every frame: made once
            self.rope = talker.code_predictor.model.rope(torch.arange(groups, device=device).float().expand(3, -1), dtype)
        self.graphs = None

    def capture(self, sizes: list[int]) -> None:
        self.graphs = graphs.Ladder(sizes, self.body, self.device)

    def run(self, seqs: list, code0: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> codes [B, G] and code embeddings [B, G, D] of one frame of `seqs`, from a graph where one fits."""
        n = len(seqs)
        graph = self.graphs is not None and n <= self.graphs.max_batch
        b = self.graphs.size_for(n) if graph else n
        params = [s.predictor_params or GREEDY for s in seqs] + [GREEDY] * (b - n)
        ints, floats = self.inputs.fill()
        ints[1:, :b] = ([p.top_k or self.top_k for p in params], [p.seed & (2**63 - 1) for p in params],
                        [(len(s.frames) + s.frames_unread) * self.groups for s in seqs] + [0] * (b - n))
        floats[:, :b] = [p.temperature for p in params], [p.top_p for p in params]
        self.inputs.send()
        self.ints[0, :n] = code0  # on the device, after the copy
        self.hidden[:n] = hidden
        if b > n:  # zero_(): a Python 0 assigned might be copied from the host first
            self.ints[0, n:b].zero_()
            self.hidden[n:b].zero_()
        self.laps.lap("inputs")
        codes, embeds = self.graphs.replay(b) if graph else self.body(n)
        self.laps.lap("launch")
        return codes[:n], embeds[:n]

    def body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for the first `b` rows, sampling included, shapes fixed by `b` alone."""
        cp = self.talker.code_predictor
        code0, top_k, seeds, base = self.ints[:, :b]
        temps, top_p = self.floats[:, :b]
        first = self.talker.get_input_embeddings()(code0)
        x = torch.stack([self.hidden[:b], first], dim=1).reshape(2 * b, -1)  # rows: hidden, code 0
        cos, sin = self.rope
        rope = cos[:2].repeat(b, 1), sin[:2].repeat(b, 1)  # positions 0 and 1 for each request
        codes, embeds, cached = [code0], [first], 0
        counters = base[:, None] + torch.arange(self.groups - 1, device=base.device)
        for i in range(self.groups - 1):
            n = 2 if i == 0 else 1
            with step_context(self.attention.at(b, cached, n), self.moe):
                h = cp.model(x, rope=rope)
            cached += n
            code = sample_tensors(cp.lm_head[i](h[n - 1::n]), temps, top_k, top_p, seeds, counters[:, i], self.top_k)
            codes.append(code)
            x = cp.model.codec_embedding[i](code)
            embeds.append(x)
            if i < self.groups - 2:
                rope = cos[cached].expand(b, -1), sin[cached].expand(b, -1)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)
