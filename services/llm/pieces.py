"""Steps that no decode graph holds (prompt chunks, prompts beside decode tokens, multimodal rows) as CUDA graphs
between attentions: piecewise graphs.

Launched eagerly, such a step of a 48-layer model spends most of its time on the host launching kernels. Of a
layer, only the attention's launch depends on the step's sequences (their page tables); the rest depends on the
token count alone. So for each count of a ladder the rest is recorded once, in two pieces a layer: before the
attention (input norm, q/k/v, QK-norm, rotation, k and v written into the cache) and after it (output
projection, residual, norm, MLP). A step of n tokens replays the smallest count >= n. Its embeddings, positions
and KV slots go into static buffers (padding rows: a scratch slot for their keys, outputs dropped); then per layer
a piece, the attention planned for the n real rows and run eagerly, a piece, and the model's own work between
layers (`after_layer`). Without graphs (the CPU, the tests) the pieces run as they are, on the same buffers.

Every piece writes its result into a buffer made here, outside the graphs' shared memory pool, so nothing a graph
made outlives its replay and the graphs may replay in any order.
"""

from typing import Callable

import torch

from services.llm.attention import kv_slots
from services.llm.context import step_context
from services.llm.graphs import Graphs, token_ladder


class StepPieces:
    def __init__(self, decoder, cache, max_tokens: int, moe: str, scratch_slot: int, graphs: bool):
        """`decoder`: a layers.Decoder (layers, `rope`, final `norm`); `cache`: its KV cache; `scratch_slot`: a
        cache slot no sequence owns, for the padding rows' keys; `graphs`: record the pieces (a GPU)."""
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.cache, self.moe, self.scratch = cache, moe, scratch_slot
        self.sizes = token_ladder(max_tokens)
        attn = self.layers[0].self_attn
        dev, dtype, n = cache.k.device, cache.k.dtype, self.sizes[-1]
        hidden, dim = self.layers[0].input_layernorm.weight.shape[0], attn.head_dim
        self.x = torch.zeros(n, hidden, dtype=dtype, device=dev)  # the residual stream, updated in place
        self.positions = torch.zeros(3, n, device=dev)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=dev)
        self.cos, self.sin = torch.zeros(n, dim, dtype=dtype, device=dev), torch.zeros(n, dim, dtype=dtype, device=dev)
        self.q = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)  # a layer's queries
        self.attn = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)  # and its attention's output
        self.graphs: Graphs | None = None
        self.steps = 0  # forwards run
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
        """Piece `j` of a step of `b` rows: 2i before layer i's attention, 2i + 1 after it."""
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
        """The decoder's normed output [n, H] for a step of at most `max_tokens` rows, with `attention` planned
        for its sequences (its `slot_mapping`: where each row's keys go). `after_layer(i, x)` sees layer i's output
        (the residual stream's first n rows, which it may change in place; a copy, to keep it)."""
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
