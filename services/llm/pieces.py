"""Steps no decode graph holds (prompt chunks, mixed steps) as CUDA graphs between attentions: piecewise graphs.

Eagerly such a step spends most of its time launching kernels, and only attention depends on the sequences;
so for each token count of a ladder each layer is recorded as two pieces, before and after attention, which
runs eagerly between them. Padding rows write their keys to a scratch slot. Every piece writes into buffers
made here, outside the graphs' pool, so nothing outlives a replay and graphs replay in any order."""

from typing import Callable

import torch

from services.llm.attention import kv_slots
from services.llm.context import step_context
from services.llm.graphs import Graphs, token_ladder


class StepPieces:
    def __init__(self, decoder, cache, max_tokens: int, moe: str, scratch_slot: int, graphs: bool):
        """`scratch_slot`: a cache slot no sequence owns, for padding rows' keys; `graphs`: record (a GPU)."""
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.cache, self.moe, self.scratch = cache, moe, scratch_slot
        self.sizes = token_ladder(max_tokens)
        attn = self.layers[0].self_attn
        dev, dtype, n = cache.k.device, cache.k.dtype, self.sizes[-1]
        hidden, dim = self.layers[0].input_layernorm.weight.shape[0], attn.head_dim
        self.x = torch.zeros(n, hidden, dtype=dtype, device=dev)  # residual stream, in place
        self.positions = torch.zeros(3, n, device=dev)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=dev)
        self.cos, self.sin = torch.zeros(n, dim, dtype=dtype, device=dev), torch.zeros(n, dim, dtype=dtype, device=dev)
        self.q = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)
        self.graphs: Graphs | None = None
        self.steps = 0
        if graphs:
            self.graphs = Graphs(dev)
            with step_context(None, moe):  # largest first: the pool then fits every smaller size
                for b in reversed(self.sizes):
                    for j in range(2 * len(self.layers)):
                        self.graphs.capture((b, j), self._piece(b, j))
            torch.cuda.synchronize(dev)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def _piece(self, b: int, j: int) -> Callable[[], None]:
        """Piece `j` of `b` rows: 2i before layer i's attention, 2i + 1 after it."""
        layer, i = self.layers[j // 2], j // 2
        if j % 2 == 0:
            def before():
                if i == 0:  # the step's rotary tables, once
                    cos, sin = self.decoder.rope(self.positions[:, :b], self.x.dtype)
                    self.cos[:b].copy_(cos)
                    self.sin[:b].copy_(sin)
                q, _, _ = layer.before_attention(self.x[:b], self.cos[:b], self.sin[:b], kv_slots(self.cache, i, self.slots[:b]))
                self.q[:b].copy_(q)
            return before

        def after():
            self.x[:b].copy_(layer.after_attention(self.x[:b], self.attn[:b]))
        return after

    def _run(self, b: int, j: int) -> None:
        if self.graphs is not None:
            self.graphs.replay((b, j))
        else:
            with step_context(None, self.moe):
                self._piece(b, j)()

    @torch.no_grad()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attention,
                after_layer: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """The normed output [n, H]; `after_layer(i, x)` may change layer i's output in place."""
        n = embeds.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.steps += 1
        self.x[:n].copy_(embeds)
        self.positions[:, :n].copy_(positions)
        self.slots[:n].copy_(attention.slot_mapping)
        if b > n:
            self.slots[n:b].fill_(self.scratch)
        for i, layer in enumerate(self.layers):
            self._run(b, 2 * i)
            attention.forward(layer.self_attn.layer, self.q[:n], None, None, written=True, out=self.attn[:n])
            self._run(b, 2 * i + 1)
            if after_layer is not None:
                after_layer(i, self.x[:n])
        return self.decoder.norm(self.x[:n])
