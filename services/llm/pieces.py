"""Steps that no decode graph holds (prompt chunks, prompts beside decode tokens, multimodal rows) as CUDA
graphs between attentions: piecewise graphs.

Launched eagerly, such a step of the 48-layer thinker spends about 1.2 ms of host time a layer on its
launches: 62.5 ms to the first token of a 40-token prompt, 12 ms of it on the device
(bench/results/profile-1xh200-prefill-b1-40-ecdda12.txt). Of a layer, only the attention's launch depends on
the step's sequences (their page tables); the rest depends on the token count alone. So for each count of
a ladder the rest is recorded once, in two pieces a layer: before the attention (input norm, q/k/v,
QK-norm, rotation, k and v written into the cache) and after it (output projection, residual, norm, MoE).
A step of n tokens replays the smallest count >= n. Its embeddings, positions and KV slots go into static
buffers (padding rows: a scratch slot for their keys, outputs dropped); then per layer a piece, the
attention planned for the n real rows and run eagerly, a piece. DeepStack's additions and the captured
layer's states run eagerly between pieces. Without graphs (`graphs=False`: the CPU, the tests) the pieces
run as they are, on the same buffers.

Every piece writes its result into a buffer made here, outside the graphs' shared memory pool, so nothing
a graph made outlives its replay and the graphs may replay in any order.
"""

import torch

from services.llm.attention import kv_slots
from services.llm.context import step_context


def token_ladder(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, then 96, 128, 192, 256, ... (x1.5, x4/3), and `max_tokens` itself: a step pads at most
    half its tokens, where short steps are cheap on the device."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b + 16 if b < 64 else (b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)
    return sizes + [max_tokens]


def build(decoder, cache, step_graphs: int, max_tokens: int, moe: str, scratch_slot: int, capturable: bool,
          triton_linear: bool = False):
    """An engine's pieces (`step_graphs`: up to that many tokens, at most its step's `max_tokens`): graphs on a
    GPU whose attention and experts a graph can hold (`capturable`), the same pieces eagerly on the CPU;
    None when off or not capturable. `triton_linear`: the step context's (services/llm/context.py)."""
    on_gpu = cache.k.is_cuda
    if not step_graphs or (on_gpu and not capturable):
        return None
    return StepPieces(decoder, cache, token_ladder(min(step_graphs, max_tokens)), moe, scratch_slot, graphs=on_gpu,
                      triton_linear=triton_linear)


class StepPieces:
    def __init__(self, decoder, cache, sizes: list[int], moe: str, scratch_slot: int, graphs: bool,
                 triton_linear: bool = False):
        """`decoder`: a stack of layers.DecoderLayer with its `rope` and final `norm` (the thinker's
        `model.model`, the talker's); `cache`: its KV cache; `scratch_slot`: a cache slot no sequence owns, for
        the padding rows' keys."""
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.cache, self.moe, self.scratch, self.triton_linear = cache, moe, scratch_slot, triton_linear
        self.sizes = sorted(sizes)
        attn = self.layers[0].self_attn
        dev, dtype, n = cache.k.device, cache.k.dtype, self.sizes[-1]
        hidden, dim = self.layers[0].input_layernorm.weight.shape[0], attn.head_dim
        self.x = torch.zeros(n, hidden, dtype=dtype, device=dev)  # the residual stream, updated in place
        self.positions = torch.zeros(3, n, device=dev)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=dev)
        self.cos, self.sin = torch.zeros(n, dim, dtype=dtype, device=dev), torch.zeros(n, dim, dtype=dtype, device=dev)
        self.q = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)  # a layer's queries
        self.attn = torch.zeros(n, attn.heads, dim, dtype=dtype, device=dev)  # and its attention's output
        self.graphs: dict[int, list] | None = None
        self.steps = self.replays = 0  # forwards run, graphs replayed
        if graphs:
            self._capture(dev)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def _piece(self, b: int, j: int):
        """Piece `j` of a step of `b` rows: 2i before layer i's attention, 2i + 1 after it."""
        layer = self.layers[j // 2]
        if j % 2 == 0:
            i = j // 2

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

    @torch.no_grad()
    def _capture(self, dev: torch.device) -> None:
        """Every piece of every size as a graph, largest size first, one memory pool for all (each piece's
        temporaries are free again when it ends: its results are in the buffers above)."""
        self.graphs, pool = {}, None
        stream = torch.cuda.Stream(dev)
        with step_context(None, self.moe, self.triton_linear):
            for b in sorted(self.sizes, reverse=True):
                runs = [self._piece(b, j) for j in range(2 * len(self.layers))]
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up outside the graphs: kernels compiled and chosen, workspaces made
                        for run in runs:
                            run()
                torch.cuda.current_stream(dev).wait_stream(stream)
                graphs = []
                for run in runs:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        run()
                    pool = graph.pool()
                    graphs.append(graph)
                self.graphs[b] = graphs
        torch.cuda.synchronize(dev)

    def _run(self, b: int, j: int) -> None:
        if self.graphs is not None:
            self.graphs[b][j].replay()
            self.replays += 1
        else:
            with step_context(None, self.moe, self.triton_linear):
                self._piece(b, j)()

    @torch.no_grad()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attention, deepstack_rows=None, deepstack=None,
                capture_layer: int | None = None):
        """ThinkerModel.forward for a step of at most `max_tokens` rows, with `attention` planned for its
        sequences (its `slot_mapping`: where each row's keys go)."""
        n = embeds.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.steps += 1
        self.x[:n].copy_(embeds)
        self.positions[:, :n].copy_(positions)
        self.slots[:n].copy_(attention.slot_mapping)
        if b > n:
            self.slots[n:b].fill_(self.scratch)
        captured = None
        for i, layer in enumerate(self.layers):
            self._run(b, 2 * i)
            attention.forward(layer.self_attn.layer, self.q[:n], None, None, written=True, out=self.attn[:n])
            self._run(b, 2 * i + 1)
            if capture_layer == i + 1:
                captured = self.x[:n].clone()
            if deepstack is not None and i < len(deepstack):
                self.x[:n].index_add_(0, deepstack_rows, deepstack[i].to(self.x.dtype))
        out = self.decoder.norm(self.x[:n])
        return out, (out if capture_layer == len(self.layers) else captured)
