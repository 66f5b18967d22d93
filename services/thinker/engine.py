"""The native thinker engine: our model on a paged KV cache, continuous batching with chunked prefill,
one forward per step over every scheduled sequence. Same requests and outputs as the reference engine."""

import time
from dataclasses import dataclass

import torch

from services.llm.attention import SeqSlice, TorchAttention
from services.llm.fp8 import FP8_BLOCK, quantize_experts_
from services.llm.context import step_context
from services.llm.kv_cache import BlockAllocator, KVCache
from services.llm.sampling import sample_batch
from services.llm.scheduler import Scheduler, SeqState, Work
from services.model.load import _default_dtype, load_config, load_weights_
from services.model.spec import OmniSpec
from services.runtime.errors import ResourceExhausted
from services.thinker.model import ThinkerModel
from services.thinker.reference import ThinkerSeq, ThinkerStep, stop_reason, validate


@dataclass(eq=False)
class ThinkerState(SeqState):
    states_sent: int = 0  # positions whose states went out (a recomputed sequence does not send them twice)


class NativeThinker:
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32, load_format: str = "auto",
                 seed: int = 0, block_size: int = 16, kv_blocks: int = 0, max_batched_tokens: int = 2048,
                 max_seqs: int = 256, moe: str = "loop", fp8_experts: str = "off"):
        self.device, self.dtype = torch.device(device), dtype
        config = load_config(model_dir)
        with torch.device(self.device), _default_dtype(dtype):
            self.model = ThinkerModel(config.thinker_config)
        load_weights_(self.model, "thinker", model_dir, dtype, load_format, seed)
        if fp8_experts != "off":
            quantize_experts_(self.model, FP8_BLOCK if fp8_experts == "block" else None)
        self.model.to(self.device).eval()
        spec = OmniSpec.load(model_dir)
        tc = config.thinker_config.text_config
        self.accept_layer = spec.talker["accept_hidden_layer"] if spec.has_talker else None
        self.vocab, self.hidden_size = tc.vocab_size, tc.hidden_size
        blocks = kv_blocks or self._fitting_blocks(tc, block_size)
        self.cache = KVCache.allocate(tc.num_hidden_layers, blocks, block_size, tc.num_key_value_heads, tc.head_dim, dtype, self.device)
        self.scheduler = Scheduler(BlockAllocator(blocks), block_size, max_batched_tokens, max_seqs)
        self.attention = TorchAttention(self.cache, tc.head_dim ** -0.5)
        self.moe = moe
        self.states: dict[int, SeqState] = {}

    def _fitting_blocks(self, tc, block_size: int) -> int:
        per_block = KVCache.bytes_per_block(tc.num_hidden_layers, block_size, tc.num_key_value_heads, tc.head_dim, self.dtype)
        if self.device.type != "cuda":
            return max(64, (1 << 30) // per_block)  # 1 GiB on the CPU
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * 0.85) // per_block  # what the weights left, minus room for activations

    @property
    def capacity(self) -> int:
        return self.scheduler.allocator.num_blocks * self.scheduler.block_size

    # -- engine protocol ---------------------------------------------------------------------------

    def add(self, seq: ThinkerSeq) -> None:
        validate(seq, self.vocab, self.hidden_size, self.accept_layer is not None)
        need = len(seq.prompt_ids) + seq.params.max_tokens
        if need > self.capacity:
            raise ResourceExhausted(f"prompt + max_tokens = {need} tokens is more than the KV cache holds ({self.capacity})")
        seq.generator = seq.params.generator(self.device)
        state = ThinkerState(tokens=seq.prompt_ids.tolist(), owner=seq)
        self.states[id(seq)] = state
        self.scheduler.add(state)

    def ready(self, seq: ThinkerSeq) -> bool:
        return not seq.done

    def free(self, seq: ThinkerSeq) -> None:
        state = self.states.pop(id(seq), None)
        if state is not None:
            self.scheduler.remove(state)

    @torch.no_grad()
    def step(self, seqs: list[ThinkerSeq]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """One forward over what the scheduler picks from every request added (not only `seqs`)."""
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        if not work:
            return []
        embeds, positions, ds_rows, ds_values = self._inputs(work)
        capture = self.accept_layer if any(w.seq.owner.return_states for w in work) else None
        with step_context(self.attention.plan([SeqSlice(w.seq.blocks, w.start, w.n) for w in work]), self.moe):
            hidden, captured = self.model(embeds, positions, ds_rows, ds_values, capture)
        self.scheduler.advance(work)
        out = self._outputs(work, embeds, hidden, captured)
        elapsed = time.perf_counter() - t0
        for w in work:
            if w.start < len(w.seq.owner.prompt_ids):
                w.seq.owner.prefill_seconds += elapsed
            else:
                w.seq.owner.decode_seconds += elapsed
        return out

    # -- one step ----------------------------------------------------------------------------------

    def _inputs(self, work: list[Work]):
        """Input embeddings [N, H] (multimodal rows from their spans), positions [3, N], DeepStack rows and values."""
        embeds, positions, ds_rows, ds_values, row = [], [], [], [], 0
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            idx = torch.arange(w.start, w.start + w.n)
            e = self.model.model.embed_tokens(torch.tensor(w.seq.tokens[w.start:w.start + w.n], device=self.device))
            for span in seq.spans:
                lo, hi = max(w.start, span.offset), min(w.start + w.n, span.offset + len(span.embeds))
                if lo >= hi:
                    continue
                e[lo - w.start:hi - w.start] = span.embeds[lo - span.offset:hi - span.offset].to(self.device, self.dtype)
                if span.deepstack:
                    ds_rows.append(torch.arange(row + lo - w.start, row + hi - w.start))
                    ds_values.append([d[lo - span.offset:hi - span.offset] for d in span.deepstack])
            prompt_len = len(seq.prompt_ids)
            pos = (idx + seq.rope_delta).float().expand(3, -1).clone()
            in_prompt = idx < prompt_len
            if seq.positions is not None and in_prompt.any():
                pos[:, in_prompt] = seq.positions[:, idx[in_prompt]]
            elif in_prompt.any():
                pos[:, in_prompt] = idx[in_prompt].float()
            embeds.append(e)
            positions.append(pos)
            row += w.n
        deepstack = None
        if ds_rows:
            deepstack = [torch.cat(level).to(self.device, self.dtype) for level in zip(*ds_values)]
            ds_rows = torch.cat(ds_rows).to(self.device)
        return torch.cat(embeds), torch.cat(positions, dim=1).to(self.device), ds_rows if deepstack else None, deepstack

    def _outputs(self, work: list[Work], embeds, hidden, captured) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        ends, row = [], 0
        for w in work:
            row += w.n
            if w.start + w.n == len(w.seq.tokens):  # caught up with its tokens: choose the next one
                ends.append((w, row - 1))
        sampled = {}
        if ends:
            logits = self.model.lm_head(hidden[[r for _, r in ends]])
            owners = [w.seq.owner for w, _ in ends]
            seen = [torch.tensor(w.seq.tokens, device=self.device) if s.params.repetition_penalty != 1.0 else None
                    for (w, _), s in zip(ends, owners)]
            tokens = sample_batch(logits, [s.params for s in owners], [s.generator for s in owners], seen,
                                  [len(s.generated) for s in owners]).tolist()
            sampled = {id(w): t for (w, _), t in zip(ends, tokens)}
        out, row = [], 0
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            step = ThinkerStep(token_ids=[])
            if seq.return_states and w.start + w.n > w.seq.states_sent:  # rows a preempted sequence recomputes are sent once
                skip = max(0, w.seq.states_sent - w.start)
                step.state_start = w.start + skip
                step.embeds, step.hidden = embeds[row + skip:row + w.n], captured[row + skip:row + w.n]
                w.seq.states_sent = w.start + w.n
            if seq.embed_token_ids and not seq.generated and w.start == 0:
                step.token_embeds = self.model.model.embed_tokens(torch.tensor(seq.embed_token_ids, device=self.device))
            if id(w) in sampled:
                token = sampled[id(w)]
                w.seq.tokens.append(token)
                seq.generated.append(token)
                step.token_ids = [token]
                seq.stop_reason = step.stop_reason = stop_reason(seq)
                seq.done = bool(seq.stop_reason)
            row += w.n
            if step.token_ids or step.embeds is not None or step.token_embeds is not None:
                out.append((seq, step))
        return out
